"""``Exchange.drain`` waits for every row in flight once: a drain with nothing issued since the
last one asks the link nothing, and the rows are read at their checks as before."""

from __future__ import annotations

from stalwart.detect.alarms import QUIET
from stalwart.detect.decision import DecisionCore
from stalwart.detect.exchange import Exchange


class _Link:
    """A one-rank row link that keeps what it was asked (the rank's own rows come back)."""

    def __init__(self) -> None:
        self.rows: dict[int, list[float]] = {}
        self.waits: list[int] = []

    def issue(self, seq: int, row: list[float]) -> None:
        self.rows[seq] = list(row)

    def wait(self, seq: int) -> None:
        self.waits.append(seq)

    def read(self, seq: int) -> list[list[float]]:
        return [self.rows.pop(seq)]

    def close(self) -> None:
        pass


def test_a_drain_waits_for_each_row_once() -> None:
    link = _Link()
    ex = Exchange(0, link, DecisionCore(True), check_every=2, max_every=2, lag=1)  # type: ignore[arg-type]
    ex.drain()
    assert link.waits == []  # nothing in flight
    ex.add(1, 0.5)
    ex.issue(2, QUIET)  # row 0, read at check 4
    ex.drain()
    ex.drain()
    assert link.waits == [0]
    assert ex.read_own(4) is not None and ex.read_rows(0) == [(1, [0.5])]
    ex.issue(4, QUIET)  # row 1
    ex.issue(6, QUIET)  # row 2 (row 1 unread: both in flight)
    ex.drain()
    ex.drain()
    assert link.waits == [0, 1, 2]
