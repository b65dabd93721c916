"""S4 for a slow host link on a host of several ranks: every rank of the host leaves (the
policy's decision and the rank -> host map every rank builds from it)."""

from __future__ import annotations

from stalwart.detect.evidence import Finding
from stalwart.mitigate.decisions import EXCLUDE
from stalwart.mitigate.policy import Policy
from stalwart.mitigate.rebalance import excluded

UNIT = 0.01


def host_finding(ranks: list[int], host: str, step: int) -> Finding:
    return Finding("link", step - 4, step, 3.0, ranks=ranks, link=[ranks[0] - 1, ranks[0]],
                   evidence={"host": host})


def run(p: Policy, groups: int, fs: list[Finding]) -> list:
    for s in range(1, 21, 2):
        assert p.observe(s, [UNIT] * groups, 4 * UNIT + 0.005, 2, [], s + 3) is None
    return [d for s in range(21, 161, 2)
            if (d := p.observe(s, [UNIT] * groups, 3 * (4 * UNIT + 0.005), 2, fs, s + 3))
            is not None]


def test_a_slow_host_of_two_ranks_takes_both_out_once_its_rent_is_paid() -> None:
    p = Policy(6, 24, restart_s=0.2)
    out = run(p, 6, [host_finding([2, 3], "1", 21)])
    assert out and out[0].kind == EXCLUDE and out[0].target == 2 and out[0].hosts == [2, 3]
    assert "ranks [2, 3]" in out[0].reason and out[0].predicted_gain > 0
    # the map every rank builds: rank 0 sends the other leaving slot 1-based in the counts
    out[0].counts = [3 + 1]
    assert excluded(out[0]) == {2, 3}


def test_a_host_holding_whole_tensor_parallel_groups_leaves_at_tp_2() -> None:
    """tp = 2, one group per host of 2 ranks: the host's group leaves (S4 at tp > 1)."""
    p = Policy(3, 12, tp=2, restart_s=0.2)
    out = run(p, 3, [host_finding([2, 3], "1", 21)])
    assert out and out[0].kind == EXCLUDE and out[0].hosts == [2, 3]


def test_the_same_host_found_again_is_the_same_straggler() -> None:
    p = Policy(6, 24, restart_s=1e9)  # never pays: only the following is checked
    fs = [host_finding([2, 3], "1", 21), host_finding([2, 3], "1", 31)]
    assert run(p, 6, fs) == []
    assert p.active is not None and p.active.ranks == (2, 3)


def test_a_host_holding_every_group_is_not_excluded() -> None:
    p = Policy(2, 8, restart_s=0.2)
    assert run(p, 2, [host_finding([0, 1], "0", 21)]) == []


class _Hosts:
    """Slots 0-5 on hosts of two ranks (SlotHosts' addressing)."""

    def addr(self, slot: int) -> str:
        return f"10.213.0.{slot // 2 + 1}"


def test_the_probe_compares_with_peers_on_other_hosts() -> None:
    from stalwart.mitigate.probe import reference_pair

    # slot 2 (host 1) probed while 0, 1, 4, 5 run: a pair that crosses links, not 0-1
    a, b = reference_pair(_Hosts(), 2, [0, 1, 4, 5])
    assert _Hosts().addr(a) != _Hosts().addr(b) and 2 // 2 not in (a // 2, b // 2)
    assert reference_pair(_Hosts(), 2, [0, 1]) == (0, 1)  # no such pair: the first two


def test_a_slow_host_across_two_tensor_parallel_groups_is_remapped_not_left() -> None:
    """tp = 2 on 3 hosts of 2 ranks, the host holding ranks 1 and 2 (one rank of each of two
    TP groups: their activations cross its link): S4 would take out 2 of 3 groups, S3 puts
    one whole TP group on it (only its data-parallel ring crosses) -- priced, S3 wins."""
    from stalwart.mitigate import remap
    from stalwart.mitigate.decisions import REMAP

    p = Policy(3, 12, tp=2, restart_s=0.2,
               traffic=remap.pair_traffic(6, 2, 1e6, 1e8), hosts=list(range(6)))
    out = run(p, 3, [host_finding([1, 2], "1", 21)])
    assert out and out[0].kind == REMAP
    moved = out[0].hosts
    on_host = sorted(r for r, h in enumerate(moved) if h in (1, 2))
    assert on_host in ([0, 1], [2, 3], [4, 5])  # a whole TP group
    assert remap.traffic_off_host(p.traffic, moved, {1, 2}) < 0.05 * remap.traffic_off_host(
        p.traffic, list(range(6)), {1, 2})


def test_an_aligned_host_has_nothing_to_remap_and_leaves() -> None:
    from stalwart.mitigate import remap

    p = Policy(3, 12, tp=2, restart_s=0.2,
               traffic=remap.pair_traffic(6, 2, 1e6, 1e8), hosts=list(range(6)))
    out = run(p, 3, [host_finding([2, 3], "1", 21)])
    assert out and out[0].kind == EXCLUDE and out[0].hosts == [2, 3]
