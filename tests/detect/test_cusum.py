"""CUSUM on per-rank relative compute: finds small lasting shifts, ignores noise and spikes."""

from __future__ import annotations

import numpy as np
import pytest

from stalwart.detect.cusum import CusumBank

SD = 0.17  # step-to-step noise of a rank's relative compute measured on the testbed


def feed(bank: CusumBank, xs: np.ndarray) -> list[tuple[int, int, object]]:
    alarms = []
    for key, row in enumerate(xs):
        for r, ch in enumerate(bank.add(key, row)):
            if ch is not None:
                alarms.append((key, r, ch))
    return alarms


def test_a_16_percent_shift_on_one_rank_is_found_with_its_onset() -> None:
    rng = np.random.default_rng(1)
    xs = np.exp(rng.normal(0.0, SD, (150, 4)))
    xs[60:, 2] *= 1.16  # what a 1.3x throttle looked like in the relative compute channel
    alarms = feed(CusumBank(4), xs)
    assert [(r) for _, r, _ in alarms] == [2]
    key, _, ch = alarms[0]
    assert 60 < key <= 100
    assert abs(ch.onset - 60) <= 15  # the CUSUM onset estimate near the noise level (cusum.py)
    assert ch.after / ch.before > 1.08


def test_noise_and_isolated_spikes_raise_no_alarm() -> None:
    rng = np.random.default_rng(2)
    xs = np.exp(rng.normal(0.0, SD, (1500, 4)))
    xs[::15, 1] *= 3.0  # an eval step or a GC pause now and then on one rank
    assert feed(CusumBank(4), xs) == []


def test_a_shift_raises_one_alarm_not_one_per_step() -> None:
    rng = np.random.default_rng(3)
    xs = np.exp(rng.normal(0.0, SD, (300, 4)))
    xs[50:, 0] *= 1.5
    assert [r for _, r, _ in feed(CusumBank(4), xs)] == [0]


def test_unconfirmed_alarms_need_more_evidence_next_time() -> None:
    bank = CusumBank(2)
    bank.unconfirmed(1)
    bank.unconfirmed(1)
    bank.unconfirmed(1)
    assert list(bank.backoff) == [1.0, bank.MAX_BACKOFF]
    bank.confirmed(1)
    assert list(bank.backoff) == [1.0, 1.0]


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="shift=0"):
        CusumBank(4, shift=0)
