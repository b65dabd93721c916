"""Calibrate a CFS quota against the CPU share it actually grants on this host.

A quota of Q us per P us period should let a CPU-bound group run Q/P of the time. On this
testbed's VMs it runs less, by a margin that grows with the quota and with the machine's load:
after each throttled period the group waits to be scheduled again (the running task keeps its
slice), so a part of every period is lost. At P = 5 ms a factor-2 quota granted 0.37-0.44 CPU
instead of 0.5 (a 2.3-2.7x slowdown instead of 2x); docs/testbed.md has the table.

``QuotaCalibrator.correct`` measures the share granted by a quota in a probe cgroup with the
same quota and weight as the target, under the load of the moment, and returns the CPUs to
write so that the share granted is the one asked for (one multiplicative correction; the loss
is roughly proportional to the quota). Cost: ``PROBES`` x ``PROBE_S`` of one busy core per new
(cpus, weight) pair, cached for ``TTL_S``. Guarantee: the probe cgroup is removed before
``correct`` returns (its process killed), also when the probe fails; a failed probe returns
the uncorrected value.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Protocol

from stalwart.testbed.cpu import remove_group

PROBES = 2  # probe runs per calibration; their CPU and wall time are summed
PROBE_S = 0.2  # wall seconds per probe run: 40 periods of 5 ms
TTL_S = 60.0  # a calibration is redone after this long (the loss follows the load)
MAX_GAIN = 2.0  # never write more than this times the CPUs asked for

# a busy loop that waits for "go", spins for argv[1] seconds of wall time, then prints its
# wall and CPU seconds
_PROBE = ("import sys, time\nsys.stdin.readline()\nd=float(sys.argv[1])\n"
          "t0=time.perf_counter(); c0=time.process_time(); x=0\n"
          "while time.perf_counter()-t0<d:\n    for i in range(2000): x+=i\n"
          "print(time.perf_counter()-t0, time.process_time()-c0, flush=True)\n")


class _Backend(Protocol):
    root: Path

    def write_quota(self, group: Path, cpus: float | None) -> str: ...

    def write_weight(self, group: Path, factor: float, boost: float = 1.0) -> str: ...


class QuotaCalibrator:
    """Corrects quotas for one cgroup backend; one per testbed (not thread-safe)."""

    def __init__(self, backend: _Backend, name: str) -> None:
        self.backend = backend
        self.name = name  # the probe group's directory name (stw-<pid>-<tag>-cal)
        self._cache: dict[tuple[float, float, float], tuple[float, float]] = {}

    def correct(self, cpus: float, factor: float, boost: float) -> float:
        """CPUs to write so that a group of this weight is granted `cpus` CPUs."""
        if cpus >= len(os.sched_getaffinity(0)):
            return cpus
        key = (round(cpus, 4), round(factor, 4), round(boost, 4))
        hit = self._cache.get(key)
        if hit is not None and time.monotonic() - hit[1] < TTL_S:
            return hit[0]
        granted = self.granted(cpus, factor, boost)
        out = cpus if granted is None else min(cpus * MAX_GAIN, cpus * cpus / granted)
        self._cache[key] = (out, time.monotonic())
        return out

    def granted(self, cpus: float, factor: float, boost: float) -> float | None:
        """CPUs a CPU-bound process gets under a quota of `cpus` (None: the probe failed)."""
        path = self.backend.root / self.name
        try:
            path.mkdir(exist_ok=True)
            self.backend.write_quota(path, cpus)
            self.backend.write_weight(path, factor, boost)
            wall = cpu = 0.0
            for _ in range(PROBES):
                w, c = self._probe(path)
                wall, cpu = wall + w, cpu + c
            return cpu / wall if wall > 0 and cpu > 0 else None
        except (OSError, ValueError, subprocess.SubprocessError):
            return None
        finally:
            remove_group(path)

    @staticmethod
    def _probe(path: Path) -> tuple[float, float]:
        p = subprocess.Popen([sys.executable, "-S", "-c", _PROBE, str(PROBE_S)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            (path / "cgroup.procs").write_text(str(p.pid))
            out, _ = p.communicate("go\n", timeout=PROBE_S * 20 + 10)
            w, c = (float(x) for x in out.split())
            return w, c
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
