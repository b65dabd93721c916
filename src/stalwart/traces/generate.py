"""Traces with known causes, generated: the ground truth the verdict is scored against.

``make_trace(case)`` draws one job's per-operation trace: per step and micro-batch, every
rank of a DP x PP x TP layout runs forward-compute, forward-send, backward-compute,
backward-send; per step grads-reduce-scatter (where the fast ranks wait for the slowest) and
optimizer, under Megatron-LM's timer names. Compute per micro-batch = the stage's base time x
the micro-batch's input size (shared by the stages and TP ranks that see it) x the worker's
factor x a job-wide step factor x per-operation noise (log-normal, sigma 3%, 1% outliers at
2x). ``style``: ``megatron`` (timers that hold the TP collectives: a TP group steps as one, so
a slow rank's TP peers read as slow as it), ``kernels`` (GPU kernels: the slow rank's own
kernels are slow, its TP peers wait in NCCL), ``cpu`` (CPU ops, for Kineto). ``write_kineto``
writes a trace as one Kineto Chrome-trace JSON per rank.

What it shows and does not: a verdict that matches a generated trace confirms that the rule
recovers this generator's own ground truth under this generator's noise model -- not that real
jobs' noise looks like it. Deterministic for a seed. Cost: ~10 us per operation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stalwart.traces.layout import Layout
from stalwart.traces.schema import Trace

BASE_S = 1e-3  # forward compute per micro-batch at a stage
COMM_S = 2e-4


@dataclass
class Case:
    name: str
    layout: Layout
    cause: str = "clean"  # clean | slow_rank | slow_group | slow_host | stage | input
    factor: float = 1.5
    rank: int = 0  # slow_rank
    group: tuple[int, int] = (0, 0)  # slow_group: (dp, pp)
    host: int = 0  # slow_host (layout.ranks_per_host)
    stage: int = 0  # stage
    input_sigma: float = 0.35  # input: log-normal spread of micro-batch sizes
    steps: list[int] = field(default_factory=lambda: list(range(20)))
    micro: int = 4
    traced: list[int] | None = None  # partial traces: only these ranks
    style: str = "megatron"
    fmt: str = "csv"  # csv | parquet | kineto
    seed: int = 0
    noise: float = 0.03
    outlier_p: float = 0.01  # chance an operation is an outlier (a GC pause, a preemption)
    outlier_x: float = 2.0  # an outlier's factor
    onset: int = 0  # the worker fault begins at this index of ``steps`` (0: from the start)

    def expected(self) -> dict[str, list[int]]:
        """kind -> the ranks it must name (in the trace), per this case's ground truth."""
        lay, traced = self.layout, set(self.traced or range(self.layout.world))
        if self.cause == "clean":
            return {}
        if self.cause == "stage":
            return {"stage_imbalance": []}
        if self.cause == "input":
            return {"input_imbalance": []}
        if self.cause == "slow_host":
            return {"slow_host": sorted(r for r in traced if lay.host(r) == self.host)}
        if self.cause == "slow_rank" and (lay.tp == 1 or self.style != "megatron"):
            return {"slow_rank": [self.rank]}
        if self.cause == "slow_rank":  # megatron timers: the TP group steps as one
            c = lay.coord(self.rank)
            g = (c.dp, c.pp)
        else:
            g = self.group
        members = sorted(r for r in traced if (lay.coord(r).dp, lay.coord(r).pp) == g)
        return {"slow_rank" if lay.tp == 1 else "slow_group": members}


def _worker_factor(case: Case, r: int) -> float:
    lay = case.layout
    c = lay.coord(r)
    if case.cause == "slow_rank" and r == case.rank:
        return case.factor
    if case.cause == "slow_group" and (c.dp, c.pp) == tuple(case.group):
        return case.factor
    if case.cause == "slow_host" and lay.host(r) == case.host:
        return case.factor
    return 1.0


