"""The one place the simulator touches the product's decision code (detect/, mitigate/).

What runs is the product's own code, not a re-implementation:
- ``SimDetector`` is a ``stalwart.detect.Monitor`` built without a process group (rank 0 of
  ``world`` ranks); per step the simulator feeds it what rank 0 would receive -- the iteration
  time (``Monitor._sample``: BOCD+V on the iteration channel) and every rank's row of compute
  time (``Monitor._relative``: the per-rank BOCD+V bank and CUSUM) -- and a decision rank 0
  made is acted on one step later, as the row link delivers it (``Monitor._on_detect``: more
  rounds, ``localize.decide``, one fault one finding, CUSUM backoff, unexplained slowdowns).
  Only the validation tests' measurements are simulated: ``_gather`` returns every rank's
  evidence built from the simulated job (each rank's compute-test rounds = its current
  compute factor x test noise; the ring's link-test round trips = the slower end's link
  factor x noise; profiles and recent compute from the simulated history), and the test
  functions themselves are stood in for during the call (``_StandIn``).
- ``SimPolicy`` wraps ``stalwart.mitigate.policy.Policy`` over data-parallel replicas
  (the policy's "rank" is a replica: a finding on any rank of replica d is about d).

Why one module: the detect/mitigate redesign (issue 22) moves these APIs; only this file
should need to follow. Cost: see ``SimDetector.feed``; evidence building (simulation, not
product) is timed separately so that the decision cost excludes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from stalwart.detect import monitor as _monitor_mod
from stalwart.detect import validate as _validate
from stalwart.detect.localize import BEFORE, ONSET_SLACK, RankEvidence
from stalwart.detect.monitor import DETECT, HEADER, NONE, IterSample, Monitor
from stalwart.detect.tracking import uninstall
from stalwart.mitigate import planner
from stalwart.mitigate.agreement import EXCLUDE, REBALANCE, REVERT, Decision
from stalwart.mitigate.policy import Policy

TEST_NOISE = 0.05  # log-sd of one compute-test round (testbed: healthy ranks 0.96-1.07x)
LINK_NOISE = 0.15  # log-sd of one link-test round trip (testbed: healthy pairs up to 13x)
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


class _StandIn:
    """Stands in for ``stalwart.detect.validate`` inside ``Monitor._on_detect``: the tests
    return placeholders; the real measurements come from ``SimDetector._gather``."""

    ring_pair_passes = staticmethod(_validate.ring_pair_passes)

    @staticmethod
    def compute_test(reps: int = 64, rounds: int = 3, **_: Any) -> list[float]:
        return [1.0] * rounds

    @staticmethod
    def link_test(passes: Any, rank: int, nbytes: int = 0, **_: Any) -> dict:
        return {}

    @staticmethod
    def round_robin_passes(n: int, skip: Any = None) -> list:
        return []  # the ring covers the links the model can slow (host uplinks)


class _Events:
    """Rank 0's event log, kept in memory (the simulator writes it with its own clock)."""

    def __init__(self) -> None:
        self.logged: list[tuple[str, dict[str, Any]]] = []

    def log(self, event: str, **fields: Any) -> dict[str, Any]:
        self.logged.append((event, fields))
        return fields

    def close(self) -> None:
        pass


