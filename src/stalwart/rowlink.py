"""The rank-0 control channel: rows to rank 0, rank 0's row to every rank.

Both control loops that meet at rank 0 use it: the detector's exchange (detect/exchange.py:
compute samples up, rank 0's alarm and exchange period down) and the mitigation plan's
agreement (mitigate/agreement.py: step times up, rank 0's decision down). One instance per
user, each on its own connections, so their schedules stay independent.

Mechanism: a star of TCP connections (TCP_NODELAY) from every rank to rank 0, set up once
(rank 0's address is shared with one ``broadcast_object_list`` on the caller's gloo group).
Exchange ``seq``: every rank other than 0 sends its row to rank 0 (``issue``); rank 0 sends
its own row -- what all the other ranks need -- to every rank. At the check the exchange is
due (``read``) rank 0 gets every rank's row and the others get rank 0's. A message is the
sequence number and ``width`` float64 values; TCP keeps each connection's messages in order,
so a read takes the next message of each connection and checks its sequence number.

Why not a gloo all-gather: one asynchronous 4-rank all-gather of 80 bytes cost ~0.85 ms of
process CPU per rank here (measured: most of it in gloo's threads handing the op over and
back, not on the wire), ~2% of a tiny-preset step at one exchange per step; the same exchange
over these sockets is a few small ``send``/``recv`` calls on the calling thread (tens of
microseconds). ``GlooRows`` keeps the all-gather path for when the sockets cannot be set up
(``open_rows`` falls back to it, with a debug log line).

Guarantees: every rank reads exchange ``seq`` at the same check (the caller's schedule);
a read blocks only until the due messages arrive (in a synchronous job they were sent a
step earlier); a peer that exits closes its connection and the read raises at once instead
of hanging; a peer silent for ``timeout`` seconds raises ``RowLinkError`` naming it.
Setup is collective and never leaves a rank behind: a rank 0 that cannot listen still takes
part in the address broadcast, and every rank then raises ``OSError``.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
import time
from typing import Any

import torch
import torch.distributed as dist

from stalwart.hostaddr import default_host

_SEQ = struct.Struct("<q")
LINK_SETUP_S = 30.0  # seconds to set up the sockets before falling back to the all-gather
READ_TIMEOUT_S = 1800.0  # a due row this late means a peer is gone: raise, never hang
log = logging.getLogger("stalwart")


class RowLinkError(RuntimeError):
    """A peer of a row link closed its connection or stayed silent."""


def _wait_readable(sock: socket.socket, timeout: float | None, peer: int, name: str) -> None:
    p = select.poll()
    p.register(sock, select.POLLIN)
    if not p.poll(None if timeout is None else 1000.0 * timeout):
        raise RowLinkError(f"stalwart: no {name} row from rank {peer} within {timeout} s")


def _recv_exact(sock: socket.socket, n: int, peer: int, timeout: float | None = None,
                name: str = "monitor") -> bytes:
    """``n`` bytes from ``sock``. A socket in blocking mode (the link's, once set up) is read
    without waiting first -- one ``recv`` when the row is there, as it usually is -- and
    polled up to ``timeout`` seconds when it is not; a socket with a timeout of its own
    waits by it (Python polls before each call on such a socket: two system calls)."""
    flags = socket.MSG_DONTWAIT if sock.gettimeout() is None else 0
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            if got == 0 and flags:
                data = sock.recv(n, flags)  # the usual case: the whole row, one call
                if len(data) == n:
                    return data
                k = len(data)
                buf[:k] = data
            else:
                k = sock.recv_into(view[got:], n - got, flags)
        except BlockingIOError:
            _wait_readable(sock, timeout, peer, name)
            continue
        except TimeoutError:
            raise RowLinkError(f"stalwart: no {name} row from rank {peer} "
                               f"within {sock.gettimeout()} s") from None
        except OSError as e:  # a reset: the peer closed with our row unread (it exited)
            raise RowLinkError(f"stalwart: rank {peer} closed the {name}'s row link "
                               f"({e.strerror or e})") from None
        if k == 0:
            raise RowLinkError(f"stalwart: rank {peer} closed the {name}'s row link "
                               "(it exited)")
        got += k
    return bytes(buf)


class StarRows:
    """Rows to rank 0 and rank 0's row to every rank, over one TCP connection per rank."""

    def __init__(self, rank: int, world: int, width: int, group: Any, host: str,
                 timeout: float = 300.0, name: str = "monitor") -> None:
        """Collective over ``group`` (every rank of the job, in rank order): rank 0 listens
        on ``host``, every other rank connects to it. ``timeout``: seconds a read waits for a
        due row before it raises. ``name``: whose rows (for error messages)."""
        self.rank, self.world, self.width, self.name = rank, world, width, name
        self._msg = struct.Struct(f"<q{width}d")
        self._peers: dict[int, socket.socket] = {}
        self._own: dict[int, list[float]] = {}  # rank 0: its own rows by sequence number
        self._got: dict[int, list[list[float]]] = {}  # rows received ahead of their read
        listener = None
        addr: list[Any] = [None]
        if rank == 0:
            try:
                listener = socket.create_server((host, 0), backlog=max(world, 8))
                listener.settimeout(timeout)
                addr = [(host, listener.getsockname()[1])]
            except OSError as e:  # still take part in the broadcast: no rank may hang in it
                addr = [f"rank 0 cannot listen on {host}: {e}"]
        dist.broadcast_object_list(addr, src=dist.get_global_rank(group, 0), group=group)
        if not isinstance(addr[0], tuple):
            raise OSError(f"stalwart: {name} row link not set up ({addr[0]})")
        try:
            if rank == 0:
                assert listener is not None
                for _ in range(world - 1):
                    conn, _ = listener.accept()
                    conn.settimeout(timeout)
                    peer = _SEQ.unpack(_recv_exact(conn, _SEQ.size, -1, name=name))[0]
                    self._peers[int(peer)] = conn
            else:
                conn = socket.create_connection(tuple(addr[0]), timeout=timeout)
                conn.settimeout(timeout)
                conn.sendall(_SEQ.pack(rank))
                self._peers[0] = conn
            for s in self._peers.values():
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        finally:
            if listener is not None:
                listener.close()
        if rank == 0 and sorted(self._peers) != list(range(1, world)):
            raise RowLinkError(f"stalwart: {name} row link got ranks {sorted(self._peers)}")
        self._order = sorted(self._peers.items())  # peers in rank order
        self.set_timeout(timeout)

    def set_timeout(self, seconds: float) -> None:
        """Seconds a read (or a send to a peer whose buffer is full) waits before it raises.
        The sockets stay in blocking mode and the wait is a ``poll`` taken only when the data
        is not there: a socket with a timeout polls before every call (twice the system
        calls on rank 0 per exchange)."""
        self._timeout = seconds
        for s in self._peers.values():
            s.settimeout(None)

    def issue(self, seq: int, row: list[float]) -> None:
        """Send this rank's row of exchange ``seq`` (never blocks on a peer in practice: a
        message is ~100 bytes and the kernel's send buffer holds thousands)."""
        data = self._msg.pack(seq, *row)
        if self.rank == 0:
            self._own[seq] = row
        for peer, s in self._order:
            try:
                try:
                    k = s.send(data, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    k = 0
                if k < len(data):  # the peer's buffer is full: wait up to the timeout
                    s.settimeout(self._timeout)
                    try:
                        s.sendall(data[k:])
                    finally:
                        s.settimeout(None)
            except OSError as e:  # reset or broken pipe: the peer exited
                raise RowLinkError(f"stalwart: rank {peer} closed the {self.name}'s row "
                                   f"link ({e.strerror or e})") from None

    def wait(self, seq: int) -> None:
        """Receive exchange ``seq``'s rows now (kept for its ``read``)."""
        if seq in self._got:
            return
        rows: list[list[float]] = [self._own.pop(seq)] if self.rank == 0 else []
        for peer, sock in self._order:
            got_seq, *vals = self._msg.unpack(_recv_exact(sock, self._msg.size, peer,
                                                          self._timeout, self.name))
            if got_seq != seq:
                raise RowLinkError(f"stalwart: rank {peer} sent {self.name} row {got_seq} "
                                   f"where {seq} was due (ranks out of step)")
            rows.append(vals)
        self._got[seq] = rows

    def read(self, seq: int) -> list[list[float]]:
        """Exchange ``seq``'s rows: rank 0 gets every rank's (in rank order), the others
        get rank 0's only."""
        self.wait(seq)
        return self._got.pop(seq)

    def close(self) -> None:
        for s in self._peers.values():
            try:
                s.close()
            except OSError:
                pass
        self._peers.clear()
        self._order = []


class GlooRows:
    """The same exchange as one asynchronous all-gather on a gloo group (every rank gets
    every row): the fallback when ``StarRows`` cannot be set up."""

    def __init__(self, rank: int, world: int, width: int, group: Any) -> None:
        self.rank, self.world, self.width, self._pg = rank, world, width, group
        self._inflight: dict[int, tuple[Any, list[torch.Tensor]]] = {}

    def issue(self, seq: int, row: list[float]) -> None:
        msg = torch.tensor(row, dtype=torch.float64)
        rows = [torch.empty(self.width, dtype=torch.float64) for _ in range(self.world)]
        # the group's own method: never seen by the detector's tracker, and a third less CPU
        # than dist.all_gather's checks and dispatch
        self._inflight[seq] = (self._pg.allgather([rows], [msg]), rows)

    def wait(self, seq: int) -> None:
        self._inflight[seq][0].wait()

    def read(self, seq: int) -> list[list[float]]:
        work, rows = self._inflight.pop(seq)
        work.wait()
        return [r.tolist() for r in rows]

    def close(self) -> None:
        for work, _ in self._inflight.values():
            work.wait()
        self._inflight.clear()


def exchange_cost(link: StarRows | GlooRows, width: int, rounds: int = 5) -> float:
    """Collective: the median process CPU seconds of one complete exchange (issued and read
    at once, on every rank) -- what an exchange costs the job, the backend's threads and the
    kernel included."""
    costs = []
    for i in range(rounds):
        seq = -1 - i  # calibration exchanges never collide with the caller's
        c0 = time.process_time()
        link.issue(seq, [0.0] * width)
        link.read(seq)
        costs.append(time.process_time() - c0)
    costs.sort()
    return costs[len(costs) // 2]


def open_rows(rank: int, world: int, width: int, group: Any,
              name: str = "monitor") -> StarRows | GlooRows:
    """Collective on ``group`` (a gloo group of every rank): direct sockets to rank 0, or,
    if any rank could not set them up, the group's all-gather."""
    link: StarRows | None = None
    try:
        # the lossy transport's rule for this rank's address: rank 0's is the one used
        link = StarRows(rank, world, width, group, default_host(), timeout=LINK_SETUP_S,
                        name=name)
    except OSError as e:
        log.debug("%s row link not set up (%s): using the gloo all-gather", name, e)
    ok = torch.tensor([0.0 if link is None else 1.0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if ok.item() == 1.0 and link is not None:
        link.set_timeout(READ_TIMEOUT_S)
        return link
    if link is not None:
        link.close()
    return GlooRows(rank, world, width, group)
