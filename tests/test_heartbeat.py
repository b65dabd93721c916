"""The launcher's liveness check (heartbeat.py): the pure judgement, and beats over a real UDP
socket from a real thread, a frozen process going silent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from stalwart import heartbeat
from stalwart.heartbeat import LEAVING, READY, STARTING, Heard, Listener, overdue


def test_a_ready_rank_is_judged_at_the_short_bound_and_a_starting_one_at_the_long() -> None:
    procs = {
        1: Heard(started=0.0, last=10.0, phase=READY),  # 3.5 s silent: overdue
        2: Heard(started=0.0, last=12.0, phase=READY),  # 1.5 s: fine
        3: Heard(started=0.0, last=10.0, phase=STARTING),  # importing torch: fine
        4: Heard(started=0.0, last=10.0, phase=LEAVING),  # finalizing: fine
        5: Heard(started=-60.0),  # never heard from, 63.5 s since its start: overdue
        6: Heard(started=0.0),  # never heard from, 13.5 s: fine
    }
    got = overdue(procs, now=13.5, silent_s=3.0, start_silent_s=60.0)
    assert [(s.pid, s.bound_s, s.heard) for s in got] == [(1, 3.0, True), (5, 60.0, False)]
    assert got[0].silent_s == pytest.approx(3.5)


_BEATER = """
import sys, time
from stalwart import heartbeat
heartbeat.beat(sys.argv[1])
heartbeat.ready()
print("up", flush=True)
time.sleep(60)
"""


def test_a_frozen_process_goes_silent_and_a_live_one_keeps_beating() -> None:
    """Two real processes beat to a real listener; one is SIGSTOPped: only it is overdue
    once ``SILENT_S`` has passed, and the other's beats say it is ready."""
    lis = Listener("127.0.0.1")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", _BEATER, lis.addr], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for p in procs:
            lis.expect(p.pid)
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "up"
        time.sleep(2 * heartbeat.BEAT_S)
        assert lis.overdue([p.pid for p in procs]) == []
        os.kill(procs[0].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        got: list[heartbeat.Silent] = []
        while not got and time.monotonic() - t0 < 4 * heartbeat.SILENT_S:
            time.sleep(0.1)
            got = lis.overdue([p.pid for p in procs])
        assert [s.pid for s in got] == [procs[0].pid] and got[0].heard
        assert got[0].bound_s == heartbeat.SILENT_S  # it had said it was ready
        # a pid the listener was never told of is not judged (a stale process's beats)
        lis.forget(procs[1].pid)
        assert procs[1].pid not in [s.pid for s in lis.overdue([p.pid for p in procs])]
    finally:
        for p in procs:
            p.kill()
            p.wait()
        lis.close()


def test_datagrams_that_are_not_beats_are_ignored() -> None:
    import socket

    lis = Listener("127.0.0.1")
    try:
        lis.expect(4242)
        host, port = lis.addr.rsplit(":", 1)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.sendto(b"garbage", (host, int(port)))
        s.sendto(b"xxxx" + bytes(9), (host, int(port)))  # right size, wrong magic
        time.sleep(0.3)
        got = lis.overdue([4242], now=time.monotonic() + 61.0)
        assert [x.heard for x in got] == [False]  # still never heard from
    finally:
        lis.close()


_GIL_HOLDER = """
import ctypes, sys, time
from stalwart import heartbeat
heartbeat.beat(sys.argv[1], native=sys.argv[2] == "native")
heartbeat.ready()
print("up", flush=True)
time.sleep(2 * heartbeat.BEAT_S)
ctypes.PyDLL("libc.so.6").sleep(int(sys.argv[3]))  # a C call that keeps the GIL
time.sleep(60)
"""


@pytest.mark.skipif(heartbeat._native() is None, reason="stalwart._beat not built")
def test_a_rank_whose_main_thread_holds_the_gil_keeps_beating_natively() -> None:
    """A main thread inside a C call that holds the GIL (as a dlopen does) for longer than
    ``SILENT_S``: the Python beat thread falls silent and the launcher would kill a live
    rank; the native one (stalwart._beat) keeps beating, phase included."""
    hold = int(heartbeat.SILENT_S) + 2
    lis = Listener("127.0.0.1")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = {kind: subprocess.Popen([sys.executable, "-c", _GIL_HOLDER, lis.addr, kind,
                                     str(hold)], env=env, stdout=subprocess.PIPE, text=True)
             for kind in ("native", "python")}
    try:
        for p in procs.values():
            lis.expect(p.pid)
        for p in procs.values():
            assert p.stdout is not None and p.stdout.readline().strip() == "up"
        t0 = time.monotonic()
        silent: set[int] = set()
        while time.monotonic() - t0 < hold + 2 * heartbeat.BEAT_S:
            time.sleep(0.1)
            silent |= {s.pid for s in lis.overdue([p.pid for p in procs.values()])}
        assert silent == {procs["python"].pid}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
        lis.close()
