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
    """Every interleaving of m forward and n backward segments (a pair is "B" then "F")."""
    out = []

    def walk(i: int, j: int, acc: list[str]) -> None:
        if (i, j) == (m, n):
            out.append(list(acc))
            return
        for step, di, dj in (("F", 1, 0), ("B", 0, 1)):
            if i + di <= m and j + dj <= n:
                acc.append(step)
                walk(i + di, j + dj, acc)
                acc.pop()

    walk(0, 0, [])
    return out


def _expand(steps: list[str]) -> list[str]:
    return [x for s in steps for x in (["B", "F"] if s == "FB" else [s])]


def _random_profile(rng: random.Random, m: int, n: int, **kw) -> Profile:
    f = [rng.uniform(0.5, 2) for _ in range(m)]
    b = [rng.uniform(0.5, 2) for _ in range(n)]
    fa = [[rng.uniform(0.3, 1.2) * f[i] for _ in range(n + 1)] for i in range(m)]
    ba = [[rng.uniform(0.3, 1.2) * b[j] for j in range(n)] for _ in range(m + 1)]
    return Profile(f, b, fa, ba, **kw)


def test_cheap_overlap_gives_full_alternation() -> None:
    # after the other strand a segment costs half: every step should alternate strands
    prof = Profile.uniform([1.0] * 3, [1.0] * 3, fwd_after_b=0.5, bwd_after_f=0.5)
    steps, t = search(prof)
    seq = _expand(steps)
    assert all(a != b for a, b in zip(seq, seq[1:], strict=False))
    assert t == pytest.approx(1.0 + 5 * 0.5)
    assert steps.count("FB") >= 2  # expressed as DHelix pairs


def test_no_overlap_gives_the_sequential_time() -> None:
    prof = Profile.uniform([1.0, 2.0], [1.0, 1.0, 3.0])  # after-the-other == alone
    steps, t = search(prof)
    assert t == pytest.approx(prof.sequential_time())
    # overlap that costs more than it hides is avoided: runs of one strand only
    worse = Profile.uniform([1.0, 1.0], [1.0, 1.0], fwd_after_b=3.0, bwd_after_f=3.0)
    steps, t = search(worse)
    seq = _expand(steps)
    assert t == pytest.approx(3 * 1.0 + 3.0)  # one switch (costing 3) is unavoidable
    assert sum(a != b for a, b in zip(seq, seq[1:], strict=False)) == 1


def test_known_mixed_optimum() -> None:
    # overlap helps only for f1 right after b0 and b2 right after f1; best: F B F B B ...
    f, b = [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]
    prof = Profile.uniform(f, b)
    prof.fwd_after_b[1][1] = 0.1  # f1 right after b0
    prof.bwd_after_f[2][1] = 0.1  # b1 right after f1
    steps, t = search(prof)
    assert _expand(steps)[:4] == ["F", "B", "F", "B"]
    assert t == pytest.approx(6.0 - 0.9 - 0.9)


@pytest.mark.parametrize("seed", range(20))
def test_search_is_optimal_against_exhaustive_enumeration(seed: int) -> None:
    rng = random.Random(seed)
    m, n = rng.randint(1, 4), rng.randint(1, 4)
    prof = _random_profile(rng, m, n)
    steps, t = search(prof)
    assert plan_time(steps, prof) == pytest.approx(t)
    best = min(plan_time(p, prof) for p in _all_plans(m, n))
    assert t == pytest.approx(best)


def test_plan_time_rejects_incomplete_plans() -> None:
    prof = Profile.uniform([1.0], [1.0])
    with pytest.raises(ValueError):
        plan_time(["F"], prof)
    with pytest.raises(ValueError):
        plan_time(["F", "F", "B"], prof)


def test_bad_profile_shape_is_rejected() -> None:
    with pytest.raises(ValueError):
        search(Profile([1.0, 1.0], [1.0], [[1.0, 1.0]], [[1.0], [1.0], [1.0]]))


def test_memory_budget_keeps_the_forward_strand_from_running_ahead() -> None:
    # f1 right after b0 is very cheap, but f0 must run before b0 to get there: live activations
    # reach 2 + 1 = 3 units > the budget of 2 (no extra memory allowed)
    prof = Profile.uniform([1.0, 1.0], [1.0, 1.0], fwd_after_b=0.8, bwd_after_f=0.8,
                           fwd_bytes=[1.0, 1.0], bwd_bytes=[1.0, 1.0])
    prof.fwd_after_b[1][1] = 0.1
    free_steps, free_t = search(prof)
    assert _expand(free_steps)[:3] == ["F", "B", "F"]
    steps, t = search(prof, max_extra_memory=0.0)
    live = prof.live_bytes()
    i = j = 0
    for s in _expand(steps):
        i, j = i + (s == "F"), j + (s == "B")
        assert live(i, j) <= 2.0
    assert _expand(steps)[0] == "B" and t > free_t
    # 50% headroom admits the faster plan again
    assert search(prof, max_extra_memory=0.5)[1] == pytest.approx(free_t)


@pytest.mark.parametrize("seed", range(10))
def test_memory_constrained_search_is_optimal_and_feasible(seed: int) -> None:
    rng = random.Random(100 + seed)
    m, n = rng.randint(1, 4), rng.randint(1, 4)
    fb = [rng.uniform(1, 3) for _ in range(m)]
    total = sum(fb)
    prof = _random_profile(rng, m, n, fwd_bytes=fb, bwd_bytes=[total / n] * n)
    live = prof.live_bytes()
    extra = rng.choice([0.0, 0.1, 0.3])

    def feasible(p: list[str]) -> bool:
        i = j = 0
        for s in _expand(p):
            i, j = i + (s == "F"), j + (s == "B")
            if live(i, j) > (1 + extra) * total * (1 + 1e-9):
                return False
        return True

    steps, t = search(prof, max_extra_memory=extra)
    assert feasible(steps)
    best = min(plan_time(p, prof) for p in _all_plans(m, n) if feasible(p))
    assert t == pytest.approx(best)


def test_plan_json_round_trip_and_signature_check(tmp_path: Path) -> None:
    sig = {"micro_batch": [[2, 16], [2, 16]], "tp": 2, "world": 2, "segments": [2, 2]}
    prof = _random_profile(random.Random(5), 2, 2)
    plan = make_plan(sig, prof)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    back = load_plan(path, sig)
    assert back is not None
    assert back.steps == plan.steps and back.predicted_time == plan.predicted_time
    assert back.key == plan.key
    assert json.loads(path.read_text())["key"] == plan.key
    assert Profile(**back.profile) == prof  # the profile it came from travels with it
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


def test_enumeration_helper_counts_interleavings() -> None:
    # sanity of the exhaustive oracle: C(4, 2) = 6, C(5, 2) = 10 interleavings
    assert len(_all_plans(2, 2)) == 6
    assert len(_all_plans(3, 2)) == 10
