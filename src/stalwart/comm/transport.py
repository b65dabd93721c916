"""UDP transport: one socket per rank, batched system calls, a thread draining into buffers.

Mechanism: the datagram transport of "Distributed Training under Packet Loss" / OptiReduce --
no connections, no acknowledgements, no retransmission. Per-packet interpreter work is what
limits a Python UDP collective (a first version with one sendto/recv_into per packet took
125 ms for a 16 MiB all-reduce between 4 testbed hosts at MTU 9000, gloo 38 ms), so
this module moves whole batches per system call: ``sendmmsg`` with one scatter-gather entry per
packet pointing straight into the caller's numpy rows (no per-packet copy, no per-packet Python
call), and ``recvmmsg`` filling a preallocated (batch, slot) numpy array plus the source
addresses, which the handler then checks and accumulates vectorised. Both are reached through
ctypes (which releases the GIL during the call).

Guarantees: datagrams never exceed the slot size chosen from the MTU by the caller (so no IP
fragmentation); the receive buffer is made as large as the kernel allows (SO_RCVBUFFORCE as
root) and is drained by a dedicated thread so overflow is rare; sends go in bursts that
alternate destinations and can be paced to a byte rate, so no single receiver is flooded.
``close()`` stops the thread within one socket timeout and closes the socket. A handler that
raises does not stop the drain (packets would pile up in the kernel): every failure is counted
in ``handler_errors``, the latest kept in ``last_error``, the first printed, and ``on_error`` is
called so that the owner can stop the job past its bound (``collective.MAX_HANDLER_ERRORS``).

Segmentation offload (UDP GSO, ``UDP_SEGMENT``, Linux >= 4.18): with it on, one message of the
batch may carry a run of up to ``gso_segments`` consecutive slot-sized datagrams to one peer;
the kernel cuts it into separate datagrams of ``slot`` bytes (the last may be shorter), each
still a whole packet with its own header and tag, so the receiver sees exactly what it would
without offload. It saves the per-datagram trip through the socket, routing and netfilter
layers on the send side (the same reason QUIC stacks use it). A run is routed as one buffer up
to where it is segmented -- on the testbed that is the receiving socket, after the loss rule,
so there the run is dropped or delivered as a whole (runs are capped at 8 datagrams to keep
that close to per-datagram loss); ``STALWART_UDP_GSO=0`` turns offload off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import socket
import struct
import threading
import time
from collections.abc import Callable

import numpy as np

from stalwart import envknobs

# re-exported: collective.py and users import them from here
from stalwart.hostaddr import default_host, is_loopback, route_source  # noqa: F401

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
_libc.sendmmsg.restype = ctypes.c_int
_libc.recvmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int,
                           ctypes.c_void_p]
_libc.recvmmsg.restype = ctypes.c_int

MSG_WAITFORONE = 0x10000
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
SOL_UDP = 17
UDP_SEGMENT = 103
UDP_GRO = 104
UDP_MAX_PAYLOAD = 65507  # largest UDP payload of one IPv4 datagram (before segmentation)
GSO_MAX_SEGMENTS = 64  # the kernel's UDP_MAX_SEGMENTS (what a coalesced receive may hold)
# datagrams per sent run: most of the per-datagram saving is had by 8, and a short run keeps
# an emulated loss rule (which drops a run whole) close to per-datagram loss at MTU 1500
GSO_SEND_SEGMENTS = 8
# longer runs, for phases with enough packets per peer that their stripes still interleave at
# least as many ways as a run is long (``sending.Sender._run``): at MTU 1500 a 16 MiB
# all-reduce's phases are ~3,000 packets per peer, and runs of 32 instead of 8 took a quarter
# of the per-message kernel work (process CPU -15%, receive thread -33%, measured on loopback)
GSO_LONG_SEGMENTS = 32

# struct layouts of x86-64 / aarch64 Linux (LP64)
_SOCKADDR = np.dtype([("family", "<u2"), ("port", ">u2"), ("addr", ">u4"), ("zero", "V8")])
_IOVEC = np.dtype([("base", "<u8"), ("len", "<u8")])
_MMSGHDR = np.dtype([
    ("name", "<u8"), ("namelen", "<u4"), ("_p0", "<u4"), ("iov", "<u8"), ("iovlen", "<u8"),
    ("control", "<u8"), ("controllen", "<u8"), ("flags", "<i4"), ("_p1", "<u4"),
    ("msg_len", "<u4"), ("_p2", "<u4"),
])
_CMSG = np.dtype([("len", "<u8"), ("level", "<i4"), ("type", "<i4"), ("value", "<i4"),
                  ("_pad", "<u4")])  # CMSG_SPACE(sizeof(int)) on LP64
assert _SOCKADDR.itemsize == 16 and _CMSG.itemsize == 24
assert _IOVEC.itemsize == 16 and _MMSGHDR.itemsize == 64

Handler = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


def _ip_u32(host: str) -> int:
    return struct.unpack("!I", socket.inet_aton(host))[0]


class UdpTransport:
    """A bound UDP socket with batched send and a receiving thread.

    ``handler(rows, sizes, src_ok)`` is called from the receiving thread for every batch:
    ``rows`` (n, slot) uint8 (valid until the handler returns), ``sizes`` (n,) datagram sizes,
    ``src_ok`` (n, n_peers) bool: whether datagram i came from peer j's registered address.
    """

    def __init__(self, host: str, slot: int, batch: int = 64, bufsize: int = 64 << 20,
                 burst: int = 32, pace_bytes_per_s: float = 0.0,
                 gso: bool | None = None) -> None:
        self.slot = int(slot)
        self.batch = int(batch)
        self.burst = int(burst)
        self.pace = float(pace_bytes_per_s)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.rcvbuf = self._grow(socket.SO_RCVBUF, SO_RCVBUFFORCE, bufsize)
        self.sndbuf = self._grow(socket.SO_SNDBUF, SO_SNDBUFFORCE, min(bufsize, 16 << 20))
        # the receiving thread wakes up this often to notice close()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 100_000))
        self.addr: tuple[str, int] = self.sock.getsockname()
        if gso is None:
            gso = envknobs.udp_gso()
        gso = gso and 2 * self.slot <= UDP_MAX_PAYLOAD  # a run must hold at least two slots
        # how many slot-sized datagrams one sent message may carry (1 = no offload)
        self.gso_segments = 1
        self.gso_long = 1  # the longest run a large phase may use
        if gso and self._offload(UDP_SEGMENT, self.slot):
            self.gso_segments = min(GSO_SEND_SEGMENTS, UDP_MAX_PAYLOAD // self.slot)
            self.gso_long = min(GSO_LONG_SEGMENTS, UDP_MAX_PAYLOAD // self.slot)
        self.peers: list[tuple[str, int]] = []
        self._peer_sa = np.zeros(0, _SOCKADDR)
        self._peer_key = np.zeros(0, np.uint64)
        # receive offload (UDP_GRO): the kernel may hand over a run of datagrams of one sender
        # as one message, with their segment size in a control message; each message then gets
        # room for ``rx_segments`` slots
        self.rx_segments = 1
        if gso and self._offload(UDP_GRO, 1):
            self.rx_segments = min(GSO_MAX_SEGMENTS, 65535 // self.slot)
        # receive side: preallocated ring the kernel writes into
        R = self.rx_segments
        self._rx = np.zeros((self.batch * R, self.slot), np.uint8)
        self._rx_sa = np.zeros(self.batch, _SOCKADDR)
        self._rx_iov = np.zeros(self.batch, _IOVEC)
        self._rx_iov["base"] = self._rx.ctypes.data + np.arange(self.batch) * (R * self.slot)
        self._rx_iov["len"] = R * self.slot
        self._rx_cmsg = np.zeros(self.batch, _CMSG)
        self._rx_msg = np.zeros(self.batch, _MMSGHDR)
        self._rx_msg["name"] = self._rx_sa.ctypes.data + np.arange(self.batch) * _SOCKADDR.itemsize
        self._rx_msg["iov"] = self._rx_iov.ctypes.data + np.arange(self.batch) * _IOVEC.itemsize
        self._rx_msg["iovlen"] = 1
        self._rx_msg["control"] = (self._rx_cmsg.ctypes.data
                                   + np.arange(self.batch) * _CMSG.itemsize)
        self._handler: Handler | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.send_errors = 0
        self.bytes_sent = 0  # UDP payload bytes handed to the kernel (all datagrams)
        self.recv_batches = 0
        self.handler_errors = 0
        self.last_error: BaseException | None = None
        # called (on the receiving thread) after each handler failure: the owner wakes its
        # waiting thread, which decides whether to stop
        self.on_error: Callable[[], None] | None = None

    def _offload(self, opt: int, value: int) -> bool:
        """Turn on a UDP offload option; False where the kernel lacks it (plain datagrams)."""
        try:
            self.sock.setsockopt(SOL_UDP, opt, value)
            return True
        except OSError:
            return False

    def _grow(self, opt: int, force_opt: int, size: int) -> int:
        for o in (force_opt, opt):  # FORCE ignores rmem_max but needs CAP_NET_ADMIN
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, o, size)
                break
            except OSError:
                continue
        return self.sock.getsockopt(socket.SOL_SOCKET, opt)

    # ---- peers ----------------------------------------------------------------------------
    def set_peers(self, peers: list[tuple[str, int]]) -> None:
        self.peers = [(h, int(p)) for h, p in peers]
        sa = np.zeros(len(peers), _SOCKADDR)
        sa["family"] = socket.AF_INET
        sa["port"] = [p for _, p in self.peers]
        sa["addr"] = [_ip_u32(h) for h, _ in self.peers]
        self._peer_sa = sa
        self._peer_key = sa["addr"].astype(np.uint64) << np.uint64(16) | sa["port"].astype(
            np.uint64)

    # ---- sending --------------------------------------------------------------------------
    def send(self, rows: np.ndarray, sizes: np.ndarray, dests: np.ndarray) -> int:
        """Send datagram i = ``rows[i, :sizes[i]]`` to peer ``dests[i]``, in the given order.

        ``rows`` must be C-contiguous uint8 (n, slot). Returns how many were handed to the
        kernel (a failed datagram is skipped and counted in ``send_errors``, never retried).
        """
        assert rows.flags.c_contiguous and rows.dtype == np.uint8
        ptrs = rows.ctypes.data + np.arange(len(sizes), dtype=np.uint64) * np.uint64(
            rows.shape[1])
        return self.send_ptrs(ptrs, sizes, dests, keepalive=[rows])

    def send_ptrs(self, ptrs: np.ndarray, sizes: np.ndarray, dests: np.ndarray,
                  keepalive: list | None = None, counts: np.ndarray | None = None) -> int:
        """Send message i = ``sizes[i]`` bytes at address ``ptrs[i]`` to peer ``dests[i]``.

        ``counts[i]`` (default 1) is how many datagrams message i holds: more than 1 only with
        segmentation offload (``gso_segments`` > 1), as a run of slot-sized datagrams. Returns
        the number of datagrams handed to the kernel. The caller keeps the memory alive
        (``keepalive`` is only held for the call's duration).
        """
        n = len(sizes)
        if n == 0:
            return 0
        counts = np.ones(n, np.int64) if counts is None else np.asarray(counts, np.int64)
        iov = np.zeros(n, _IOVEC)
        iov["base"] = ptrs
        iov["len"] = sizes
        msg = np.zeros(n, _MMSGHDR)
        msg["name"] = self._peer_sa.ctypes.data + np.asarray(dests, np.uint64) * 16
        msg["namelen"] = 16
        msg["iov"] = iov.ctypes.data + np.arange(n, dtype=np.uint64) * _IOVEC.itemsize
        msg["iovlen"] = 1
        fd = self.sock.fileno()
        base = msg.ctypes.data
        sent = 0
        i = 0
        t0 = time.perf_counter()
        nbytes = 0
        while i < n:
            k = min(self.burst, n - i)
            r = _libc.sendmmsg(fd, base + i * _MMSGHDR.itemsize, k, 0)
            if r < 0:
                e = ctypes.get_errno()
                if e == errno.EINTR:
                    continue
                self.send_errors += 1  # e.g. EPERM from a firewall: skip this datagram
                i += 1
                continue
            chunk_bytes = int(sizes[i:i + r].sum())
            nbytes += chunk_bytes
            self.bytes_sent += chunk_bytes
            sent += int(counts[i:i + r].sum())
            i += r
            if self.pace > 0:
                ahead = nbytes / self.pace - (time.perf_counter() - t0)
                if ahead > 0.0002:
                    time.sleep(ahead)
        # keep the arrays alive until here (the kernel read them during the calls)
        del iov, msg
        return sent

    # ---- receiving ------------------------------------------------------------------------
    def start(self, handler: Handler) -> None:
        self._handler = handler
        self._thread = threading.Thread(target=self._loop, name="stalwart-udp-rx", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        fd = self.sock.fileno()
        base = self._rx_msg.ctypes.data
        while not self._stop.is_set():
            self._rx_msg["namelen"] = 16
            self._rx_msg["controllen"] = _CMSG.itemsize
            self._rx_cmsg["len"] = 0
            n = _libc.recvmmsg(fd, base, self.batch, MSG_WAITFORONE, None)
            if n <= 0:
                continue  # timeout (EAGAIN), EINTR, or socket closing
            self.recv_batches += 1
            rows, sizes, msg = self._split(n)
            sa = self._rx_sa[msg]
            key = sa["addr"].astype(np.uint64) << np.uint64(16) | sa["port"].astype(np.uint64)
            src_ok = key[:, None] == self._peer_key[None, :]
            try:
                assert self._handler is not None
                self._handler(rows, sizes, src_ok)
            except Exception as e:  # a handler bug must not kill the drain (packets pile up)
                self.handler_errors += 1
                self.last_error = e
                if self.handler_errors == 1:
                    import traceback

                    traceback.print_exc()
                if self.on_error is not None:
                    self.on_error()

    def _split(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The n received messages as datagrams: (rows (k, slot), sizes (k,), message index
        (k,)). A message without a segment-size control message is one datagram; a coalesced
        one is cut at its segment size -- by gathering its slots when that is the slot (the
        sender's runs), by copying byte ranges otherwise (small packets that the kernel
        happened to coalesce). Without receive offload the ring itself is returned (a view)."""
        R, slot = self.rx_segments, self.slot
        length = self._rx_msg["msg_len"][:n].astype(np.int64)
        if R == 1:
            return self._rx[:n], length, np.arange(n)
        cm = self._rx_cmsg[:n]
        has = ((self._rx_msg["controllen"][:n] >= 20) & (cm["level"] == SOL_UDP)
               & (cm["type"] == UDP_GRO))
        seg = np.where(has, cm["value"], 0).astype(np.int64)
        if not has.any():
            return self._rx[np.arange(n) * R], length, np.arange(n)
        plain = (seg == 0) | (seg == slot)
        k = np.where(seg == slot, -(-length // slot), 1)
        k = np.where(plain, np.minimum(k, R), 0)
        msg = np.repeat(np.arange(n), k)
        first = np.repeat(np.cumsum(k) - k, k)
        i = np.arange(msg.size) - first  # index of the datagram inside its message
        idx = msg * R + i
        sizes = np.where(seg[msg] == slot, np.minimum(slot, length[msg] - i * slot), length[msg])
        rows = self._rx[idx]
        if plain.all():
            return rows, sizes, msg
        extra_rows, extra_sizes, extra_msg = [rows], [sizes], [msg]
        flat = self._rx.reshape(-1)
        for j in np.flatnonzero(~plain).tolist():
            g, total = int(seg[j]), int(length[j])
            starts = list(range(0, total, g))
            part = np.zeros((len(starts), slot), np.uint8)
            part_sizes = np.zeros(len(starts), np.int64)
            for q, off in enumerate(starts):
                size = min(g, total - off)
                part_sizes[q] = size  # a segment over one slot is kept as malformed (> slot)
                w = min(size, slot)
                part[q, :w] = flat[j * R * slot + off: j * R * slot + off + w]
            extra_rows.append(part)
            extra_sizes.append(part_sizes)
            extra_msg.append(np.full(len(starts), j))
        return (np.concatenate(extra_rows), np.concatenate(extra_sizes),
                np.concatenate(extra_msg))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        try:
            self.sock.close()
        except OSError:
            pass


def default_mtu() -> int:
    return envknobs.mtu()
