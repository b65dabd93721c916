"""A per-rank channel's return to its own level is not a slowdown (decision._back_among_peers): a
rank that ran fast for a while (or whose level was learned in a dip at the warm-up) and is
back among its peers raises no alarm, while one that goes on past its level does."""

from __future__ import annotations

import numpy as np

from stalwart.detect.alarms import DETECT, NONE, OUTLIER, IterSample
from stalwart.detect.changepoint import Change
from stalwart.detect.decision import REL_MIN_SHIFT, DecisionCore

N = 8
SUSPECT = 3


def _run(levels: list[float], seed: int = 0) -> list[tuple[int, int, int]]:
    """Rank 0's alarms (step, action, suspect) over a job of N ranks whose rank SUSPECT's
    compute follows ``levels`` (one per step, x its peers') with 2% noise everywhere; every
    alarm is taken at once and its verdict left open (no validation here)."""
    rng = np.random.default_rng(seed)
    core = DecisionCore(True, warmup=10, audit=False)
    alarms = []
    for k, level in enumerate(levels):
        comps = 0.1 * np.exp(rng.normal(0.0, 0.02, N))
        comps[SUSPECT] *= level
        core.sample(IterSample(k, 0.2 * float(np.exp(rng.normal(0.0, 0.02))), 0.1, 0.1))
        core.relative(k, comps.tolist())
        a = core.take_pending(travels=False)
        if a.action != NONE:
            alarms.append((k, a.action, a.suspect))
    return alarms


def test_a_rank_back_from_a_dip_raises_no_alarm() -> None:
    # healthy, 20 steps at 0.8x its peers (a verified speed-up), then healthy again
    alarms = _run([1.0] * 40 + [0.8] * 20 + [1.0] * 60)
    assert [a for a in alarms if a[2] == SUSPECT] == []


def test_a_rank_whose_level_was_learned_in_a_dip_raises_no_alarm_when_it_joins_its_peers() -> None:
    alarms = _run([0.8] * 30 + [1.0] * 60)
    assert [a for a in alarms if a[2] == SUSPECT] == []


def test_a_rank_that_goes_past_its_peers_after_a_dip_is_still_found() -> None:
    alarms = _run([1.0] * 40 + [0.8] * 20 + [1.6] * 60)
    assert (DETECT, SUSPECT) in [(a[1], a[2]) for a in alarms]


def test_a_slowdown_without_a_dip_is_untouched() -> None:
    alarms = _run([1.0] * 40 + [1.5] * 60)
    assert (DETECT, SUSPECT) in [(a[1], a[2]) for a in alarms]


def test_the_rule_reads_only_per_rank_slowdowns_that_end_near_the_peers() -> None:
    core = DecisionCore(True, warmup=10, audit=False)
    core._rel_dets(4)
    up = Change(40, 45, 0.85, 1.0)
    assert core._back_among_peers(up, "rank3", DETECT)
    assert not core._back_among_peers(up, "iteration", DETECT)
    assert not core._back_among_peers(up, "rank3", OUTLIER)
    assert not core._back_among_peers(Change(40, 45, 1.0, 0.85), "rank3", DETECT)  # a dip
    edge = 1.0 + REL_MIN_SHIFT
    assert core._back_among_peers(Change(40, 45, 0.9, edge), "rank3", DETECT)
    assert not core._back_among_peers(Change(40, 45, 0.9, edge + 0.01), "rank3", DETECT)
    assert not core._back_among_peers(Change(40, 45, 1.0, 1.1), "rank3", DETECT)  # from peers
    # two ranks: a slowdown by x reads 2x / (1 + x), so half the shift
    two = DecisionCore(True, warmup=10, audit=False)
    two._rel_dets(2)
    assert not two._back_among_peers(Change(40, 45, 0.9, 1.0 + REL_MIN_SHIFT), "rank1", DETECT)
    assert two._back_among_peers(Change(40, 45, 0.9, 1.0 + REL_MIN_SHIFT / 2), "rank1", DETECT)
