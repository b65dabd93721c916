"""Rank 0's choice of the exchange period (exchange.py), driven through the exchange's
read and issue with a two-rank row link held in memory (the real link is tested in
test_rowlink.py; here only what rank 0 decides from the rows matters)."""

from __future__ import annotations

from stalwart.detect.alarms import QUIET
from stalwart.detect.decision import DecisionCore
from stalwart.detect.exchange import Exchange


class TwoRankRows:
    """Rank 0's end of a link to one peer that always asks for ``peer_request``."""

    def __init__(self, peer_request: int) -> None:
        self.peer_request = peer_request
        self.sent: dict[int, list[float]] = {}

    def issue(self, seq: int, row: list[float]) -> None:
        self.sent[seq] = row

    def wait(self, seq: int) -> None:
        pass

    def close(self) -> None:
        pass

    def read(self, seq: int) -> list[list[float]]:
        peer = [0.0] * len(self.sent[seq])
        peer[5] = float(self.peer_request)
        return [self.sent.pop(seq), peer]


def periods(peer_request: int, checks: int = 40) -> list[int]:
    # an exchange costs 1.5x the 0.2% budget of a 50 ms step
    ex = Exchange(0, TwoRankRows(peer_request), DecisionCore(leader=True),  # type: ignore
                  check_every=None, max_every=2, lag=1, process_cost=150e-6)
    ex._step_cpu.extend([0.05] * 3)
    out = []
    for c in range(1, checks + 1):
        ex.read(c)
        if ex.issues(c):
            ex.issue(c, QUIET)
        out.append(ex.check_every)
    ex.close()
    return out


def test_a_quiet_job_settles_on_the_budgets_period() -> None:
    # rank 0 starts at one exchange per step; its own last choice must not keep it there
    assert periods(peer_request=2)[-10:] == [2] * 10


def test_a_peer_asking_for_every_step_gets_it() -> None:
    assert periods(peer_request=1)[-10:] == [1] * 10
