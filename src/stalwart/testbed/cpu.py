"""Slow compute and CPU contention through Linux cgroups (the "comp" fail-slow of FALCON).

A ``CpuGroup`` is one cgroup of the CPU controller holding a rank's whole process tree:

* compute factor F  -> CFS bandwidth quota of ``share / F`` CPUs (v1: cpu.cfs_quota_us over
  cpu.cfs_period_us; v2: cpu.max), where share is the CPU a rank gets when healthy: one CPU, or
  cores/nproc when ranks outnumber cores (4 ranks on 2 cores each get half a core, so a cap of
  one core / 2 would not slow anyone). The kernel stops the group for the rest of each period
  once its quota is used, so a CPU-bound rank runs ~F times slower than when healthy.
  The group's CFS weight is also divided by F (cpu.shares / cpu.weight): when the machine is
  busier than planned (other jobs on the cores) the quota alone would not bind, while the
  weight still gives the rank a smaller part of a contended core (F=2 against one equal
  competitor: 1/3 instead of 1/2 of the core, 1.5x; the full F only without competitors).
* contention K      -> K real busy processes are started inside the same group, capped at
  ``share`` CPUs. The group competes with the rest of the machine as one scheduling entity, so
  the rank and the K processes split one rank's worth of CPU through the ordinary CFS scheduler
  (the rank gets ~1/(K+1) of it). Both combined: the cap is share / F.

Host CPU budget: with ``capped`` every rank's group is held at ``share`` CPUs even without a
fault (the testbed does this for all hosts when CPU faults are scheduled, or with
``--cpu-cap fair``). Otherwise a healthy rank borrows the cores its peers leave idle while
they wait in a collective, runs faster than ``share``, and a fault of F reads as ~1.5F (2.9x
measured for F=2 with 4 ranks on 2 cores); capped, the achieved factor is close to F (the
testbed measures it and logs it as ``achieved_factor`` on the fault's ``fault_removed``).

Guarantees: the group is named ``stw-<owner pid>-<k>-r<rank>``; ``close()`` moves every process
still inside back to the cgroup it came from, stops the busy processes and removes the group.
Busy processes also exit on their own within milliseconds when their parent dies (they poll
their parent pid), so a killed owner leaves no spinning processes behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from stalwart.errors import ConfigError
from stalwart.testbed._sys import PREFIX

# A short CFS period makes throttling fine-grained: with 100 ms a rank whose steps take 30 ms
# could run several unthrottled steps before its quota runs out. With 20 ms, a tiny-preset
# step's ~8 ms of CPU either fit in what was left of the quota or waited out the period: its
# compute time relative to its peers' jittered by 25-28% (sd of the log, 4 ranks on 2 cores),
# larger than a 1.3x fault's shift (+0.15); with 5 ms the jitter is 13-20% and a 1.3x rank
# was found in 4 of 4 runs (1 of 3 at 20 ms). Shorter than the scheduler tick (4 ms at
# HZ=250) the kernel enforces the quota late. The kernel's minimum quota is 1 ms, so large
# factors stretch the period instead (at most 1 s, the kernel's maximum).
PERIOD_US = 5_000
MIN_QUOTA_US = 1_000
MAX_PERIOD_US = 1_000_000


def quota_period(cpus: float) -> tuple[int, int]:
    """(quota, period) in microseconds granting `cpus` CPUs."""
    period = PERIOD_US
    if cpus * period < MIN_QUOTA_US:
        period = min(MAX_PERIOD_US, int(MIN_QUOTA_US / cpus + 0.5))
    return max(MIN_QUOTA_US, int(round(cpus * period))), period


# the busy loop: pure interpreter work; leaves when its parent (the testbed owner, passed as
# argv[1] -- reading getppid() at start would race with an owner that dies during our start-up)
# is gone
_BUSY = ("import os, sys\np=int(sys.argv[1])\nwhile os.getppid()==p:\n"
         "    for _ in range(100000): pass\n")


@dataclass(frozen=True)
class CgroupBackend:
    version: int  # 1 or 2
    root: Path  # where our groups are created

    def write_weight(self, group: Path, factor: float, boost: float = 1.0) -> str:
        """Set the group's CFS weight to boost/factor times the default."""
        if self.version == 1:
            shares = min(262_144, max(2, int(round(1024 * boost / factor))))
            (group / "cpu.shares").write_text(str(shares))
            return f"cpu.shares={shares}"
        weight = min(10_000, max(1, int(round(100 * boost / factor))))
        (group / "cpu.weight").write_text(str(weight))
        return f"cpu.weight={weight}"

    def write_quota(self, group: Path, cpus: float | None) -> str:
        """Cap `group` at `cpus` CPUs (None = unlimited); returns the setting written."""
        if cpus is None:
            if self.version == 1:
                (group / "cpu.cfs_quota_us").write_text("-1")
                return "cpu.cfs_quota_us=-1"
            (group / "cpu.max").write_text(f"max {PERIOD_US}")
            return "cpu.max=max"
        quota, period = quota_period(cpus)
        if self.version == 1:
            # quota first: shrinking the period under an old, larger quota is refused
            (group / "cpu.cfs_quota_us").write_text("-1")
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
            return f"cpu.cfs_quota_us={quota} cpu.cfs_period_us={period}"
        (group / "cpu.max").write_text(f"{quota} {period}")
        return f"cpu.max={quota} {period}"


