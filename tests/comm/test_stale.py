"""Missed parameter chunks: kept stale (default) or extrapolated along the owner's last update,
and always replaced by the owner's value when a broadcast lands."""

from __future__ import annotations

import numpy as np

from stalwart.comm.optim import MAX_EXTRAPOLATE, ShardedLossyOptimizer


def replica(stale: str, x0: np.ndarray) -> ShardedLossyOptimizer:
    # only the book-keeping of _refresh is exercised: no sockets needed
    opt = object.__new__(ShardedLossyOptimizer)
    opt.stale = stale
    opt.numel = x0.size
    opt.flat = x0.astype(np.float32).copy()
    opt.last_true = opt.flat.copy()
    opt.vel = np.zeros(x0.size, np.float32)
    opt.age = np.zeros(x0.size, np.int32)
    return opt


def run(stale: str, owner: list[np.ndarray], arrive: list[np.ndarray]) -> list[np.ndarray]:
    """Owner's values per step, which elements arrived per step -> the replica per step."""
    opt = replica(stale, owner[0])
    seen = []
    for x, m in zip(owner[1:], arrive, strict=True):
        opt.flat[m] = x[m]  # what the broadcast writes
        opt._refresh(m)
        seen.append(opt.flat.copy())
    return seen


def test_keep_freezes_missed_values_and_landing_repairs_them() -> None:
    owner = [np.full(3, float(t)) for t in range(6)]  # the owner adds 1 per step
    arrive = [np.array([True, True, True]), np.array([True, False, True]),
              np.array([True, False, True]), np.array([True, True, True]),
              np.array([True, True, True])]
    seen = run("keep", owner, arrive)
    assert seen[1][1] == 1.0 and seen[2][1] == 1.0  # stale copy kept
    assert seen[3][1] == 4.0  # repaired by the broadcast that landed
    assert max(np.abs(s - o).max() for s, o in zip(seen, owner[1:], strict=True)) == 2.0


def test_extrapolate_follows_a_steady_update_exactly_and_is_capped() -> None:
    steps = MAX_EXTRAPOLATE + 4
    owner = [np.full(2, 0.5 * t) for t in range(steps + 3)]
    arrive = [np.array([True, True])] * 2 + [np.array([True, False])] * steps
    seen = run("extrapolate", owner, arrive)
    for t in range(2, 2 + MAX_EXTRAPOLATE):
        assert abs(seen[t][1] - owner[t + 1][1]) < 1e-6  # exact for a constant update
    # after the cap the estimate stops moving: bounded even if the owner went silent
    assert seen[-1][1] == seen[1 + MAX_EXTRAPOLATE][1]
