"""Pairwise overlap profiler: what each segment costs next to each segment of the other strand.

Mechanism (DHelix's operator-pair profiling, arXiv 2411.15871), measured the way the executor
runs: a segment's time is from its resume to its park -- first waiting for its own strand's
previous collective, then computing up to its own collective (issued, left in flight). Run
right after a segment of its own strand, it waits for that segment's whole collective; run
right after the other strand's segment, that collective had the other segment's compute to
hide behind. So we measure, on the real model and group:

* fwd[i], bwd[j]: each segment after its own predecessor (a pass run alone);
* fwd_after_b[i][j]: f_i right after b_{j-1}; bwd_after_f[i][j]: b_j right after f_{i-1}
  (passes that alternate the two strands along one diagonal of the (i, j) grid: advance one
  strand alone to the diagonal's start, then alternate backward-first; m + n diagonals cover
  every cell).

The minimum over repetitions (interference from other processes only ever adds time, so the
least sample is the least noisy estimate), then the element-wise maximum over the TP group, so
every TP rank derives the same plan from the same numbers (the slowest rank's view wins).

Guarantee: the profile describes this machine, this group and these shapes; profiling runs
real passes (gradients are accumulated and must be discarded by the caller).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from stalwart.overlap.comm import TPComm
from stalwart.overlap.plan import Profile
from stalwart.overlap.strands import Strand


def _timed(s: Strand) -> float:
    t0 = time.perf_counter()
    s.resume()
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
    """Measure the four tables of ``Profile`` (see the module docstring).

    With `live_bytes` (the activation meter), also the bytes each forward segment saves and
    each backward segment frees (measured on the passes run alone).
    """
    live = live_bytes or (lambda: 0)
    fbytes = [0.0] * m
    bbytes = [0.0] * n
    fs: list[list[float]] = [[] for _ in range(m)]
    bs: list[list[float]] = [[] for _ in range(n)]
    fa: list[list[list[float]]] = [[[] for _ in range(n + 1)] for _ in range(m)]
    ba: list[list[list[float]]] = [[[] for _ in range(n)] for _ in range(m + 1)]
    for _ in range(reps):
        for d in range(-m, n):
            # a completed forward gives the backward strand a graph (times: forward alone)
            first = fwd()
            while not first.done:
                i, before = first.segments, live()
                fs[i].append(_timed(first))
                fbytes[i] = float(live() - before)
            first.join()
            f, b = fwd(), bwd(first.result)
            last = ""
            while not (f.done and b.done):
                i, j = f.segments, b.segments
                if f.done or (not b.done and j - i <= d):
                    (ba[i][j] if last == "F" else bs[j]).append(_timed(b))
                    last = "B"
                else:
                    (fa[i][j] if last == "B" else fs[i]).append(_timed(f))
                    last = "F"
            f.join()
            b.join()
            rest = bwd(f.result)  # frees the second forward's graph (times: backward alone)
            while not rest.done:
                j, before = rest.segments, live()
                bs[j].append(_timed(rest))
                bbytes[j] = float(before - live())
            rest.join()
    fwd_t = [min(x) for x in fs]
    bwd_t = [min(x) for x in bs]
    # a cell no walk reached (none should be) falls back to "no overlap"
    prof = Profile(
        fwd=fwd_t, bwd=bwd_t,
        fwd_after_b=[[min(c) if c else fwd_t[i] for c in row] for i, row in enumerate(fa)],
        bwd_after_f=[[min(c) if c else bwd_t[j] for j, c in enumerate(row)] for row in ba],
        fwd_bytes=fbytes if live_bytes else [],
        bwd_bytes=bbytes if live_bytes else [],
    )
    return max_over_group(prof, comm)


def max_over_group(prof: Profile, comm: TPComm) -> Profile:
    m, n = len(prof.fwd), len(prof.bwd)
    parts = [prof.fwd, prof.bwd, [x for r in prof.fwd_after_b for x in r],
             [x for r in prof.bwd_after_f for x in r], prof.fwd_bytes, prof.bwd_bytes]
    flat = torch.tensor([x for p in parts for x in p], dtype=torch.float64)
    if comm.world > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=comm.group)
    v = flat.tolist()
    out = []
    for p in parts:
        out.append(v[:len(p)])
        v = v[len(p):]
    return Profile(fwd=out[0], bwd=out[1],
                   fwd_after_b=[out[2][i * (n + 1):(i + 1) * (n + 1)] for i in range(m)],
                   bwd_after_f=[out[3][i * n:(i + 1) * n] for i in range(m + 1)],
                   fwd_bytes=out[4], bwd_bytes=out[5])
