"""The one place the simulator touches the product's decision code (detect/, mitigate/).

What runs is the product's own code, not a re-implementation:
- ``SimDetector`` drives ``stalwart.detect.decision.DecisionCore`` -- the torch-free state
  machine the Monitor drives during training -- as rank 0 of ``world`` ranks: per step the
  iteration sample (``sample``: BOCD+V on the iteration channel) and every rank's compute
  (``relative``: the per-rank BOCD+V bank and CUSUM); an alarm rank 0 raised is acted on one
  step later, as the row link delivers it (``take_pending``/``alarm_read``), through the
  product's verdict: ``localize.more_rounds`` (longer compute tests for a mild straggler) and
  ``localize.decide``, then ``apply_verdict`` (one fault one finding, CUSUM backoff,
  unexplained slowdowns) or, for a recovery, the compute test at equal load
  (``recovery_test``) then ``apply_recovery``. Only the validation tests' measurements are
  simulated (``_evidence``): each rank's compute-test rounds = its current compute factor x
  test noise; the ring's link-test round trips = the slower end's link factor x noise;
  profiles and recent compute from the simulated history. The loop that asks for more rounds
  mirrors ``verify.validate_alarm``, whose other work is torch plumbing.
- ``SimPolicy`` wraps ``stalwart.mitigate.policy.Policy`` over data-parallel replicas
  (the policy's "rank" is a replica: a finding on any rank of replica d is about d).

Why one module: when these APIs move, only this file should need to follow. Cost: see
``SimDetector.feed``; evidence building (simulation, not product) is timed separately
(``sim_s``) so that the decision cost excludes it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from stalwart.detect.alarms import DETECTS, MODES, NONE, Alarm, IterSample
from stalwart.detect.decision import DecisionCore
from stalwart.detect.evidence import Finding, RankEvidence
from stalwart.detect.localize import decide, more_rounds
from stalwart.detect.onset import BEFORE, ONSET_SLACK
from stalwart.mitigate import planner
from stalwart.mitigate.decisions import EXCLUDE, REBALANCE, REVERT, Decision
from stalwart.mitigate.policy import Policy

TEST_NOISE = 0.05  # log-sd of one compute-test round (testbed: healthy ranks 0.96-1.07x)
LINK_NOISE = 0.15  # log-sd of one link-test round trip (testbed: healthy pairs up to 13x)
ROUNDS = 3  # the compute test's first rounds (validate.compute_test's default)
__all__ = ["EXCLUDE", "REBALANCE", "REVERT", "Decision", "Evidence", "SimDetector",
           "SimPolicy", "planner"]


@dataclass
class Evidence:
    """What the simulated job can say about its ranks when a validation pause starts."""

    comp_factor: np.ndarray  # per rank: compute slowdown now (ground truth)
    link_factor: np.ndarray  # per host: link slowdown now
    host_of: np.ndarray  # rank -> host
    keys: np.ndarray  # the last H steps' keys
    compute: np.ndarray  # (H, N) compute seconds of those steps
    step_s: np.ndarray  # (H,) their step times (a rank's communication = step - compute)


class _Events:
    """Rank 0's typed events, kept in memory (the simulator writes them with its clock)."""

    def __init__(self) -> None:
        self.logged: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, ev: Any) -> None:
        self.logged.append((ev.name, ev.fields()))


