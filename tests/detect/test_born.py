"""Verdicts on stragglers with no healthy "before" (outlier alarms and the audit), from
synthetic evidence, and the policy pricing them from their peers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stalwart.detect.localize import (
    AUDIT_MODE,
    CHANGE_MODE,
    COMPUTE_MILD,
    OUTLIER_MODE,
    RankEvidence,
    decide,
    more_rounds,
)
from stalwart.mitigate.decisions import REBALANCE
from stalwart.mitigate.policy import Policy

RING4 = {"0-1": 0.004, "1-2": 0.004, "2-3": 0.004, "0-3": 0.004}


def evidence(slow: int | None, factor: float = 2.0, test: float = 2.0, steps: int = 40,
             first: int = 0, rise_at: int | None = None, links: dict[str, float] | None = None,
             seed: int = 0) -> list[RankEvidence]:
    """4 ranks' evidence from step ``first``: compute ~10 ms with noise, rank ``slow``
    ``factor`` x slower (from ``rise_at``, else all along); its compute test ``test`` x."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(4):
        keys = list(range(first, first + steps))
        c = 0.01 * rng.lognormal(0.0, 0.25, steps)
        if r == slow:
            c = np.where(np.asarray(keys) >= (rise_at if rise_at is not None else first),
                         c * factor, c)
        comm = 0.02 if r != slow else 0.01
        rounds = [0.1 * (test if r == slow else 1.0 + 0.01 * r)] * 3
        out.append(RankEvidence(r, None, float(np.median(c)), None, comm,
                                float(np.median(rounds)), {}, rounds,
                                list(zip(keys, c.tolist(), strict=True))))
    for k, v in (links or RING4).items():
        out[int(k.split("-")[0])].links[k] = v
    return out


def test_an_outlier_confirmed_by_the_compute_test_is_named_since_the_first_sample() -> None:
    f = decide(evidence(2), onset_step=0, step=40, severity=1.3, suspect_rank=2,
               mode=OUTLIER_MODE)
    assert f.kind == "compute" and f.ranks == [2] and f.onset_step == 0
    assert f.evidence["never_healthy"] is True and f.evidence["detected_by"] == "outlier"
    # priced from the peers: the step (compute + comm ~30 ms) without the ~10 ms excess
    assert 1.2 < f.severity < 1.8
    assert f.evidence["rounds_chance"] == pytest.approx(4.0 ** -3, rel=1e-2)


def test_an_outlier_that_rose_mid_window_gets_the_rise_as_its_onset() -> None:
    f = decide(evidence(1, first=100, steps=80, rise_at=150), onset_step=124, step=180,
               severity=1.3, suspect_rank=1, mode=OUTLIER_MODE)
    assert f.kind == "compute" and f.ranks == [1]
    assert abs(f.onset_step - 150) <= 3 and f.evidence["never_healthy"] is False


def test_an_outlier_the_compute_test_does_not_confirm_names_nobody() -> None:
    f = decide(evidence(2, test=1.02), onset_step=0, step=40, severity=1.3, suspect_rank=2,
               mode=OUTLIER_MODE)
    assert f.kind == "unknown"


def test_the_audit_names_a_rank_both_tests_agree_on_and_nobody_on_a_clean_job() -> None:
    f = decide(evidence(3), onset_step=0, step=40, severity=1.0, mode=AUDIT_MODE)
    assert f.kind == "compute" and f.ranks == [3] and f.onset_step == 0
    assert f.evidence["never_healthy"] and f.evidence["sign_test"]["rank"] == 3
    assert f.evidence["sign_test"]["p"] < 0.01
    assert decide(evidence(None), 0, 40, 1.0, mode=AUDIT_MODE).kind == "unknown"
    # a compute test that reads one rank slow, with training-time compute that does not:
    # the audit has no candidate and rule 3 (the compute test alone) does not apply
    flat = evidence(3, factor=1.0, test=2.5)
    assert decide(flat, 0, 40, 1.0, mode=AUDIT_MODE).kind == "unknown"
    # ... while the training-time evidence alone (the compute test healthy) names nobody
    assert decide(evidence(3, test=1.0), 0, 40, 1.0, mode=AUDIT_MODE).kind == "unknown"


