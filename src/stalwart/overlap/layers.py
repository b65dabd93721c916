"""Megatron-style column- and row-parallel linear layers with explicit asynchronous collectives.

Mechanism (Megatron-LM tensor parallelism; the workload DHelix interleaves): a column-parallel
linear holds a slice of the output features; its forward needs no communication (the input is
replicated) and its backward all-reduces the input gradient (every rank holds a partial sum). A
row-parallel linear holds a slice of the input features; its forward all-reduces the partial
output, its backward needs no communication. A column layer followed by a row layer (qkv ->
attention -> proj, fc -> GELU -> proj) therefore costs one all-reduce in forward and one in
backward.

Every collective goes through ``TPComm.start``/``finish`` (see ``comm.py``): the column layer's
backward issues the input-gradient all-reduce and computes its weight gradient before waiting
(Megatron's async dgrad all-reduce), and inside a strand ``finish`` is where the other strand
gets to run. Guarantee: outputs and gradients equal those of the unsharded ``nn.Linear`` (up to
float summation order), whatever the mode.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from stalwart.overlap.comm import TPComm


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _ColumnParallelFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, comm: TPComm):  # type: ignore[override]
        comm.pump()  # a collective may have completed: the next queued one goes (serial)
        ctx.save_for_backward(x, weight)
        ctx.comm = comm
        ctx.params = (weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        comm: TPComm = ctx.comm
        comm.pump()
        g = g.contiguous()
        # input gradient first: it is what the all-reduce needs; the weight gradient is local
        # work that runs while the all-reduce is in flight -- or, split off into the queue,
        # whenever some strand would block on a collective (wgrad.py)
        pending = comm.start_matmul(g, weight)
        gw, gb = _weight_grads(comm, x, g, *ctx.params)
        gx = comm.finish(pending)
        return gx, gw, gb, None


class _RowParallelFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, comm: TPComm):  # type: ignore[override]
        comm.pump()  # a collective may have completed: the next queued one goes (serial)
        ctx.save_for_backward(x, weight)
        ctx.comm = comm
        ctx.params = (weight, bias)
        # bias is added once, after the reduction (every rank holds the full bias)
        out = comm.finish(comm.start_matmul(x, weight.t()))
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        ctx.comm.pump()
        g = g.contiguous()
        gx = torch.matmul(g, weight)
        gw, gb = _weight_grads(ctx.comm, x, g, *ctx.params)
        return gx, gw, gb, None


def _weight_grads(comm: TPComm, x: torch.Tensor, g: torch.Tensor, weight: nn.Parameter,
                  bias: nn.Parameter | None
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The weight and bias gradients now, or (None, None) after queueing them (split backward:
    autograd then accumulates nothing for them; the queue adds them to ``.grad`` itself)."""
    if comm.wgrad is not None:
        comm.wgrad.push(x, g, weight, bias)
        return None, None
    return _flat(g).t().matmul(_flat(x)), (_flat(g).sum(0) if bias is not None else None)


def mark_sharded(*params: nn.Parameter | None) -> None:
    """Tag parameters that hold a different slice on each TP rank (see ``tp_grad_norm``)."""
    for p in params:
        if p is not None:
            p.tp_sharded = True  # type: ignore[attr-defined]


def is_sharded(p: torch.Tensor) -> bool:
    return bool(getattr(p, "tp_sharded", False))


class ColumnParallelLinear(nn.Module):
    """y[..., my slice of out_features] = x W_slice^T + b_slice; input replicated."""

    def __init__(self, in_features: int, out_features: int, comm: TPComm, bias: bool = True,
                 ) -> None:
        super().__init__()
        if out_features % comm.world:
            raise ValueError(f"out_features {out_features} not divisible by TP size {comm.world}")
        self.comm = comm
        self.in_features, self.out_features = in_features, out_features
        self.local_out = out_features // comm.world
        self.weight = nn.Parameter(torch.empty(self.local_out, in_features))
        self.bias = nn.Parameter(torch.zeros(self.local_out)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        mark_sharded(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ColumnParallelFn.apply(x, self.weight, self.bias, self.comm)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}/{self.comm.world}"


class RowParallelLinear(nn.Module):
    """y = all_reduce(x[..., my slice of in_features] W_slice^T) + b; output replicated."""

    def __init__(self, in_features: int, out_features: int, comm: TPComm, bias: bool = True,
                 ) -> None:
        super().__init__()
        if in_features % comm.world:
            raise ValueError(f"in_features {in_features} not divisible by TP size {comm.world}")
        self.comm = comm
        self.in_features, self.out_features = in_features, out_features
        self.local_in = in_features // comm.world
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None  # replicated
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        mark_sharded(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RowParallelFn.apply(x, self.weight, self.bias, self.comm)

    def extra_repr(self) -> str:
        return f"in={self.in_features}/{self.comm.world}, out={self.out_features}"


# ---- sharding full weights -------------------------------------------------------------------
def column_slice(full: torch.Tensor, rank: int, world: int, parts: int = 1) -> torch.Tensor:
    """This rank's rows of a column-parallel weight/bias.

    `parts` > 1 when the output is a concatenation of equally sized blocks that are each split
    (qkv = [q; k; v]: every rank takes its heads' rows of q, of k and of v).
    """
    blocks = full.chunk(parts, dim=0)
    return torch.cat([b.chunk(world, dim=0)[rank] for b in blocks], dim=0).clone()


def row_slice(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's input columns of a row-parallel weight."""
    return full.chunk(world, dim=1)[rank].clone()
