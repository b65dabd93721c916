"""The compute test's rank-order rules at any job size (localize.top_places): "the slowest"
is the slowest rank up to 7 ranks and the slowest quarter from 8 on, so a healthy rank
counts a round with chance <= 1/4 at any size while a straggler among 10,000 ranks is not
asked to beat the extremes of 9,999 healthy ranks' test noise."""

from __future__ import annotations

import numpy as np

from stalwart.detect.evidence import RankEvidence
from stalwart.detect.localize import (
    MILD_ROUNDS,
    OUTLIER_MODE,
    decide,
    more_rounds,
    round_chance,
    slowest_counts,
    slowest_every_round,
    top_places,
)
from stalwart.simulate.testnoise import TestNoise


def _ev(rounds: np.ndarray) -> list[RankEvidence]:
    tests = np.median(rounds, axis=1)
    return [RankEvidence(r, 0.05, 0.05, 0.01, 0.02, float(tests[r]), {}, rounds[r].tolist())
            for r in range(len(rounds))]


def test_up_to_seven_ranks_only_the_slowest_counts() -> None:
    assert [top_places(n) for n in range(1, 8)] == [1] * 7
    assert [top_places(n) for n in (8, 9, 12, 10_000)] == [2, 2, 3, 2_500]
    assert all(round_chance(n) <= 0.25 for n in range(8, 200))
    assert round_chance(4) == 0.25 and round_chance(6) == 1 / 6


def test_counts_in_one_pass_equal_one_rank_at_a_time_with_ties_at_forty_ranks() -> None:
    rng = np.random.default_rng(5)
    rounds = rng.choice([0.1, 0.2, 0.3, 0.4], size=(40, 7))  # ties on purpose
    ev = _ev(rounds)
    assert slowest_counts(ev) == {r: slowest_every_round(ev, r) for r in range(40)}


def _validate(noise: TestNoise, rng: np.random.Generator, n: int, suspect: int,
              factor: float) -> bool:
    """One validation of ``suspect`` (its compute factor ``factor``) among ``n`` ranks, the
    rounds drawn from the testbed's measured test noise, as many as ``more_rounds`` asks
    for; True when ``decide`` names it."""
    f = np.ones(n)
    f[suspect] = factor
    rounds = noise.rounds(rng, f, 3)
    while k := more_rounds(_ev(rounds), suspect, OUTLIER_MODE):
        rounds = np.hstack([rounds, noise.rounds(rng, f, k)])
    found = decide(_ev(rounds), 0, 10, 1.0, suspect_rank=suspect, mode=OUTLIER_MODE)
    return found.kind == "compute" and found.ranks == [suspect]


def test_a_straggler_among_two_thousand_ranks_is_confirmed_and_a_healthy_suspect_is_not() -> None:
    noise = TestNoise.load()  # the testbed's measured test noise (replay corpus)
    rng = np.random.default_rng(2)
    n = 2_000
    assert [_validate(noise, rng, n, 77, 2.0) for _ in range(4)] == [True] * 4
    assert [_validate(noise, rng, n, 77, 1.0) for _ in range(4)] == [False] * 4
    # healthy ranks that count all 7 rounds: 4^-7 x 1,999 = 0.12 expected
    rounds = noise.rounds(rng, np.ones(n), MILD_ROUNDS)
    assert sum(k == MILD_ROUNDS for k in slowest_counts(_ev(rounds)).values()) <= 2
    # the strict rule it replaces: the slowest of all 2,000 in every round, which a 2x rank's
    # readings (its test reads 0.8-4.7x) almost never are
    f = np.ones(n)
    f[77] = 2.0
    rounds = noise.rounds(rng, f, MILD_ROUNDS)
    assert sum(rounds[77, i] > np.delete(rounds[:, i], 77).max() for i in range(MILD_ROUNDS)) \
        < MILD_ROUNDS
