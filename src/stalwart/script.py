"""A user's own torchrun script as the ranks of ``stalwart run`` (launcher side).

``stalwart run --script train.py [--testbed netns] [--fault ...] [--detect] -- ARGS`` starts
``train.py ARGS`` once per rank, exactly as torchrun would (its environment: RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT, ...; see launch.py), on the emulated hosts of the testbed, with
the fault schedule applied and logged as ground truth. The script needs no change and no
import of stalwart. The rank side is ``stalwart.scriptboot``.

What this module guarantees:
- a script run is checked before anything starts: a missing file, a folder, a file that does
  not compile as Python, options that only make sense for stalwart's own workload, or a fault
  window in steps without a step counter stop the run with one line naming the value
  (ConfigError, exit code 2);
- the display shows rank 0's own output as it comes, the faults as they switch and the
  monitor's findings, all on the clock the fault windows use (seconds since the ranks started);
- when several ranks have failed by the time the launcher looks, the one whose script raised
  first is blamed (each rank's bootstrap records when its script raised, ``first_errors``):
  when one rank crashes, its peers fail a moment later in their next collective.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from stalwart.config import RunConfig
from stalwart.events import describe as describe_event
from stalwart.rundir import ERROR_SUFFIX, ITERATIONS, LOGS

__all__ = ["ERROR_SUFFIX", "ITERATIONS", "ScriptProgress", "describe", "first_errors",
           "format_event"]
PLAIN_EVERY_S = 10.0

def first_errors(run_dir: Path) -> dict[int, dict[str, Any]]:
    """rank -> {"time", "error", ...} for every rank whose script raised or exited non-zero."""
    out: dict[int, dict[str, Any]] = {}
    for f in (run_dir / LOGS).glob(f"rank-*{ERROR_SUFFIX}"):
        try:
            rank = int(f.name[len("rank-"):-len(ERROR_SUFFIX)])
            rec = json.loads(f.read_text())
            out[rank] = rec if isinstance(rec, dict) else {}
        except (ValueError, OSError):
            continue
    return out


def describe(cfg: RunConfig) -> str:
    args = " ".join(cfg.job.script_args)
    return f"{cfg.job.script}{' ' + args if args else ''}"


class ScriptProgress:
    """The launcher's display for a script run (same interface as stalwart.progress.Progress).

    Plain lines, never a live bar (a script has no known length): rank 0's output as it
    comes, prefixed ``[rank 0]``; faults and findings as they are logged; with the monitor,
    every ``PLAIN_EVERY_S`` seconds the iterations rank 0 has done and their recent time.
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, enabled: bool = True) -> None:
        self.enabled = enabled
        self.run_dir = run_dir
        self.t0 = time.monotonic()
        self.iterations = 0
        self._recent: list[float] = []
        self._last_plain = self.t0
        self._log_pos = 0
        self._log_partial = b""
        self._seen: set[str] = set()
        if enabled:
            print(f"stalwart: {cfg.job.nproc} ranks run {describe(cfg)} on the {cfg.testbed.kind} "
                  f"testbed -> {run_dir}", flush=True)

    def _say(self, text: str) -> None:
        if self.enabled:
            print(f"stalwart: {text}", flush=True)

    def on_metric(self, m: dict[str, Any]) -> None:
        """One iteration line of the monitor (scriptboot)."""
        if m.get("rank") == 0:
            self.iterations = max(self.iterations, int(m.get("step", 0)) + 1)
            self._recent = (self._recent + [float(m.get("step_time", 0.0))])[-20:]

    def on_event(self, e: dict[str, Any]) -> None:
        key = repr(sorted(e.items()))
        if key in self._seen:
            return
        self._seen.add(key)
        text = format_event(e)
        if text:
            self._say(text)

    def _tail_rank0(self) -> None:
        try:
            with open(self.run_dir / LOGS / "rank-0.log", "rb") as f:
                f.seek(self._log_pos)
                data = f.read()
                self._log_pos = f.tell()
        except OSError:
            return
        *lines, self._log_partial = (self._log_partial + data).split(b"\n")
        for line in lines:
            print(f"[rank 0] {line.decode(errors='replace')}", flush=True)

    def refresh(self) -> None:
        if not self.enabled:
            return
        self._tail_rank0()
        now = time.monotonic()
        if self._recent and now - self._last_plain >= PLAIN_EVERY_S:
            self._last_plain = now
            med = sorted(self._recent)[len(self._recent) // 2]
            self._say(f"{now - self.t0:.0f}s: {self.iterations} iterations on rank 0, "
                      f"{med * 1000:.0f} ms each (monitor)")

    def finish(self) -> None:
        if not self.enabled:
            return
        self._tail_rank0()
        if self._log_partial:
            print(f"[rank 0] {self._log_partial.decode(errors='replace')}", flush=True)
            self._log_partial = b""
        its = f", {self.iterations} iterations (monitor)" if self.iterations else ""
        self._say(f"done in {time.monotonic() - self.t0:.1f}s{its}")

    def close(self) -> None:
        sys.stdout.flush()


def format_event(e: dict[str, Any]) -> str | None:
    """One line for a fault or a finding, on the script run's clock."""
    ev = e.get("event")
    at = f" at {e['elapsed_s']:.1f}s" if isinstance(e.get("elapsed_s"), (int, float)) else ""
    if ev in ("fault_applied", "fault_removed"):
        return f"{ev.replace('_', ' ')}{at}: {e.get('spec', e.get('kind'))}"
    if ev == "straggler_detected" and (line := describe_event(e, unit="iteration")):
        return line + " (monitor)"
    return describe_event(e, unit="iteration")
