"""sockets.py: the connections opened between two snapshots are shut (the other end reads
EOF at once), a listener and sockets opened before are left alone, and a descriptor reused
under another inode is never touched."""

from __future__ import annotations

import socket

from stalwart.elastic import sockets


def test_the_connections_opened_between_two_snapshots_are_shut_and_nothing_else() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    old = socket.create_connection(srv.getsockname())
    old_peer, _ = srv.accept()
    before = sockets.open_sockets()
    new = socket.create_connection(srv.getsockname())
    new_peer, _ = srv.accept()
    listener = socket.create_server(("127.0.0.1", 0))
    after = sockets.open_sockets()
    try:
        assert sockets.shut(after - before, peers={"10.9.9.9"}) == 0  # not its peer
        # the server side of a connection (its own port: a store served here) is spared
        assert sockets.shut({s for s in after - before if s[0] == new_peer.fileno()},
                            spare_port=srv.getsockname()[1]) == 0
        assert sockets.shut(after - before) == 2  # new and new_peer; not the listener
        new_peer.settimeout(5)
        assert new_peer.recv(10) == b""
        old.sendall(b"x")  # untouched
        assert old_peer.recv(10) == b"x"
        listener.settimeout(0.01)
        try:
            listener.accept()
        except TimeoutError:
            pass  # still listening
        # a descriptor closed and reused by another socket is not the one recorded
        fd = old.fileno()
        gone = {(fd, next(i for f, i in after if f == fd) + 1)}
        assert sockets.shut(gone) == 0
    finally:
        for s in (srv, old, old_peer, new, new_peer, listener):
            s.close()
