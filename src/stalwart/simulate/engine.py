"""One simulated job: the step loop that joins the model, the faults and the decision code.

Per step: the faults in force at the simulated clock (faults.Schedule) and measured noise
(noise.Noise) give every rank's compute; the model (model.StepModel) gives the step time and
the signals rank 0 sees; the product's detector (decide.SimDetector) takes them, and every
``every`` steps the product's policy (decide.SimPolicy) its per-replica seconds per
micro-batch. Its decisions act on the simulated job as they act on a real one:
- a plan (rebalance/revert) changes the replicas' micro-batch counts from the next step;
- excluding a host restarts the job on the other replicas (the product excludes the
  culprit's host; at tp x pp > 1 the simulator takes out its data-parallel replica, as
  elastic frameworks such as torchft do): the clock pays ``restart_s`` and a fresh detector
  and policy start, as after a real restart; when the excluded replica's faults are over the
  launcher's probe (every 6 s, healthy twice) brings it back with another restart, if the
  remaining work repays it;
- a validation pause costs ``validation_s``; a fail-stop ``restart_s`` plus the work since
  the last checkpoint (``lost_work``: uniform over the checkpoint interval, drawn once per
  stop, so every scenario loses the same work to the same stop).

The clock is simulated seconds; the job is done after ``steps`` steps. Guarantees: the same
seed and inputs give the same events and times (the decision cost measured on this machine is
the only thing that varies). Cost per step: the model's O(N) vector work, plus the product's
decision code (its own cost is what ``decision_s`` measures).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stalwart.simulate.decide import (
    EXCLUDE,
    REBALANCE,
    REVERT,
    Decision,
    Evidence,
    SimDetector,
    SimPolicy,
    default_test_noise,
    planner,
)
from stalwart.simulate.faults import Fault, Schedule
from stalwart.simulate.model import Job, StepModel
from stalwart.simulate.noise import Noise

HISTORY = 64  # steps of per-rank compute kept for the validation evidence
PROBE_S = 12.0  # the launcher's probe: every 6 s, healthy twice
MEASURE_AFTER = 6  # steps after a switch at which its gain is measured (as rebalance.py)
TIMELINE = 2000  # points of the step-time timeline kept per scenario


def lost_work(stop: Fault, ckpt_every_s: float) -> float:
    """Seconds of work a fail-stop throws away: uniform over the checkpoint interval, drawn
    from the stop itself (its time and host), so the same stop costs the same in every
    scenario. Why: drawn from the scenario's own stream, which the scenarios consume
    differently, the host stops of a 10,000-rank day threw away different work in each, by
    as much as the fail-slows the policies are compared on: "auto" once finished 0.07 h
    before the healthy job (``jct_recovered_10k`` 1.105)."""
    seed = [int(round(stop.start_s * 1000.0)), int(stop.target)]
    return float(np.random.default_rng(seed).uniform(0.0, ckpt_every_s))


@dataclass
class Settings:
    policy: str = "auto"  # "none" (no detector) | "detect" (detector only) | "rebalance" |
    #                      "exclude" | "auto"
    restart_s: float = 12.0  # BENCHMARKS mitigate: regroup_s 9-16 s (a restart)
    validation_s: float = 1.0  # BENCHMARKS detect: validation 0.3-1 s
    ckpt_every_s: float = 1800.0
    every: int = 2  # steps per policy exchange
    seed: int = 0


@dataclass
class Outcome:
    """What one simulated job did."""

    name: str
    steps: int
    jct_s: float
    events: list[dict[str, Any]] = field(default_factory=list)
    decision_s: list[float] = field(default_factory=list)  # rank 0's CPU per step
    pause_steps: list[int] = field(default_factory=list)  # steps whose cost held a pause
    timeline: list[tuple[float, float]] = field(default_factory=list)  # (clock h, step s)
    wall_s: float = 0.0
    pauses: int = 0
    restarts: int = 0
    healthy_step_s: float = 0.0


class Engine:
    """Runs one scenario; ``progress(done_steps)`` is called about once a second."""

    def __init__(self, job: Job, faults: list[Fault], noise: Noise, settings: Settings,
                 progress: Callable[[int], None] | None = None) -> None:
        self.job, self.faults, self.noise, self.s = job, faults, noise, settings
        self.model = StepModel(job)
        self.progress = progress
        self.rpg = job.tp * job.pp  # ranks per replica

    def run(self, steps: int, name: str = "") -> Outcome:
        j = self.job
        t_wall = time.perf_counter()
        st = _State(self, steps, name)
        every_tl = max(1, steps // TIMELINE)
        last_progress = time.perf_counter()
        for k in range(steps):
            comp_f, link_f = st.faults_at(k)
            comp = j.mb_compute_s * comp_f * self.noise.ranks(st.rng, j.ranks) * \
                self.noise.step(st.rng)
            res = self.model.step(st.counts, comp, link_f)
            st.t += res.step_s
            st.record(k, res)
            if k % every_tl == 0:
                st.out.timeline.append((st.t / 3600.0, res.step_s))
            if st.det is not None:
                dec = st.decide(k, res, comp_f, link_f)
                st.measure(k)
                if dec is not None:
                    st.apply(k, dec)
                st.probe(k, res.step_s)
            if self.progress is not None and time.perf_counter() - last_progress > 1.0:
                last_progress = time.perf_counter()
                self.progress(k + 1)
        st.out.jct_s = st.t
        gc.unfreeze()  # (SimEvidence froze the heap out of the collector's scans)
        gc.collect()
        st.out.wall_s = time.perf_counter() - t_wall
        return st.out

    # -- helpers ------------------------------------------------------------------------------
    def _live(self, active: np.ndarray) -> np.ndarray:
        """The simulated ranks the detector sees (those of the running replicas), in order."""
        return (active[:, None] * self.rpg + np.arange(self.rpg)).ravel()

    def _group_of(self, rank: int, active: np.ndarray) -> int | None:
        g = np.flatnonzero(active == rank // self.rpg)
        return int(g[0]) if g.size else None

    def _uniform(self, active: np.ndarray) -> np.ndarray:
        counts = np.zeros(self.job.dp, dtype=np.int64)
        counts[active] = planner.uniform(self.job.m, len(active))
        return counts

    def _fresh(self, active: np.ndarray, drng: np.random.Generator
               ) -> tuple[SimDetector | None, SimPolicy | None]:
        """A new detector and policy, as a (re)started job builds them."""
        s = self.s
        if s.policy == "none":
            return None, None
        det = SimDetector(len(active) * self.rpg, drng,
                          noise=default_test_noise(self.noise.scale))
        if s.policy == "detect" or len(active) < 2:
            return det, None
        return det, SimPolicy(len(active), self.job.m, s.policy, s.restart_s, s.every)


class _State:
    """One run's moving parts: the clock, the plan, the decision code and its bookkeeping."""

    def __init__(self, eng: Engine, steps: int, name: str) -> None:
        j, s = eng.job, eng.s
        self.eng, self.job, self.s, self.steps = eng, j, s, steps
        self.rng = np.random.default_rng(s.seed)  # same noise stream in every scenario
        self.drng = np.random.default_rng(s.seed + 1)  # validation-test noise
        self.sched = Schedule(eng.faults, j.ranks, j.hosts)
        self.host_of = j.host_of()
        self.out = Outcome(name, steps, 0.0)
        self.counts = np.asarray(planner.uniform(j.m, j.dp), dtype=np.int64)
        self.active = np.arange(j.dp)  # replicas running, in the policy's group order
        # the ranks of ``active`` (Engine._live) and whether they are every rank, made again
        # only when ``active`` is replaced (a restart), not every step
        self._live_for: tuple[np.ndarray, np.ndarray, bool] | None = None
        self.det, self.pol = eng._fresh(self.active, self.drng)
        self.keys = np.zeros(HISTORY, dtype=np.int64)
        self.comp_hist = np.zeros((HISTORY, j.ranks))
        self.step_hist = np.zeros(HISTORY)
        self.unit_acc = np.zeros(j.dp)
        self.step_acc = 0.0
        self.out_of: dict[int, float] = {}  # excluded replica -> clock its probe passes
        self.pending_measure: tuple[int, Decision, float] | None = None
        self.recent: list[float] = []
        self.t = 0.0

    def _event(self, name: str, k: int, **fields: Any) -> None:
        self.out.events.append({"event": name, "step": k, "clock_s": round(self.t, 1),
                                **fields})

    def faults_at(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        comp_f, link_f, started, ended = self.sched.at(self.t)
        for f in started:
            self._event("fault_applied", k, **f.as_event())
        for f in ended:
            self._event("fault_removed", k, **f.as_event())
        for f in self.sched.stops_until(self.t):
            lost = lost_work(f, self.s.ckpt_every_s)
            self.t += self.s.restart_s + lost
            self.out.restarts += 1
            self._event("fail_stop", k, host=f.target, lost_s=round(lost, 1))
        return comp_f, link_f

    def record(self, k: int, res: Any) -> None:
        i = k % HISTORY
        self.keys[i], self.comp_hist[i], self.step_hist[i] = k, res.compute_s, res.step_s
        self.recent.append(res.step_s)
        if len(self.recent) > 2 * MEASURE_AFTER:
            self.recent.pop(0)

    def _live(self) -> tuple[np.ndarray, bool]:
        """``Engine._live(active)`` and whether it is every rank in order, kept per
        ``active`` array (replaced, never changed in place, at a restart)."""
        got = self._live_for
        if got is None or got[0] is not self.active:
            live = self.eng._live(self.active)
            every = len(live) == self.job.ranks and bool(
                np.array_equal(live, np.arange(self.job.ranks)))
            got = self._live_for = (self.active, live, every)
        return got[1], got[2]

    def decide(self, k: int, res: Any, comp_f: np.ndarray, link_f: np.ndarray
               ) -> Decision | None:
        """Rank 0's decision code for step ``k``; its CPU time (less the simulator's own
        evidence building) goes to ``decision_s``."""
        det, s, eng = self.det, self.s, self.eng
        assert det is not None
        live, every = self._live()

        def evidence() -> Evidence:
            order = np.argsort(self.keys)[-min(k + 1, HISTORY):]
            return Evidence(comp_f[live], link_f, self.host_of[live], self.keys[order],
                            self.comp_hist[order][:, live], self.step_hist[order])

        c0, sim0 = time.thread_time(), det.sim_s
        comm0 = res.step_s - float(res.compute_s[live[0]])
        # every rank's compute as the row gathers it (the step's own array when every replica
        # runs: the decision code reads it, nothing keeps or changes it)
        compute = res.compute_s if every else res.compute_s[live]
        if det.feed(k, res.step_s, compute, comm0, evidence):
            self.t += s.validation_s
            self.out.pauses += 1
            self.out.pause_steps.append(k)
        dec = None
        self.unit_acc += np.nan_to_num(res.unit_s)
        self.step_acc += res.step_s
        if self.pol is not None and (k + 1) % s.every == 0:
            active = self.active
            findings = SimPolicy.map_findings(
                det.core.findings, lambda r: eng._group_of(int(live[r]), active))
            dec = self.pol.observe(k, (self.unit_acc[active] / s.every).tolist(),
                                   self.step_acc / s.every, findings)
            self.unit_acc[:] = 0.0
            self.step_acc = 0.0
        self.out.decision_s.append(time.thread_time() - c0 - (det.sim_s - sim0))
        for name, fields in det.events.logged:
            self.out.events.append({"event": name, "clock_s": round(self.t, 1), **fields})
        det.events.logged.clear()
        return dec

    def measure(self, k: int) -> None:
        """A switch's measured gain, ``MEASURE_AFTER`` steps on (as rebalance.py)."""
        if self.pending_measure is None or k < self.pending_measure[0]:
            return
        _, dec, before = self.pending_measure
        after = float(np.median(self.recent[-MEASURE_AFTER:]))
        if self.pol is not None:
            self.pol.measured(dec, 1.0 - after / before)
        self.pending_measure = None

    def apply(self, k: int, dec: Decision) -> None:
        active = self.active
        target = int(active[dec.target]) if 0 <= dec.target < len(active) else -1
        self._event("mitigation_reverted" if dec.kind == REVERT else "mitigation_applied", k,
                    strategy=dec.name, version=dec.version, target=target, reason=dec.reason)
        if dec.kind in (REBALANCE, REVERT):
            self.counts[:] = 0
            self.counts[active] = dec.counts
            if dec.kind == REBALANCE:
                self.pending_measure = (k + MEASURE_AFTER, dec,
                                        float(np.median(self.recent[-MEASURE_AFTER:])))
        elif dec.kind == EXCLUDE:
            self.active = active[active != target]
            self.out_of[target] = math.inf
            self._restart()

    def _restart(self) -> None:
        """A restart on the replicas in ``active``: its time, a fresh detector and policy."""
        self.counts = self.eng._uniform(self.active)
        self.t += self.s.restart_s
        self.out.restarts += 1
        self.det, self.pol = self.eng._fresh(self.active, self.drng)
        self.pending_measure = None

    def probe(self, k: int, step_s: float) -> None:
        """The launcher's probe of each excluded replica: healthy once its faults are over,
        taken back when the remaining steps repay a restart."""
        rpg = self.eng.rpg
        for g in list(self.out_of):
            ranks = range(g * rpg, (g + 1) * rpg)
            hosts = set(self.host_of[list(ranks)].tolist())
            bad = any((f.kind == "compute" and f.target in ranks) or (
                f.kind == "link" and f.target in hosts) for f in self.sched.active)
            if bad:
                self.out_of[g] = math.inf
            elif math.isinf(self.out_of[g]):
                self.out_of[g] = self.t + PROBE_S
            elif self.t >= self.out_of[g] and \
                    (self.steps - k) * step_s / len(self.active) > self.s.restart_s:
                del self.out_of[g]
                self.active = np.sort(np.append(self.active, g))
                self._restart()
                self._event("mitigation_applied", k, strategy="restore_host", target=g,
                            reason="probe: healthy twice")