def fair_share(nproc: int) -> float:
    """CPUs one of `nproc` busy ranks gets on this machine: min(1, usable cores / nproc)."""
    return min(1.0, len(os.sched_getaffinity(0)) / max(nproc, 1))


def _v2_mount() -> Path | None:
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[2] == "cgroup2":
                    return Path(parts[1])
    except OSError:
        pass
    return None


def find_backend() -> CgroupBackend:
    """The CPU controller to use: cgroup v1 ``cpu`` if mounted, else v2 with ``cpu`` enabled.

    Raises ConfigError (one line) when neither is usable by this process.
    """
    for v1 in (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpu,cpuacct")):
        if (v1 / "cpu.cfs_quota_us").exists():
            if not os.access(v1, os.W_OK):
                raise ConfigError(f"cgroup {v1} is not writable: compute/contention faults "
                                  "need root")
            return CgroupBackend(1, v1)
    v2 = _v2_mount()
    if v2 is not None and "cpu" in (v2 / "cgroup.controllers").read_text().split():
        if not os.access(v2, os.W_OK):
            raise ConfigError(f"cgroup {v2} is not writable: compute/contention faults need root")
        ctl = v2 / "cgroup.subtree_control"
        if "cpu" not in ctl.read_text().split():
            try:
                ctl.write_text("+cpu")
            except OSError as e:
                raise ConfigError(f"cannot enable the cgroup v2 cpu controller in {v2}: "
                                  f"{e.strerror}") from None
        return CgroupBackend(2, v2)
    raise ConfigError("no cgroup CPU controller found (mount cgroup v1 'cpu' at "
                      "/sys/fs/cgroup/cpu, or cgroup v2 with the cpu controller enabled)")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (a rank may run under a wrapper or fork helpers)."""
    kids = _children()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def _current_group(backend: CgroupBackend, pid: int) -> Path:
    """The cgroup directory `pid` is in now, for this backend's hierarchy."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                ok = ("cpu" in ctrls.split(",")) if backend.version == 1 else ctrls == ""
                if ok:
                    return backend.root / path.lstrip("/")
    except (OSError, ValueError):
        pass
    return backend.root


def _move(pid: int, group: Path) -> bool:
    try:
        (group / "cgroup.procs").write_text(str(pid))
        return True
    except OSError:  # exited already, or a kernel thread
        return False


class CpuGroup:
    """One rank's CPU cgroup: throttling (factor) and contention (busy processes)."""

    def __init__(self, backend: CgroupBackend, name: str, boost: float = 1.0) -> None:
        """`boost` > 1 raises the group's base CFS weight: measurements use it to shield the
        quota's effect from unrelated jobs on the machine. Ranks keep the default (1.0)."""
        if not name.startswith(PREFIX + "-"):
            raise ValueError(f"cgroup name must start with {PREFIX}-: {name}")
        self.backend = backend
        self.path = backend.root / name
        self.path.mkdir(exist_ok=True)
        self._origin: dict[int, Path] = {}  # pid -> cgroup it came from
        self._busy: list[subprocess.Popen[bytes]] = []
        self.quota = backend.write_quota(self.path, None)
        self.boost = boost
        backend.write_weight(self.path, 1.0, boost)
        self._closed = False

    # -- membership ------------------------------------------------------------------------
    def add(self, pid: int) -> None:
        """Move `pid` and its descendants into the group."""
        for p in process_tree(pid):
            origin = _current_group(self.backend, p)
            if origin != self.path and _move(p, self.path):
                self._origin.setdefault(p, origin)

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    # -- the two fault mechanisms ----------------------------------------------------------
    def set_limit(self, factor: float, procs: int, share: float = 1.0,
                  capped: bool = False) -> str:
        """Apply compute factor and contention procs (1.0 and 0 = no fault); returns a
        description of the mechanism now in force.

        `share` is the CPU the process would get without the fault (1.0 = a dedicated CPU;
        ``fair_share(nproc)`` when ranks outnumber cores): the cap is ``share / factor`` so the
        slowdown is F relative to the healthy run, not relative to an idle machine.
        `capped`: without a fault the group is still held at `share` (the host's CPU budget),
        so that a healthy rank cannot borrow the cores its peers leave idle while they wait
        -- borrowing made a healthy rank faster than `share` and a fault of F read as ~1.5F.
        """
        cpus: float | None = share if capped else None
        if factor > 1.0 or procs > 0:
            cpus = share / factor
        self.quota = self.backend.write_quota(self.path, cpus)
        weight = self.backend.write_weight(self.path, factor, self.boost)
        self._set_busy(procs)
        desc = f"cgroup v{self.backend.version} {self.path.name} {self.quota}"
        if factor > 1.0:
            desc += f" {weight}"
        if procs:
            desc += f", {procs} busy process{'es' if procs > 1 else ''} in the same group"
        return desc

    def _set_busy(self, procs: int) -> None:
        while len(self._busy) > procs:
            self._stop(self._busy.pop())
        while len(self._busy) < procs:
            tag = f"# {self.path.name} busy\n"
            p = subprocess.Popen([sys.executable, "-S", "-c", tag + _BUSY, str(os.getpid())],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
            self._busy.append(p)
            _move(p.pid, self.path)

    @staticmethod
    def _stop(p: subprocess.Popen[bytes]) -> None:
        p.kill()
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def busy_pids(self) -> list[int]:
        return [p.pid for p in self._busy]

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        while self._busy:
            self._stop(self._busy.pop())
        remove_group(self.path, self._origin)


def remove_group(path: Path, origin: dict[int, Path] | None = None) -> bool:
    """Move every process out of `path` (back where it came from, else to the parent) and
    remove the directory. Returns True when it is gone."""
    origin = origin or {}
    # A process that is still exiting (e.g. a rank SIGKILLed with its killed launcher) cannot
    # be moved but keeps the group busy until the kernel has reaped it: retry for a moment.
    deadline = time.monotonic() + 5.0
    while True:
        for _ in range(3):  # a process may fork while we move its siblings
            try:
                pids = [int(x) for x in (path / "cgroup.procs").read_text().split()]
            except OSError:
                break
            if not pids:
                break
            for pid in pids:
                dest = origin.get(pid, path.parent)
                if not _move(pid, dest) and dest != path.parent:
                    _move(pid, path.parent)
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
