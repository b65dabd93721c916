"""The plan channel's message (agreement.py ``PlanMessage``) and the rebalancer's measurement
row (rebalance.py ``WindowRow``): the wire layout, packed and unpacked in one place."""

from __future__ import annotations

import pytest

from stalwart.mitigate.agreement import EXCLUDE, REBALANCE, REMAP, Decision, PlanMessage
from stalwart.mitigate.rebalance import WindowRow


def test_the_wire_layout() -> None:
    """The floats on the wire, in order: a change here breaks ranks of different versions."""
    dec = Decision(REBALANCE, 3, 41, [5, 5, 6], target=2, predicted_gain=0.125)
    assert PlanMessage(dec, [0.25, 0.5, 7.0]).pack(slots=4, row_len=3) == [
        float(REBALANCE), 3.0, 41.0, 2.0, 125000.0, 5.0, 5.0, 6.0, 0.0, 0.25, 0.5, 7.0]
    # no decision: zeros before the row; a short row is zero-padded, a long one cut
    assert PlanMessage(None, [1.0]).pack(slots=2, row_len=3) == [0.0] * 7 + [1.0, 0.0, 0.0]
    assert PlanMessage(None, [1.0, 2.0, 3.0]).pack(slots=1, row_len=2)[-2:] == [1.0, 2.0]


@pytest.mark.parametrize(("kind", "counts", "read"), [
    (REBALANCE, [5, 5, 6], [5, 5, 6]),  # a plan: the first ``groups`` slots
    (EXCLUDE, [2], [2, 0, 0]),  # the hosts leaving with the target, 1-based, in those slots
    (REMAP, [1, 0, 3, 2], [1, 0, 3, 2]),  # a rank -> host map: every slot
])
def test_unpack_inverts_pack(kind: int, counts: list[int], read: list[int]) -> None:
    dec = Decision(kind, 7, 100, counts, target=1, predicted_gain=0.3333337)
    msg = PlanMessage(dec, [1.5, 2.5, 3.0]).pack(slots=4, row_len=3)
    got = PlanMessage.unpack(msg, slots=4, groups=3)
    assert got.decision is not None and got.values == [1.5, 2.5, 3.0]
    d = got.decision
    assert (d.kind, d.version, d.start_step, d.counts, d.target) == (kind, 7, 100, read, 1)
    assert d.predicted_gain == 0.333334  # a whole number of millionths
    assert PlanMessage.unpack(PlanMessage(None, [1.0]).pack(4, 1), 4, 3).decision is None


def test_a_decision_with_more_counts_than_slots_is_refused() -> None:
    with pytest.raises(ValueError, match="3 counts for 2 slots"):
        PlanMessage(Decision(REBALANCE, 1, 5, [1, 2, 3]), []).pack(slots=2, row_len=0)


def test_window_row() -> None:
    row = WindowRow(0.125, 0.5, 4)
    assert row.pack() == [0.125, 0.5, 4.0] and len(row.pack()) == WindowRow.SIZE
    assert WindowRow.unpack(row.pack()) == row
