"""``evidence.PeerTable`` (every rank's peer series at once) equals the per-rank reference
``evidence._peer_series`` exactly, on random evidence with ties, gaps, repeated steps and
non-positive values, and on the replay corpus's shapes (small and large rank counts)."""

from __future__ import annotations

import numpy as np
import pytest

from stalwart.detect import evidence
from stalwart.detect.evidence import PeerTable, RankEvidence, _peer_series, peer_series


def _random_ev(rng: np.random.Generator, n: int, steps: int) -> list[RankEvidence]:
    ev = []
    for r in rng.permutation(n).tolist():
        recent = []
        for k in range(steps):
            if rng.random() < 0.05:
                continue  # a gap: that step is no longer every rank's
            c = float(np.round(rng.lognormal(-3.0, 0.3), int(rng.integers(2, 6))))  # ties
            if rng.random() < 0.02:
                c = float(rng.choice([0.0, -1e-3]))
            recent.append((k, c))
            if rng.random() < 0.02:
                recent.append((k, c * 1.5))  # a repeated step: the last entry counts
        ev.append(RankEvidence(r, recent=recent, host="h"))
    return ev


@pytest.mark.parametrize("n", [2, 3, 4, 5, 16, 17, 64, 129])
def test_table_equals_the_per_rank_reference(n: int) -> None:
    rng = np.random.default_rng(n)
    for _ in range(5):
        ev = _random_ev(rng, n, int(rng.integers(1, 40)))
        table = PeerTable.build(ev)
        assert table is not None
        for e in ev:
            k0, x0 = _peer_series(ev, e.rank)
            k1, x1 = table.series(e.rank)
            assert k0.tolist() == k1.tolist()
            assert x0.tolist() == x1.tolist()  # exact, not approximately
        k0, x0 = _peer_series(ev, n + 7)  # a rank the evidence does not hold
        assert not len(table.series(n + 7)[0]) and not len(k0)


def test_peer_series_uses_one_table_per_evidence_list() -> None:
    rng = np.random.default_rng(1)
    ev = _random_ev(rng, 40, 30)
    want = [_peer_series(ev, e.rank) for e in ev]
    got = [peer_series(ev, e.rank) for e in ev]
    assert [(a.tolist(), b.tolist()) for a, b in want] == [
        (a.tolist(), b.tolist()) for a, b in got]
    table = evidence._cache[1]
    peer_series(ev, 3)
    assert evidence._cache[1] is table  # kept for the same list
    other = _random_ev(rng, 40, 30)
    assert peer_series(other, 3)[1].tolist() == _peer_series(other, 3)[1].tolist()
    assert evidence._cache[1] is not table


def test_evidence_it_does_not_cover_falls_back_to_the_reference() -> None:
    ev = [RankEvidence(r % 20, recent=[(0, 1.0 + r), (1, 2.0)], host="h") for r in range(21)]
    assert PeerTable.build(ev) is None  # a rank repeated
    assert peer_series(ev, 3)[1].tolist() == _peer_series(ev, 3)[1].tolist()
    ev = [RankEvidence(r, recent=[(0, float("nan") if r == 2 else 1.0)], host="h")
          for r in range(20)]
    assert PeerTable.build(ev) is None  # a value that is not finite
    assert peer_series(ev, 3)[1].tolist() == _peer_series(ev, 3)[1].tolist()
