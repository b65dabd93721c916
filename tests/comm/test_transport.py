"""UDP transport: runs sent with segmentation offload arrive as separate datagrams, whole and in
order; datagrams the kernel coalesced at another segment size are cut apart correctly."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from stalwart.comm.transport import SOL_UDP, UDP_SEGMENT, UdpTransport


class Sink:
    """Collects what the receiving thread hands over."""

    def __init__(self) -> None:
        self.got: list[tuple[bytes, int, bool]] = []
        self.lock = threading.Lock()

    def __call__(self, rows: np.ndarray, sizes: np.ndarray, src_ok: np.ndarray) -> None:
        with self.lock:
            for r, n, ok in zip(rows, sizes.tolist(), src_ok[:, 0].tolist(), strict=True):
                self.got.append((r[: min(n, r.size)].tobytes(), n, ok))

    def wait_for(self, n: int, timeout: float = 5.0) -> list[tuple[bytes, int, bool]]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if len(self.got) >= n:
                    return list(self.got)
            time.sleep(0.01)
        return list(self.got)


def test_a_run_of_slots_arrives_as_separate_whole_datagrams() -> None:
    slot = 1000
    rx, tx = UdpTransport("127.0.0.1", slot), UdpTransport("127.0.0.1", slot)
    try:
        sink = Sink()
        rx.set_peers([tx.addr])
        tx.set_peers([rx.addr])
        rx.start(sink)
        # 5 full slots and a short last one, each filled with its own index
        rows = np.zeros((6, slot), np.uint8)
        for i in range(6):
            rows[i] = i + 1
        sizes = [slot] * 5 + [300]
        if tx.gso_segments > 1:  # one message holding all six (what the collective sends)
            n = tx.send_ptrs(np.array([rows.ctypes.data], np.uint64), np.array([5 * slot + 300]),
                             np.array([0]), keepalive=[rows], counts=np.array([6]))
        else:
            n = tx.send(rows, np.array(sizes), np.zeros(6, np.int64))
        assert n == 6
        got = sink.wait_for(6)
        assert [g[1] for g in got] == sizes
        assert all(g[2] for g in got)  # the source address is the registered peer
        for i, (data, _, _) in enumerate(got):
            assert data == bytes([i + 1]) * sizes[i]
    finally:
        rx.close()
        tx.close()


def test_datagrams_coalesced_at_a_smaller_size_are_cut_apart() -> None:
    rx = UdpTransport("127.0.0.1", 1000)
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        if rx.rx_segments == 1:
            pytest.skip("receive offload (UDP_GRO) off: old kernel or STALWART_UDP_GSO=0")
        sender.bind(("127.0.0.1", 0))
        sender.setsockopt(SOL_UDP, UDP_SEGMENT, 100)  # the kernel cuts at 100 bytes
        sink = Sink()
        rx.set_peers([sender.getsockname()])
        rx.start(sink)
        payload = b"".join(bytes([k]) * 100 for k in range(1, 10)) + b"\x63" * 40
        sender.sendto(payload, rx.addr)
        got = sink.wait_for(10)
        assert [g[1] for g in got] == [100] * 9 + [40]
        assert b"".join(g[0] for g in got) == payload
        assert all(g[2] for g in got)
    finally:
        sender.close()
        rx.close()
