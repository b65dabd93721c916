"""BOCD+V on synthetic iteration-time series."""

from __future__ import annotations

import numpy as np
import pytest

from stalwart.detect.bocpd import BOCPD
from stalwart.detect.changepoint import ChangeDetector


def series(n: int, noise: float, seed: int, shift_at: int | None = None, factor: float = 1.0,
           end_at: int | None = None, outliers: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = 0.1 * np.exp(rng.normal(0.0, noise, n))
    if shift_at is not None:
        x[shift_at:end_at] *= factor
    if outliers:
        idx = rng.choice(np.arange(12, n), outliers, replace=False)
        x[idx] *= 2.5
    return x


def run(x: np.ndarray) -> list:
    d = ChangeDetector()
    return [c for i, v in enumerate(x) if (c := d.add(i, float(v))) is not None]


@pytest.mark.parametrize("seed", range(5))
def test_detects_a_1_5x_shift_with_onset_and_within_five_iterations(seed: int) -> None:
    ch = run(series(100, 0.03, seed, shift_at=50, factor=1.5))
    assert len(ch) == 1
    c = ch[0]
    assert abs(c.onset - 50) <= 1
    assert c.decided - 50 <= 5
    assert 1.35 < c.ratio < 1.65


@pytest.mark.parametrize("seed", range(5))
def test_detects_onset_and_recovery(seed: int) -> None:
    ch = run(series(120, 0.04, seed, shift_at=40, factor=1.3, end_at=80))
    assert [c.ratio > 1 for c in ch] == [True, False]
    assert abs(ch[0].onset - 40) <= 2 and abs(ch[1].onset - 80) <= 2


@pytest.mark.parametrize("seed", range(10))
def test_no_detection_on_noise_with_outliers(seed: int) -> None:
    assert run(series(150, 0.08, seed, outliers=6)) == []


def test_small_shift_below_ten_percent_is_not_reported() -> None:
    assert run(series(120, 0.005, 0, shift_at=50, factor=1.06)) == []


def test_warmup_samples_are_ignored() -> None:
    x = series(80, 0.03, 1)
    x[:8] *= 3.0  # slow first steps (allocation, caches)
    assert run(x) == []


def test_posterior_is_bounded_and_normalised() -> None:
    b = BOCPD(0.0, 0.05, max_run=50)
    for v in np.random.default_rng(0).normal(0, 0.05, 200):
        post = b.update(float(v))
    assert len(post) == 50
    assert abs(post.sum() - 1.0) < 1e-9
    assert post[-1] > 0.5  # the long run keeps its mass at the cap


def test_a_brief_speed_up_does_not_hide_a_slowdown_right_after() -> None:
    x = series(90, 0.03, 2)
    x[40:46] *= 0.6  # a spurious speed-up (the machine got quieter for a moment)
    x[46:] *= 2.5  # then a real slowdown, within min_spacing of the speed-up's onset
    ch = run(x)
    assert any(c.ratio > 1.5 and abs(c.onset - 46) <= 1 for c in ch), ch


def textbook_bocpd(xs: np.ndarray, mu0: float, scale: float, hazard: float, max_run: int,
                   kappa0: float = 0.1, alpha0: float = 5.0) -> np.ndarray:
    """Adams & MacKay written out directly (Normal-Gamma, Student-t predictive, cap folded)."""
    from math import lgamma, log, pi

    b0 = scale * scale * (alpha0 - 1.0)
    params: list[tuple[float, float, float, float]] = []  # (mu, kappa, alpha, beta) per run
    post = np.empty(0)

    def logpdf(x: float, mu: float, k: float, a: float, b: float) -> float:
        nu, var = 2 * a, b * (k + 1) / (a * k)
        return (lgamma((nu + 1) / 2) - lgamma(nu / 2) - 0.5 * log(nu * pi * var)
                - (nu + 1) / 2 * np.log1p((x - mu) ** 2 / (nu * var)))

    for x in xs:
        prior = (mu0, kappa0, alpha0, b0)
        grow = [p * (1 - hazard) * np.exp(logpdf(x, *q)) for p, q in
                zip(post, params, strict=True)]
        new = np.array([hazard * np.exp(logpdf(x, *prior))] + grow)
        new /= new.sum()
        params = [((k * mu + x) / (k + 1), k + 1, a + 0.5, b + k * (x - mu) ** 2 / (2 * (k + 1)))
                  for mu, k, a, b in [prior, *params]]
        if len(new) > max_run:
            new[max_run - 1] += new[max_run:].sum()
            new, params = new[:max_run], params[:max_run]
        post = new
    return post


def test_posterior_matches_the_textbook_recursion() -> None:
    rng = np.random.default_rng(3)
    xs = np.concatenate([rng.normal(0.0, 0.05, 60), rng.normal(0.2, 0.05, 10)])
    b = BOCPD(0.0, 0.05, hazard=1 / 50, max_run=40)
    for x in xs:
        post = b.update(float(x))
    ref = textbook_bocpd(xs, 0.0, 0.05, 1 / 50, 40)
    assert np.allclose(post, ref, rtol=1e-9, atol=1e-12)


def test_detectors_sharing_a_bank_find_what_they_find_alone() -> None:
    from stalwart.detect.bocpd import BOCPDBank

    xs = [series(160, 0.05, s, shift_at=60 + 10 * s, factor=1.3 + 0.2 * s,
                 end_at=120 if s == 1 else None) for s in range(4)]
    xs[2][30] = np.nan  # a missing sample: that detector alone skips it
    alone = [run(x) for x in xs]
    bank = BOCPDBank()
    dets = [ChangeDetector(bank=bank) for _ in xs]
    together: list[list] = [[] for _ in xs]
    for i in range(160):
        for j, c in enumerate(ChangeDetector.add_many(dets, i, [float(x[i]) for x in xs])):
            if c is not None:
                together[j].append(c)
    assert together == alone
    assert [len(c) for c in alone] == [1, 2, 1, 1]


def test_a_bank_update_matches_single_updates_past_the_cap() -> None:
    from stalwart.detect.bocpd import BOCPDBank, update_rows

    rng = np.random.default_rng(4)
    bank = BOCPDBank(max_run=20)
    together = [BOCPD(0.0, 0.05, max_run=20, bank=bank) for _ in range(3)]
    alone = [BOCPD(0.0, 0.05, max_run=20) for _ in range(3)]
    for _ in range(60):
        xs = [float(v) for v in rng.normal(0.0, 0.05, 3)]
        posts = update_rows(together, xs)
        for m, x, p in zip(alone, xs, posts, strict=True):
            assert np.allclose(m.update(x), p, rtol=1e-12, atol=1e-15)
    assert all(len(p) == 20 for p in posts)


def test_absolute_deviation_from_the_median_by_halves() -> None:
    from stalwart.detect.robust import _abs_dev

    rng = np.random.default_rng(5)
    for n in range(1, 40):
        x = rng.normal(0.0, 1.0, n)
        assert _abs_dev(x) == pytest.approx(float(np.abs(x - np.median(x)).sum()), rel=1e-12)


def test_rise_onset_finds_where_a_series_rose_not_an_earlier_blip() -> None:
    from stalwart.detect.robust import rise_onset

    rng = np.random.default_rng(3)
    keys = np.arange(60)
    xs = rng.normal(0.0, 0.05, 60)
    xs[23:25] += 0.5  # a two-step blip before the change
    xs[30:] += 0.25  # the change
    perm = rng.permutation(60)  # stored in a ring: any order
    assert rise_onset(keys[perm], xs[perm], 19, 40) == 30
    # nothing rose: no onset
    flat = rng.normal(0.0, 0.05, 60)
    assert rise_onset(keys, -np.abs(flat) - np.linspace(0, 1, 60), 19, 40) is None


def _changes(x: np.ndarray, gate: bool) -> tuple[list, int]:
    d = ChangeDetector(gate=gate)
    out = [c for i, v in enumerate(x) if (c := d.add(i, float(v))) is not None]
    return out, d.slept


@pytest.mark.parametrize("seed", range(8))
def test_the_sleeping_model_finds_what_the_always_updated_one_finds(seed: int) -> None:
    # shifts of 1.15-1.6x and back, at noise levels where the model must sleep and wake
    rng = np.random.default_rng(100 + seed)
    factor, noise = float(rng.uniform(1.15, 1.6)), float(rng.uniform(0.01, 0.05))
    x = series(300, noise, seed, shift_at=120 + seed, factor=factor, end_at=220)
    gated, slept = _changes(x, gate=True)
    always, never = _changes(x, gate=False)
    assert [(c.ratio > 1, c.onset) for c in gated] == [(c.ratio > 1, c.onset) for c in always]
    assert [c.decided for c in gated] == [c.decided for c in always]
    assert len(always) == 2
    # asleep on the flat stretches: most samples cost no model update
    assert never == 0 and slept > 0.5 * len(x)


def test_a_sleeping_model_wakes_for_a_shift_after_a_long_quiet_run() -> None:
    x = series(500, 0.02, 3, shift_at=450, factor=1.25)
    d = ChangeDetector()
    found = [c for i, v in enumerate(x) if (c := d.add(i, float(v))) is not None]
    assert len(found) == 1 and abs(found[0].onset - 450) <= 1
    assert d.slept > 300  # it slept through most of the 450 quiet samples


def test_changes_are_the_same_with_the_numpy_best_split(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The verification's split in C (``robust.best_split``) gives the changes the numpy
    reference gives, on noisy series with shifts, spikes and ties."""
    from stalwart.detect import robust

    def run() -> list[tuple[int, int, float, float]]:
        out = []
        for seed in range(12):
            rng = np.random.default_rng(seed)
            t = 0.1 * np.exp(rng.normal(0.0, 0.05 + 0.02 * (seed % 3), 400))
            t[150:] *= 1.0 + 0.1 * (seed % 5)
            t[300:] /= 1.3
            t[rng.integers(0, 400, 6)] *= 3.0
            if seed % 4 == 0:
                t = np.round(t, 3)
            det = ChangeDetector()
            for k, x in enumerate(t.tolist()):
                ch = det.add(k, x)
                if ch is not None:
                    out.append((ch.onset, ch.decided, ch.before, ch.after))
        return out

    native = run()
    monkeypatch.setattr(robust, "_best_split", None)
    assert run() == native and native