def test_the_audit_finds_a_slow_host_link_and_a_slow_pair_from_the_start() -> None:
    host = dict(RING4, **{"0-1": 0.4, "1-2": 0.5})
    f = decide(evidence(None, links=host), 0, 40, 1.0, mode=AUDIT_MODE)
    assert f.kind == "link" and f.ranks == [1] and f.onset_step == 0
    assert f.evidence["never_healthy"] and f.severity > 1.0
    pair = dict(RING4, **{"1-2": 0.6})
    g = decide(evidence(None, links=pair), 0, 40, 1.0, mode=AUDIT_MODE)
    assert g.kind == "link" and g.ranks == [] and g.link == [1, 2] and g.severity > 1.0


def test_the_audits_mild_candidate_gets_the_longer_compute_test() -> None:
    ev = evidence(2, factor=1.6, test=1.3)
    assert more_rounds(ev, None, AUDIT_MODE) == 4  # 3 rounds so far, slowest in each
    assert more_rounds(ev, None, CHANGE_MODE) == 0  # no profile rank without a "before"


def test_the_policy_prices_a_straggler_that_was_never_healthy_from_its_peers() -> None:
    """A rank 2x slow from step 0: every step the policy saw was slow, so without the
    finding's peer-priced severity its healthy level would be the slow one and the rent
    that buys a rebalance would never accrue."""
    from stalwart.detect.localize import Finding

    def run(born: bool) -> list[int]:
        pol = Policy(groups=4, micro=16)
        ev = {"never_healthy": True, "detected_by": "outlier"} if born else {}
        f = Finding("compute", 0, 6, 1.6, ranks=[2], evidence=ev)
        out = []
        for i in range(30):
            step = 2 * i
            units = [0.01, 0.01, 0.02, 0.01]  # rank 2 twice its peers per micro-batch
            dec = pol.observe(step, units, 0.16, 2, [f] if step >= 6 else [], step + 3)
            if dec is not None:
                out.append(dec.kind)
        return out

    assert REBALANCE in run(born=True)
    assert REBALANCE not in run(born=False)  # what a born finding looked like before


def test_a_link_fault_that_began_before_the_audit_is_not_called_never_healthy() -> None:
    slow = dict(RING4, **{"1-2": 0.6, "2-3": 0.5})
    ev = evidence(None, links=slow)
    for e in ev:  # steps of 0.1 s, 1.3 s from step 25 on (the fault began there)
        e.steps = [(k, 0.1 if k < 25 else 1.3) for k, _ in e.recent]
    f = decide(ev, 0, 40, 1.0, mode=AUDIT_MODE)
    assert f.kind == "link" and f.ranks == [2]
    assert f.onset_step == 25 and f.evidence["never_healthy"] is False
    for e in ev:  # slow all along
        e.steps = [(k, 1.3) for k, _ in e.recent]
    g = decide(ev, 0, 40, 1.0, mode=AUDIT_MODE)
    assert g.onset_step == 0 and g.evidence["never_healthy"] is True


def test_the_audit_confirms_a_mild_rank_only_by_the_long_consistent_test() -> None:
    # a 1.3x rank: above its peers by ~16% in the median, no sign test passes at 25%
    ev = evidence(1, factor=1.18, test=1.3, steps=40, seed=4)
    assert more_rounds(ev, None, AUDIT_MODE) == 4  # the mild candidate: 7 rounds
    assert decide(ev, 0, 40, 1.0, mode=AUDIT_MODE).kind == "unknown"  # 3 rounds: not yet
    for e in ev:  # 7 rounds, the candidate the slowest in each
        e.compute_rounds = e.compute_rounds + e.compute_rounds[:1] * 4
    f = decide(ev, 0, 40, 1.0, mode=AUDIT_MODE)
    assert f.kind == "compute" and f.ranks == [1] and f.evidence["sign_test"]["mild_only"]
    # a mild candidate never passes on size alone: 2x in 3 rounds is not enough for it
    big = evidence(1, factor=1.18, test=2.0, steps=40, seed=4)
    assert decide(big, 0, 40, 1.0, mode=AUDIT_MODE).kind == "unknown"
    assert more_rounds(big, None, AUDIT_MODE) == 4
    # 2 ranks: no mild fallback (the 7-round chance is 2^-7)
    two = [e for e in evidence(1, factor=1.18, test=1.3, steps=40, seed=4) if e.rank < 2]
    assert more_rounds(two, None, AUDIT_MODE) == 0