class SimDetector:
    """Rank 0's detector of a simulated ``world``-rank job (module docstring)."""

    def __init__(self, world: int, rng: np.random.Generator, warmup: int = 10) -> None:
        self.world = world
        self.events = _Events()
        self.core = DecisionCore(True, warmup=warmup, emit=self.events)
        self._rng = rng
        self._due: Alarm | None = None
        self.sim_s = 0.0  # CPU seconds spent building simulated evidence (not product work)
        self.pauses = 0

    def feed(self, key: int, step_s: float, compute: np.ndarray, comm0: float,
             evidence: Callable[[], Evidence] | None = None) -> bool:
        """One step as rank 0 sees it; True if a validation pause ran (its alarm arrived).

        Order as in the Monitor: the iteration sample, then the alarm raised at the previous
        check (the rows carrying it arrive now: validate, apply), then the rows' per-rank
        samples, whose new alarm goes out with the next rows."""
        core = self.core
        core.sample(IterSample(key, float(step_s), float(compute[0]), float(comm0)))
        paused = False
        if self._due is not None:
            alarm, self._due = self._due, None
            core.alarm_read()
            if alarm.action in DETECTS:
                suspect = alarm.suspect if alarm.suspect >= 0 else None
                mode = MODES[alarm.action]
                t0 = time.thread_time()
                src = evidence() if evidence is not None else None
                self.sim_s += time.thread_time() - t0
                gathered = self._evidence(src, alarm.onset, key, ROUNDS)
                while extra := more_rounds(gathered, suspect, mode):
                    gathered = self._evidence(src, alarm.onset, key, ROUNDS + extra,
                                              gathered)
                finding = decide(gathered, alarm.onset, key, alarm.severity, suspect, mode)
                core.apply_verdict(finding, suspect, action=alarm.action)
                self.pauses += 1
                paused = True
            else:
                ratio = None
                if core.needs_recovery_test() and core.active is not None:
                    ratio = self._recovery_ratio(evidence, core.active.ranks[0])
                    self.pauses += 1
                    paused = True
                if core.recovery_test(ratio, key):
                    core.apply_recovery(alarm.onset, key, alarm.severity, ratio)
        core.relative(key, compute.tolist())
        alarm = core.take_pending(travels=True)
        if alarm.action != NONE:
            self._due = alarm
        return paused

    def report(self) -> list[dict[str, Any]]:
        """Findings so far, oldest first (as ``Monitor.report``)."""
        out = []
        for f in self.core.findings:
            d = f.event_fields()
            d["recovered_step"] = f.recovered_step
            out.append(d)
        return out

    def _recovery_ratio(self, evidence: Callable[[], Evidence] | None,
                        suspect: int) -> float | None:
        """The compute test on a recovery alarm (verify.recovery_ratio): each rank's rounds =
        its compute factor now x test noise; the suspect's median over its peers'."""
        if evidence is None:
            return None
        t0 = time.thread_time()
        src = evidence()
        rounds = src.comp_factor[:, None] * np.exp(
            self._rng.normal(0.0, TEST_NOISE, (self.world, ROUNDS)))
        tests = np.median(rounds, axis=1)
        peers = np.delete(tests, suspect)
        self.sim_s += time.thread_time() - t0
        return float(tests[suspect] / np.median(peers)) if peers.size else 1.0

    def _evidence(self, src: Evidence | None, onset: int, decided: int, rounds: int,
                  prev: list[RankEvidence] | None = None) -> list[RankEvidence]:
        """Every rank's evidence after ``rounds`` compute-test rounds (earlier rounds kept)."""
        t0 = time.thread_time()
        n = self.world
        if src is None:
            out = [RankEvidence(r, compute_rounds=[1.0] * rounds, compute_test=1.0)
                   for r in range(n)]
            self.sim_s += time.thread_time() - t0
            return out
        have = len(prev[0].compute_rounds) if prev else 0
        new = src.comp_factor[:, None] * np.exp(
            self._rng.normal(0.0, TEST_NOISE, (n, rounds - have)))
        if prev:
            for e, extra in zip(prev, new.tolist(), strict=True):
                e.compute_rounds = e.compute_rounds + extra
                e.compute_test = float(np.median(e.compute_rounds))
            self.sim_s += time.thread_time() - t0
            return prev
        tests = np.median(new, axis=1)
        keys = src.keys
        comm = src.step_s[:, None] - src.compute
        before_m = (keys >= onset - BEFORE) & (keys < onset)
        after_m = (keys >= onset) & (keys <= decided)

        def med(x: np.ndarray, m: np.ndarray) -> list[float | None]:
            return np.median(x[m], axis=0).tolist() if m.any() else [None] * n
        cb, ca, mb, ma = (med(src.compute, before_m), med(src.compute, after_m),
                          med(comm, before_m), med(comm, after_m))
        rec_m = (keys >= onset - ONSET_SLACK - BEFORE) & (keys <= decided)
        rec_keys = keys[rec_m].tolist()
        rec = src.compute[rec_m].T.tolist()  # (N, steps)
        rows = new.tolist()
        out = [RankEvidence(r, cb[r], ca[r], mb[r], ma[r], float(tests[r]), {}, rows[r],
                            list(zip(rec_keys, rec[r], strict=True))) for r in range(n)]
        # the ring's pairs, in the passes the product tests; a pair is as slow as the slower
        # of its hosts' links when it crosses hosts
        from stalwart.detect.validate import ring_pair_passes  # (validate imports torch)

        pairs = [p for ps in ring_pair_passes(n) for p in ps]
        a = np.fromiter((p[0] for p in pairs), int, len(pairs))
        b = np.fromiter((p[1] for p in pairs), int, len(pairs))
        ha, hb = src.host_of[a], src.host_of[b]
        slow = np.where(ha != hb, np.maximum(src.link_factor[ha], src.link_factor[hb]), 1.0)
        rtt = slow * np.exp(self._rng.normal(0.0, LINK_NOISE, len(pairs)))
        out[0].links = {f"{x}-{y}": float(t) for x, y, t in
                        zip(a.tolist(), b.tolist(), rtt.tolist(), strict=True)}
        self.sim_s += time.thread_time() - t0
        return out


class SimPolicy:
    """The product's escalation policy over ``groups`` data-parallel replicas.

    ``mode``: "rebalance" (S2 only), "exclude" (S4 only: S2's price set out of reach),
    "auto" (the full policy)."""

    def __init__(self, groups: int, micro: int, mode: str, restart_s: float,
                 every: int = 2) -> None:
        pmode = "rebalance" if mode == "rebalance" else "auto"
        self.policy = Policy(groups=groups, micro=micro, tp=1, mode=pmode,
                             restart_s=restart_s, every=every)
        if mode == "exclude":
            self.policy.s2_price = lambda units: float("inf")  # type: ignore[method-assign]
        self.every = every

    def observe(self, step: int, units: list[float], step_s: float,
                findings: list[Finding]) -> Decision | None:
        """``findings``: the detector's, their ranks already mapped to replica indices of
        this policy (``SimPolicy.map_findings``)."""
        return self.policy.observe(step, units, step_s, self.every, findings, step + 1)

    @staticmethod
    def map_findings(findings: list[Finding], to_group: Callable[[int], int | None]
                     ) -> list[Finding]:
        """The detector's findings with each rank replaced by its replica (``to_group``;
        None: a replica this policy does not run)."""
        out = []
        for f in findings:
            gs = {to_group(int(r)) for r in f.ranks}
            link = None if f.link is None else [
                x for x in (to_group(int(r)) for r in f.link) if x is not None]
            out.append(dataclasses.replace(f, ranks=sorted(x for x in gs if x is not None),
                                           link=link))
        return out

    def measured(self, dec: Decision, gain: float) -> None:
        self.policy.measured(dec.name, dec.version, gain)
