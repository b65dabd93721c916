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

import collections
import math
import time
from typing import Any

import numpy as np
import torch

from stalwart.comm.collective import LossyCollective
from stalwart.comm.staging import HostStaging
from stalwart.comm.wire import R

MAX_EXTRAPOLATE = 4  # steps a missed chunk is moved along its last update before it freezes


OptimizerSpec = type[torch.optim.Optimizer] | torch.optim.Optimizer


def param_groups_of(module_params: list[torch.Tensor], optimizer: OptimizerSpec,
                    kwargs: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The parameter groups the lossy optimizer trains, as the user gave them: an optimizer
    instance's own groups; or, for a class, ``kwargs["params"]`` (an iterable of tensors or of
    group dicts) if given, else every trainable parameter of the module in one group. Each group
    is a dict with "params" (a list) and its own hyper-parameters. Returns (groups, the
    remaining kwargs: the optimizer class's constructor options)."""
    kwargs = dict(kwargs)
    if isinstance(optimizer, torch.optim.Optimizer):
        if kwargs:
            raise ValueError(f"optimizer options ({', '.join(sorted(kwargs))}) go to the "
                             f"optimizer's constructor, and this optimizer is already built")
        groups = [dict(g) for g in optimizer.param_groups]
    elif isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        given = kwargs.pop("params", None)
        if given is None:
            groups = [{"params": list(module_params)}]
        else:
            given = list(given)
            if given and isinstance(given[0], dict):
                groups = [dict(g) for g in given]
            else:
                groups = [{"params": given}]
    else:
        raise ValueError(f"expected a torch.optim.Optimizer class or instance, got "
                         f"{optimizer!r}")
    seen: set[int] = set()
    for g in groups:
        g["params"] = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(
            g["params"])
        for p in g["params"]:
            if id(p) in seen:
                raise ValueError("a parameter appears in more than one parameter group")
            seen.add(id(p))
    return groups, kwargs


class ShardedLossyOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` over the user's parameter groups that communicates through
    ``coll``: any ``lr_scheduler`` works on it, ``param_groups`` are the user's groups (their
    own hyper-parameters; a scheduler's or the caller's changes reach the owner's optimizer at
    the next ``step()``), ``state_dict``/``load_state_dict`` hold this rank's shard of the
    optimizer state.

    The flat vector is the groups' parameters in order, so each group covers one contiguous
    range of it and, on this rank's shard, one contiguous segment: the inner optimizer (the
    user's class, or the user's instance re-pointed at the segments) has one group per user
    group, holding that segment as one flat tensor, with that group's hyper-parameters.
    """

    def __init__(self, params: list[torch.Tensor] | list[dict[str, Any]],
                 optimizer_class: OptimizerSpec, coll: LossyCollective,
                 mode: str = "params", max_grad_norm: float | None = None,
                 stale: str = "keep", **kwargs: Any) -> None:
        if mode not in ("params", "naive"):
            raise ValueError(f"unknown mode {mode!r} (params or naive)")
        if stale not in ("extrapolate", "keep"):
            raise ValueError(f"unknown stale policy {stale!r} (extrapolate or keep)")
        if isinstance(optimizer_class, torch.optim.Optimizer):
            groups, kwargs = param_groups_of([], optimizer_class, kwargs)  # the instance's own
        else:
            groups, kwargs = param_groups_of([], optimizer_class,
                                             {**kwargs, "params": list(params)})
        self.params = [p for g in groups for p in g["params"]]
        # CPU or CUDA parameters; the transport and the owner's update work in host memory
        self.staging = HostStaging(self.params)
        self.coll = coll
        self.mode = mode
        self.stale = stale
        self.max_grad_norm = max_grad_norm
        self.numel = sum(p.numel() for p in self.params)
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
            base = self.lo
        else:
            self.shard = torch.nn.Parameter(torch.from_numpy(self.flat.copy()))
            base = 0
        # each group's segment of the shard: [seg_lo, seg_hi) in shard coordinates
        self._segs: list[tuple[int, int]] = []
        at = 0
        for g in groups:
            n = sum(p.numel() for p in g["params"])
            lo = min(max(at - base, 0), self.shard.numel())
            hi = min(max(at + n - base, 0), self.shard.numel())
            self._segs.append((lo, hi))
            at += n
        self._views = [torch.nn.Parameter(self.shard.detach()[lo:hi].clone())
                       for lo, hi in self._segs]
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        if isinstance(optimizer_class, torch.optim.Optimizer):
            inner = optimizer_class  # the user's instance, re-pointed at this rank's segments
            inner.param_groups = []
            inner.state = collections.defaultdict(dict)
            for v, h in zip(self._views, hyper, strict=True):
                inner.add_param_group({"params": [v], **h})
        else:
            inner = optimizer_class([{"params": [v], **h}
                                     for v, h in zip(self._views, hyper, strict=True)], **kwargs)
        self.inner = inner
        # the user-facing groups: the user's tensors and the inner groups' full hyper-parameters
        outer = [{**{k: v for k, v in ig.items() if k != "params"}, "params": g["params"]}
                 for g, ig in zip(groups, inner.param_groups, strict=True)]
        super().__init__(outer, dict(inner.defaults))
        self._stats: dict[str, Any] = {}

    # ---- optimizer surface ----------------------------------------------------------------
    def _sync_hyper(self) -> None:
        """Carry the user-facing groups' hyper-parameters (lr schedules, weight decay changes)
        to the owner's optimizer."""
        for og, ig in zip(self.param_groups, self.inner.param_groups, strict=True):
            for k, v in og.items():
                if k != "params":
                    ig[k] = v

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"inner": self.inner.state_dict(), "groups": groups, "mode": self.mode,
                "numel": self.numel, "shard": (self.lo, self.hi)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = state_dict
        if sd.get("numel") != self.numel or tuple(sd.get("shard", ())) != (self.lo, self.hi):
            raise ValueError("optimizer state was saved for another model size or world size")
        self.flat = self._gather_params()  # the model may have been reloaded too
        with torch.no_grad():
            src = self.flat[self.lo: self.hi] if self.mode == "params" else self.flat
            self.shard.copy_(torch.from_numpy(src))
            for v, (lo, hi) in zip(self._views, self._segs, strict=True):
                v.copy_(self.shard[lo:hi])
        self.inner.load_state_dict(sd["inner"])
        for g, saved in zip(self.param_groups, sd.get("groups", []), strict=False):
            g.update(saved)
        self._sync_hyper()

    # ---- the step -------------------------------------------------------------------------
    def _gather_params(self) -> np.ndarray:
        return self.staging.values()

    def _gather_grads(self) -> np.ndarray:
        return self.staging.grads()

    def _scatter_params(self) -> None:
        self.staging.put_values(self.flat)

    def _inner_step(self, values: np.ndarray, grad: np.ndarray) -> np.ndarray:
        """Step the inner optimizer on ``values`` (this rank's shard, or the whole vector in
        naive mode) with ``grad``; returns the new values."""
        self._sync_hyper()
        out = values.copy()
        for v, (lo, hi) in zip(self._views, self._segs, strict=True):
            v.copy_(torch.from_numpy(values[lo:hi]))
            v.grad = torch.from_numpy(np.ascontiguousarray(grad[lo:hi]))
        self.inner.step()
        for v, (lo, hi) in zip(self._views, self._segs, strict=True):
            out[lo:hi] = v.detach().numpy()
            v.grad = None
        with torch.no_grad():
            self.shard.copy_(torch.from_numpy(out))
        return out

    def step(self, closure: Any = None) -> Any:
        """One data-parallel step: reduce-scatter the LOCAL gradients, (clip,) update the owned
        shard, broadcast it. ``closure`` (optional) is called once, with gradients enabled,
        before that (it must run forward and backward) and its loss is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._step()
        return loss

    def _step(self) -> None:
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
            new = self._inner_step(self.flat_model_shard(), avg)
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
            self.flat = self._inner_step(self._gather_params(), full)
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
            # erasure code: parity packets sent, chunks this rank rebuilt from parity
            "parity": sum(p.parity for p in phases),
            "recovered": sum(p.recovered for p in phases),
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
        return self.staging.slice_values(self.lo, self.hi)

    def stats(self) -> dict[str, Any]:
        """Metrics of the last step (merged by the worker into metrics.jsonl)."""
        return {k: v for k, v in self._stats.items() if not k.startswith("_")}

    def close(self) -> None:
        self.coll.close()
