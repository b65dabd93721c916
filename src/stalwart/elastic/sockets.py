"""Aborting a gloo group from the outside: gloo has no abort that reaches a collective in flight
(``ProcessGroupGloo.abort()``/``shutdown()`` return at once and leave a ``recv`` from a frozen
peer blocked until gloo's own timeout -- measured with torch 2.13), but a ``shutdown(2)`` of
the group's TCP connections makes every operation on them fail within milliseconds
("Connection closed by peer"), its work complete with that error, and its threads go idle.

A group's connections are the TCP sockets this process opened while the group was built
(``Snapshot`` before and after the build: the group's store client and gloo's pairs), less
sockets known to be another's (the caller's liveness connections). A socket is named by its
file descriptor *and* inode, so a descriptor closed and reused by something else since is
never touched. Linux only (``/proc/self/fd``); elsewhere nothing is found and nothing shut.

Cost: one ``fstat`` per open descriptor of the process per snapshot (two per group build).
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat

Sock = tuple[int, int]  # (file descriptor, inode)


def open_sockets() -> set[Sock]:
    """Every socket this process holds now."""
    out: set[Sock] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            st = os.fstat(int(name))
        except (OSError, ValueError):
            continue
        if stat.S_ISSOCK(st.st_mode):
            out.add((int(name), st.st_ino))
    return out


def inode(s: socket.socket) -> int | None:
    with contextlib.suppress(OSError):
        return os.fstat(s.fileno()).st_ino
    return None


def shut(socks: set[Sock], peers: set[str] | None = None, spare_port: int | None = None
         ) -> int:
    """``shutdown(SHUT_RDWR)`` each TCP socket of ``socks`` still open under the same inode
    (the descriptors stay open: their owner closes them); listening and unconnected sockets are
left alone (gloo's device listener), and with ``peers``, so is a socket connected to an
address not in it; ``spare_port``: a socket whose own port it is is left alone (the
connections a store served in this process accepted). How many were shut."""
    n = 0
    for fd, ino in socks:
        try:
            if os.fstat(fd).st_ino != ino:
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6) \
                    and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                peer = str(s.getpeername()[0]).removeprefix("::ffff:")  # OSError: unconnected
                if (peers is not None and peer not in peers) or \
                        s.getsockname()[1] == spare_port:
                    continue
                s.shutdown(socket.SHUT_RDWR)
                n += 1
        except OSError:
            pass  # not connected, or already gone
        finally:
            s.close()  # the duplicate only
    return n
