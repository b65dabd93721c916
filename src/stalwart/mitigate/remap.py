"""Re-mapping ranks around a slow link (S3): which rank pairs carry bytes, and which placement
of ranks on hosts puts the least traffic on a slow pair of hosts.

Mechanism. gloo runs this job's all-reduces as rings in rank order over each process group
(``torch.distributed.new_group`` sorts its ranks; measured on the testbed: a 10x-slow pair
0-2 of a 4-rank data-parallel job left the step time unchanged, a slow neighbour pair 2-3
slowed it), so the bytes each rank pair carries per step follow from the world size and
``--tp`` alone: the tensor-parallel groups (consecutive ranks) are rings carrying activations,
the data-parallel groups (ranks of equal TP index) rings carrying gradients. ``pair_traffic``
writes that down (a ring of d ranks moves 2 (d-1)/d of the tensor across each of its edges;
bytes are per step, both directions together); ``stalwart/testbed/traffic.py`` measures it on
the testbed with per-host-pair nftables counters and docs/mitigate.md shows both.

A slow pair of hosts (a, b) costs nothing when the ranks on a and b exchange nothing: in a
ring of 4 or more, two ranks that are not neighbours; in a 2 x 2 TP x DP grid, the two
"diagonal" pairs. ``placement`` picks, among the rank pairs with the least traffic, the one
that moves the fewest ranks to other hosts (ranks keep their numbers and their state --
model, optimizer and tensor-parallel shards all follow the rank -- only the host under them
changes). Exact: every rank pair is a candidate, and putting hosts a and b under a given pair
takes at most two swaps, the fewest possible.

A slow host of several ranks (``host_placement``): its link carries every pair with one end
on it, so the placement that helps puts on it the ranks that talk most among themselves --
at tp > 1 a whole tensor-parallel group, whose activations then stay inside the host while
only its data-parallel rings cross the link once per rank.

Applied by regrouping in place on the permuted host map (mitigate/regroup.py; a restart from
the checkpoint where the job cannot regroup in place). Across the regroup the slow pair of
hosts is carried (``host_pairs``, ``rank_pairs_on``), so that the next generation's detector
does not test it again (verify.py). There is no revert: in a ring (and the grid) the
permuted placement is exactly as fast as the original when the link heals, so going back
would cost a regroup and gain nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

Pair = tuple[int, int]


def pair_traffic(world: int, tp: int, dp_bytes: float, tp_bytes: float) -> dict[Pair, float]:
    """Bytes per step on each rank pair (a < b): rings over the TP groups (``tp_bytes``: what
    one rank all-reduces per step in its TP group) and the DP groups (``dp_bytes``: its
    gradient bytes). Pairs absent from the result carry nothing."""
    if world < 1 or tp < 1 or world % tp:
        raise ValueError(f"world {world} is not a multiple of tp {tp}")
    out: dict[Pair, float] = {}

    def ring(members: list[int], nbytes: float) -> None:
        d = len(members)
        if d < 2 or nbytes <= 0:
            return
        per_edge = 2.0 * (d - 1) / d * nbytes
        for i in range(d):
            a, b = members[i], members[(i + 1) % d]
            key = (min(a, b), max(a, b))
            out[key] = out.get(key, 0.0) + per_edge

    for g in range(world // tp):
        ring(list(range(g * tp, (g + 1) * tp)), tp_bytes)
    for i in range(tp):
        ring(list(range(i, world, tp)), dp_bytes)
    return out


def traffic_on(traffic: dict[Pair, float], hosts: list[int], slow: Pair) -> float:
    """Bytes per step crossing the slow host pair under the rank -> host map ``hosts``."""
    where = {h: r for r, h in enumerate(hosts)}
    if slow[0] not in where or slow[1] not in where:
        return 0.0
    a, b = where[slow[0]], where[slow[1]]
    return traffic.get((min(a, b), max(a, b)), 0.0)


def placement(traffic: dict[Pair, float], hosts: list[int], slow: Pair) -> list[int]:
    """The rank -> host map with the least traffic on the slow host pair, moving the fewest
    ranks (ties: the lowest rank pair). Returns ``hosts`` itself when nothing is better."""
    world = len(hosts)
    moves = ([(x, slow[0]), (y, slow[1])] for x in range(world) for y in range(world) if x != y)
    return _least(hosts, moves, lambda cand: traffic_on(traffic, cand, slow))


def _least(hosts: list[int], moves: Iterable[list[tuple[int, int]]],
           cost: Callable[[list[int]], float]) -> list[int]:
    """Of ``hosts`` and each candidate made by moving ranks onto slots (a move swaps the rank
    with the one holding the slot, in order), the one of least ``cost``, then fewest ranks
    moved; the first such candidate wins a tie, ``hosts`` itself when nothing is better."""
    best, best_key = list(hosts), (cost(hosts), 0)
    for move in moves:
        cand = list(hosts)
        for rank, slot in move:
            j = cand.index(slot)
            cand[rank], cand[j] = cand[j], cand[rank]
        key = (cost(cand), sum(1 for a, b in zip(cand, hosts, strict=True) if a != b))
        if key < best_key:
            best, best_key = cand, key
    return best


def traffic_off_host(traffic: dict[Pair, float], hosts: list[int], slots: set[int]) -> float:
    """Bytes per step crossing the link of the host that holds ``slots`` (a host of several
    ranks: its ranks' slots) under the rank -> slot map ``hosts``: rank pairs with exactly one
    end on it (pairs inside the host cross no link)."""
    on = {r for r, h in enumerate(hosts) if h in slots}
    return sum(b for (x, y), b in traffic.items() if (x in on) != (y in on))


def host_placement(traffic: dict[Pair, float], hosts: list[int],
                   slots: set[int]) -> list[int]:
    """The rank -> slot map with the least traffic across a slow host's link (the host
    holding ``slots``), moving the fewest ranks. Candidates: the ranks on it now, and every
    block of as many consecutive ranks (a tensor-parallel group is consecutive ranks: a block
    aligned with one keeps its traffic inside the host and sends only the data-parallel rings
    across the link). The chosen ranks take the host's slots in rank order, each swapping
    with the rank there. Returns ``hosts`` itself when nothing is better. Cost:
    O(world x pairs)."""
    world = len(hosts)
    mine = sorted(s for s in slots if s in hosts)
    k = len(mine)
    if k == 0 or k >= world:
        return list(hosts)
    moves = (list(zip(range(start, start + k), mine, strict=True))
             for start in range(world - k + 1))
    return _least(hosts, moves, lambda cand: traffic_off_host(traffic, cand, slots))


def model_bytes(n_params: int, micro_per_rank: float, micro_batch: int, block: int,
                n_embd: int, n_layer: int, tp: int) -> tuple[float, float]:
    """(dp_bytes, tp_bytes) per rank and step for the built-in GPT in fp32: its gradients
    (this rank's parameters), and for tensor parallelism the activations all-reduced per
    micro-batch -- two per block forward (attention and MLP outputs) and two backward."""
    dp = 4.0 * n_params
    tpb = 0.0 if tp == 1 else 4.0 * micro_batch * block * n_embd * 4 * n_layer * micro_per_rank
    return dp, tpb


def host_pairs(links: Iterable[Pair], slots: list[int], per_host: int) -> set[Pair]:
    """The pairs of hosts under the rank pairs ``links`` (rank r on slot ``slots[r]``, slot s
    on host s // ``per_host``); a pair inside one host is none."""
    out = set()
    for a, b in links:
        ha, hb = slots[a] // per_host, slots[b] // per_host
        if ha != hb:
            out.add((min(ha, hb), max(ha, hb)))
    return out


def rank_pairs_on(pairs: set[Pair], slots: list[int], per_host: int) -> set[Pair]:
    """The rank pairs (a < b) whose ranks sit on the two hosts of one of ``pairs``."""
    host = [s // per_host for s in slots]
    return {(a, b) for a in range(len(slots)) for b in range(a + 1, len(slots))
            if (min(host[a], host[b]), max(host[a], host[b])) in pairs}
