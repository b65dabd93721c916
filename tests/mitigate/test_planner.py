"""The planner is exact: brute force over every plan on small cases, both code paths (heap
greedy and numpy selection) bit-identical, and an optimality certificate at scale."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.mitigate import planner
from stalwart.mitigate.planner import assignment, makespan, plan, time_plan_ms, uniform


def brute(times: Sequence[float], m: int, lo: Sequence[int], hi: Sequence[int]
          ) -> tuple[float, list[int]]:
    """Every composition: the optimal makespan, and the plan the module docstring promises
    among optimal ones -- the chosen free items (finish time, group), listed latest first,
    lexicographically smallest (earliest finish; ties to the lower group index)."""
    best: tuple[float, list[tuple[float, int]]] | None = None
    arg: list[int] = []
    for c in itertools.product(*(range(a, b + 1) for a, b in zip(lo, hi, strict=True))):
        if sum(c) != m:
            continue
        items = sorted(((k * t, i) for i, (n, a, t) in enumerate(zip(c, lo, times, strict=True))
                        for k in range(a + 1, n + 1)), reverse=True)
        key = (makespan(c, times), items)
        if best is None or key < best:
            best, arg = key, list(c)
    assert best is not None
    return best[0], arg


def paths(times: Sequence[float], m: int, lo: Sequence[int], hi: Sequence[int]
          ) -> tuple[list[int], list[int]]:
    """The heap greedy and the numpy selection on the same (scaled) input."""
    t = np.asarray(times, dtype=np.float64)
    t = np.ldexp(t, -int(np.frexp(t.max())[1]))
    lo_a, hi_a = np.asarray(lo, dtype=np.int64), np.minimum(np.asarray(hi, dtype=np.int64), m)
    if int(lo_a.sum()) == m:
        return list(lo), list(lo)
    return planner._heap(t, lo_a, hi_a, m), planner._select(t, lo_a, hi_a, m)


def certify(c: Sequence[int], times: Sequence[float], m: int, lo: Sequence[int],
            hi: Sequence[int]) -> None:
    """Feasible, and optimal by an O(G) certificate: the makespan T is a forced lo_i * t_i,
    or the micro-batches finishing strictly before T cannot make up m."""
    t = np.asarray(times, dtype=np.float64)
    lo_a, hi_a, c_a = (np.asarray(x, dtype=np.int64) for x in (lo, hi, c))
    assert int(c_a.sum()) == m and (lo_a <= c_a).all() and (c_a <= hi_a).all()
    mk = makespan(c, times)
    if mk == max(makespan(lo, times), 0.0):
        return
    k = np.ceil(mk / t) - 1  # the largest k with k * t_i < T, made exact below
    k += (k + 1) * t < mk
    k -= (k * t >= mk) & (k > 0)
    assert int(np.clip(k, lo_a, hi_a).sum()) < m
    # and the secondary objective: no micro-batch moves to a group that finishes it sooner
    fin = c_a * t
    nxt = np.where(c_a < hi_a, (c_a + 1) * t, np.inf)
    movable = c_a > lo_a
    if movable.any():
        assert nxt.min() >= fin[movable].max() - 1e-12 * mk


def case(seed: int) -> tuple[list[float], int, list[int], list[int]]:
    rng = random.Random(seed)
    g = rng.randint(2, 4)
    m = rng.randint(0, 12)
    pool = [1.0, 1.0, 2.0, 3.0, 0.5, 1.5, 0.1, 0.3, 0.7, 1e-3, 1e3]
    times = [rng.choice([*pool, rng.uniform(0.2, 20.0), 10 ** rng.uniform(-4, 4)])
             for _ in range(g)]
    lo = [rng.choice([0, 1, 1, 2]) for _ in range(g)]
    if sum(lo) > m:
        lo = [0] * g
    hi = [rng.choice([m, m, rng.randint(lo[i], m)]) for i in range(g)]
    if sum(hi) < m:
        hi = [m] * g
    return times, m, lo, hi


@pytest.mark.parametrize("seed", range(300))
def test_exact_against_brute_force(seed: int) -> None:
    times, m, lo, hi = case(seed)
    best, arg = brute(times, m, lo, hi)
    heap, sel = paths(times, m, lo, hi)
    assert heap == sel == arg
    c = plan(times, m, lo, hi)
    assert c == arg and makespan(c, times) == best
    certify(c, times, m, lo, hi)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.sampled_from([0.1, 0.2, 0.3, 1.0, 3.0]),
                          st.floats(1e-3, 1e3)), min_size=1, max_size=4),
       st.integers(0, 10), st.data())
def test_property_brute_force(times: list[float], extra: int, data: st.DataObject) -> None:
    g = len(times)
    lo = data.draw(st.lists(st.integers(0, 2), min_size=g, max_size=g))
    m = sum(lo) + extra
    hi = [m] * g
    best, arg = brute(times, m, lo, hi)
    assert plan(times, m, lo) == arg
    assert paths(times, m, lo, hi) == (arg, arg)
    assert makespan(arg, times) == best


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 60), st.integers(0, 3000), st.integers(0, 2**32 - 1),
       st.sampled_from(["ties", "lognormal", "log-uniform"]), st.sampled_from([3, 30]))
def test_property_paths_agree_and_certify(g: int, extra: int, seed: int, kind: str,
                                          lo_max: int) -> None:
    """Larger than brute force can reach: the two paths agree exactly, the plan certifies.
    Wide time ratios and large minimums make ``_select`` bisect its bracket too."""
    rng = np.random.default_rng(seed)
    times = {"ties": lambda: rng.choice([0.1, 0.3, 0.7, 1.0, 2.0], size=g),
             "lognormal": lambda: rng.lognormal(0.0, 1.0, size=g),
             "log-uniform": lambda: 10 ** rng.uniform(-3.0, 3.0, size=g)}[kind]().tolist()
    lo = rng.integers(0, lo_max, size=g).tolist()
    m = sum(lo) + extra
    hi = [a + int(rng.integers(0, m + 1)) for a in lo]
    if sum(hi) < m:
        hi = [a + m for a in lo]
    heap, sel = paths(times, m, lo, hi)
    assert heap == sel
    c = plan(times, m, lo, hi)
    assert c == sel
    certify(c, times, m, lo, [min(b, m) for b in hi])


def test_the_benchmark_scale() -> None:
    """10,000 groups, 160,000 micro-batches (the benchmark's size): certified, and equal to
    the greedy placing every micro-batch one by one."""
    rng = np.random.default_rng(7)
    t = rng.lognormal(0.0, 0.1, size=10_000)
    slow = rng.choice(10_000, size=500, replace=False)
    t[slow] *= rng.uniform(1.3, 4.0, size=500)
    c = plan(t, 160_000)
    lo, hi = [1] * 10_000, [160_000] * 10_000
    certify(c, t.tolist(), 160_000, lo, hi)
    assert c == paths(t, 160_000, lo, hi)[0]


@pytest.mark.parametrize("times, m", [
    ([1e-9, 1.0, 1e9], 100_000),            # ratios of 1e18
    ([0.1] * 500, 7_777),                   # all tied
    ([1.0] * 9_999 + [1e6], 160_000),       # one hopeless group
    ([1.0] * 9_999 + [1e-6], 160_000),      # one group takes nearly everything
])
def test_extreme_inputs(times: list[float], m: int) -> None:
    g = len(times)
    c = plan(times, m)
    certify(c, times, m, [1] * g, [m] * g)
    assert c == paths(times, m, [1] * g, [m] * g)[0]


def test_fit_counts_by_the_products_the_greedy_compares() -> None:
    """N(T) = #{k : k * t <= T} in float products, even where floor(T / t) is off by one
    (one in ~20 random cases at T = k * t or just below it)."""
    rng = np.random.default_rng(0)
    t = rng.uniform(0.01, 1.0, size=20_000)
    k = rng.integers(1, 1000, size=20_000).astype(np.float64)
    lo, hi = np.zeros_like(t), np.full_like(t, 1e9)
    for x in (k * t, np.nextafter(k * t, -np.inf)):
        n = planner._fit(x, t, lo, hi)  # elementwise: one T per group here
        assert (n * t <= x).all() and ((n + 1) * t > x).all()
    assert not (np.floor(k * t / t) == k).all()  # the case the correction exists for
    assert (planner._fit(1.0, t, lo, hi) == np.floor(1.0 / t)).mean() > 0.99


def test_two_x_straggler_among_four() -> None:
    assert plan([1.0, 1.0, 2.0, 1.0], 16) == [5, 5, 2, 4]  # makespan 5 (uniform: 8)


def test_earliest_finish_among_equal_makespans() -> None:
    # [2, 2] is as short (3.0) but gives the slow group work the fast one has room for
    assert plan([1.0, 1.5], 4) == [3, 1]


def test_minimum_counts() -> None:
    assert plan([1.0, 1.0, 100.0], 6, min_count=0) == [3, 3, 0]  # the host can go
    assert plan([1.0, 1.0, 100.0], 6, min_count=1) == [3, 2, 1]
    assert plan([1.0, 1.0, 100.0], 6, min_count=[0, 0, 2]) == [2, 2, 2]
    assert plan([1.0, 5.0], 6, min_count=[0, 3]) == [3, 3]
    assert plan([1.0, 1.0], 0, min_count=0) == [0, 0]
    assert plan([2.0], 5) == [5]


def test_maximum_counts() -> None:
    assert plan([1.0, 3.0, 3.0], 9, max_count=4) == [4, 3, 2]
    assert plan([1.0, 3.0], 9, max_count=[4, 9]) == [4, 5]
    assert plan([1.0, 1.0], 6, max_count=[3, 3]) == [3, 3]


def test_equal_times_give_the_uniform_plan() -> None:
    for g, m in [(4, 16), (4, 10), (7, 23), (1000, 16_007), (3, 3)]:
        assert plan([0.3] * g, m) == uniform(m, g)
    assert uniform(10, 4) == [3, 3, 2, 2]
    assert uniform(0, 3) == [0, 0, 0]


def test_assignment_partitions_every_index_once() -> None:
    for counts in (plan([1.0, 2.5, 1.1, 0.9, 7.0], 37), uniform(37, 5), [0, 4, 0, 3, 0]):
        blocks = assignment(counts)
        assert [len(r) for r in blocks] == list(counts)
        assert [i for r in blocks for i in r] == list(range(sum(counts)))
    assert assignment([]) == []


def test_makespan() -> None:
    assert makespan([2, 3], [1.5, 1.0]) == 3.0
    assert makespan([0, 0], [1.0, 2.0]) == 0.0
    with pytest.raises(ValueError):
        makespan([1], [1.0, 2.0])


def test_deterministic() -> None:
    t = np.random.default_rng(3).uniform(0.5, 2.0, size=1000)
    first = plan(t, 20_000)
    assert all(plan(t.copy(), 20_000) == first for _ in range(3))
    assert plan(t.tolist(), 20_000) == first
    assert plan(tuple(t), 20_000) == first
    assert all(type(n) is int for n in first)


def test_permuting_groups_permutes_the_plan() -> None:
    rng = np.random.default_rng(5)
    t = rng.uniform(0.5, 4.0, size=300)  # distinct: no index tie-break involved
    perm = rng.permutation(300)
    c = plan(t, 5_000)
    assert plan(t[perm], 5_000) == [c[i] for i in perm]


def test_scale_invariant() -> None:
    t = [0.1, 0.3, 0.7, 1.3, 2.0]
    assert plan(t, 40) == plan([x * 1024.0 for x in t], 40) == plan([x / 8.0 for x in t], 40)


@pytest.mark.parametrize("args, kwargs, msg", [
    (([1.0, 0.0], 4), {}, "finite and > 0"),
    (([1.0, -2.0], 4), {}, "finite and > 0"),
    (([1.0, float("nan")], 4), {}, "finite and > 0"),
    (([float("inf"), 1.0], 4), {}, "finite and > 0"),
    (([1.0, 1.0], 1), {}, "minimum counts need 2"),
    (([1.0, 1.0], -1), {}, ">= 0"),
    (([1.0, 1.0], 2.5), {}, "integer"),
    (([], 4), {}, "non-empty"),
    (([[1.0], [2.0]], 4), {}, "1-D"),
    (([1.0, 1.0], 4), {"min_count": [1, 1, 1]}, "3 entries for 2 groups"),
    (([1.0, 1.0], 4), {"min_count": -1}, "min_count must be >= 0"),
    (([1.0, 1.0], 4), {"min_count": [1.5, 1]}, "integer"),
    (([1.0, 1.0], 4), {"max_count": 1}, "allow 2 micro-batches, need 4"),
    (([1.0, 1.0], 4), {"min_count": 2, "max_count": [3, 1]}, "group 1: max_count 1 < "),
])
def test_bad_input_is_one_line_value_error(args: tuple, kwargs: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg) as e:
        plan(*args, **kwargs)
    assert "\n" not in str(e.value)


def test_uniform_and_assignment_reject_nonsense() -> None:
    with pytest.raises(ValueError):
        uniform(4, 0)
    with pytest.raises(ValueError):
        assignment([1, -1])


def test_time_plan_ms_runs() -> None:
    ms = time_plan_ms(8, 64, reps=3)
    assert isinstance(ms, float) and ms >= 0.0  # a number for the benchmark, not a bound
