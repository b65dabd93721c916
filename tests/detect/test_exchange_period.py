"""Rank 0's choice of the exchange period (monitor.py ``_choose_every``/``_read``), driven
through the monitor's own issue/read path with a two-rank row link held in memory (the real
link is tested in test_rowlink.py; here only what rank 0 decides from the rows matters)."""

from __future__ import annotations

from stalwart.detect import Monitor


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
    m = Monitor(rank=0, world=2, max_every=2)
    m._rows = TwoRankRows(peer_request)  # type: ignore[assignment]
    m._exchange_process_cpu = 150e-6  # an exchange: 1.5x the 0.2% budget of a 50 ms step
    m._step_cpu.extend([0.05] * 3)
    out = []
    for c in range(1, checks + 1):
        m._read(c)
        if c >= m._next_issue:
            m._issue(c)
        out.append(m.check_every)
    m.close()
    return out


def test_a_quiet_job_settles_on_the_budgets_period() -> None:
    # rank 0 starts at one exchange per step; its own last choice must not keep it there
    assert periods(peer_request=2)[-10:] == [2] * 10


def test_a_peer_asking_for_every_step_gets_it() -> None:
    assert periods(peer_request=1)[-10:] == [1] * 10
