"""Peer beats (elastic/peerbeat.py) and what they change in the membership: a member whose main
thread holds the GIL for longer than ``DEAD_AFTER_S`` stays in the job when its beats are
native, and is taken for dead when they are not; a SIGSTOPped member is taken for dead within
the bound either way. Real processes, a real c10d store, real sockets."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from stalwart.elastic import peerbeat
from stalwart.elastic import protocol as P
from stalwart.elastic.peerbeat import PeerBeats
from stalwart.elastic.rank import Runtime
from stalwart.elastic.store import serve


def _drain(s: socket.socket, for_s: float) -> int:
    s.settimeout(0.05)
    got, end = 0, time.monotonic() + for_s
    while time.monotonic() < end:
        try:
            got += len(s.recv(4096))
        except TimeoutError:
            pass
    return got


@pytest.mark.parametrize("native", [True, False])
def test_beats_arrive_every_period_and_stop_once_removed(native: bool) -> None:
    if native and peerbeat._native() is None:
        pytest.skip("stalwart._beat not built")
    a, b = socket.socketpair()
    beats = PeerBeats(0.05, native=native)
    assert beats.native is native
    try:
        beats.add(a)
        n = _drain(b, 0.6)
        assert 4 <= n <= 20  # ~12 at one byte per 50 ms
        beats.remove(a)
        _drain(b, 0.1)  # a beat sent before remove returned may still be in flight
        assert _drain(b, 0.3) == 0
    finally:
        beats.close()
        a.close()
        b.close()


_MEMBER = """
import ctypes, sys, time
from stalwart.elastic import peerbeat
if sys.argv[3] == "python":
    peerbeat._native = lambda: None
from stalwart.elastic.rank import Runtime
rt = Runtime("127.0.0.1", int(sys.argv[1]), "t/", "node-b", 0, "127.0.0.1", min_world=1)
print(rt.me.id, flush=True)
sys.stdin.readline()
ctypes.PyDLL("libc.so.6").sleep(int(sys.argv[2]))  # a C call that keeps the GIL
print("released", flush=True)
time.sleep(60)
"""


def _start_member(port: int, hold_s: int, kind: str) -> tuple[subprocess.Popen[str], int]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.Popen([sys.executable, "-c", _MEMBER, str(port), str(hold_s), kind],
                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    return p, int(p.stdout.readline())


def _watch(rt: Runtime, member: int, for_s: float) -> bool:
    """Whether ``rt`` takes ``member`` for dead within ``for_s``."""
    end = time.monotonic() + for_s
    while time.monotonic() < end:
        with rt.lock:
            if member in rt.dead:
                return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["native", "python"])
def test_a_member_holding_the_gil_stays_with_native_beats_and_a_stopped_one_is_dropped(
        kind: str) -> None:
    if kind == "native" and peerbeat._native() is None:
        pytest.skip("stalwart._beat not built")
    srv = serve("127.0.0.1", 0)
    hold = int(P.DEAD_AFTER_S) + 2
    rt = Runtime("127.0.0.1", srv.port, "t/", "node-a", 0, "127.0.0.1", min_world=1)
    p, mid = _start_member(srv.port, hold, kind)
    try:
        assert p.stdin is not None and p.stdout is not None
        # both know each other (connections made, beats flowing) before the hold starts
        end = time.monotonic() + 10
        while mid not in rt._sock_beats and time.monotonic() < end:
            time.sleep(0.05)
        assert mid in rt._sock_beats
        p.stdin.write("go\n")
        p.stdin.flush()
        dead = _watch(rt, mid, hold + 0.5)
        assert dead is (kind == "python")
        if dead:
            return
        assert p.stdout.readline().strip() == "released"
        os.kill(p.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        assert _watch(rt, mid, P.DEAD_AFTER_S + 2.0)
        assert time.monotonic() - t0 >= P.DEAD_AFTER_S - 0.5
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        rt.close()
