"""The one place the simulator touches the product's decision code (detect/, mitigate/).

What runs is the product's own code, not a re-implementation:
- ``SimDetector`` drives the one decision path, ``stalwart.detect.detector.Detector`` -- the
  same the live monitor and replay drive -- as rank 0 of ``world`` ranks: per step the
  iteration sample and every rank's compute; an alarm rank 0 raised is acted on one step
  later, as the row link delivers it, through the product's rules (more compute rounds for a
  mild suspect, ``localize.decide``, what a verdict does, recovery at equal load). Only the
  validation tests' measurements are simulated (``SimEvidence``, the Detector's
  ``EvidenceSource``): each rank's compute-test rounds = its current compute factor x the
  testbed's measured test noise; the ring's link-test round trips = the slower end's link
  factor x the testbed's measured round-trip noise (testnoise.py: resampled from recorded
  validation rounds); profiles and recent compute from the simulated history.
- ``SimPolicy`` wraps ``stalwart.mitigate.policy.Policy`` over data-parallel replicas
  (the policy's "rank" is a replica: a finding on any rank of replica d is about d).

Why one module: when these APIs move, only this file should need to follow. Cost: see
``SimDetector.feed``; evidence building (simulation, not product) is timed separately
(``sim_s``) so that the decision cost excludes it.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from stalwart.detect.alarms import NONE, Alarm, IterSample
from stalwart.detect.decision import VECTOR_RANKS, DecisionCore
from stalwart.detect.detector import ROUNDS, Detector, StepInput
from stalwart.detect.evidence import Finding, RankEvidence
from stalwart.detect.onset import BEFORE, ONSET_SLACK
from stalwart.mitigate import planner
from stalwart.mitigate.decisions import EXCLUDE, REBALANCE, REVERT, Decision
from stalwart.mitigate.policy import Policy
from stalwart.simulate.testnoise import TestNoise

__all__ = ["EXCLUDE", "REBALANCE", "REVERT", "Decision", "Evidence", "SimDetector",
           "SimEvidence", "SimPolicy", "TestNoise", "default_test_noise", "planner"]


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


def _pair_slow(src: Evidence, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Each pair (a[i], b[i]) as slow as the slower of its hosts' links when it crosses
    hosts, else 1."""
    ha, hb = src.host_of[a], src.host_of[b]
    return np.where(ha != hb, np.maximum(src.link_factor[ha], src.link_factor[hb]), 1.0)


