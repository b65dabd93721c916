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
  the last checkpoint (uniform over the checkpoint interval).

The clock is simulated seconds; the job is done after ``steps`` steps. Guarantees: the same
seed and inputs give the same events and times (the decision cost measured on this machine is
the only thing that varies). Cost per step: the model's O(N) vector work, plus the product's
decision code (its own cost is what ``decision_s`` measures).
"""

from __future__ import annotations

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
    planner,
)
from stalwart.simulate.faults import Fault, Schedule
from stalwart.simulate.model import Job, StepModel
from stalwart.simulate.noise import Noise

HISTORY = 64  # steps of per-rank compute kept for the validation evidence
PROBE_S = 12.0  # the launcher's probe: every 6 s, healthy twice
MEASURE_AFTER = 6  # steps after a switch at which its gain is measured (as rebalance.py)
TIMELINE = 2000  # points of the step-time timeline kept per scenario


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
        j, s = self.job, self.s
        t_wall = time.perf_counter()
        rng = np.random.default_rng(s.seed)  # same noise stream in every scenario
        drng = np.random.default_rng(s.seed + 1)  # validation-test noise
        sched = Schedule(self.faults, j.ranks, j.hosts)
        host_of = j.host_of()
        out = Outcome(name, steps, 0.0)
        counts = np.asarray(planner.uniform(j.m, j.dp), dtype=np.int64)
        active = np.arange(j.dp)  # replicas running, in the policy's group order
        det, pol = self._fresh(active, drng)
        keys = np.zeros(HISTORY, dtype=np.int64)
        comp_hist = np.zeros((HISTORY, j.ranks))
        step_hist = np.zeros(HISTORY)
        unit_acc = np.zeros(j.dp)
        step_acc = 0.0
        out_of: dict[int, float] = {}  # excluded replica -> clock when its probe passes
        pending_measure: tuple[int, Decision, float] | None = None
        recent_steps: list[float] = []
        t = 0.0
        every_tl = max(1, steps // TIMELINE)
        last_progress = time.perf_counter()
        ev = out.events
        for k in range(steps):
            comp_f, link_f, started, ended = sched.at(t)
            for f in started:
                ev.append({"event": "fault_applied", "step": k, "clock_s": round(t, 1),
                           **f.as_event()})
            for f in ended:
                ev.append({"event": "fault_removed", "step": k, "clock_s": round(t, 1),
                           **f.as_event()})
            for f in sched.stops_until(t):
                lost = float(rng.uniform(0.0, s.ckpt_every_s))
                t += s.restart_s + lost
                out.restarts += 1
                ev.append({"event": "fail_stop", "step": k, "clock_s": round(t, 1),
                           "host": f.target, "lost_s": round(lost, 1)})
            comp = j.mb_compute_s * comp_f * self.noise.ranks(rng, j.ranks) * \
                self.noise.step(rng)
            res = self.model.step(counts, comp, link_f)
            t += res.step_s
            i = k % HISTORY
            keys[i], comp_hist[i], step_hist[i] = k, res.compute_s, res.step_s
            if k % every_tl == 0:
                out.timeline.append((t / 3600.0, res.step_s))
            recent_steps.append(res.step_s)
            if len(recent_steps) > 2 * MEASURE_AFTER:
                recent_steps.pop(0)
            if det is None:
                continue
            live = self._live(active)

            def evidence(live: np.ndarray = live, cf: np.ndarray = comp_f,
                         lf: np.ndarray = link_f, k: int = k) -> Evidence:
                order = np.argsort(keys)[-min(k + 1, HISTORY):]
                return Evidence(cf[live], lf, host_of[live], keys[order],
                                comp_hist[order][:, live], step_hist[order])

            c0 = time.thread_time()
            sim0 = det.sim_s
            comm0 = res.step_s - float(res.compute_s[live[0]])
            if det.feed(k, res.step_s, res.compute_s[live], comm0, evidence):
                t += s.validation_s
                out.pauses += 1
                out.pause_steps.append(k)
            dec = None
            unit_acc += np.nan_to_num(res.unit_s)
            step_acc += res.step_s
            if pol is not None and (k + 1) % s.every == 0:
                units = (unit_acc[active] / s.every).tolist()
                findings = SimPolicy.map_findings(
                    det.report(), lambda r, live=live, active=active: self._group_of(
                        int(live[r]), active))
                dec = pol.observe(k, units, step_acc / s.every, findings)
                unit_acc[:] = 0.0
                step_acc = 0.0
            out.decision_s.append(time.thread_time() - c0 - (det.sim_s - sim0))
            for name_, fields in det.events.logged:
                ev.append({"event": name_, "clock_s": round(t, 1), **fields})
            det.events.logged.clear()
            if pending_measure is not None and k >= pending_measure[0]:
                _, pdec, before = pending_measure
                after = float(np.median(recent_steps[-MEASURE_AFTER:]))
                if pol is not None:
                    pol.measured(pdec, 1.0 - after / before)
                pending_measure = None
            if dec is not None:
                ev.append({"event": "mitigation_applied" if dec.kind != REVERT else
                           "mitigation_reverted", "step": k, "clock_s": round(t, 1),
                           "strategy": dec.name, "version": dec.version,
                           "target": int(active[dec.target]) if dec.target >= 0 and
                           dec.target < len(active) else -1,
                           "reason": dec.reason})
                if dec.kind in (REBALANCE, REVERT):
                    counts[:] = 0
                    counts[active] = dec.counts
                    if dec.kind == REBALANCE:
                        pending_measure = (k + MEASURE_AFTER, dec,
                                           float(np.median(recent_steps[-MEASURE_AFTER:])))
                elif dec.kind == EXCLUDE:
                    gone = int(active[dec.target])
                    active = active[active != gone]
                    out_of[gone] = math.inf
                    counts = self._uniform(active)
                    t += s.restart_s
                    out.restarts += 1
                    det, pol = self._fresh(active, drng)
                    pending_measure = None
            # the probe of an excluded replica: healthy once its faults are over
            for g in list(out_of):
                ranks = range(g * self.rpg, (g + 1) * self.rpg)
                hosts = set(host_of[list(ranks)].tolist())
                bad = any((f.kind == "compute" and f.target in ranks) or (
                    f.kind == "link" and f.target in hosts) for f in sched.active)
                if bad:
                    out_of[g] = math.inf
                elif math.isinf(out_of[g]):
                    out_of[g] = t + PROBE_S
                elif t >= out_of[g] and (steps - k) * res.step_s / len(active) > \
                        s.restart_s:  # the remaining steps repay the restart
                    del out_of[g]
                    active = np.sort(np.append(active, g))
                    counts = self._uniform(active)
                    t += s.restart_s
                    out.restarts += 1
                    ev.append({"event": "mitigation_applied", "step": k,
                               "clock_s": round(t, 1), "strategy": "restore_host",
                               "target": g, "reason": "probe: healthy twice"})
                    det, pol = self._fresh(active, drng)
                    pending_measure = None
            if self.progress is not None and time.perf_counter() - last_progress > 1.0:
                last_progress = time.perf_counter()
                self.progress(k + 1)
        out.jct_s = t
        out.wall_s = time.perf_counter() - t_wall
        return out

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
        det = SimDetector(len(active) * self.rpg, drng)
        if s.policy == "detect" or len(active) < 2:
            return det, None
        return det, SimPolicy(len(active), self.job.m, s.policy, s.restart_s, s.every)
