"""Pairwise overlap profiler: how long each (forward segment, backward segment) pair takes.

Mechanism (DHelix's operator-pair profiling, arXiv 2411.15871): for every forward segment f_i
and backward segment b_j of the real model on the real group, measure f_i alone, b_j alone
and the pair co-executed (f_i's compute, its collective issued, b_j's compute while it flies,
b_j's collective issued, then both waited for). A profiling pass walks one diagonal of the
(i, j) grid -- advance one strand alone to the diagonal's start, then pair step by step -- so
m + n - 1 passes cover all m*n pairs, and the alone steps of each pass give the single-strand
times for free. Every step ends with a barrier on its collectives so that steps are timed
separately. Medians over repetitions; then the element-wise maximum over the TP group, so every
TP rank derives the same plan from the same numbers (and the slowest rank's view wins).

Guarantee: the profile describes this machine, this group and these shapes; profiling runs
real passes (gradients are accumulated and must be discarded by the caller).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from stalwart.overlap.comm import TPComm
from stalwart.overlap.plan import Profile
from stalwart.overlap.strands import Strand

# makes a strand for a pass: ("F", micro-batch index) -> forward strand returning the loss;
# ("B", loss) -> backward strand
StrandFactory = Callable[..., Strand]


def _timed_step(comm: TPComm, strands: list[Strand]) -> float:
    t0 = time.perf_counter()
    for s in strands:
        s.resume()
    for s in strands:
        if s.pending is not None:
            comm.wait(s.pending)
    return time.perf_counter() - t0


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
                  live_bytes: Callable[[], int] | None = None) -> Profile:
    """Measure P(f_i, -), P(-, b_j) and P(f_i, b_j) for all i < m, j < n.

    With `live_bytes` (the activation meter), also the bytes each forward segment saves and
    each backward segment frees (measured on the alone passes).
    """
    live = live_bytes or (lambda: 0)
    fbytes = [0.0] * m
    bbytes = [0.0] * n
    fs: list[list[float]] = [[] for _ in range(m)]
    bs: list[list[float]] = [[] for _ in range(n)]
    ps: list[list[list[float]]] = [[[] for _ in range(n)] for _ in range(m)]
    for _ in range(reps):
        for d in range(-(m - 1), n):
            # a completed forward to give the backward strand a graph (times: forward alone)
            first = fwd()
            while not first.done:
                i, before = first.segments, live()
                fs[i].append(_timed_step(comm, [first]))
                fbytes[i] = float(live() - before)
            first.join()
            f, b = fwd(), bwd(first.result)
            while not (f.done and b.done):
                i, j = f.segments, b.segments
                if f.done or (not b.done and j - i < d):
                    bs[j].append(_timed_step(comm, [b]))
                elif b.done or j - i > d:
                    fs[i].append(_timed_step(comm, [f]))
                else:
                    ps[i][j].append(_timed_step(comm, [b, f]))  # as run_plan orders them
            f.join()
            b.join()
            last = bwd(f.result)  # frees the second forward's graph (times: backward alone)
            while not last.done:
                j, before = last.segments, live()
                bs[j].append(_timed_step(comm, [last]))
                bbytes[j] = float(before - live())
            last.join()
    prof = Profile(
        fwd=[statistics.median(x) for x in fs],
        bwd=[statistics.median(x) for x in bs],
        pair=[[statistics.median(x) for x in row] for row in ps],
        fwd_bytes=fbytes if live_bytes else [],
        bwd_bytes=bbytes if live_bytes else [],
    )
    return max_over_group(prof, comm)


def max_over_group(prof: Profile, comm: TPComm) -> Profile:
    m, n = len(prof.fwd), len(prof.bwd)
    k = len(prof.fwd_bytes)
    flat = torch.tensor(prof.fwd + prof.bwd + [x for r in prof.pair for x in r]
                        + prof.fwd_bytes + prof.bwd_bytes, dtype=torch.float64)
    if comm.world > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=comm.group)
    v = flat.tolist()
    rest = v[m + n + m * n:]
    return Profile(fwd=v[:m], bwd=v[m:m + n],
                   pair=[v[m + n + i * n: m + n + (i + 1) * n] for i in range(m)],
                   fwd_bytes=rest[:k], bwd_bytes=rest[k:])
