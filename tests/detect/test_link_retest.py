"""A slow pair read once is read again before it is named (localize.retested, the Detector's
validation): a pair that reads >= LINK_RATIO again stays, a noise spike does not; a host's
link (several pairs alike) stays when its pairs read past hostlink.retest_threshold again; a
recording without the second reading is left as it is."""

from __future__ import annotations

import numpy as np

from stalwart.detect import hostlink
from stalwart.detect.alarms import DETECT, Alarm, IterSample
from stalwart.detect.decision import DecisionCore
from stalwart.detect.detector import Detector, StepInput, Validation
from stalwart.detect.evidence import RankEvidence
from stalwart.detect.localize import decide, lone_slow_pairs, pairs_to_retest, retested

RING4 = {"0-1": 0.004, "2-3": 0.004, "1-2": 0.004, "0-3": 0.004}


def _ev(links: dict[str, float]) -> list[RankEvidence]:
    per: dict[int, dict[str, float]] = {}
    for k, v in links.items():
        per.setdefault(int(k.split("-")[0]), {})[k] = v
    return [RankEvidence(r, 0.05, 0.05, 0.01, 0.05, 0.2, per.get(r, {})) for r in range(4)]


def test_a_pair_slow_twice_stays_and_a_spike_does_not() -> None:
    ev = _ev(dict(RING4, **{"1-2": 0.3}))  # 75x the healthy pairs
    first = decide(ev, 40, 44, 1.4)
    assert first.kind == "link" and lone_slow_pairs(first, ev) == ["1-2"]
    again = retested(first, ev, {"1-2": 0.28})
    assert again.kind == "link" and again.link == [1, 2]
    assert again.evidence["link_retest"] == {"1-2": 70.0}
    spike = retested(first, ev, {"1-2": 0.005})
    assert spike.kind == "unknown" and spike.evidence["link_retest"] == {"1-2": 1.25}
    assert retested(first, ev, {}) is first  # no second reading: the first verdict stands


def test_a_host_link_read_slow_twice_stays_and_a_burst_of_load_does_not() -> None:
    """Host 0's two crossing pairs at 9.5x and 4.5x (a clean run under load named host 0
    from one such reading): read again, the host stays only if both still pass."""
    ev = _ev(dict(RING4, **{"0-1": 0.038, "0-3": 0.018}))
    for e in ev:
        e.host = f"h{e.rank}"  # one rank per host, as on the testbed
    first = decide(ev, 40, 44, 1.4)
    assert first.kind == "link" and first.evidence["host_link"]["host"] == "h0"
    # the host's pairs, then the crossing pairs away from it (the second reading's level)
    assert pairs_to_retest(first, ev) == ["0-1", "0-3", "1-2", "2-3"]
    assert lone_slow_pairs(first, ev) == []
    t2 = hostlink.retest_threshold(2, first.evidence["host_link"]["sigma"])
    assert hostlink.MIN_RATIO <= t2 < first.evidence["host_link"]["threshold"]
    slow = retested(first, ev, {"0-1": 0.03, "0-3": 0.02})
    assert slow.kind == "link" and slow.ranks == first.ranks and slow.link == first.link
    assert slow.evidence["link_retest"] == {"0-1": 7.5, "0-3": 5.0}
    burst = retested(first, ev, {"0-1": 0.03, "0-3": 0.004})  # one pair back to healthy
    assert burst.kind == "unknown" and burst.evidence["link_retest"]["0-3"] == 1.0
    assert retested(first, ev, {}) is first
    # load that slows every transfer in the second reading: the host's pairs are no slower
    # than the re-read reference pairs
    load = retested(first, ev, {"0-1": 0.03, "0-3": 0.02, "1-2": 0.02, "2-3": 0.02})
    assert load.kind == "unknown" and load.evidence["link_retest"] == {"0-1": 1.5, "0-3": 1.0}
    assert load.evidence["retest_reference_pairs"] == 2


def test_of_two_slow_pairs_the_one_slow_again_is_named() -> None:
    ev = _ev(dict(RING4, **{"1-2": 0.3, "0-3": 0.2}))
    first = decide(ev, 40, 44, 1.4)
    assert first.kind == "link" and lone_slow_pairs(first, ev) == ["1-2", "0-3"]
    kept = retested(first, ev, {"1-2": 0.004, "0-3": 0.25})
    assert kept.kind == "link" and kept.link == [0, 3]


def test_a_compute_verdict_has_no_lone_pairs() -> None:
    ev = _ev(RING4)
    ev[3] = RankEvidence(3, 0.05, 0.09, 0.01, 0.01, 0.45, {})
    f = decide(ev, 40, 44, 1.4, suspect_rank=3)
    assert f.kind == "compute" and lone_slow_pairs(f, ev) == []


class Spiky:
    """A link test whose first reading of pair 1-2 is a spike (75x) and whose second is
    healthy, or slow both times (``slow``); records what the Detector asked for."""

    def __init__(self, slow: bool) -> None:
        self.slow, self.asked = slow, []

    def tests(self, alarm: Alarm, decided: int, own: RankEvidence) -> list[RankEvidence]:
        return _ev(dict(RING4, **{"1-2": 0.3}))

    def more_rounds(self, rounds: int) -> list[RankEvidence]:
        return []

    def more_links(self) -> list[RankEvidence] | None:
        return None

    def retest_links(self, pairs: list[str]) -> dict[str, float]:
        self.asked.append(pairs)
        return {"1-2": 0.3 if self.slow else 0.0041}

    def recovery_ratio(self, suspect: int, decided: int) -> float | None:
        return None


def _validated(src: object) -> Validation:
    """The validation a Detector over ``src`` makes of one alarm at step 20 of 30."""
    det = Detector(DecisionCore(True, audit=False), src)  # type: ignore[arg-type]
    out = None
    for k in range(30):
        alarm = Alarm(DETECT, k - 3, 1.4, -1) if k == 20 else None
        got = det.step(StepInput(IterSample(k, 0.1, 0.05, 0.05), alarm=alarm, issue=False))
        out = got.validation or out
    assert out is not None
    return out


def test_the_detector_reads_a_lone_pair_again_and_records_both_readings() -> None:
    for slow, kind in ((True, "link"), (False, "unknown")):
        src = Spiky(slow)
        out = _validated(src)
        assert src.asked == [["1-2"]]
        assert out.finding.kind == kind
        rec = out.record()
        assert rec["retest"] == {"1-2": 0.3 if slow else 0.0041}
        assert np.isclose(out.finding.evidence["link_retest"]["1-2"],
                          75.0 if slow else 1.025)


def test_replay_decides_again_on_both_recorded_readings() -> None:
    from stalwart.replay import RecordedEvidence

    for slow, kind in ((True, "link"), (False, "unknown")):
        live = _validated(Spiky(slow))
        replayed = _validated(RecordedEvidence([live.record()]))
        assert replayed.finding.kind == kind == live.finding.kind
