"""The outlier rule (a rank slower than its peers all along) and the audit, on seeded
synthetic noise: no timing, no processes."""

from __future__ import annotations

import math
from itertools import combinations

import numpy as np
import pytest

from stalwart.detect.alarms import AUDIT, NONE, OUTLIER, IterSample
from stalwart.detect.decision import AUDIT_AFTER, AUDIT_MIN, DecisionCore
from stalwart.detect.localize import Finding
from stalwart.detect.outlier import (
    MIN_SHIFT,
    MIN_WINDOW,
    STRIDE,
    OutlierBank,
    _critical_comb,
    alpha_per_test,
    binom_tail,
    critical,
    peer_medians,
)


def test_the_binomial_tail_and_critical_count_are_exact() -> None:
    for n in (1, 5, 12):
        for k in range(n + 2):
            brute = sum(1 for bits in range(2 ** n) if bin(bits).count("1") >= k) / 2 ** n
            assert binom_tail(n, k) == pytest.approx(brute)
    for n in (40, 100, 200):
        for log2a in (-7, -20, -25):
            k = critical(n, log2a)
            assert binom_tail(n, k) <= 2.0 ** log2a < binom_tail(n, k - 1)


def test_the_critical_count_equals_its_term_by_term_reference() -> None:
    """``critical`` (each tail term from the one before) against ``_critical_comb`` (each
    by ``math.comb``): the same count for every window length a bank can hold and every
    level from 2**-60 up, including the edges (no k, every k)."""
    for n in range(0, 260):
        for log2a in range(-60, 1):
            assert critical.__wrapped__(n, log2a) == _critical_comb(n, log2a), (n, log2a)


def test_peer_medians_leave_each_rank_out() -> None:
    rng = np.random.default_rng(0)
    for n in range(2, 10):
        c = rng.lognormal(0.0, 0.5, n)
        c[rng.integers(n)] = c[0]  # ties too
        want = [float(np.median(np.delete(c, r))) for r in range(n)]
        assert peer_medians(c) == pytest.approx(want)


def born_job(n: int, slow: int, factor: float, steps: int, rng: np.random.Generator,
             sigma: float = 0.35) -> np.ndarray:
    """(steps, n) compute seconds: log-normal noise of ``sigma`` (this testbed's per-step
    relative compute swings by ~0.3-0.4 in log), one rank ``factor`` x slow from step 0."""
    c = 0.01 * rng.lognormal(0.0, sigma, (steps, n))
    if slow >= 0:
        c[:, slow] *= factor
    return c


def run_core(c: np.ndarray, step_s: float = 0.04) -> DecisionCore:
    """Rank 0's decision core fed a job's samples, one row per step (as replay does), up to
    the first outlier alarm (the change-point channels' alarms on this synthetic noise are
    let go: theirs is another test)."""
    core = DecisionCore(True, audit=False)
    for k, row in enumerate(c):
        core.sample(IterSample(k, step_s, float(row[0]), step_s - float(row[0])))
        core.relative(k, row.tolist())
        if core.pending.action == OUTLIER:
            break
        core.pending = core.pending._replace(action=NONE)
    return core


def test_a_rank_2x_slow_from_its_first_step_is_flagged_since_the_first_sample() -> None:
    for seed in range(10):
        rng = np.random.default_rng(seed)
        core = run_core(born_job(4, 2, 2.0, 300, rng), step_s=0.04)
        a = core.pending
        assert a.action == OUTLIER and a.suspect == 2, (seed, a)
        assert a.onset == 0  # the monitor's first sample: its whole history is in question
        assert a.severity > 1.0  # priced from the peers
        assert core.samples[-1].key <= 10 + 100  # within ~100 samples of the warm-up


def test_clean_noise_at_the_nulls_boundary_alarms_at_the_stated_rate() -> None:
    """The rank's median relative compute exactly at 1 + MIN_SHIFT (the worst case the
    null allows): the alarms per test stay at most the per-test level, and within an order
    of magnitude of it (the binomial's discreteness and overlapping windows take some)."""
    rng = np.random.default_rng(7)
    n, steps = 4, 60_000
    step_s = 2.0 ** -7 * 3600.0 / (1e-3 * STRIDE)  # a per-test level of 2^-7 at 1e-3 / h
    log2a = alpha_per_test(1e-3, STRIDE, step_s)
    assert log2a == -7
    bank = OutlierBank(n, warmup=0)
    alarms = tests = 0
    peers = np.ones(n - 1)
    for k in range(steps):
        x0 = (1.0 + MIN_SHIFT) * math.exp(rng.normal(0.0, 0.3))
        out = bank.add(k, np.concatenate([[x0], peers]), step_s)
        if (k + 1) % STRIDE == 0 and bank.filled[0] >= MIN_WINDOW:
            tests += 1
        alarms += sum(o.rank == 0 for o in out)
    rate = alarms / tests
    assert 2.0 ** log2a / 10 <= rate <= 2.0 ** log2a * 1.2, (alarms, tests, rate)


