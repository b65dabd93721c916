"""BOCPD's run-length cap (bocpd.MAX_RUN): the same changes as the 300-run posterior it
replaced, on series long enough for the cap to bind (bocpd.py states the noise model)."""

from __future__ import annotations

import numpy as np
import pytest

from stalwart.detect.bocpd import MAX_RUN, BOCPDBank
from stalwart.detect.changepoint import Change, ChangeDetector


def _series(seed: int) -> tuple[np.ndarray, int]:
    """Log-normal steps (noise 1-9%, the corpus' range) with a 1.12-1.6x shift that starts
    after a stable stretch longer than the cap and ends later, as a straggler does."""
    rng = np.random.default_rng(500 + seed)
    noise, factor = float(rng.uniform(0.01, 0.09)), float(rng.uniform(1.12, 1.6))
    start = int(rng.integers(2 * MAX_RUN, 3 * MAX_RUN))
    x = 0.1 * np.exp(rng.normal(0.0, noise, start + 2 * MAX_RUN))
    x[start:start + MAX_RUN] *= factor
    return x, start


def _changes(x: np.ndarray, max_run: int, gate: bool) -> list[Change]:
    d = ChangeDetector(gate=gate, bank=BOCPDBank(hazard=1 / 200, max_run=max_run))
    return [c for i, v in enumerate(x) if (c := d.add(i, float(v))) is not None]


@pytest.mark.parametrize("gate", [False, True])
def test_the_capped_posterior_finds_what_the_300_run_one_finds(gate: bool) -> None:
    # every change found at the same onset, in the same direction; when it is decided may move
    # by a few samples on a marginal shift (2-3 noise scales), either way, on few series, and
    # by no more than 0.1 sample per change on average (a cap that delayed decisions would)
    seeds, moved, delay, changes = range(40), 0, 0, 0
    for seed in seeds:
        x, _ = _series(seed)
        capped, full = _changes(x, MAX_RUN, gate), _changes(x, 300, gate)
        assert [(c.onset, c.ratio > 1) for c in capped] == [
            (c.onset, c.ratio > 1) for c in full], seed
        d = [a.decided - b.decided for a, b in zip(capped, full, strict=True)]
        moved += any(d)
        delay += sum(d)
        changes += len(full)
    assert changes >= 2 * len(seeds)
    assert moved <= 0.1 * len(seeds) and abs(delay) <= 0.1 * changes


def test_the_cap_binds_on_these_series() -> None:
    # (the comparison above is not vacuous: the always-updated model reaches the cap)
    x, start = _series(0)
    d = ChangeDetector(gate=False)
    for i, v in enumerate(x[:start]):
        d.add(i, float(v))
    assert d.bank.max_run == MAX_RUN and int(d.bank.n.max()) == MAX_RUN
