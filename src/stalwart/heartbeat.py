"""Liveness of a job's ranks as the launcher sees it: a rank that hangs or is cut off is found
within a stated bound, without waiting for a collective to fail.

A process exit is seen by the launcher at once (supervise.py polls every 0.1 s); a rank that
is frozen (SIGSTOP, a deadlock in native code) or whose host lost its link does not exit, and
its peers wait in gloo's collective up to the group's timeout (minutes). So every rank started
through ``stalwart.lifeline`` sends a small UDP datagram to the launcher every ``BEAT_S``
(``beat``: a native thread that never takes the GIL, else a daemon thread; its address in
``ENV``). The datagram travels the rank's own
network path -- on the netns testbed from the rank's host to a control namespace on the same
bridge (testbed/hosts.py ``Hosts.control``) -- so a host cut off goes silent like a frozen one.
The launcher (``Listener``) keeps the last beat of each process; ``overdue`` (pure) says
which ranks have been silent too long, and the supervisor SIGKILLs them: from there a hang is
a death, with the in-place fail-stop (or, in another job, a one-line error) that follows.

Bounds (docs/calibration.md, "Liveness"): a rank that has said it is set up (``ready``: the
worker after its first process group, an ``elastic.Job`` once it joined) is judged silent
after ``SILENT_S`` = 3.0 s, the elastic membership's ``DEAD_AFTER_S`` (both bounds are on
beats sent by native threads that never take the GIL); before that, while it imports torch
and connects (a dlopen holds the GIL for ~0.45 s at load 2.5 and scales with the load), and
once its module returned (``leaving``: the interpreter's finalization runs no thread), after
``START_SILENT_S`` = 60 s. A rank that was never heard from is judged from its start at
``START_SILENT_S``.

Cost: one 16-byte datagram per rank per ``BEAT_S``; on the launcher one thread blocked in
``recvfrom``. Torch-free. Not covered: a hang that keeps the heartbeat thread running (a rank
whose main thread is stuck but whose interpreter still schedules threads); the detector sees
such a rank's steps stop, not this module.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

ENV = "STALWART_HEARTBEAT"  # HOST:PORT of the launcher's listener, given to every rank
BEAT_S = 0.5
SILENT_S = 3.0  # = elastic/protocol.py DEAD_AFTER_S: beats from a native thread in both
START_SILENT_S = 60.0
_FMT = "!4sIIB"  # magic, pid, sequence, phase
_MAGIC = b"stwh"
STARTING, READY, LEAVING = 0, 1, 2  # a process's phases, in order

_phase = [STARTING]
_send: list[Callable[[], None]] = []  # the beat thread's send, to beat at once on a change
_keep: list[socket.socket] = []  # the native beat thread's socket, kept open


# ---- rank side ---------------------------------------------------------------------------
def ready() -> None:
    """This rank is set up: from now the launcher judges it at ``SILENT_S``."""
    _enter(READY)


def leaving() -> None:
    """This rank's module has returned: the interpreter's finalization (no thread runs
    there) is judged at ``START_SILENT_S``, and the process's exit is what the launcher
    waits for."""
    _enter(LEAVING)


def _enter(phase: int) -> None:
    _phase[0] = max(_phase[0], phase)
    for send in _send:
        send()


def _native() -> Any:
    """``stalwart._beat`` (_native/beat.c), or None where it was not built."""
    try:
        from stalwart import _beat
    except ImportError:
        return None
    return _beat


def beat(addr: str, pid: int | None = None, native: bool | None = None
         ) -> threading.Thread | None:
    """Start the thread that sends this process's beats to ``addr`` (HOST:PORT); a send that
    fails (no route while the link is down) is skipped, never raised.

    The thread is native (``stalwart._beat``: a pthread that never takes the GIL) when the
    extension is built, else (or with ``native=False``) a Python daemon thread, returned. Why
    native: a rank's main thread may hold the GIL for seconds (a dlopen in a lazy import,
    slowed by the load and by the rank's own CPU quota) -- a Python beat thread then falls
    silent past ``SILENT_S`` and the launcher kills a slow rank as a hung one (seen: a rank
    under a 2x CPU quota at step 0, load ~15, in `stalwart bench detect`). Either thread
    stops with the whole process (SIGSTOP) and its beats stop arriving with its link."""
    host, port = addr.rsplit(":", 1)
    me = os.getpid() if pid is None else pid

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    lib = _native() if native is not False else None
    if lib is not None and _keep:
        return None  # this process's native beat runs already (one per process)
    if lib is not None:
        ip = socket.gethostbyname(host)
        _keep.append(sock)  # its fd is the native thread's for the process's life
        lib.set_phase(_phase[0])
        lib.start(sock.fileno(), ip, int(port), me & 0xFFFFFFFF, int(BEAT_S * 1000))

        def send_native() -> None:
            lib.set_phase(_phase[0])
            lib.send_now()

        _send.append(send_native)
        return None
    seq = [0]

    def send() -> None:
        seq[0] += 1
        with contextlib.suppress(OSError):
            sock.sendto(struct.pack(_FMT, _MAGIC, me, seq[0] & 0xFFFFFFFF, _phase[0]),
                        (host, int(port)))

    def run() -> None:
        while True:
            send()
            time.sleep(BEAT_S)

    _send.append(send)

    t = threading.Thread(target=run, name="stalwart-heartbeat", daemon=True)
    t.start()
    return t


# ---- the decision (pure) -----------------------------------------------------------------
@dataclass(frozen=True)
class Heard:
    """What the launcher knows of one process: when it started, its last beat, whether it
    said it is set up."""

    started: float
    last: float | None = None
    phase: int = STARTING


@dataclass(frozen=True)
class Silent:
    """A process judged hung or cut off: its seconds without a beat, and the bound it broke."""

    pid: int
    silent_s: float
    bound_s: float
    heard: bool  # ever beat: False means it never got as far as its first beat


def overdue(procs: Mapping[int, Heard], now: float, silent_s: float = SILENT_S,
            start_silent_s: float = START_SILENT_S) -> list[Silent]:
    """The processes silent past their bound: ``silent_s`` while ready, else (starting,
    leaving) ``start_silent_s``, since the last beat (or the start, when none came)."""
    out = []
    for pid, h in sorted(procs.items()):
        since = h.last if h.last is not None else h.started
        bound = silent_s if h.phase == READY else start_silent_s
        if now - since > bound:
            out.append(Silent(pid, now - since, bound, h.last is not None))
    return out


# ---- launcher side -----------------------------------------------------------------------
_CLONE_NEWNET = 0x40000000


def _in_netns(netns: str | None) -> socket.socket:
    """A UDP socket created inside network namespace ``netns`` (None: this one). Only the
    calling thread enters the namespace (setns(2) is per thread), and it comes back."""
    if netns is None:
        return socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    there = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(there, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns} failed")
        try:
            return socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        finally:
            if libc.setns(here, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the launcher's netns failed")
    finally:
        os.close(here)
        os.close(there)


class Listener:
    """The launcher's end: a UDP socket at ``host`` (inside ``netns`` when given) and a thread
    that records each process's last beat. ``addr`` is what ranks get in ``ENV``."""

    def __init__(self, host: str = "127.0.0.1", netns: str | None = None) -> None:
        self._lock = threading.Lock()
        self._heard: dict[int, Heard] = {}
        sock = _in_netns(netns)
        sock.bind((host, 0))
        sock.settimeout(0.5)
        self._sock = sock
        self.addr = f"{host}:{sock.getsockname()[1]}"
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="stalwart-liveness",
                                        daemon=True)
        self._thread.start()

    def expect(self, pid: int) -> None:
        """A process was started now: judged from here until its first beat."""
        with self._lock:
            self._heard[pid] = Heard(time.monotonic())

    def forget(self, pid: int) -> None:
        with self._lock:
            self._heard.pop(pid, None)

    def overdue(self, pids: list[int], now: float | None = None) -> list[Silent]:
        """``overdue`` over the given live processes (ones never ``expect``-ed are skipped)."""
        with self._lock:
            seen = {p: self._heard[p] for p in pids if p in self._heard}
        return overdue(seen, time.monotonic() if now is None else now)

    def _run(self) -> None:
        size = struct.calcsize(_FMT)
        while not self._closed:
            try:
                data, _ = self._sock.recvfrom(64)
            except TimeoutError:
                continue
            except OSError:
                return
            if len(data) != size:
                continue
            magic, pid, _seq, phase = struct.unpack(_FMT, data)
            if magic != _MAGIC:
                continue
            with self._lock:
                h = self._heard.get(pid)
                if h is not None:  # a process of this launch (stale pids are ignored)
                    self._heard[pid] = Heard(h.started, time.monotonic(),
                                             max(h.phase, min(phase, LEAVING)))

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        self._thread.join(timeout=1.0)