def test_healthy_ranks_in_noise_raise_no_alarm_at_the_default_rate() -> None:
    # 4 healthy ranks, 20,000 steps each (2 rank-hours... at 0.09 s a step): the stated rate
    # is 1e-3 per rank-hour, so any alarm here would be far above it
    rng = np.random.default_rng(11)
    bank = OutlierBank(4)
    c = born_job(4, -1, 1.0, 20_000, rng, sigma=0.4)
    assert not any(bank.add(k, row, 0.09) for k, row in enumerate(c))


def test_an_unconfirmed_rank_is_not_paused_for_again_at_that_level() -> None:
    # rank 0 reads 1.5x its peers all along (it does the monitor's work) but its compute
    # test is healthy: one alarm, then its line rises to that level
    rng = np.random.default_rng(5)
    c = born_job(4, 0, 1.5, 3000, rng, sigma=0.2)
    bank = OutlierBank(4)
    first = None
    for k, row in enumerate(c):
        out = bank.add(k, row, 0.04)
        if out:
            assert first is None, out
            first = out[0]
            bank.unconfirmed(first.rank)
    assert first is not None and first.rank == 0
    assert bank.line[0] > 1.5


def test_the_audit_runs_once_after_the_warm_up_from_the_first_sample() -> None:
    rng = np.random.default_rng(1)
    c = born_job(4, -1, 1.0, 120, rng)
    core = DecisionCore(True)
    audits = []
    for k, row in enumerate(c, start=3):  # the monitor's first sample need not be step 0
        core.sample(IterSample(k, 0.04, float(row[0]), 0.03))
        core.relative(k, row.tolist())
        a = core.take_pending()
        if a.action == AUDIT:
            audits.append((k, a))
            core.alarm_read()
            # a clean audit: nothing reported, nothing counted as a hiccup
            core.apply_verdict(Finding("unknown", a.onset, k, 1.0), None, action=AUDIT)
    assert len(audits) == 1
    k, a = audits[0]
    assert a.onset == 3 and a.suspect == -1 and k == 3 + 10 + AUDIT_AFTER - 1
    assert core.findings == [] and core.hiccups == 0 and core.audit["kind"] == "unknown"


def test_a_job_of_slow_steps_is_audited_after_seconds_not_samples() -> None:
    core = DecisionCore(True)
    seen = []
    for k in range(40):
        core.sample(IterSample(k, 0.5, 0.1, 0.4))  # 0.5 s steps (a slow link from step 0)
        core.relative(k, [0.1, 0.1, 0.1])
        if core.take_pending().action == AUDIT:
            seen.append(k)
            core.alarm_read()
            core.apply_verdict(Finding("unknown", 0, k, 1.0), None, action=AUDIT)
    # 2 s of iterations after the 10-sample warm-up: 4 samples, but never fewer than AUDIT_MIN
    assert seen == [10 + AUDIT_MIN - 1]


def test_a_link_the_audit_finds_is_logged_as_never_healthy_and_followed() -> None:
    events: list = []
    core = DecisionCore(True, emit=events.append)
    rng = np.random.default_rng(2)
    for k, row in enumerate(born_job(4, -1, 1.0, 60, rng)):
        core.sample(IterSample(k, 0.2, float(row[0]), 0.19))
        core.relative(k, row.tolist())
        a = core.take_pending()
        if a.action == AUDIT:
            core.alarm_read()
            f = Finding("link", a.onset, k, 4.0, ranks=[1], link=[0, 1],
                        evidence={"detected_by": "audit", "never_healthy": True})
            core.apply_verdict(f, None, action=AUDIT)
    (ev,) = events
    assert ev.kind == "link" and ev.onset_step == 0 and ev.evidence["never_healthy"]
    assert core.active is not None and core.follow.healthy == pytest.approx(0.2 / 4.0)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_other_world_sizes(n: int) -> None:
    rng = np.random.default_rng(n)
    core = run_core(born_job(n, n - 1, 2.0, 400, rng))
    assert core.pending.action == OUTLIER and core.pending.suspect == n - 1


def test_peer_medians_match_for_all_small_subsets() -> None:
    vals = [0.3, 0.1, 0.7, 0.2, 0.9]
    for n in range(2, 6):
        for sub in combinations(vals, n):
            c = np.asarray(sub)
            assert peer_medians(c) == pytest.approx(
                [float(np.median(np.delete(c, r))) for r in range(n)])
