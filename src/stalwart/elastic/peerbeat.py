"""A member's beats to the members that watch it, on the liveness connections they opened to it.

Every member connects to every other one's listener (rank.py); the accepting side writes one
byte on each accepted connection every period, and the connecting side reads it as a beat of
that member. The writer is a native thread that never takes the GIL (``stalwart._beat``'s
``fan_add``) where the extension is built, else a Python daemon thread. Why native: a member's
main thread may hold the GIL for seconds (a dlopen in a lazy import, a long C call that keeps
it); the membership's own watcher thread then cannot beat through the store, and a member
that is slow, not hung, would be taken for dead after ``DEAD_AFTER_S``. The native beats stop
only when the whole process stops (SIGSTOP, a frozen host) or its link stops carrying them (a
cut link, a full send buffer).

Guarantees: a socket passed to ``add`` is written at most once per period until ``remove``
returns; nothing is written to it after that (call ``remove`` before closing it, so that a
reused descriptor is never written). Not covered: a process whose main thread is stuck while
its threads still run keeps beating -- the training loop's progress, not liveness, shows that.
Cost: one 1-byte non-blocking ``send`` per watched-by connection per period, no Python on the
native path; a send that would block (the reader stopped reading) is skipped.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

from stalwart import heartbeat

BEAT = b"\x01"


def _native() -> Any:
    """``stalwart._beat`` with the peer-beat calls (heartbeat.py loads it), or None where it
    was not built."""
    lib = heartbeat._native()
    return lib if hasattr(lib, "fan_add") else None


class PeerBeats:
    """The beats one member sends on the connections accepted by its listener."""

    def __init__(self, period_s: float, native: bool | None = None) -> None:
        self.period_s = period_s
        self._lib = _native() if native is not False else None
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._lib is None:
            self._thread = threading.Thread(target=self._run, name="stalwart-peerbeat",
                                            daemon=True)
            self._thread.start()

    @property
    def native(self) -> bool:
        return self._lib is not None

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.add(sock)
        if self._lib is not None:
            self._lib.fan_add(sock.fileno(), max(1, round(self.period_s * 1000)))

    def remove(self, sock: socket.socket) -> None:
        """Stop writing to ``sock``; once this returns nothing more is written to it."""
        with self._lock:
            if sock not in self._socks:
                return
            self._socks.discard(sock)
            if self._lib is not None:
                self._lib.fan_remove(sock.fileno())

    def close(self) -> None:
        """Stop writing to every socket (the caller closes them)."""
        with self._lock:
            socks, self._socks = self._socks, set()
            if self._lib is not None:
                for s in socks:
                    self._lib.fan_remove(s.fileno())
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with self._lock:
                for s in self._socks:
                    with contextlib.suppress(OSError):
                        s.send(BEAT, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