def test_a_born_ranks_warm_up_is_not_its_onset() -> None:
    ev = evidence(2)
    for e in ev:  # the slow rank's first 3 samples read like its peers' (warm-up noise)
        if e.rank == 2:
            e.recent = [(k, c / 2.0 if k < 3 else c) for k, c in e.recent]
    f = decide(ev, 0, 40, 1.0, suspect_rank=2, mode=OUTLIER_MODE)
    assert f.onset_step == 0 and f.evidence["never_healthy"] is True


def test_the_mild_candidate_is_the_eligible_rank_the_compute_test_reads_slowest() -> None:
    # rank 0 reads ~1.18x its peers all along (its extra work) but computes like them;
    # rank 2 reads ~1.14x and is the one the compute test finds slow
    ev = evidence(2, factor=1.4, test=1.3, steps=40, seed=6)
    for e in ev:
        if e.rank == 0:
            e.recent = [(k, c * 1.25) for k, c in e.recent]
    why: dict = {}
    from stalwart.detect.localize import candidate_of
    assert candidate_of(ev, None, AUDIT_MODE, why) == 2 and why["sign_test"]["mild_only"]


def _noisy(seed: int, rise_at: int | None, factor: float) -> list[RankEvidence]:
    """41 steps of a plain script's tiny steps under a CPU quota: every rank's compute swings
    ~0.45 in log from step to step (a rank's ratio to its peers 0.4x-4.7x, as recorded), rank
    2 ``factor`` x slower from ``rise_at`` (from step 0 when None)."""
    ev = evidence(2, factor=1.0, steps=41, seed=seed)
    rng = np.random.default_rng(1000 + seed)
    for e in ev:
        e.recent = [(k, 0.005 * float(rng.lognormal(0.0, 0.45))
                     * (factor if e.rank == 2 and k >= (rise_at or 0) else 1.0))
                    for k, _ in e.recent]
    return ev


def test_a_noisy_rank_slow_from_step_0_is_not_called_healthy_before_a_chance_rise() -> None:
    # the stated rate: a rise placed at z >= RISE_Z has p <= 1% over a window's splits; here
    # the recorded noise (1.45x, ratio sd 0.58 in log) over 300 windows of 41 steps
    from stalwart.detect.onset import born_onset

    wrong = sum(not born_onset(_noisy(s, None, 1.45), 2, 0, 40, math.log(COMPUTE_MILD))[1]
                for s in range(300))
    assert wrong <= 3, wrong
    # the median rule alone (what it replaced) called 28 of these 300 healthy before a rise
    # a real rise in the same noise is still placed: 3x from step 20, within 3 steps in about
    # two thirds of windows (as without the z test: the split itself misplaces the rest)
    placed = [born_onset(_noisy(s, 20, 3.0), 2, 0, 40, math.log(COMPUTE_MILD))
              for s in range(100)]
    assert sum(not never and abs(at - 20) <= 3 for at, never in placed) >= 60, placed


def test_a_rise_a_few_steps_before_the_audit_is_its_onset_not_the_first_sample() -> None:
    """Too few samples after the rise for the rank-sum test (z 3.5 needs >= 5 against ~25),
    but all above the before-samples' quantile that gives the same false-rise chance: slow
    since the rise, not "never healthy" (onset._recent_rise; a CI run under load met the
    audit 3 steps into a fault). The evidence's noise: 0.25 lognormal per rank and step."""
    from stalwart.detect.onset import born_onset

    placed = [born_onset(evidence(2, factor=3.0, steps=28, rise_at=25, seed=s), 2, 0, 27,
                         math.log(COMPUTE_MILD)) for s in range(100)]
    # measured 78 of 100 (the rest: an after-sample within the before's noise, or the split
    # placed elsewhere); without the rule 0 of 100 -- all "never healthy"
    assert sum(at == 25 and not never for at, never in placed) >= 60, placed
    # slow from the first sample: never healthy, in every window
    born = [born_onset(evidence(2, factor=3.0, steps=28, seed=s), 2, 0, 27,
                       math.log(COMPUTE_MILD)) for s in range(100)]
    assert all(never and at == 0 for at, never in born), born


