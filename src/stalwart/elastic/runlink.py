"""The built-in trainer's link between ``stalwart run`` and its ranks, the launcher's side:
typed records kept in the launch's membership store (the ``LauncherStore`` process,
elastic/launcher.py), torch-free.

A job that regroups in place (mitigate/membership.py ``in_place_ok``) gets the same store
process as a ``--script`` run: ``python -m stalwart.elastic.store --commands`` in rank 0's
host (its netns on the netns testbed), tied to the launcher by ``stalwart.lifeline``. Its
ranks reach it over TCP (``STALWART_STORE``, elastic/ranklink.py); the launcher, which does
not import torch, talks to it through the process's stdin and stdout: one JSON line per
store operation, answered in order (``StorePipe``).

The records of one launch (one *incarnation*: a new ``token`` after every relaunch), under
``stalwart/<job>/run/<token>``:

- ``gen/<n>``, a ``membership.Generation``: written by the launcher (n = 0 at launch, a
  rank lost, a fallback) and by rank 0 (a planned change), each by compare-and-set (the
  first writer of n wins; the other builds on it); read by every rank's membership watcher
  and by the launcher.
- ``ready/<slot>``, a ``Ready``: written by a launch rank started again to rejoin, once it
  is built; read by the launcher, which then asks rank 0 to take it back.
- ``takeback``, a ``TakeBack``: written by the launcher when a host out of the job is
  healthy again and its launch rank, started again, is ready; read and removed by rank 0,
  which decides ``restore_host`` at an agreed step (mitigate/rebalance.py).
- ``exit/<slot>``, an ``ExitRecord``: written by a rank just before it exits 0 early (left
  out, fell back, left for a restart with its host map); read by the launcher when it sees
  that exit. A rank's exit code is 0 then, as when it finished (no record); anything else is
  a failure (2: bad input, the CLI's contract).
- ``pg/<n>``, ``host port``: written by rank 0 of generation n, where its TCPStore serves
  the generation's process-group rendezvous; read by the other members.

A rank started again to rejoin is told so by its command line (``--rejoin``), and every rank
of the job by ``--link TOKEN`` which launch it belongs to.

Guarantees: a record is one key, set whole (a reader sees one whole generation); generation
n + 1 is only written once n exists, and never rewritten (compare-and-set), so generations
only grow and a reader finds the newest by walking up from the one it holds; the token is
new for every launch, so a relaunch never reads an older incarnation's records, and a
resumed run starts a new store process. Cost, launcher: one pipe round trip (~0.2 ms) per
operation, a few per membership change and one per poll (0.1 s) only while a rank started to
rejoin is not ready yet.

When the store process dies (it should not: it only serves keys; it dies with the launcher)
the launcher sees it at its next poll and stops the job with one line naming it and its log
(supervise.py); the ranks' store calls fail or time out (``STORE_TIMEOUT_S``), and they are
stopped by the launcher anyway.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

STORE_TIMEOUT_S = 10.0  # an answer to one operation, once the store serves
START_TIMEOUT_S = 180.0  # the store process's start (its torch import on a loaded machine)


def run_prefix(job: str, token: str) -> str:
    """The key prefix of launch ``token``'s records (a ``PrefixStore``'s, on both sides)."""
    return f"stalwart/{job}/run/{token}"


@dataclass(frozen=True)
class Ready:
    """A launch rank started again to rejoin is built and waits for the generation that takes
    it back (its process id: what a test or an operator signals)."""

    slot: int
    pid: int
    time: float

    def to_json(self) -> str:
        return json.dumps({"slot": self.slot, "pid": self.pid, "time": self.time})

    @staticmethod
    def from_json(text: str | bytes) -> Ready:
        d = json.loads(text)
        return Ready(int(d["slot"]), int(d["pid"]), float(d["time"]))


@dataclass(frozen=True)
class TakeBack:
    """The launcher's request to rank 0: host ``host`` (out of the job) is healthy again and
    taking it back pays (``reason``, ``predicted_gain``); ``live``: its launch rank was
    started again and is ready to join in place."""

    host: int
    predicted_gain: float
    reason: str
    live: bool

    def to_json(self) -> str:
        return json.dumps({"host": self.host, "predicted_gain": self.predicted_gain,
                           "reason": self.reason, "live": self.live})

    @staticmethod
    def from_json(text: str | bytes) -> TakeBack:
        d = json.loads(text)
        return TakeBack(int(d["host"]), float(d["predicted_gain"]), str(d["reason"]),
                        bool(d["live"]))


LEFT, FALLBACK, RESTART = "left", "fallback", "restart"  # why a rank exits before the end


@dataclass(frozen=True)
class ExitRecord:
    """Why a rank exits 0 before the job's end, written before it exits:

    - ``left``: a planned regroup left it out (S4), or it was started to rejoin and not
      taken back; its host is probed for the way back;
    - ``fallback``: its in-place regroup failed (or the launcher gave up on it); ``saved``:
      where its state is (mitigate/fallback.py ``Saved``), the launcher relaunches from the
      most advanced;
    - ``restart``: an S3/S4 decision that takes a restart (not the in-place path);
      ``hosts``: the next incarnation's rank -> host map (rank 0's record carries it),
      ``strategy``, ``reason``, ``predicted_gain``, ``step_time_before`` for the
      launcher's ``restart`` event.

    A rank that exits 0 without one has finished the job."""

    slot: int
    why: str
    step: int
    reason: str = ""
    hosts: tuple[int, ...] = ()
    strategy: str = ""
    predicted_gain: float | None = None
    step_time_before: float | None = None
    saved: Any = None  # fallback.Saved

    def to_json(self) -> str:
        return json.dumps({"slot": self.slot, "why": self.why, "step": self.step,
                           "reason": self.reason, "hosts": list(self.hosts),
                           "strategy": self.strategy, "predicted_gain": self.predicted_gain,
                           "step_time_before": self.step_time_before,
                           "saved": None if self.saved is None else self.saved.to_dict()})

    @staticmethod
    def from_json(text: str | bytes) -> ExitRecord:
        from stalwart.mitigate.fallback import Saved

        d = json.loads(text)
        gain, before = d.get("predicted_gain"), d.get("step_time_before")
        return ExitRecord(int(d["slot"]), str(d["why"]), int(d["step"]), str(d.get("reason", "")),
                          tuple(int(h) for h in d.get("hosts") or ()), str(d.get("strategy", "")),
                          None if gain is None else float(gain),
                          None if before is None else float(before),
                          None if d.get("saved") is None else Saved.from_dict(d["saved"]))


class StoreGone(RuntimeError):
    """The store process exited or stopped answering."""


class StorePipe:
    """The launcher's end of the store process's command pipe (``python -m
    stalwart.elastic.store --commands``): ``call(op, key, ...)`` sends one JSON line and
    returns its answer. ``send`` does not wait (its answer is read and dropped before the
    next ``call``'s): the launcher's first write must not wait for the store's torch
    import. Thread-safe (one lock)."""

    def __init__(self, proc: subprocess.Popen, log: str) -> None:
        self.proc = proc
        self.log = log
        self._lock = threading.Lock()
        self._owed = 0  # answers of ``send``s not read yet
        self._buf = b""
        self._serving = False  # the store said it serves (its first line)

    def send(self, op: str, key: str, *args: str, prefix: str = "") -> None:
        with self._lock:
            self._write(op, key, args, prefix)
            self._owed += 1

    def call(self, op: str, key: str, *args: str, prefix: str = "") -> Any:
        with self._lock:
            self._write(op, key, args, prefix)
            while self._owed:
                self._answer()
                self._owed -= 1
            return self._answer()

    def _write(self, op: str, key: str, args: tuple[str, ...], prefix: str) -> None:
        line = json.dumps({"op": op, "key": key, "args": list(args), "prefix": prefix}) + "\n"
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):
            raise StoreGone(self._gone("its command pipe is closed")) from None

    def _line(self) -> bytes:
        """The next line from the store, within the timeout (the start's until it serves)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + (STORE_TIMEOUT_S if self._serving else START_TIMEOUT_S)
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreGone(self._gone(f"no answer in {STORE_TIMEOUT_S:.0f} s"))
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if not ready:
                if self.proc.poll() is not None:
                    raise StoreGone(self._gone("it exited"))
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise StoreGone(self._gone("it exited"))
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _answer(self) -> Any:
        while True:
            line = self._line()
            if not line.startswith(b"{"):  # "STALWART_STORE=...": it serves
                self._serving = True
                continue
            got = json.loads(line)
            if "error" in got:
                raise StoreGone(self._gone(str(got["error"])))
            return got.get("value")

    def _gone(self, why: str) -> str:
        code = self.proc.poll()
        how = f"exit code {code}" if code is not None else "still running"
        return (f"the run's membership store process failed ({why}; {how}); see {self.log}")


class LauncherLink:
    """The launcher's records of one launch (``token``) on the store (the module docstring).
    Values travel as text; ``None`` answers a key that is not there."""

    def __init__(self, pipe: StorePipe, job: str, token: str) -> None:
        self.pipe = pipe
        self.token = token
        self.prefix = run_prefix(job, token)

    def _call(self, op: str, key: str, *args: str) -> Any:
        return self.pipe.call(op, key, *args, prefix=self.prefix)

    def put_generation(self, g: Any, wait: bool = True) -> None:
        """Generation ``g`` as the launcher decides it (0 at launch: ``wait=False``, the
        store may still be starting; the ranks wait for the key)."""
        if wait:
            self._call("set", f"gen/{g.gen}", g.to_json())
        else:
            self.pipe.send("set", f"gen/{g.gen}", g.to_json(), prefix=self.prefix)

    def propose_generation(self, g: Any) -> str:
        """Compare-and-set ``gen/<g.gen>``: the text of the winner (``g``'s or an earlier
        writer's)."""
        return str(self._call("cas", f"gen/{g.gen}", "", g.to_json()))

    def generation_text(self, n: int) -> str | None:
        v = self._call("get", f"gen/{n}")
        return None if v is None else str(v)

    def ready(self, slot: int) -> Ready | None:
        v = self._call("get", f"ready/{slot}")
        return None if v is None else Ready.from_json(v)

    def clear_ready(self, slot: int) -> None:
        self._call("delete", f"ready/{slot}")

    def ask_take_back(self, t: TakeBack) -> None:
        """Ask rank 0 to take a host back (it reads and removes the request: ``take_back``
        in elastic/ranklink.py)."""
        self._call("set", "takeback", t.to_json())

    def exit_of(self, slot: int) -> ExitRecord | None:
        """Launch rank ``slot``'s reason for exiting 0 early (None: it finished the job)."""
        v = self._call("get", f"exit/{slot}")
        return None if v is None else ExitRecord.from_json(v)

    def clear_exit(self, slot: int) -> None:
        """Forget launch rank ``slot``'s exit record (it is started again)."""
        self._call("delete", f"exit/{slot}")
