"""The testbed a run executes on, and its fault schedule with the ground-truth event log.

``open_testbed(cfg, events)`` returns a context manager:

* ``local``: ranks run on this machine's loopback (master 127.0.0.1); compute and contention
  faults act through CPU cgroups.
* ``netns``: rank r runs inside emulated host r // K (``--ranks-per-host K``, default 1; see
  hosts.py); gloo binds to that host's eth0, so ranks of one host talk inside its namespace
  and cross its link only to reach other hosts; link, pairlink and loss faults act on the
  hosts' network paths (all their ranks), compute and contention on one rank's own cgroup.
  The placement is logged once per incarnation as ``testbed_placement`` (rank -> host).

Slots: a rank's identity across restarts is its slot (``cfg.job.hosts``: rank -> slot; rank r is
slot r at launch); slot s runs on host s // K. A fault's ``rank=`` names a slot, ``host=`` a
host. ``Testbed.hosts`` (netns) addresses slots (``SlotHosts``), so the mitigation's probes
keep counting slots.

Schedule: the launcher calls ``on_step(next_step)`` as training advances (stalwart's metrics,
or the monitor's iteration count for a user's script) and ``on_time(elapsed)`` with the seconds
since the ranks were first started. A fault is active while ``start <= next_step < end`` for a
window in steps, ``start_s <= elapsed < end_s`` for one in seconds (faults.py). On every
transition the kernel state is rebuilt from the set of active faults, and only once the new
state is in force is the ground-truth line written:
``fault_applied`` / ``fault_removed`` with step, kind, target, magnitude, spec, mechanism and
the explicit rank (compute, contention) or hosts (link, pairlink, loss). Faults still active at
``close()`` are removed and logged with ``at_close: true``. A CPU fault whose rank has no pid
yet is applied (and logged) by ``attach_ranks``.

A kill fault (``kill:rank=R,at=...``) is one moment, not a window: when it comes due and the
rank's process is known, its process group gets SIGKILL and ``fault_applied`` is logged with
the pid; it is never removed (the process stays dead), and never applied twice.

CPU budget: when CPU faults are scheduled (or ``--cpu-cap fair``) every host is held at its
fair share of the cores from ``attach_ranks`` on (logged once as ``testbed_cpu_cap``), so a
compute fault of F slows its rank by about F; ``fault_removed`` of a CPU fault carries the
``achieved_factor`` measured from the ranks' compute time (``observe``, fed by the launcher).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import statistics
from collections.abc import Mapping
from typing import Any

from stalwart.config import ConfigError, RunConfig
from stalwart.events import (
    FaultApplied,
    FaultRemoved,
    TestbedCpuCap,
    TestbedPlacement,
    TestbedTraffic,
)
from stalwart.faultspec import MOMENT_KINDS, Fault
from stalwart.heartbeat import ENV as BEAT_ENV
from stalwart.heartbeat import Listener
from stalwart.rundir import EventLog
from stalwart.testbed import cleanup, traffic
from stalwart.testbed._sys import PREFIX, next_tag, require_root, require_tool
from stalwart.testbed.cpu import CpuGroup, fair_share, find_backend
from stalwart.testbed.hosts import CONTROL_ADDR, Hosts

CPU_KINDS = ("compute", "contention")


class Testbed:
    """Common schedule/logging logic; subclasses provide placement and network faults."""

    kind = "local"
    master_addr = "127.0.0.1"

    def __init__(self, cfg: RunConfig, events: EventLog | None) -> None:
        tb = cfg.testbed
        self.nproc = cfg.job.nproc
        self.mtu = tb.mtu
        self.events = events
        # identical specs are one fault (a set of active faults cannot hold both)
        self.per_host = tb.ranks_per_host
        self.faults: list[Fault] = list(dict.fromkeys(cfg.parse_fault(s) for s in tb.faults))
        self._tag = next_tag()
        self._owner = os.getpid()
        self._pids: dict[int, int] = {}
        self._groups: dict[int, CpuGroup] = {}
        self._backend = None
        self._active: set[Fault] = set()  # desired: scheduled-on at the last step
        self._logged: dict[Fault, str] = {}  # applied and logged -> its mechanism
        self._step = 0
        self._elapsed: float | None = None  # seconds since the ranks started (on_time)
        self._closed = False
        # rank -> host: rank r on host r at launch; a restart without a host (mitigation's
        # S4) moves ranks, and faults stay on their hosts (a compute fault's "rank" is the
        # host that rank ran on at launch)
        self._host_of = list(cfg.job.hosts) if cfg.job.hosts else list(range(cfg.job.nproc))
        # every host's CPU budget (cpu.py): its fair share of the cores, fixed for the run
        # (a restart on fewer hosts does not give the others more)
        self._share = fair_share(max(self._host_of) + 1)
        has_cpu = any(f.kind in CPU_KINDS for f in self.faults)
        self._cap = tb.cpu_cap == "fair" or (tb.cpu_cap == "auto" and has_cpu)
        if has_cpu or self._cap:
            require_root("compute/contention faults" if has_cpu else "--cpu-cap fair")
            self._backend = find_backend()
        self._cap_logged = False
        # host -> step -> compute seconds per micro-batch (from the metrics the launcher
        # passes to observe()): the achieved slowdown of a CPU fault, logged at its removal
        self._unit: dict[int, dict[int, float]] = {}
        self._applied_at: dict[Fault, int] = {}
        self._killed: set[Fault] = set()
        self._back: dict[Fault, float] = {}  # killed ranks to start again: fault -> kill time
        self.liveness: Listener | None = None  # start_liveness

    def start_liveness(self) -> Listener:
        """The launcher's liveness listener (heartbeat.py), started once; every rank started
        after this beats to it (its address is in ``env``). Closed with the testbed."""
        if self.liveness is None:
            self.liveness = self._listen()
        return self.liveness

    def _listen(self) -> Listener:
        """Where every rank reaches the launcher over its own network path: here, loopback."""
        return Listener("127.0.0.1")

    def _beat_env(self) -> dict[str, str]:
        return {BEAT_ENV: self.liveness.addr} if self.liveness is not None else {}

    # -- placement (contract) --------------------------------------------------------------
    def command_prefix(self, rank: int) -> list[str]:
        return []

    def env(self, rank: int) -> dict[str, str]:
        return {"STALWART_HOST_ADDR": "127.0.0.1", "STALWART_MTU": str(self.mtu),
                **self._beat_env()}

    def host(self, rank: int) -> int:
        """The rank's slot (its launch rank: rank r of the first incarnation)."""
        return self._host_of[rank]

    def node(self, rank: int) -> int:
        """The emulated host the rank runs on (``--ranks-per-host`` slots to a host)."""
        return self.host(rank) // self.per_host

    def placement(self) -> dict[str, Any]:
        """The rank -> host map of this incarnation (logged as ``testbed_placement``)."""
        return {"ranks_per_host": self.per_host, "slots": list(self._host_of),
                "host_of_rank": [self.node(r) for r in range(len(self._host_of))]}

    def set_hosts(self, hosts: list[int] | None) -> None:
        """The next incarnation's rank -> host map (the previous ranks have exited)."""
        self._host_of = list(hosts) if hosts else list(range(self.nproc))
        self._pids.clear()

    def attach_ranks(self, pids: Mapping[int, int]) -> None:
        """Tell the testbed each rank's pid (cgroup faults act on processes; kept per host)."""
        self._pids.update({self.host(int(r)): int(p) for r, p in pids.items()})
        for rank, group in self._groups.items():
            if rank in self._pids:
                group.add(self._pids[rank])
        if self._cap:
            self._apply(set(self._logged), {("rank", h) for h in self._pids})
            if not self._cap_logged and self.events is not None:
                self._cap_logged = True
                self.events.emit(TestbedCpuCap(
                    step=self._step, testbed=self.kind, cpus=round(self._share, 4),
                    hosts=sorted(self._pids), mechanism=self._groups[min(self._pids)].quota))
        self._reconcile(self._step)

    def observe(self, metric: Mapping[str, Any]) -> None:
        """One metrics line (launcher): kept per host for the achieved factor of CPU faults."""
        # kept only while a CPU fault is applied: nothing else reads it, and a long run would
        # otherwise grow it by a line per rank and step
        if not self._applied_at or "compute_time" not in metric or "rank" not in metric:
            return
        rank = int(metric["rank"])
        if rank >= len(self._host_of):
            return
        # after an in-place regroup ranks are renumbered; the line's own host is the truth
        host = int(metric["host"]) if "host" in metric else self.host(rank)
        per = float(metric["compute_time"]) / max(int(metric.get("micro_batches", 1)), 1)
        self._unit.setdefault(host, {})[int(metric["step"])] = per

    def achieved_factor(self, host: int, lo: int, hi: int) -> float | None:
        """Median over steps lo+2 .. hi-1 of the host's compute per micro-batch over its
        peers' median at the same step (peers are capped at the same budget, so they are the
        healthy reference even while mitigation moves work); None with < 3 such steps."""
        mine = self._unit.get(host, {})
        ratios = []
        for step in range(lo + 2, hi):
            peers = [u[step] for h, u in self._unit.items() if h != host and step in u]
            if step in mine and peers:
                ratios.append(mine[step] / max(statistics.median(peers), 1e-9))
        return round(statistics.median(ratios), 3) if len(ratios) >= 3 else None

    # -- schedule --------------------------------------------------------------------------
    def on_step(self, next_step: int) -> None:
        if self._closed:
            return
        self._step = next_step
        self._active = {f for f in self.faults
                        if f.kind not in MOMENT_KINDS
                        and f.active_at(next_step, self._elapsed)}
        self._reconcile(next_step)
        self._kill_due()

    def on_time(self, elapsed: float) -> None:
        """Seconds since the ranks were first started (launcher, every poll): faults whose
        window is in seconds switch here."""
        if self._closed:
            return
        self._elapsed = elapsed
        active = {f for f in self.faults
                  if f.kind not in MOMENT_KINDS and f.active_at(self._step, elapsed)}
        if active != self._active:
            self._active = active
            self._reconcile(self._step)
        self._kill_due()

    def _kill_due(self) -> None:
        """SIGKILL (a kill fault) or SIGSTOP (a hang) the process group of each rank whose
        fault is due, once."""
        for f in self.faults:
            if f.kind not in MOMENT_KINDS or f in self._killed or not f.active_at(
                    self._step, self._elapsed):
                continue
            pid = self._pids.get(f.rank)  # type: ignore[arg-type]
            if pid is None:
                continue
            self._killed.add(f)
            if f.back_s is not None:
                self._back[f] = self._elapsed or 0.0
            sig = signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)  # the rank is its session's leader (launch)
            self._log(FaultApplied, f, self._step, f"{sig.name} to process group {pid}",
                      False, pid=pid)

    def restarts_due(self) -> list[int]:
        """The ranks whose kill fault's ``back`` seconds have passed since the kill, each
        once (the launcher starts them again: supervise.py); a ``fault_removed`` is logged
        for each; empty before the launcher's first ``on_time`` (no clock yet)."""
        now = self._elapsed
        if now is None:
            return []
        due = [f for f, t in self._back.items() if f.back_s is not None and now - t >= f.back_s]
        for f in due:
            del self._back[f]
            self._log(FaultRemoved, f, self._step, "rank started again", False)
        return [int(f.rank) for f in due if f.rank is not None]

    def _reconcile(self, step: int, at_close: bool = False) -> None:
        desired = {f for f in self._active if f.kind not in CPU_KINDS or f.rank in self._pids}
        gone = [f for f in self._logged if f not in desired]
        new = [f for f in self.faults if f in desired and f not in self._logged]
        if not gone and not new:
            return
        mech = self._apply(desired, {t for f in gone + new for t in self._targets(f)})
        for f in gone:
            extra: dict[str, Any] = {}
            if f.kind in CPU_KINDS and f in self._applied_at:
                extra["achieved_factor"] = self.achieved_factor(
                    f.rank, self._applied_at.pop(f), step)
            self._log(FaultRemoved, f, step, self._logged.pop(f), at_close, **extra)
            if not self._applied_at:
                self._unit.clear()
        for f in new:
            self._logged[f] = mech.get(f, "")
            if f.kind in CPU_KINDS:
                self._applied_at[f] = step
            self._log(FaultApplied, f, step, self._logged[f], at_close)

    @staticmethod
    def _targets(f: Fault) -> list[tuple[str, Any]]:
        """What a fault's mechanism acts on: a rank's cgroup, a host, or a pair of hosts."""
        if f.kind in CPU_KINDS:
            return [("rank", f.rank)]
        if f.kind == "pairlink":
            return [("pairlink", tuple(sorted(f.hosts)))]
        return [(f.kind, h) for h in f.hosts]

    def _log(self, event: type[FaultApplied | FaultRemoved], f: Fault, step: int,
             mechanism: str, at_close: bool, **extra: Any) -> None:
        if self.events is None:
            return
        # the time axis of a run without steps (a user's script): seconds since the ranks
        # started, as the fault's window counts them
        elapsed = None if self._elapsed is None else round(self._elapsed, 3)
        try:
            self.events.emit(event(step=step, testbed=self.kind, mechanism=mechanism,
                                   **f.event_fields(), **extra, at_close=at_close or None,
                                   elapsed_s=elapsed))
        except OSError:
            pass  # the run's event log was closed first; nothing else to tell

    def _apply(self, desired: set[Fault], targets: set[tuple[str, Any]]) -> dict[Fault, str]:
        """Make the kernel state match `desired` for the touched targets; returns the
        mechanism description of each desired fault."""
        mech: dict[Fault, str] = {}
        for kind, rank in targets:
            if kind != "rank":
                continue
            mine = [f for f in desired if f.kind in CPU_KINDS and f.rank == rank]
            factor = 1.0
            for f in mine:
                if f.kind == "compute":
                    factor *= f.factor
            procs = sum(f.procs for f in mine if f.kind == "contention")
            group = self._group(rank)
            desc = group.set_limit(min(factor, 100.0), procs, self._share, self._cap)
            for f in mine:
                mech[f] = desc
        mech.update(self._apply_net(desired, targets))
        # faults on untouched targets keep their recorded mechanism
        for f in desired:
            mech.setdefault(f, self._logged.get(f, ""))
        return mech

    def _apply_net(self, desired: set[Fault],
                   targets: set[tuple[str, Any]]) -> dict[Fault, str]:
        return {}

    def _group(self, rank: int) -> CpuGroup:
        if rank not in self._groups:
            assert self._backend is not None
            g = CpuGroup(self._backend, f"{PREFIX}-{self._tag}-r{rank}")
            self._groups[rank] = g
            if rank in self._pids:
                g.add(self._pids[rank])
        return self._groups[rank]

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Remove every active fault (logged, at_close), every cgroup and every host.
        Idempotent; also run at exit and on SIGTERM/SIGHUP."""
        if self._closed or os.getpid() != self._owner:
            return
        self._closed = True
        try:
            self._active = set()
            self._reconcile(self._step, at_close=True)
        except Exception:  # noqa: BLE001 -- teardown below must still happen
            pass
        finally:
            if self.liveness is not None:
                self.liveness.close()
            for g in self._groups.values():
                g.close()
            self._groups.clear()
            self._close_hosts()
            cleanup.unregister(self)

    def _close_hosts(self) -> None:
        pass

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalTestbed(Testbed):
    kind = "local"

    def __init__(self, cfg: RunConfig, events: EventLog | None) -> None:
        super().__init__(cfg, events)
        if self._backend is not None:
            cleanup.cleanup_stale()
        cleanup.register(self)


class NetnsTestbed(Testbed):
    kind = "netns"

    def __init__(self, cfg: RunConfig, events: EventLog | None) -> None:
        super().__init__(cfg, events)
        require_root("--testbed netns")
        require_tool("ip", "--testbed netns")
        kinds = {f.kind for f in self.faults}
        if kinds & {"link", "pairlink"}:
            require_tool("tc", "link faults")
        if "loss" in kinds:
            require_tool("nft", "loss faults")
        if "cut" in kinds:
            require_tool("nft", "cut faults")
        n_hosts = max(self._host_of) // self.per_host + 1
        self.net = Hosts(n_hosts, cfg.testbed.mtu)  # removes stale leftovers first
        self.hosts = SlotHosts(self.net, self.per_host)
        cleanup.register(self)
        self.master_addr = self.hosts.addr(self.host(0))
        self._log_placement()
        # measured traffic matrix (traffic.py), logged per incarnation as testbed_traffic
        self._count = shutil.which("nft") is not None
        self._snap: tuple[int, dict[tuple[int, int], int]] | None = None
        self._inc_start = 0
        self._seg_hosts: list[int] | None = None  # the ranks' hosts after a regroup in place
        if self._count:
            traffic.start(self.net)

    def _log_placement(self) -> None:
        if self.events is not None:
            self.events.emit(TestbedPlacement(step=self._step, testbed=self.kind,
                                              **self.placement()))

    def on_step(self, next_step: int) -> None:
        super().on_step(next_step)
        # from the 5th step of an incarnation: start-up (rendezvous, DDP's broadcast) excluded
        if self._count and self._snap is None and next_step >= self._inc_start + 5 \
                and not self._closed:
            self._snap = (next_step, traffic.read(self.net))

    def regrouped(self, hosts: list[int]) -> None:
        """The ranks regrouped in place on ``hosts`` (rank -> host): the traffic so far is
        logged as one segment, and counting starts again (as at a restart)."""
        self._log_traffic()
        self._inc_start = self._step
        self._seg_hosts = list(hosts)

    def _log_traffic(self) -> None:
        """Bytes per step between each pair of hosts since the snapshot (ground truth)."""
        if self._snap is None:
            return
        step0, before = self._snap
        self._snap = None
        steps = self._step - step0
        if steps <= 0 or self.events is None:
            return
        now = traffic.read(self.net)
        pairs = traffic.per_pair({k: n - before.get(k, 0) for k, n in now.items()})
        self.events.emit(TestbedTraffic(
            step=self._step, from_step=step0, to_step=self._step,
            hosts=list(self._seg_hosts or self._host_of), ranks_per_host=self.per_host,
            bytes_per_step={f"{a}-{b}": round(n / steps) for (a, b), n in sorted(pairs.items())}))

    def command_prefix(self, rank: int) -> list[str]:
        return self.hosts.exec_prefix(self.host(rank))

    def set_hosts(self, hosts: list[int] | None) -> None:
        self._log_traffic()  # the incarnation that ended
        self._inc_start = self._step
        self._seg_hosts = None
        super().set_hosts(hosts)
        self.master_addr = self.hosts.addr(self.host(0))
        self._log_placement()

    def env(self, rank: int) -> dict[str, str]:
        # the host's only link; NCCL's bootstrap and socket transport too, for GPU scripts
        return {"STALWART_HOST_ADDR": self.hosts.addr(self.host(rank)),
                "STALWART_HOST": str(self.node(rank)),  # the detector's host (hostlink.py)
                "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0",
                "STALWART_MTU": str(self.mtu), **self._beat_env()}

    def _listen(self) -> Listener:
        """In the control namespace on the hosts' bridge (hosts.py ``control``): a host cut
        off goes silent like a frozen rank."""
        return Listener(CONTROL_ADDR, netns=self.net.control())

    def _apply_net(self, desired: set[Fault],
                   targets: set[tuple[str, Any]]) -> dict[Fault, str]:
        mech: dict[Fault, str] = {}
        h = self.net  # faults name hosts, not slots
        for kind, host in sorted(targets, key=str):
            if kind in ("loss", "cut"):  # loss:host=all is one fault over every host
                for f, desc in self._drop(kind, host, desired).items():
                    mech[f] = "; ".join(x for x in (mech.get(f, ""), desc) if x)
            elif kind == "link":
                mine = [f for f in desired if f.kind == "link" and f.hosts[0] == host]
                rate = min((f.rate_bps for f in mine), default=None)
                desc = f"host{host}: " + h.set_link(host, rate)
                for f in mine:
                    mech[f] = desc
            elif kind == "pairlink":
                mine = [f for f in desired
                        if f.kind == "pairlink" and tuple(sorted(f.hosts)) == host]
                rate = min((f.rate_bps for f in mine), default=None)
                desc = h.set_pair(host[0], host[1], rate)
                for f in mine:
                    mech[f] = desc
        return mech

    def _drop(self, kind: str, host: int, desired: set[Fault]) -> dict[Fault, str]:
        """A host's nftables drops: its loss faults compose (the kept fractions multiply);
        a cut is on while any cut fault of the host is."""
        mine = [f for f in desired if f.kind == kind and host in f.hosts]
        if kind == "cut":
            desc = self.net.set_cut(host, bool(mine))
        elif mine:
            keep = 1.0
            for f in mine:
                keep *= 1.0 - f.p
            desc = f"host{host}: " + self.net.set_loss(host, 1.0 - keep)
        else:
            self.net.clear_loss(host)
            desc = ""
        return {f: desc for f in mine}

    def _close_hosts(self) -> None:
        try:
            self._log_traffic()
        except Exception:  # noqa: BLE001 -- a counting problem must not keep hosts alive
            pass
        self.net.close()


class SlotHosts:
    """``Hosts`` addressed by slot (slot s on host s // ``per_host``): what the rest of
    stalwart (probes, tests) calls a rank's host. Ranks of one host share its address and
    namespace; ``net`` is the hosts themselves."""

    def __init__(self, net: Hosts, per_host: int) -> None:
        self.net, self.per_host = net, per_host
        self.n, self.mtu, self.bridge = net.n * per_host, net.mtu, net.bridge

    def addr(self, slot: int) -> str:
        return self.net.addr(slot // self.per_host)

    def ns(self, slot: int) -> str:
        return self.net.ns(slot // self.per_host)

    def port(self, slot: int) -> str:
        return self.net.port(slot // self.per_host)

    def exec_prefix(self, slot: int) -> list[str]:
        return self.net.exec_prefix(slot // self.per_host)

    def close(self) -> None:
        self.net.close()


def open_testbed(cfg: RunConfig, events: EventLog | None) -> Testbed:
    """Create the testbed `cfg.testbed.kind` for `cfg.job.nproc` ranks with
    `cfg.testbed.faults` scheduled.

    Raises ConfigError (one line: what is missing and how to install it) when the machine
    cannot provide what the configuration needs.
    """
    if cfg.testbed.kind == "local":
        return LocalTestbed(cfg, events)
    if cfg.testbed.kind == "netns":
        return NetnsTestbed(cfg, events)
    raise ConfigError(f"unknown testbed {cfg.testbed.kind!r} (choose from local, netns)")