class SimDetector(Monitor):
    """Rank 0's detector of a simulated ``world``-rank job (module docstring)."""

    def __init__(self, world: int, rng: np.random.Generator, warmup: int = 10) -> None:
        super().__init__(run_dir=None, rank=0, world=world, track_ddp=False, warmup=warmup)
        uninstall(self.tracker)  # nothing to track: no process group, no collectives
        self.events = _Events()
        self._events = self.events  # type: ignore[assignment]
        self._rng = rng
        self._due: tuple[int, int, float, int] | None = None
        self._evidence_src: Evidence | None = None
        self._rounds: np.ndarray | None = None
        self._ev_onset = 0
        self.sim_s = 0.0  # CPU seconds spent building simulated evidence (not product work)
        self.pauses = 0

    # -- the product's calls, fed by the simulator ---------------------------------------------
    def feed(self, key: int, step_s: float, compute: np.ndarray, comm0: float,
             evidence: Callable[[], Evidence] | None = None) -> bool:
        """One step as rank 0 sees it; True if a validation pause ran (its decision arrived).

        Order as in ``Monitor.step``/``_check``: the iteration sample, then the decision made
        at the previous check (the rows carrying it arrive now), then the rows' per-rank
        samples (``_relative``), whose new decision goes out with the next rows."""
        self._sample(IterSample(key, float(step_s), float(compute[0]), float(comm0)))
        paused = False
        if self._due is not None:
            action, onset, severity, suspect = self._due
            self._due = None
            self._deciding -= 1
            if action == DETECT:
                t0 = time.thread_time()
                self._evidence_src = evidence() if evidence is not None else None
                self.sim_s += time.thread_time() - t0
                self._rounds = None
                with _stand_in():
                    self._on_detect(onset, key, severity, True,
                                    suspect if suspect >= 0 else None)
                self._evidence_src = None
                self.pauses += 1
                paused = True
            else:
                self._on_recover(onset, key, severity)
        row = np.zeros((len(compute), HEADER + 2))
        row[:, HEADER] = key
        row[:, HEADER + 1] = compute
        self._relative(row.tolist(), 1)
        if self._pending[0] != NONE:
            self._due, self._pending = self._pending, (NONE, 0, 0.0, -1)
            self._deciding += 1
        return paused

    def findings_as_events(self) -> list[dict[str, Any]]:
        return self.report()

    # -- overrides: no process group -----------------------------------------------------------
    def _evidence(self, onset: int, decided: int) -> RankEvidence:
        self._ev_onset = onset  # the window _gather builds every rank's profile over
        return super()._evidence(onset, decided)

    def _group(self) -> Any:
        return None

    def _test_device(self) -> tuple[Any, Any, Any]:
        return None, None, None

    def _gather(self, ev: RankEvidence) -> list[RankEvidence]:
        t0 = time.thread_time()
        src = self._evidence_src
        n = self.world
        k = len(ev.compute_rounds)
        if src is None:
            out = [RankEvidence(r, compute_rounds=[1.0] * k, compute_test=1.0)
                   for r in range(n)]
            self.sim_s += time.thread_time() - t0
            return out
        # rounds are drawn once per pause and extended when more are asked for
        have = 0 if self._rounds is None else self._rounds.shape[1]
        if k > have:
            new = src.comp_factor[:, None] * np.exp(
                self._rng.normal(0.0, TEST_NOISE, (n, k - have)))
            self._rounds = new if self._rounds is None else np.hstack([self._rounds, new])
        assert self._rounds is not None
        rounds = self._rounds[:, :k]
        tests = np.median(rounds, axis=1)
        onset, keys = self._ev_onset, src.keys
        comm = src.step_s[:, None] - src.compute
        before_m = (keys >= onset - BEFORE) & (keys < onset)
        after_m = keys >= onset

        def med(x: np.ndarray, m: np.ndarray) -> list[float | None]:
            return np.median(x[m], axis=0).tolist() if m.any() else [None] * n
        cb, ca, mb, ma = (med(src.compute, before_m), med(src.compute, after_m),
                          med(comm, before_m), med(comm, after_m))
        rec_m = keys >= onset - ONSET_SLACK - BEFORE
        rec_keys = keys[rec_m].tolist()
        rec = src.compute[rec_m].T.tolist()  # (N, steps)
        out = []
        for r in range(n):
            out.append(RankEvidence(r, cb[r], ca[r], mb[r], ma[r], float(tests[r]), {},
                                    rounds[r].tolist(),
                                    list(zip(rec_keys, rec[r], strict=True))))
        # the ring's pairs, in the passes the product tests; a pair is as slow as the slower
        # of its hosts' links when it crosses hosts
        pairs = [p for ps in _validate.ring_pair_passes(n) for p in ps]
        a = np.fromiter((p[0] for p in pairs), int, len(pairs))
        b = np.fromiter((p[1] for p in pairs), int, len(pairs))
        ha, hb = src.host_of[a], src.host_of[b]
        slow = np.where(ha != hb, np.maximum(src.link_factor[ha], src.link_factor[hb]), 1.0)
        rtt = slow * np.exp(self._rng.normal(0.0, LINK_NOISE, len(pairs)))
        out[0].links = {f"{x}-{y}": float(t) for x, y, t in
                        zip(a.tolist(), b.tolist(), rtt.tolist(), strict=True)}
        self.sim_s += time.thread_time() - t0
        return out


@contextmanager
def _stand_in() -> Iterator[None]:
    real = _monitor_mod.validate
    _monitor_mod.validate = _StandIn  # type: ignore[assignment]
    try:
        yield
    finally:
        _monitor_mod.validate = real


class SimPolicy:
    """The product's escalation policy over ``groups`` data-parallel replicas.

    ``mode``: "rebalance" (S2
    only), "exclude" (S4 only: S2's price set out of reach), "auto" (the full policy)."""

    def __init__(self, groups: int, micro: int, mode: str, restart_s: float,
                 every: int = 2) -> None:
        pmode = "rebalance" if mode == "rebalance" else "auto"
        self.policy = Policy(groups=groups, micro=micro, tp=1, mode=pmode,
                             restart_s=restart_s, every=every)
        if mode == "exclude":
            self.policy.s2_price = lambda units: float("inf")  # type: ignore[method-assign]
        self.every = every

    def observe(self, step: int, units: list[float], step_s: float,
                findings: list[dict[str, Any]]) -> Decision | None:
        """``findings``: the detector's, their ``ranks`` already mapped to replica indices
        of this policy (``SimPolicy.map_findings``)."""
        return self.policy.observe(step, units, step_s, self.every, findings, step + 1)

    @staticmethod
    def map_findings(findings: list[dict[str, Any]], to_group: Callable[[int], int | None]
                     ) -> list[dict[str, Any]]:
        """The detector's findings with each rank replaced by its replica (``to_group``;
        None: a replica this policy does not run)."""
        out = []
        for f in findings:
            g = dict(f)
            gs = {to_group(int(r)) for r in f.get("ranks") or []}
            g["ranks"] = sorted(x for x in gs if x is not None)
            if f.get("link"):
                g["link"] = [x for x in (to_group(int(r)) for r in f["link"]) if x is not None]
            out.append(g)
        return out

    def measured(self, dec: Decision, gain: float) -> None:
        self.policy.measured(dec.name, dec.version, gain)