def make_trace(case: Case) -> Trace:
    lay = case.layout
    rng = np.random.default_rng(case.seed)
    W, S, M = lay.world, len(case.steps), case.micro
    coords = [lay.coord(r) for r in range(W)]
    base = np.array([BASE_S * (case.factor if case.cause == "stage" and c.pp == case.stage
                               else 1.0) for c in coords])
    wf = np.array([_worker_factor(case, r) for r in range(W)])[:, None] * np.ones(S)
    wf[:, :case.onset] = 1.0  # a fault that begins mid-trace
    size = (np.exp(rng.normal(0, case.input_sigma, (lay.dp, S, M))) if case.cause == "input"
            else np.ones((lay.dp, S, M)))
    step_f = np.exp(rng.normal(0, 0.05, S))

    def noisy(shape: tuple[int, ...]) -> np.ndarray:
        x = np.exp(rng.normal(0, case.noise, shape))
        return x * np.where(rng.random(shape) < case.outlier_p, case.outlier_x, 1.0)

    dp_i = np.array([c.dp for c in coords])
    fwd = (base[:, None, None] * size[dp_i] * wf[:, :, None] * step_f[None, :, None]
           * noisy((W, S, M)))
    bwd = 2 * (base[:, None, None] * size[dp_i] * wf[:, :, None] * step_f[None, :, None]
               * noisy((W, S, M)))
    if case.style == "megatron" and lay.tp > 1:  # timers hold the TP collectives
        for g in {(c.dp, c.pp) for c in coords}:
            idx = [r for r in range(W) if (coords[r].dp, coords[r].pp) == g]
            fwd[idx] = fwd[idx].max(axis=0)
            bwd[idx] = bwd[idx].max(axis=0)
    opt = BASE_S * 0.5 * noisy((W, S))
    busy = fwd.sum(axis=2) + bwd.sum(axis=2) + 4 * M * COMM_S + opt
    step_t = busy.max(axis=0) + COMM_S
    traced = set(case.traced if case.traced is not None else range(W))
    cols: dict[str, list[Any]] = {k: [] for k in ("rank", "step", "name", "start", "duration",
                                                  "micro")}

    def add(r: int, s: int, name: str, t0: float, d: float, m: int) -> float:
        for k, v in zip(cols, (r, s, name, t0, d, m), strict=True):
            cols[k].append(v)
        return t0 + d

    t_step = 100.0
    for si, s in enumerate(case.steps):
        for r in sorted(traced):
            t = t_step
            for m in range(M):
                t = add(r, s, "forward-compute", t, float(fwd[r, si, m]), m)
                t = add(r, s, "forward-send", t, COMM_S, m)
                t = add(r, s, "backward-compute", t, float(bwd[r, si, m]), m)
                t = add(r, s, "backward-send", t, COMM_S, m)
            wait = float(step_t[si] - busy[r, si])
            t = add(r, s, "grads-reduce-scatter", t, COMM_S + wait, -1)
            add(r, s, "optimizer", t, float(opt[r, si]), -1)
        t_step += float(step_t[si]) + 1e-3
    return Trace.from_columns(cols["rank"], cols["step"], cols["name"], cols["start"],
                              cols["duration"], cols["micro"], source=case.name, fmt=case.fmt)


KERNEL_NAMES = {"forward-compute": "ampere_sgemm_128x64_tn",
                "backward-compute": "void at::native::vectorized_elementwise_kernel<4>",
                "forward-send": "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)",
                "backward-send": "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)",
                "grads-reduce-scatter": "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL",
                "optimizer": "void multi_tensor_apply_kernel<AdamFunctor>"}
CPU_NAMES = {"forward-compute": "aten::addmm", "backward-compute": "aten::mm",
             "forward-send": "gloo:send", "backward-send": "gloo:recv",
             "grads-reduce-scatter": "gloo:reduce_scatter", "optimizer": "Optimizer.step#SGD.step"}


def write_kineto(t: Trace, out_dir: Path, style: str = "kernels") -> list[Path]:
    """One Kineto Chrome-trace JSON per rank, ``rank<N>.json`` (times in microseconds)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for r in sorted(set(t.rank.tolist())):
        sel = np.flatnonzero(t.rank == r)
        ev: list[dict[str, Any]] = []
        for s in sorted(set(t.step[sel].tolist())):
            idx = sel[t.step[sel] == s]
            a = float(t.start[idx].min()) * 1e6
            b = float((t.start[idx] + t.duration[idx]).max()) * 1e6
            ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}",
                       "pid": 1, "tid": 1, "ts": a - 1, "dur": b - a + 2})
        for corr, i in enumerate(sel.tolist()):
            ts, dur = float(t.start[i]) * 1e6, float(t.duration[i]) * 1e6
            name = str(t.name[i])
            if style == "kernels":
                ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                           "pid": 1, "tid": 1, "ts": ts, "dur": 0.5,
                           "args": {"correlation": corr}})
                ev.append({"ph": "X", "cat": "kernel", "name": KERNEL_NAMES.get(name, name),
                           "pid": 0, "tid": 7, "ts": ts + 2, "dur": dur,
                           "args": {"correlation": corr, "device": 0}})
            else:
                ev.append({"ph": "X", "cat": "cpu_op", "name": CPU_NAMES.get(name, name),
                           "pid": 1, "tid": 1, "ts": ts, "dur": dur})
        f = out_dir / f"rank{r}.json"
        f.write_text(json.dumps({"schemaVersion": 1, "traceEvents": ev,
                                 "distributedInfo": {"backend": "nccl", "rank": r,
                                                     "world_size": int(t.rank.max()) + 1}}))
        files.append(f)
    return files
