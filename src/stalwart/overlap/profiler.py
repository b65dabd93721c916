"""Overlap profiler: each segment's compute and collective time, and the co-execution tables.

Mechanism (DHelix's pair profiling, arXiv 2411.15871, adapted to one compute thread per rank):
a segment runs from its resume to its park -- first waiting for its own strand's previous
collective, then computing up to its own collective (issued, left in flight). On real passes
of the real model over the real group, run alone (forward pass, then its backward), we measure
per segment its compute time c (resume to park, minus the time blocked on the previous
collective) and its collective's time m (issue to completion, with nothing else running). The
pair tables of ``Profile`` follow from them (``Profile.from_segments``): a segment right after
the other strand's segment waits only for what of its own collective the other's compute did
not cover.

Why not time every pair directly, as DHelix does on GPUs: we did (alternating passes along each
diagonal of the (i, j) grid); at 5-30 ms per segment on a shared two-core machine the samples'
noise was as large as the overlap being priced, and the plans it produced ran slower than plain
alternation (see docs/overlap.md). Per-segment c and m are long, clean measurements; the
benchmark checks the model's prediction against the measured interleaved step.

The minimum over repetitions (interference from other processes only ever adds time, so the
least sample is the least noisy estimate), then the element-wise maximum over the TP group, so
every TP rank derives the same plan from the same numbers (the slowest rank's view wins).

Guarantee: the profile describes this machine, this group and these shapes; profiling runs
real passes (gradients are accumulated and must be discarded by the caller).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from stalwart.overlap.comm import Pending, TPComm
from stalwart.overlap.plan import Profile
from stalwart.overlap.strands import Strand
from stalwart.overlap.wgrad import WGradQueue, device_sync


def _measure_pass(comm: TPComm, s: Strand, compute: list[list[float]],
                  collective: list[list[float]], nbytes: list[float],
                  live: Callable[[], int], sign: float) -> None:
    """Run a pass alone, segment by segment, recording c, m and bytes of each segment."""
    prev: Pending | None = None
    while not s.done:
        k, before, blocked = s.segments, live(), comm.ledger.exposed
        device_sync()
        t0 = time.perf_counter()
        s.resume()
        device_sync()
        dt = time.perf_counter() - t0
        compute[k].append(max(dt - (comm.ledger.exposed - blocked), 0.0))
        nbytes[k] = sign * float(live() - before)
        if prev is not None and prev.t_done is not None:
            collective[k - 1].append(prev.t_done - prev.t_issue)
        prev = s.pending
    s.join()


def count_segments(fwd: Callable[[], Strand], bwd: Callable[[torch.Tensor], Strand]
                   ) -> tuple[int, int]:
    f = fwd()
    f.run_to_end()
    f.join()
    b = bwd(f.result)
    b.run_to_end()
    b.join()
    return f.segments, b.segments


def profile_pairs(comm: TPComm, fwd: Callable[[], Strand],
                  bwd: Callable[[torch.Tensor], Strand], m: int, n: int, reps: int = 2,
                  live_bytes: Callable[[], int] | None = None,
                  wgrad: WGradQueue | None = None) -> Profile:
    """Measure c and m of every segment (alone), max-reduce, build the ``Profile``.

    With `live_bytes` (the activation meter), also the bytes each forward segment saves and
    each backward segment frees. With `wgrad` (split backward; its filling off), the
    backward segments compute input gradients only and the weight-gradient work each of
    them deferred is timed on its own, after the pass (``Profile.bwd_wgrad``).
    """
    live = live_bytes or (lambda: 0)
    fc: list[list[float]] = [[] for _ in range(m)]
    bc: list[list[float]] = [[] for _ in range(n)]
    # the last segment of each pass issues no collective: m = 0
    fm: list[list[float]] = [[] for _ in range(m - 1)] + [[0.0]]
    bm: list[list[float]] = [[] for _ in range(n - 1)] + [[0.0]]
    bw: list[list[float]] = [[] for _ in range(n)]
    fbytes, bbytes = [0.0] * m, [0.0] * n
    for rep in range(reps + 1):  # the first repetition warms up and is discarded
        f = fwd()
        _measure_pass(comm, f, fc, fm, fbytes, live, 1.0)
        b = bwd(f.result)
        _measure_pass(comm, b, bc, bm, bbytes, live, -1.0)
        if wgrad is not None:
            # the tasks hold x and g until they run: their release is counted with the
            # segment that deferred them (filling runs them soon after, in the next waits)
            secs, freed = wgrad.timed_by_segment(n, live if live_bytes else None)
            for j in range(n):
                bw[j].append(secs[j])
                bbytes[j] += freed[j]
        if rep == 0:
            for lst in (*fc, *bc, *fm[:-1], *bm[:-1], *bw):
                lst.clear()
    vals = [min(x) if x else 0.0 for x in (*fc, *fm, *bc, *bm, *bw)]
    vals += fbytes + bbytes if live_bytes else []
    vals.append(_sustained_factor(comm))
    vals.extend(_contention(comm))
    flat = torch.tensor(vals, dtype=torch.float64)
    if comm.world > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=comm.group)
    v = flat.tolist()
    cut = [0, m, 2 * m, 2 * m + n, 2 * m + 2 * n, 2 * m + 3 * n]
    fc_, fm_, bc_, bm_, bw_ = (v[cut[k]:cut[k + 1]] for k in range(5))
    factor, slow_compute, slow_comm = v[-3:]
    rest = v[cut[5]:-3]
    prof = Profile.from_segments(fc_, fm_, bc_, bm_, fwd_bytes=rest[:m], bwd_bytes=rest[m:],
                                 bwd_wgrad=bw_ if wgrad is not None else [])
    prof.segments["comm_sustained_factor"] = [factor]
    prof.segments["compute_contention"] = [slow_compute]
    prof.segments["comm_contention"] = [slow_comm]
    return prof


def _contention(comm: TPComm, reps: int = 3, work_s: float = 0.03) -> tuple[float, float]:
    """How much slower compute and collectives run while both are busy on this rank.

    On a CPU a collective is not free while it travels: gloo's threads copy and reduce the
    buffers and the kernel runs the sockets, on the cores the compute needs (measured on
    this testbed: an interleaved step's compute took 1.36x its sequential time and its
    collectives 1.4x). Measured directly: a fixed matrix-multiply loop of about `work_s`
    alone; a chain of all-reduces (the profiled collectives' mean size, about twice the
    loop's length) alone; then the chain issued and the loop run under it. The loop's
    ratio is the compute's slowdown ``a``; the chain moved ``w / b`` of its work during the
    loop's ``w`` seconds, which gives ``b``. Medians over `reps`, at least 1. The chain's
    length is agreed over the group (every rank must issue the same collectives).
    """
    if comm.world == 1 or comm.ledger.count == 0:
        return 1.0, 1.0
    size = max(1, comm.ledger.bytes // comm.ledger.count // 4)
    x, w_ = torch.randn(256, 768), torch.randn(768, 768)

    def work(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            torch.mm(x, w_)
        return time.perf_counter() - t0

    per = work(4) / 4
    n = max(1, int(work_s / max(per, 1e-6)))
    probe = torch.zeros(size)
    dist.barrier(group=comm.group)
    t0 = time.perf_counter()
    dist.all_reduce(probe, group=comm.group)
    one = time.perf_counter() - t0
    k = torch.tensor([min(64, max(2, math.ceil(2 * work_s / max(one, 1e-6))))])
    dist.all_reduce(k, op=dist.ReduceOp.MAX, group=comm.group)
    chain = int(k.item())
    bufs = [probe, *(torch.zeros(size) for _ in range(chain - 1))]  # one per op in flight

    def run_chain(during: int) -> tuple[float, float]:
        dist.barrier(group=comm.group)
        t0 = time.perf_counter()
        works = [dist.all_reduce(b, group=comm.group, async_op=True) for b in bufs]
        loop = work(during) if during else 0.0
        for wk in works:
            wk.wait()
        return time.perf_counter() - t0, loop

    a_s, b_s = [], []
    for _ in range(reps):
        dist.barrier(group=comm.group)
        alone = work(n)
        chain_alone, _ = run_chain(0)
        chain_under, under = run_chain(n)
        a_s.append(under / max(alone, 1e-9))
        # the chain outlasts the loop: its last (chain_under - under) s ran uncontended
        moved = chain_alone - (chain_under - under)
        b_s.append(under / moved if moved > 1e-6 else 1.0)
    med = sorted(a_s)[len(a_s) // 2], sorted(b_s)[len(b_s) // 2]
    return max(1.0, med[0]), max(1.0, med[1])


def _sustained_factor(comm: TPComm, reps: int = 3, idle_s: float = 0.03, chain: int = 4
                      ) -> float:
    """How much longer a collective takes right behind another than after the link idled.

    Shaped links (a token bucket, like the testbed's tbf, or any link with burst credit) move
    a transfer faster after an idle gap than back to back; strand interleaving keeps the link
    busy, so the step model needs both. Measured on a tensor of the profiled collectives'
    mean size: after `idle_s` of quiet (a measurement of the idle case, not a wait for an
    event), one all-reduce alone, then `chain` issued back to back (their mean, so that the
    ranks' skew at the start -- large with more ranks than cores -- is spread over several).
    Median ratio.
    """
    if comm.world == 1 or comm.ledger.count == 0:
        return 1.0
    t = torch.zeros(max(1, comm.ledger.bytes // comm.ledger.count // 4))
    ratios = []
    for _ in range(reps):
        dist.barrier(group=comm.group)
        time.sleep(idle_s)
        t0 = time.perf_counter()
        dist.all_reduce(t, group=comm.group)
        t1 = time.perf_counter()
        for _ in range(chain):
            dist.all_reduce(t, group=comm.group)
        t2 = time.perf_counter()
        ratios.append((t2 - t1) / chain / max(t1 - t0, 1e-9))
    return max(1.0, sorted(ratios)[len(ratios) // 2])