class SimEvidence:
    """The validation tests' measurements drawn from the simulated job (module docstring):
    the Detector's ``EvidenceSource``. ``job``: what the job can say now (set per step by
    ``SimDetector.feed``; None: every rank reads healthy). ``noise``: the tests' noise as
    the testbed measured it (testnoise.py). ``sim_s``: CPU seconds spent building them
    (simulation, not product work).

    Cost per pause: O(N x steps) to build the N ranks' ``RankEvidence`` (the product's
    interface: one object per rank); the rounds, their medians, the ring's pairs are arrays
    (the pairs and hosts made once per job size)."""

    def __init__(self, world: int, rng: np.random.Generator,
                 noise: TestNoise | None = None) -> None:
        self.world = world
        self.job: Callable[[], Evidence] | None = None
        self.noise = noise if noise is not None else default_test_noise()
        self._rng = rng
        self._src: Evidence | None = None
        self._ev: list[RankEvidence] = []
        self._rounds = np.empty((world, 0))  # (N, rounds so far) of the pause under way
        self._onset = self._decided = 0
        self._pairs: tuple[np.ndarray, np.ndarray, list[str]] | None = None
        self._hosts: tuple[np.ndarray, list[str]] | None = None
        self.sim_s = 0.0

    def tests(self, alarm: Alarm, decided: int, own: RankEvidence) -> list[RankEvidence]:
        t0 = time.thread_time()
        self._src = self.job() if self.job is not None else None
        self.sim_s += time.thread_time() - t0
        self._onset, self._decided = alarm.onset, decided
        self._ev = self._evidence(self._src, alarm.onset, decided)
        return self._ev

    def more_rounds(self, rounds: int) -> list[RankEvidence]:
        """``rounds`` more rounds on every rank, the earlier ones kept; every rank's median
        at once."""
        t0 = time.thread_time()
        self._rounds = np.hstack([self._rounds, self._draw(self._src, rounds)])
        tests = np.median(self._rounds, axis=1)
        for e, row, t in zip(self._ev, self._rounds.tolist(), tests.tolist(), strict=True):
            e.compute_rounds, e.compute_test = row, t
        self.sim_s += time.thread_time() - t0
        return self._ev

    def more_links(self) -> list[RankEvidence] | None:
        return None  # the simulator tests the ring's pairs only

    def retest_links(self, pairs: list[str]) -> dict[str, float]:
        """The ring's ``pairs`` read once more: each as slow as the slower of its hosts'
        links when it crosses hosts, x a fresh draw of the measured pair noise."""
        if not pairs:
            return {}
        t0 = time.thread_time()
        src = self._src
        slow = np.ones(len(pairs))
        if src is not None:
            ends = [tuple(int(x) for x in k.split("-")) for k in pairs]
            a = np.fromiter((p[0] for p in ends), int, len(ends))
            b = np.fromiter((p[1] for p in ends), int, len(ends))
            slow = _pair_slow(src, a, b)
        rtt = self.noise.rtts(self._rng, slow).tolist()
        self.sim_s += time.thread_time() - t0
        return dict(zip(pairs, rtt, strict=True))

    def recovery_ratio(self, suspect: int, decided: int) -> float | None:
        """The compute test on a recovery alarm (verify.recovery_ratio): each rank's rounds =
        its compute factor now x test noise; the suspect's median over its peers'."""
        if self.job is None:
            return None
        t0 = time.thread_time()
        src = self.job()
        tests = np.median(self.noise.rounds(self._rng, src.comp_factor, ROUNDS), axis=1)
        peers = np.delete(tests, suspect)
        self.sim_s += time.thread_time() - t0
        return float(tests[suspect] / np.median(peers)) if peers.size else 1.0

    def _draw(self, src: Evidence | None, k: int) -> np.ndarray:
        factor = src.comp_factor if src is not None else np.ones(self.world)
        return self.noise.rounds(self._rng, factor, k)

    def _ring(self) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """The ring's pairs in the passes the product tests (ends, and their keys)."""
        if self._pairs is None:
            from stalwart.detect.validate import ring_pair_passes  # (validate imports torch)

            pairs = [p for ps in ring_pair_passes(self.world) for p in ps]
            a = np.fromiter((p[0] for p in pairs), int, len(pairs))
            b = np.fromiter((p[1] for p in pairs), int, len(pairs))
            self._pairs = a, b, [f"{x}-{y}" for x, y in pairs]
        return self._pairs

    def _host_names(self, host_of: np.ndarray) -> list[str]:
        if self._hosts is None or not np.array_equal(self._hosts[0], host_of):
            self._hosts = host_of.copy(), host_of.astype(str).tolist()
        return self._hosts[1]

    def _evidence(self, src: Evidence | None, onset: int, decided: int
                  ) -> list[RankEvidence]:
        """Every rank's evidence after the first ``ROUNDS`` compute-test rounds, built with
        the cyclic garbage collector paused, then everything alive frozen out of its scans
        (``gc.freeze``): the N x steps tuples and N objects made at once set off
        collections of the whole heap, and after it the first collection scanned them all
        (at 10,000 ranks 0.45 s of CPU per pause, 0.16 s so; none is in a cycle: reference
        counting frees them). ``Engine.run`` unfreezes and collects once per scenario."""
        was_on = gc.isenabled()
        gc.disable()
        try:
            return self._build(src, onset, decided)
        finally:
            gc.freeze()  # (what was made stays out of later collections' scans)
            if was_on:
                gc.enable()

    def _build(self, src: Evidence | None, onset: int, decided: int) -> list[RankEvidence]:
        t0 = time.thread_time()
        n = self.world
        self._rounds = self._draw(src, ROUNDS)
        tests = np.median(self._rounds, axis=1).tolist()
        rows = self._rounds.tolist()
        if src is None:
            out = [RankEvidence(r, compute_rounds=rows[r], compute_test=tests[r], host="")
                   for r in range(n)]
            self.sim_s += time.thread_time() - t0
            return out
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
        hosts = self._host_names(src.host_of)  # ranks of a host share its link (hostlink)
        out = [RankEvidence(r, cb[r], ca[r], mb[r], ma[r], tests[r], {}, rows[r],
                            list(zip(rec_keys, rec[r], strict=True)), host=hosts[r])
               for r in range(n)]
        # the ring's pairs; a pair is as slow as the slower of its hosts' links when it
        # crosses hosts
        a, b, names = self._ring()
        slow = _pair_slow(src, a, b)
        rtt = self.noise.rtts(self._rng, slow).tolist()
        out[0].links = dict(zip(names, rtt, strict=True))
        self.sim_s += time.thread_time() - t0
        return out


_TEST_NOISE: dict[float, TestNoise] = {}


def default_test_noise(scale: float = 1.0) -> TestNoise:
    """The measured test-noise pools (testnoise.DEFAULT) at ``scale``, loaded once."""
    if scale not in _TEST_NOISE:
        _TEST_NOISE[scale] = TestNoise.load(scale=scale)
    return _TEST_NOISE[scale]


class SimDetector:
    """Rank 0's detector of a simulated ``world``-rank job (module docstring)."""

    def __init__(self, world: int, rng: np.random.Generator, warmup: int = 10,
                 noise: TestNoise | None = None) -> None:
        self.world = world
        self.events = _Events()
        self.core = DecisionCore(True, warmup=warmup, emit=self.events)
        self.source = SimEvidence(world, rng, noise)
        self.detector = Detector(self.core, self.source)
        self._due: Alarm | None = None
        self.pauses = 0

    @property
    def sim_s(self) -> float:
        """CPU seconds spent building simulated evidence (not product work)."""
        return self.source.sim_s

    def feed(self, key: int, step_s: float, compute: np.ndarray, comm0: float,
             evidence: Callable[[], Evidence] | None = None) -> bool:
        """One step as rank 0 sees it; True if a validation pause ran (its alarm arrived).
        ``Detector.step``: the iteration sample, every rank's compute this step, then the
        alarm raised at the previous step (its row arrives now) validated and applied; the
        alarm raised since goes out with this step's row."""
        self.source.job = evidence
        due, self._due = self._due, None
        out = self.detector.step(StepInput(
            IterSample(key, float(step_s), float(compute[0]), float(comm0)),
            # an array from VECTOR_RANKS on (what DecisionCore.relative's vector path takes)
            [(key, compute if len(compute) >= VECTOR_RANKS else compute.tolist())], due, key))
        if out.send.action != NONE:
            self._due = out.send
        if out.paused:
            self.pauses += 1
        return out.paused

    def report(self) -> list[dict[str, Any]]:
        """Findings so far, oldest first (as ``Monitor.report``)."""
        out = []
        for f in self.core.findings:
            d = f.event_fields()
            d["recovered_step"] = f.recovered_step
            out.append(d)
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
