"""Owner update + bounded-drift parameter broadcast: a drop-in optimizer over lossy UDP.

Mechanism: phase 2 of "Distributed Training under Packet Loss" (Weintraub et al., 2025) on the
ZeRO-1 partition (as torch's ZeroRedundancyOptimizer): rank r owns shard r of the flattened
parameters, keeps the inner optimizer's state for it only, steps ANY ``torch.optim`` optimizer
class on it with the unbiased averaged gradient, and broadcasts the UPDATED PARAMETERS. A rank
that misses a chunk keeps its stale copy until a later broadcast lands; a chunk is stale with
probability p per step, so staleness is geometric (mean p/(1-p)) and the replicas' distance to
the owners' parameters stays bounded however long training runs.

``mode="naive"`` is the contrast for the benchmark only: owners broadcast averaged GRADIENTS and
every rank steps a full local optimizer; a missed chunk is a missed update that is never
repaired, so replicas random-walk apart without bound.

``max_grad_norm`` clips the averaged gradient by its global norm (owners exchange their shards'
squared norms in one tiny extra phase), i.e. the semantics of ``clip_grad_norm_`` after a
reliable all-reduce; the alternative, clipping each rank's LOCAL gradient before ``step()``,
also works but is a different (per-rank) clipping rule.

Per-step statistics (``stats()``): pkts_sent/pkts_recv/pkts_lost/pkts_rejected (all phases;
rejected = failed a check; authentic packets that came after their phase are pkts_late),
deadline_hits, copies (most copies of a packet sent this step), loss_in (the highest raw loss
rate this rank measures on its incoming links), drift, stale_max, silent_ranks, comm_time,
rx_errors (receive-handler failures this step; past a bound the step raises instead).
``drift`` is the largest |replica - owner| this rank observed this step: for every chunk that
landed, the gap between the stale local copy and the owner's value that replaced it (with no
loss: one step's update);
``stale_max`` is the age in steps of this replica's oldest chunk.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch

from stalwart.comm.collective import LossyCollective
from stalwart.comm.wire import R

MAX_EXTRAPOLATE = 4  # steps a missed chunk is moved along its last update before it freezes


def require_cpu(params: list[torch.Tensor]) -> None:
    """Refuse parameters off the CPU with one line. The transport reads gradients and writes
    parameters through numpy views of host memory (``.numpy()``), which CUDA tensors do not
    have; staging through pinned host buffers would work but was never run on a GPU here."""
    devs = sorted({str(p.device) for p in params if p.device.type != "cpu"})
    if devs:
        raise ValueError(f"stalwart.comm works on CPU parameters only (got {', '.join(devs)}): "
                         f"use the reliable backend (NCCL) for GPU training")


class ShardedLossyOptimizer:
    """Optimizer-like object over a list of parameters, communicating through ``coll``."""

    def __init__(self, params: list[torch.Tensor], optimizer_class: type[torch.optim.Optimizer],
                 coll: LossyCollective, mode: str = "params",
                 max_grad_norm: float | None = None, stale: str = "keep",
                 **kwargs: Any) -> None:
        if mode not in ("params", "naive"):
            raise ValueError(f"unknown mode {mode!r} (params or naive)")
        require_cpu(params)
        self.params = params
        self.coll = coll
        if stale not in ("extrapolate", "keep"):
            raise ValueError(f"unknown stale policy {stale!r} (extrapolate or keep)")
        self.mode = mode
        self.stale = stale
        self.max_grad_norm = max_grad_norm
        self.numel = sum(p.numel() for p in params)
        lay = coll.layout
        if lay.numel != self.numel:
            raise ValueError(f"collective sized for {lay.numel} elements, params have {self.numel}")
        self.lo, self.hi = lay.shard(coll.rank)
        self.flat = self._gather_params()  # this rank's replica, flat
        self.age = np.zeros(self.numel, np.int32)  # steps since each element was refreshed
        self.last_true = self.flat.copy()  # each element's value when it last landed
        self.vel = np.zeros(self.numel, np.float32)  # its owner's recent update per step
        if mode == "params":
            self.shard = torch.nn.Parameter(torch.from_numpy(self.flat[self.lo: self.hi].copy()))
        else:
            self.shard = torch.nn.Parameter(torch.from_numpy(self.flat.copy()))
        self.inner = optimizer_class([self.shard], **kwargs)
        self._stats: dict[str, Any] = {}

    # ---- optimizer surface ----------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups  # the caller's lr schedule reaches the owner directly

    @property
    def state(self) -> Any:
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "mode": self.mode, "numel": self.numel,
                "shard": (self.lo, self.hi)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("numel") != self.numel or tuple(sd.get("shard", ())) != (self.lo, self.hi):
            raise ValueError("optimizer state was saved for another model size or world size")
        self.flat = self._gather_params()  # the model may have been reloaded too
        with torch.no_grad():
            src = self.flat[self.lo: self.hi] if self.mode == "params" else self.flat
            self.shard.copy_(torch.from_numpy(src))
        self.inner.load_state_dict(sd["inner"])

    # ---- the step -------------------------------------------------------------------------
    def _gather_params(self) -> np.ndarray:
        with torch.no_grad():
            return torch.cat([p.detach().reshape(-1).float() for p in self.params]).numpy().copy()

    def _gather_grads(self) -> np.ndarray:
        with torch.no_grad():
            return torch.cat([
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                for p in self.params]).numpy()

    def _scatter_params(self) -> None:
        with torch.no_grad():
            src = torch.from_numpy(self.flat)
            i = 0
            for p in self.params:
                n = p.numel()
                p.copy_(src[i: i + n].view_as(p))
                i += n

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("closures are not supported (the gradient comes from the network)")
        t0 = time.perf_counter()
        coll = self.coll
        coll.begin_round()
        grads = self._gather_grads()
        avg, p1 = coll.reduce_scatter(grads)
        phases = [p1]
        if self.max_grad_norm is not None:
            # clip the AVERAGED gradient by its global norm -- exactly what
            # clip_grad_norm_ after a reliable all-reduce does (same formula)
            total_sq, p3 = coll.global_norm_sq(float(np.dot(avg.astype(np.float64), avg)))
            phases.append(p3)
            coef = min(1.0, self.max_grad_norm / (math.sqrt(total_sq) + 1e-6))
            if coef < 1.0:
                avg *= np.float32(coef)
        if self.mode == "params":
            # the owner's shard is authoritative: the model's copy of it equals self.shard
            # unless the caller reloaded the model, which this picks up
            self.shard.copy_(torch.from_numpy(self.flat_model_shard()))
            self.shard.grad = torch.from_numpy(avg.copy())
            self.inner.step()
            new = self.shard.detach().numpy()
            before = self.flat.copy()
            mask, p2 = coll.broadcast(new, self.flat)
            phases.append(p2)
            landed = mask.copy()
            landed[self.lo: self.hi] = False
            drift = float(np.abs(before[landed] - self.flat[landed]).max()) if landed.any() \
                else 0.0
        else:
            full = np.zeros(self.numel, np.float32)  # a missed chunk = a missed update
            mask, p2 = coll.broadcast(avg, full)
            phases.append(p2)
            self.shard.copy_(torch.from_numpy(self._gather_params()))
            self.shard.grad = torch.from_numpy(full)
            self.inner.step()
            self.flat = self.shard.detach().numpy().copy()
            drift = float("nan")  # unobservable locally: the benchmark measures it exactly
        if self.mode == "params":
            self._refresh(mask)
        else:
            self.age += 1
            self.age[mask] = 0
        self._scatter_params()
        rej = coll.bad_packets()
        late = int(coll.rejected[R["late"]])
        rx_err = coll.transport.handler_errors
        self._stats = {
            "pkts_sent": sum(p.sent for p in phases), "pkts_recv": sum(p.recv for p in phases),
            "pkts_lost": sum(p.lost for p in phases),
            "pkts_rejected": rej - self._stats.get("_rej_total", 0), "_rej_total": rej,
            "pkts_late": late - self._stats.get("_late_total", 0), "_late_total": late,
            # receive-handler failures (each lost a batch of datagrams); past
            # collective.MAX_HANDLER_ERRORS the step raises ReceiveFailed instead
            "rx_errors": rx_err - self._stats.get("_rx_err_total", 0), "_rx_err_total": rx_err,
            "deadline_hits": sum(int(p.deadline_hit) for p in phases),
            # forward error protection in force, and the worst incoming loss measured
            "copies": max(p.copies for p in phases),
            "loss_in": coll.worst_loss_in(),
            "drift": drift, "stale_max": int(self.age.max()) if self.numel else 0,
            "silent_ranks": sorted(coll.silent),
            "comm_time": (time.perf_counter() - t0),
            # per phase: where the time went (t_norm only with max_grad_norm)
            "t_reduce": p1.elapsed, "t_bcast": p2.elapsed,
            **({"t_norm": phases[1].elapsed} if len(phases) == 3 else {}),
        }

    def _refresh(self, mask: np.ndarray) -> None:
        """Book-keeping of landed vs missed elements; extrapolate the missed ones.

        A missed chunk's owner almost certainly moved it by about the same update as in its
        last steps (optimizer updates are smooth: momentum), so instead of freezing the stale
        copy we continue it along its last observed per-step update, for at most
        ``MAX_EXTRAPOLATE`` steps. When the owner's broadcast lands, its exact value replaces
        the estimate: the drift stays bounded, and it is smaller than with a frozen copy.
        """
        landed = np.flatnonzero(mask)
        if landed.size:
            steps = self.age[landed] + 1
            self.vel[landed] = (self.flat[landed] - self.last_true[landed]) / steps
            self.last_true[landed] = self.flat[landed]
            self.age[landed] = 0
        missed = np.flatnonzero(~mask)
        if missed.size:
            self.age[missed] += 1
            if self.stale == "extrapolate":
                k = np.minimum(self.age[missed], MAX_EXTRAPOLATE).astype(np.float32)
                self.flat[missed] = self.last_true[missed] + self.vel[missed] * k

    def flat_model_shard(self) -> np.ndarray:
        with torch.no_grad():
            i, out = 0, []
            for p in self.params:
                n = p.numel()
                lo, hi = max(self.lo, i), min(self.hi, i + n)
                if lo < hi:
                    out.append(p.detach().reshape(-1)[lo - i: hi - i].float())
                i += n
            return torch.cat(out).numpy() if out else np.zeros(0, np.float32)

    def stats(self) -> dict[str, Any]:
        """Metrics of the last step (merged by the worker into metrics.jsonl)."""
        return {k: v for k, v in self._stats.items() if not k.startswith("_")}

    def close(self) -> None:
        self.coll.close()
