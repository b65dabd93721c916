"""Plan search on synthetic profiles (known optima, exhaustive check) and plan JSON round-trip."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from stalwart.overlap.plan import (
    Plan,
    Profile,
    load_plan,
    make_plan,
    plan_time,
    save_plan,
    search,
)


def _all_plans(m: int, n: int) -> list[list[str]]:
    """Every monotone path through the (m+1) x (n+1) grid, as step lists."""
    out = []

    def walk(i: int, j: int, acc: list[str]) -> None:
        if (i, j) == (m, n):
            out.append(list(acc))
            return
        for step, di, dj in (("F", 1, 0), ("B", 0, 1), ("FB", 1, 1)):
            if i + di <= m and j + dj <= n:
                acc.append(step)
                walk(i + di, j + dj, acc)
                acc.pop()

    walk(0, 0, [])
    return out


def test_cheap_pairs_give_the_diagonal() -> None:
    # pairing hides everything: pair = max(f, b), so the optimum pairs as much as possible
    f, b = [1.0, 2.0, 1.0], [2.0, 1.0, 2.0]
    prof = Profile(f, b, [[max(x, y) for y in b] for x in f])
    steps, t = search(prof)
    assert steps == ["FB", "FB", "FB"]
    assert t == pytest.approx(2.0 + 2.0 + 2.0)


def test_expensive_pairs_give_the_sequential_plan() -> None:
    f, b = [1.0, 1.0], [1.0, 1.0, 1.0]
    prof = Profile(f, b, [[3.0] * 3 for _ in f])
    steps, t = search(prof)
    assert sorted(steps) == ["B", "B", "B", "F", "F"]
    assert t == pytest.approx(5.0)


def test_known_mixed_optimum() -> None:
    # only (f1, b0) and (f2, b2) overlap well; the best path must use exactly those two pairs
    f, b = [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]
    pair = [[2.0] * 3 for _ in f]
    pair[1][0] = 1.0
    pair[2][2] = 1.0
    steps, t = search(Profile(f, b, pair))
    assert steps == ["F", "FB", "B", "FB"]
    assert t == pytest.approx(4.0)


@pytest.mark.parametrize("seed", range(20))
def test_search_is_optimal_against_exhaustive_enumeration(seed: int) -> None:
    rng = random.Random(seed)
    m, n = rng.randint(1, 4), rng.randint(1, 4)
    f = [rng.uniform(0.1, 2) for _ in range(m)]
    b = [rng.uniform(0.1, 2) for _ in range(n)]
    pair = [[rng.uniform(max(x, y) * 0.9, x + y) for y in b] for x in f]
    prof = Profile(f, b, pair)
    steps, t = search(prof)
    assert plan_time(steps, prof) == pytest.approx(t)
    best = min(plan_time(p, prof) for p in _all_plans(m, n))
    assert t == pytest.approx(best)


def test_plan_time_rejects_incomplete_plans() -> None:
    prof = Profile([1.0], [1.0], [[1.0]])
    with pytest.raises(ValueError):
        plan_time(["F"], prof)


def test_bad_profile_shape_is_rejected() -> None:
    with pytest.raises(ValueError):
        search(Profile([1.0, 1.0], [1.0], [[1.0]]))


def test_plan_json_round_trip_and_signature_check(tmp_path: Path) -> None:
    sig = {"micro_batch": [[2, 16], [2, 16]], "tp": 2, "world": 2, "segments": [5, 5]}
    f = [1.0, 2.0]
    prof = Profile(f, [1.0, 1.5], [[1.2, 2.0], [2.1, 1.9]])
    plan = make_plan(sig, prof)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    back = load_plan(path, sig)
    assert back is not None
    assert back.steps == plan.steps and back.predicted_time == plan.predicted_time
    assert back.key == plan.key
    assert json.loads(path.read_text())["key"] == plan.key
    # a changed shape or world is a different signature: not reused
    assert load_plan(path, {**sig, "tp": 4}) is None
    assert load_plan(path, {**sig, "micro_batch": [[4, 16], [4, 16]]}) is None
    # missing or corrupt files are "no plan", not an error
    assert load_plan(tmp_path / "absent.json", sig) is None
    path.write_text("{not json")
    assert load_plan(path, sig) is None


def test_plan_from_json_rejects_unknown_steps() -> None:
    plan = Plan({"a": 1}, ["F", "XB"], 1.0, 1.0)
    with pytest.raises(ValueError):
        Plan.from_json(plan.to_json())


def test_enumeration_helper_counts_delannoy_paths() -> None:
    # sanity of the exhaustive oracle: Delannoy numbers D(2,2)=13, D(3,2)=25
    assert len(_all_plans(2, 2)) == 13
    assert len(_all_plans(3, 2)) == 25
    assert len(set(map(tuple, _all_plans(2, 2)))) == 13


def test_memory_budget_keeps_the_forward_strand_from_running_ahead() -> None:
    # (f1, b0) overlaps best, but reaching it means f0 ran before any backward segment freed
    # anything: live = 2 + 1 - 0 = 3 units > budget 2 (no extra memory allowed)
    pair = [[1.5, 2.0], [0.5, 1.5]]
    prof = Profile([1.0, 1.0], [1.0, 1.0], pair, fwd_bytes=[1.0, 1.0], bwd_bytes=[1.0, 1.0])
    assert search(prof) == (["F", "FB", "B"], pytest.approx(2.5))
    steps, t = search(prof, max_extra_memory=0.0)
    assert steps == ["FB", "FB"] and t == pytest.approx(3.0)
    # 50% headroom admits the faster plan again
    assert search(prof, max_extra_memory=0.5)[0] == ["F", "FB", "B"]


@pytest.mark.parametrize("seed", range(10))
def test_memory_constrained_search_is_optimal_and_feasible(seed: int) -> None:
    rng = random.Random(100 + seed)
    m, n = rng.randint(1, 4), rng.randint(1, 4)
    f = [rng.uniform(0.1, 2) for _ in range(m)]
    b = [rng.uniform(0.1, 2) for _ in range(n)]
    pair = [[rng.uniform(max(x, y) * 0.9, x + y) for y in b] for x in f]
    fb = [rng.uniform(1, 3) for _ in range(m)]
    total = sum(fb)
    bb = [total / n] * n  # the same micro-batch shape: frees what it saved
    prof = Profile(f, b, pair, fwd_bytes=fb, bwd_bytes=bb)
    live = prof.live_bytes()
    extra = rng.choice([0.0, 0.1, 0.3])

    def feasible(p: list[str]) -> bool:
        i = j = 0
        for s in p:
            i += "F" in s
            j += "B" in s
            if live(i, j) > (1 + extra) * total * (1 + 1e-9):
                return False
        return True

    steps, t = search(prof, max_extra_memory=extra)
    assert feasible(steps)
    best = min(plan_time(p, prof) for p in _all_plans(m, n) if feasible(p))
    assert t == pytest.approx(best)
