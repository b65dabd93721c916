"""The detector pools every rank's compute-test rounds over a job's validations
(detector.Detector, localize.decide's ``prior``): a mild rank each validation leaves
unconfirmed is named once the rounds together rule out chance; a rank named starts again."""

from __future__ import annotations

from stalwart.detect.alarms import DETECT, Alarm, IterSample
from stalwart.detect.decision import DecisionCore
from stalwart.detect.detector import Detector, StepInput
from stalwart.detect.evidence import RankEvidence

HEALTHY = [0.20, 0.21, 0.20, 0.22, 0.20, 0.21, 0.20, 0.21, 0.20, 0.22]
SLOW = [0.28] * 10  # 1.4x
OTHER = [*HEALTHY[:8], 0.30, 0.30]  # slower than rank 1 in the last two rounds


class Rounds:
    """Every validation measures the same rounds: rank 1 the slowest in 8 of 10."""

    def __init__(self) -> None:
        self.asked = 0

    def tests(self, alarm: Alarm, decided: int, own: RankEvidence) -> list[RankEvidence]:
        self.asked += 1
        rounds = {0: OTHER, 1: SLOW, 2: HEALTHY, 3: HEALTHY}
        return [RankEvidence(r, 0.05, 0.06 if r == 1 else 0.05, 0.01, 0.02,
                             sorted(v)[len(v) // 2], {}, list(v)) for r, v in rounds.items()]

    def more_rounds(self, rounds: int) -> list[RankEvidence]:
        return []

    def more_links(self) -> list[RankEvidence] | None:
        return None

    def retest_links(self, pairs: list[str]) -> dict[str, float]:
        return {}

    def recovery_ratio(self, suspect: int, decided: int) -> float | None:
        return None


def test_rounds_pooled_over_two_validations_name_a_mild_rank() -> None:
    src = Rounds()
    det = Detector(DecisionCore(True, audit=False), src)
    kinds = []
    for k in range(60):
        alarm = Alarm(DETECT, k - 3, 1.2, 1) if k in (20, 40) else None
        out = det.step(StepInput(IterSample(k, 0.1, 0.08, 0.02), alarm=alarm, issue=False))
        if out.validation is not None:
            kinds.append(out.validation.finding.kind)
    assert src.asked == 2
    # 8 of 10 alone: not confirmed; 16 of 20 pooled (chance ~4e-8 at 4 ranks): rank 1
    assert kinds == ["unknown", "compute"]
    f = det.core.findings[-1]
    assert f.ranks == [1] and f.evidence["pooled_rounds"]["of"] == 20
    assert 1 not in det._pool  # named: its pool starts again


def test_every_ranks_count_in_one_pass_equals_one_rank_at_a_time() -> None:
    import numpy as np

    from stalwart.detect.localize import slowest_counts, slowest_every_round

    rng = np.random.default_rng(3)
    for n, m in ((2, 3), (4, 10), (9, 7)):
        rounds = rng.choice([0.1, 0.2, 0.3], size=(n, m)).tolist()  # ties on purpose
        ev = [RankEvidence(r, 0.05, 0.05, 0.01, 0.02, 0.2, {}, rounds[r]) for r in range(n)]
        assert slowest_counts(ev) == {r: slowest_every_round(ev, r) for r in range(n)}
    uneven = [RankEvidence(0, 0.05, 0.05, 0.01, 0.02, 0.2, {}, [0.3, 0.3]),
              RankEvidence(1, 0.05, 0.05, 0.01, 0.02, 0.2, {}, [0.1])]
    assert slowest_counts(uneven) == {0: 0, 1: 0}
