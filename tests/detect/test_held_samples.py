"""A hinted step whose check has nothing due only records its times (monitor.py): the samples
held go through the decision state machine at the next check with work, in order -- the same
findings, counters and samples as a monitor that analyses every step."""

from __future__ import annotations

import numpy as np

from stalwart.detect import Monitor
from stalwart.detect.monitor import amortised


def _times(seed: int, n: int = 160) -> np.ndarray:
    t = 0.1 * np.exp(np.random.default_rng(seed).normal(0.0, 0.03, n))
    t[70:] *= 1.6  # a lasting job-wide slowdown ("unknown": no validation here)
    t[40:43] *= 3.0  # and a hiccup before it
    return t


def _run(mon: Monitor, times: np.ndarray, held: list[int]) -> None:
    for step, t in enumerate(times.tolist()):
        mon.step(step, {"step_time": t, "compute_time": 0.8 * t, "comm_time": 0.2 * t})
        held.append(mon._n_held)


def test_held_samples_decide_as_one_step_at_a_time() -> None:
    for seed in range(3):
        times = _times(seed)
        batched = Monitor(rank=0, world=1, check_every=8)
        ref = Monitor(rank=0, world=1, check_every=8)
        ref._due = lambda c: True  # type: ignore[method-assign]  # every step analysed
        ref._set_due = lambda: None  # type: ignore[method-assign]  # (no step only records)
        ref._due_at = 0
        held_b: list[int] = []
        held_r: list[int] = []
        _run(batched, times, held_b)
        _run(ref, times, held_r)
        assert max(held_b) == 7 and max(held_r) == 0  # it did hold them (7 of every 8)
        assert batched.report() == ref.report() and ref.report()  # the same findings
        assert {f.kind for f in ref.core.findings} == {"unknown"}
        assert (batched.hiccups, batched.core.verdicts, batched._checks) == (
            ref.hiccups, ref.core.verdicts, ref._checks)
        assert list(batched.samples) == list(ref.samples)  # (reading them flushes)
        batched.close()
        ref.close()


def test_close_hands_held_samples_to_on_sample() -> None:
    seen: list[int] = []
    mon = Monitor(rank=0, world=1, check_every=8, on_sample=lambda s: seen.append(s.key))
    for step in range(13):
        mon.step(step, {"step_time": 0.1, "compute_time": 0.08, "comm_time": 0.02})
    assert seen == list(range(8))  # steps 8-12 held: their check has nothing due
    mon.close()
    assert seen == list(range(13))


def test_amortised_is_each_windows_mean() -> None:
    assert amortised([]) == []
    assert amortised([1.0, 3.0]) == [2.0]
    xs = [1.0] * 15 + [17.0] + [1.0] * 16 + [5.0]  # one heavy step per window, a leftover
    assert amortised(xs) == [2.0, 1.0]
