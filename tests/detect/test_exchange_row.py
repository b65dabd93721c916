"""The exchange's row (exchange.py ``RowHead``, ``ExchangeRow``): the wire layout every rank
reads, packed and unpacked in one place."""

from __future__ import annotations

import numpy as np

from stalwart.detect.alarms import DETECT, QUIET, Alarm
from stalwart.detect.exchange import ExchangeRow, RowHead


def test_the_wire_layout() -> None:
    """The floats on the wire, in order: a change here breaks ranks of different versions."""
    row = ExchangeRow(RowHead(Alarm(DETECT, 17, 1.25, 3), 2, 4), [(20.0, 0.5), (21.0, 0.75)])
    assert row.pack(ExchangeRow.width(3)) == [
        float(DETECT), 17.0, 1.25, 3.0, 2.0, 4.0, 20.0, 0.5, 21.0, 0.75, 0.0, 0.0]


def test_unpack_inverts_pack() -> None:
    rng = np.random.default_rng(0)
    for entries in range(5):
        samples = [(float(k), float(rng.random())) for k in range(entries)]
        row = ExchangeRow(RowHead(Alarm(DETECT, 5, float(rng.random()) + 1, 1), entries, 3),
                          samples)
        assert ExchangeRow.unpack(row.pack(ExchangeRow.width(4))) == row
    assert RowHead.unpack(RowHead(QUIET, 0, 1).pack()) == RowHead(QUIET, 0, 1)


def test_rank0s_column_reads_agree_with_unpack() -> None:
    """``by_step`` and ``least_every`` read every rank's row column-wise: the same as
    unpacking each row, with the entries every rank sent."""
    rng = np.random.default_rng(1)
    width = ExchangeRow.width(4)
    rows = []
    for r in range(4):
        n = 4 if r != 2 else 2  # a rank with fewer samples sends fewer entries
        samples = [(float(10 + k), float(rng.random())) for k in range(n)]
        rows.append(ExchangeRow(RowHead(QUIET, n, 4 - r), samples).pack(width))
    got = [ExchangeRow.unpack(r) for r in rows]
    want = [(int(got[0].samples[k][0]), [g.samples[k][1] for g in got]) for k in range(2)]
    assert ExchangeRow.by_step(rows) == want
    assert ExchangeRow.least_every(rows[1:], 9) == min(g.head.every for g in got[1:]) == 1
    assert ExchangeRow.least_every([], 9) == 9
