"""Rank 0's read of an exchange's rows in C (``_channels.by_step``, detect/_native/
channels.c) against the Python reference (``ExchangeRow.by_step_ref``): the same list on
random rows, and None (the reference runs) wherever the C call does not apply."""

from __future__ import annotations

import numpy as np
import pytest

from stalwart.detect import exchange
from stalwart.detect.exchange import ExchangeRow, RowHead

pytestmark = pytest.mark.skipif(exchange._by_step is None, reason="channels.c not built")


def _rows(rng: np.random.Generator, world: int, every: int) -> list[list[float]]:
    width = ExchangeRow.width(every)
    rows = []
    for _ in range(world):
        n = int(rng.integers(0, every + 1))
        vals = [float(x) for x in rng.normal(size=RowHead.SIZE)]
        vals[RowHead.ENTRIES] = float(n)
        for j in range(n):
            vals += [float(100 + j), float(rng.lognormal(-2.5, 0.3))]
        rows.append(vals + [0.0] * (width - len(vals)))
    return rows


def test_the_native_read_equals_the_reference() -> None:
    rng = np.random.default_rng(0)
    for _ in range(2000):
        rows = _rows(rng, int(rng.integers(1, 9)), int(rng.integers(1, 17)))
        got = exchange._by_step(rows, RowHead.SIZE, RowHead.ENTRIES)
        want = ExchangeRow.by_step_ref(rows)
        assert got == want
        assert all(type(k) is int and type(c) is list for k, c in got)
        assert ExchangeRow.by_step(rows) == want


@pytest.mark.parametrize("bad", ["tuple", "int", "nan", "negative", "short", "empty", "key"])
def test_rows_it_does_not_take_go_to_the_reference(bad: str) -> None:
    rows = _rows(np.random.default_rng(1), 4, 8)
    for r in rows:
        r[RowHead.ENTRIES] = 3.0
    if bad == "tuple":
        rows[1] = tuple(rows[1])  # type: ignore[call-overload]
    elif bad == "int":
        rows[2][RowHead.SIZE + 1] = 1  # type: ignore[call-overload]
    elif bad == "nan":
        rows[0][RowHead.ENTRIES] = float("nan")
    elif bad == "negative":
        rows[3][RowHead.ENTRIES] = -1.0
    elif bad == "short":
        rows[1] = rows[1][:RowHead.SIZE + 3]
    elif bad == "empty":
        rows = []
    elif bad == "key":
        rows[0][RowHead.SIZE] = float("inf")
    assert exchange._by_step(rows, RowHead.SIZE, RowHead.ENTRIES) is None
    try:
        want = ExchangeRow.by_step_ref(rows)
    except (ValueError, OverflowError, IndexError) as e:
        with pytest.raises(type(e)):
            ExchangeRow.by_step(rows)
    else:
        assert ExchangeRow.by_step(rows) == want