def _offset(seed: int, offset: float, factor: float, born: float = 1.0) -> list[RankEvidence]:
    """``_noisy``'s windows with rank 2 at ``offset`` x its peers while healthy (where it
    runs: a core it shares, other jobs' load on it), ``born`` x more from step 0 and
    ``factor`` x more from step 20."""
    ev = _noisy(seed, 20, factor)
    for e in ev:
        if e.rank == 2:
            e.recent = [(k, c * offset * born) for k, c in e.recent]
    return ev


def test_a_rank_healthy_above_its_peers_that_rises_is_slow_since_the_rise() -> None:
    """A healthy rank reads above its peers where its core is loaded (0.39x-1.27x in loaded
    runs of one 2-rank job; 1.25x for the replay corpus's compute2x-n3-lossy rank 2, named
    "never healthy" with onset 0 for a fault at step 30). A rise from there is its onset
    (onset.healthy_before: the level before nearer its peers' than the level after). The
    line 1 + MIN_SHIFT alone placed 83 and 16 of these 300 at 1.2x and 1.4x."""
    from stalwart.detect.onset import born_onset

    for off in (1.2, 1.4):
        placed = [born_onset(_offset(s, off, 3.0), 2, 0, 40, math.log(COMPUTE_MILD))
                  for s in range(300)]
        # measured 277 and 274 of 300 (the rest: the split misplaced, as with no offset)
        assert sum(not never and abs(at - 20) <= 3 for at, never in placed) >= 240, off


def test_a_rank_slow_from_step_0_that_grew_slower_is_mostly_still_never_healthy() -> None:
    """2x from step 0, 1.5x more from step 20 (two faults on one rank): the level before
    the rise is nearer the one after it than its peers' -- never healthy -- except where the
    two medians' noise crosses the midpoint. The cost of the rule, stated: measured 278 of
    300 never healthy (the rest slow since the rise, at step 20); the line 1 + MIN_SHIFT
    alone called all 300 never healthy. 2x then 1.3x more: 293 of 300."""
    from stalwart.detect.onset import born_onset

    for more, least in ((1.5, 270), (1.3, 285)):
        got = [born_onset(_offset(s, 1.0, more, born=2.0), 2, 0, 40, math.log(COMPUTE_MILD))
               for s in range(300)]
        assert sum(never and at == 0 for at, never in got) >= least, more


def _hosts_of_two(seed: int, rise_at: int | None, factor: float, level: float = 1.0,
                  steps: int = 40) -> list[RankEvidence]:
    """6 ranks, 2 per host, per-step log noise 0.45; host 1's ranks (2, 3) at ``level`` x
    the others (a load offset while healthy, or a born slowdown), ``factor`` x more from
    ``rise_at``."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(6):
        rec = [(k, 0.005 * float(rng.lognormal(0.0, 0.45))
                * (level * (factor if rise_at is not None and k >= rise_at else 1.0)
                   if r in (2, 3) else 1.0)) for k in range(steps)]
        out.append(RankEvidence(r, recent=rec, host=str(r // 2)))
    return out


def test_a_slow_groups_onset_is_placed_on_the_groups_series() -> None:
    """A host's two ranks slowed alike, met by the audit two steps into their fault (the
    testbed under load: host 1's ranks at ~1.6x their peers while healthy, the audit at step
    26 for a fault at 25, named "never healthy" with onset 0): the group's series
    (onset.group_series) places the rise where each member's own often cannot. Measured on
    200 windows: placed within a step in 125 (one member's series: 59); a group 2x slow from
    step 0 stays never healthy in 200 (one member's series: 198)."""
    from stalwart.detect.onset import born_onset

    m = math.log(COMPUTE_MILD)
    late = [_hosts_of_two(s, 38, 3.0, level=1.5) for s in range(200)]
    group = [born_onset(ev, 3, 0, 39, m, [2, 3]) for ev in late]
    alone = [born_onset(ev, 3, 0, 39, m) for ev in late]

    def placed(got: list[tuple[int, bool]]) -> int:
        return sum(not never and abs(at - 38) <= 1 for at, never in got)
    assert placed(group) >= 110 and placed(group) > 2 * placed(alone), (placed(group),
                                                                         placed(alone))
    born = [born_onset(_hosts_of_two(s, None, 1.0, level=2.0), 3, 0, 39, m, [2, 3])
            for s in range(200)]
    assert sum(never and at == 0 for at, never in born) >= 196
