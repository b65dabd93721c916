"""S3's traffic model and placement: which rank pairs carry bytes, and the cheapest placement
of a slow host pair (checked against every permutation on small worlds)."""

from __future__ import annotations

import itertools

import pytest

from stalwart.mitigate.remap import (
    host_pairs,
    pair_traffic,
    placement,
    rank_pairs_on,
    traffic_on,
)


def test_data_parallel_rings_use_neighbours_only() -> None:
    t = pair_traffic(4, 1, dp_bytes=100, tp_bytes=0)
    assert set(t) == {(0, 1), (1, 2), (2, 3), (0, 3)}
    assert all(v == pytest.approx(150.0) for v in t.values())  # 2 (d-1)/d of the tensor
    assert pair_traffic(2, 1, 100, 0) == {(0, 1): pytest.approx(200.0)}  # both directions


def test_a_2x2_grid_leaves_the_diagonals_idle() -> None:
    t = pair_traffic(4, 2, dp_bytes=10, tp_bytes=1000)
    assert set(t) == {(0, 1), (2, 3), (0, 2), (1, 3)}
    assert t[(0, 1)] > t[(0, 2)]  # TP activations outweigh DP gradients


@pytest.mark.parametrize("world,tp", [(3, 1), (4, 1), (4, 2), (5, 1), (6, 2), (6, 3)])
def test_placement_is_optimal_and_moves_the_fewest_ranks(world: int, tp: int) -> None:
    t = pair_traffic(world, tp, dp_bytes=7, tp_bytes=50)
    hosts = list(range(world))
    for slow in itertools.combinations(range(world), 2):
        got = placement(t, hosts, slow)
        assert sorted(got) == hosts
        best = min(traffic_on(t, list(p), slow) for p in itertools.permutations(hosts))
        assert traffic_on(t, got, slow) == pytest.approx(best)
        moved = sum(a != b for a, b in zip(got, hosts, strict=True))
        fewest = min(sum(a != b for a, b in zip(p, hosts, strict=True))
                     for p in itertools.permutations(hosts)
                     if traffic_on(t, list(p), slow) == pytest.approx(best))
        assert moved == fewest


def test_slow_pair_examples_from_the_issue() -> None:
    # data parallel on 4: neighbours 2-3 slow -> they end up two apart in the ring
    t = pair_traffic(4, 1, 100, 0)
    new = placement(t, [0, 1, 2, 3], (2, 3))
    assert traffic_on(t, new, (2, 3)) == 0.0
    # 2 x 2 TP x DP: hosts 0-1 (a TP pair) slow -> they hold a diagonal pair of ranks
    t = pair_traffic(4, 2, 10, 1000)
    new = placement(t, [0, 1, 2, 3], (0, 1))
    assert traffic_on(t, new, (0, 1)) == 0.0
    # already idle: nothing moves
    assert placement(t, [0, 1, 2, 3], (0, 3)) == [0, 1, 2, 3]
    # after an earlier restart the map is not the identity; the result is still a placement
    assert sorted(placement(t, [2, 0, 3, 1], (0, 1))) == [0, 1, 2, 3]


def test_a_slow_link_is_carried_across_a_remap_by_its_hosts() -> None:
    """Ranks 2-3 on hosts 2-3 found slow; after the S3 placement [0, 2, 1, 3] the same hosts
    sit under ranks 1 and 3, the pair the next detector must leave out."""
    slow = host_pairs([(2, 3)], [0, 1, 2, 3], 1)
    assert slow == {(2, 3)}
    assert rank_pairs_on(slow, [0, 2, 1, 3], 1) == {(1, 3)}
    # two ranks to a host: slots 4-5 on host 2, 6-7 on host 3; every rank pair across them
    slow = host_pairs([(5, 6)], list(range(8)), 2)
    assert slow == {(2, 3)}
    assert rank_pairs_on(slow, list(range(8)), 2) == {(4, 6), (4, 7), (5, 6), (5, 7)}
    assert host_pairs([(4, 5)], list(range(8)), 2) == set()  # inside one host: no link
