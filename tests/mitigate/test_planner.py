"""The planner is exact: its makespan equals brute force over every plan on small cases."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.mitigate.planner import SMALL, assignment, makespan, plan, uniform


def brute(times: list[float], m: int, lo: list[int], hi: list[int]) -> float:
    best = float("inf")
    ranges = [range(a, min(b, m) + 1) for a, b in zip(lo, hi, strict=True)]
    for c in itertools.product(*ranges):
        if sum(c) == m:
            best = min(best, makespan(c, times))
    return best


def check(times: list[float], m: int, lo: list[int], hi: list[int]) -> None:
    c = plan(times, m, lo, hi)
    assert sum(c) == m and all(a <= n <= b for n, a, b in zip(c, lo, hi, strict=True))
    assert makespan(c, times) == pytest.approx(brute(times, m, lo, hi), rel=1e-12)


@pytest.mark.parametrize("seed", range(60))
def test_exact_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    g = rng.randint(2, 4)
    m = rng.randint(g, 12)
    times = [rng.choice([1.0, 1.0, 2.0, 3.0, 1.3, rng.uniform(0.2, 20.0)]) for _ in range(g)]
    lo = [rng.choice([0, 1, 1, 2]) for _ in range(g)]
    if sum(lo) > m:
        lo = [0] * g
    hi = [rng.choice([m, m, rng.randint(max(a, 1), m)]) for a in lo]
    if sum(hi) < m:
        hi = [m] * g
    check(times, m, lo, hi)


def test_the_numpy_path_is_exact_too() -> None:
    """Many micro-batches take the bisection path: compare with the plain greedy's makespan
    and with a brute force over the two slow groups' counts."""
    rng = np.random.default_rng(1)
    for _ in range(20):
        t = rng.uniform(0.5, 3.0, size=3)
        m = SMALL + 200
        c = plan(t, m)
        best = min(makespan((a, b, m - a - b), t) for a in range(1, m) for b in range(1, m - a))
        assert makespan(c, t) == pytest.approx(best, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.05, 50.0), min_size=1, max_size=5), st.integers(0, 10))
def test_property_matches_brute_force(times: list[float], extra: int) -> None:
    g = len(times)
    check(times, g + extra, [1] * g, [g + extra] * g)


def test_two_x_straggler_among_four() -> None:
    c = plan([1.0, 1.0, 2.0, 1.0], 16)
    assert c == [5, 5, 2, 4]  # makespan 5 (uniform: 8); ties go to the lower group index


def test_zero_minimum_excludes_a_hopeless_group() -> None:
    assert plan([1.0, 1.0, 100.0], 6, min_count=0) == [3, 3, 0]
    assert plan([1.0, 1.0, 100.0], 6, min_count=1) == [3, 2, 1]


def test_healthy_times_give_the_uniform_plan() -> None:
    assert plan([0.3] * 4, 16) == uniform(16, 4) == [4, 4, 4, 4]
    assert uniform(10, 4) == [3, 3, 2, 2]


def test_assignment_partitions_every_index_once() -> None:
    counts = plan([1.0, 2.5, 1.1, 0.9, 7.0], 37)
    idx = [i for r in assignment(counts) for i in r]
    assert idx == list(range(37))


def test_deterministic() -> None:
    t = np.random.default_rng(3).uniform(0.5, 2.0, size=1000)
    assert plan(t, 20000) == plan(t.copy(), 20000)


@pytest.mark.parametrize("args, msg", [
    (([1.0, 0.0], 4), "finite and > 0"),
    (([1.0, float("nan")], 4), "finite and > 0"),
    (([1.0, 1.0], 1), "minimum counts need 2"),
    (([1.0, 1.0], -1), ">= 0"),
])
def test_bad_input_is_one_line_value_error(args: tuple, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        plan(*args)
