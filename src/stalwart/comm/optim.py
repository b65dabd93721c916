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

Re-sharding (an in-place regroup, train/inplace.py): ``full_state()`` is a collective over a
process group in which every rank that holds a shard contributes it (and any ``piece`` it was
handed: a leaving rank's shard); every rank of the group -- one that holds nothing too, e.g. a
rank that joins -- gets the whole optimizer as ``FullState``: the flat parameter vector with
each element's OWNER's value (replicas may be stale: the owners' values are the truth), the
per-element state over the whole vector (AdamW's exp_avg and exp_avg_sq; a tensor is
per-element when it has the dimension and size of its segment) and the scalar state (AdamW's
step; identical across owners: the first one's). A lossy optimizer built for another world
takes its own shard of it with ``load_full_state``. Elements no piece owns (a dead owner's
shard) get their parameter values from one named rank's replica and their per-element state
restarts from zero (``FullState.reset`` counts them). Generic over the inner optimizer: only
its state's shapes are read. Cost: one all-gather of a few hundred bytes (who owns what, the
state's keys, the scalar state) and one all-reduce of (1 + per-element keys) x 4 bytes per
parameter (AdamW: 12; per further dtype of state one more all-reduce).

The step in flight: with ``keep_undo`` (set in jobs that regroup in place) the owner keeps
its shard's values and optimizer state from before its last update (a copy of 3 x 4 bytes
per owned parameter per step with AdamW), so that a step that raises after the update --
the collective was interrupted (``interrupt``: a member was lost) -- leaves the owner's shard
as it was, and an owner one committed step ahead of the others can go back (``undo_last``).
"""

from __future__ import annotations

import collections
import copy
import math
import time
from dataclasses import dataclass
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

    def __init__(self, params: list[torch.Tensor] | list[dict[str, Any]],  # noqa: PLR0915
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
        self._bounds: list[tuple[int, int]] = []  # each group's range of the flat vector
        at = 0
        for g in groups:
            n = sum(p.numel() for p in g["params"])
            lo = min(max(at - base, 0), self.shard.numel())
            hi = min(max(at + n - base, 0), self.shard.numel())
            self._segs.append((lo, hi))
            self._bounds.append((at, at + n))
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
        # the owner's shard before its last update: (values, inner state), while keep_undo
        self.keep_undo = False
        self._undo: tuple[np.ndarray, dict[Any, dict[str, Any]]] | None = None
        self.committed = 0  # steps this optimizer completed (its update and broadcast)

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
            cur = self.flat_model_shard()
            if self.keep_undo:
                self._undo = (cur, _clone_state(self.inner.state))  # (cur: a fresh copy)
            new = self._inner_step(cur, avg)
            before = self.flat.copy()
            try:
                mask, p2 = coll.broadcast(new, self.flat)
            except BaseException:
                if self._undo is not None:  # the step did not complete: nor does its update
                    self.undo_last()
                raise
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
        self.committed += 1
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

    # ---- in-place regroups: the step in flight, re-sharding ------------------------------
    def interrupt(self, why: str) -> None:
        """Make the step in progress (or the next one) raise ``collective.Interrupted`` at
        its next wait for packets (from any thread: a membership change was announced)."""
        self.coll.interrupt(why)

    def can_undo(self) -> bool:
        """Whether the owner's last update can be undone (``keep_undo``, not undone yet)."""
        return self._undo is not None

    def undo_last(self) -> None:
        """Put the owner's shard -- its values in the model and the inner optimizer's state --
        back to what it was before its last update."""
        if self._undo is None:
            raise RuntimeError("no update to undo")
        values, state = self._undo
        self._undo = None
        self.inner.state.clear()
        self.inner.state.update(state)
        self._set_shard(values)
        full = self._gather_params()
        full[self.lo: self.hi] = values
        self.flat[self.lo: self.hi] = values
        self.staging.put_values(full)

    def _set_shard(self, values: np.ndarray) -> None:
        with torch.no_grad():
            self.shard.copy_(torch.from_numpy(np.ascontiguousarray(values)))
            for v, (lo, hi) in zip(self._views, self._segs, strict=True):
                v.copy_(self.shard[lo:hi])

    def piece(self) -> dict[str, Any]:
        """This rank's shard as a self-contained piece of the whole optimizer (what
        ``gather_full_state`` takes; a rank leaving the job sends its piece to one that
        stays): its range of the flat vector and its owner's values there, per group the
        per-element state of its segment (global start, tensor) and the scalar state, the
        groups' ranges and hyper-parameters. Copies: the optimizer may go on."""
        if self.mode != "params":
            raise ValueError("only mode='params' has owners' state to re-shard")
        elem, scalar = [], []
        for v, (lo, hi) in zip(self._views, self._segs, strict=True):
            st = self.inner.state.get(v, {})
            elem.append({k: (self.lo + lo, _clone(t).reshape(-1)) for k, t in st.items()
                         if _per_element(t, hi - lo)})
            scalar.append({k: _clone(t) for k, t in st.items() if not _per_element(t, hi - lo)})
        return {"range": (self.lo, self.hi), "values": self.flat_model_shard(),
                "numel": self.numel, "bounds": list(self._bounds), "elem": elem,
                "scalar": scalar,
                "hyper": [{k: v for k, v in g.items() if k != "params"}
                          for g in self.param_groups]}

    def full_state(self, values_from: int | None = None, group: Any = None,
                   extra: list[dict[str, Any]] | None = None) -> FullState:
        """The whole optimizer, gathered from the owners over ``group`` (see the module's
        docstring; every rank of the group calls it: ``gather_full_state``)."""
        return gather_full_state(self, values_from, group, extra)

    def load_full_state(self, full: FullState) -> None:
        """Become this rank's shard of ``full``: the parameters (all of them, into the model
        and this replica), this shard's per-element state, the scalar state and the groups'
        hyper-parameters. Local: no communication."""
        if self.mode != "params":
            raise ValueError("only mode='params' has owners' state to re-shard")
        if full.numel != self.numel or [tuple(b) for b in full.bounds] != self._bounds:
            raise ValueError("full state of another model or parameter grouping")
        self.flat = np.array(full.values, np.float32, copy=True)
        self.staging.put_values(self.flat)
        self.age[:] = 0
        self.last_true = self.flat.copy()
        self.vel[:] = 0
        self._set_shard(self.flat[self.lo: self.hi])
        self.inner.state.clear()
        for gi, (v, (slo, shi)) in enumerate(zip(self._views, self._segs, strict=True)):
            a = self.lo + slo - full.bounds[gi][0]
            st: dict[str, Any] = {k: t[a: a + shi - slo].clone().to(v.device)
                                  for k, t in full.elem[gi].items()}
            st.update({k: _clone(t) for k, t in full.scalar[gi].items()})
            if st:
                self.inner.state[v] = st
        for g, h in zip(self.param_groups, full.hyper, strict=False):
            g.update(h)
        self._sync_hyper()
        self._undo = None


# ---- the whole optimizer, for re-sharding --------------------------------------------------
@dataclass
class FullState:
    """A lossy optimizer's state over the whole flat vector (``full_state``)."""

    numel: int
    bounds: list[tuple[int, int]]  # each parameter group's range of the flat vector
    values: np.ndarray  # float32: each element's owner's parameter value
    elem: list[dict[str, torch.Tensor]]  # per group: per-element state over its range
    scalar: list[dict[str, Any]]  # per group: scalar state (the owners', identical)
    hyper: list[dict[str, Any]]  # per group: hyper-parameters
    reset: int = 0  # elements of no contributing owner: their per-element state restarted


def _per_element(t: Any, n: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 1 and t.numel() == n


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _clone(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


def _clone_state(state: Any) -> dict[Any, dict[str, Any]]:
    return {p: {k: _clone(v) for k, v in s.items()} for p, s in state.items()}


def _packing(numel: int, bounds: list[tuple[int, int]],
             schema: list[dict[str, str]]) -> tuple[dict[str, int], dict[Any, int]]:
    """Sizes of the packed buffers (one per dtype; "float32" starts with the values) and
    where each group's per-element key starts in its buffer."""
    size = {"float32": numel}
    at: dict[Any, int] = {}
    for gi, keys in enumerate(schema):
        n = bounds[gi][1] - bounds[gi][0]
        for k in sorted(keys):
            name = keys[k]
            at[(gi, k)] = size.get(name, 0)
            size[name] = size.get(name, 0) + n
    return size, at


def _buffers(size: dict[str, int]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(n, dtype=getattr(torch, name)) for name, n in size.items()}


def _uncovered(numel: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of [0, numel) outside ``ranges``; RuntimeError when two ranges overlap."""
    out, at = [], 0
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if lo < at:
            raise RuntimeError(f"two ranks own overlapping shards of the optimizer ({lo} < {at})")
        if lo > at:
            out.append((at, lo))
        at = hi
    if at < numel:
        out.append((at, numel))
    return out


def _meta(p: dict[str, Any]) -> dict[str, Any]:
    """A piece without its data: what the ranks tell each other before the all-reduce."""
    return {"range": tuple(p["range"]), "numel": p["numel"], "bounds": p["bounds"],
            "elem": [{k: _dtype_name(t) for k, (_, t) in e.items()} for e in p["elem"]],
            "scalar": p["scalar"], "hyper": p["hyper"]}


def _fill(p: dict[str, Any], bounds: list[tuple[int, int]], bufs: dict[str, torch.Tensor],
          at: dict[Any, int]) -> None:
    """Write piece ``p`` (its owner's values and per-element state) into the packed buffers."""
    lo, hi = p["range"]
    bufs["float32"][lo:hi] = torch.from_numpy(np.ascontiguousarray(p["values"]))
    for gi, e in enumerate(p["elem"]):
        for k, (start, t) in e.items():
            o = at[(gi, k)] + start - bounds[gi][0]
            bufs[_dtype_name(t)][o: o + t.numel()] = t.detach().reshape(-1).cpu()


def _union(pieces: list[dict[str, Any]], groups: int
           ) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    """Per group: every piece's per-element keys (with their dtypes), the first piece's
    scalar state."""
    schema: list[dict[str, str]] = [{} for _ in range(groups)]
    scalar: list[dict[str, Any]] = [{} for _ in range(groups)]
    for m in pieces:
        for gi, (elem, sc) in enumerate(zip(m["elem"], m["scalar"], strict=True)):
            for k, name in elem.items():
                schema[gi].setdefault(k, name)
            for k, v in sc.items():
                scalar[gi].setdefault(k, v)
    return schema, scalar


def gather_full_state(opt: ShardedLossyOptimizer | None, values_from: int | None = None,
                      group: Any = None, extra: list[dict[str, Any]] | None = None
                      ) -> FullState:
    """Collective over ``group`` (every rank calls it): the whole optimizer from the shards
    the ranks hold -- ``opt``'s (None: a rank that holds none, e.g. one that joins) and the
    ``extra`` pieces it was given (``piece``: a leaving rank's). Each element is filled by
    the one piece that owns it -- zeros elsewhere and a SUM all-reduce, so every rank gets it
    bit for bit. Elements no piece owns take their values from the replica of rank
    ``values_from`` (of ``group``) and zero per-element state (``reset`` counts them). The
    scalar state is the first piece's, in rank order. RuntimeError when no rank holds a
    shard, two overlap, or elements are left without values."""
    import torch.distributed as dist

    world, me = dist.get_world_size(group), dist.get_rank(group)
    mine = ([opt.piece()] if opt is not None else []) + list(extra or [])
    metas: list[Any] = [None] * world
    dist.all_gather_object(metas, ([_meta(p) for p in mine], opt is not None), group=group)
    pieces = [m for ms, _ in metas for m in ms]
    if not pieces:
        raise RuntimeError("no rank holds a shard of the lossy optimizer")
    ref = pieces[0]
    if any(m["numel"] != ref["numel"] or m["bounds"] != ref["bounds"] for m in pieces):
        raise RuntimeError("the ranks' lossy optimizers cover different parameters")
    numel, bounds = int(ref["numel"]), [tuple(b) for b in ref["bounds"]]
    schema, scalar = _union(pieces, len(bounds))
    gaps = _uncovered(numel, [m["range"] for m in pieces])
    if gaps and (values_from is None or not metas[values_from][1]):
        raise RuntimeError(f"elements {gaps} have no owner and no replica was named for them")
    size, at = _packing(numel, bounds, schema)
    bufs = _buffers(size)
    for p in mine:
        _fill(p, bounds, bufs, at)
    if me == values_from and gaps:
        assert opt is not None
        replica = torch.from_numpy(opt._gather_params())
        for a, b in gaps:
            bufs["float32"][a:b] = replica[a:b]
    for name in sorted(bufs):
        dist.all_reduce(bufs[name], op=dist.ReduceOp.SUM, group=group)
    full = FullState(numel, bounds, bufs["float32"][:numel].numpy().copy(),
                     [{} for _ in bounds], scalar, ref["hyper"],
                     sum(b - a for a, b in gaps) if any(schema) else 0)
    for gi, keys in enumerate(schema):
        n = bounds[gi][1] - bounds[gi][0]
        full.elem[gi] = {k: bufs[name][at[(gi, k)]: at[(gi, k)] + n].clone()
                         for k, name in keys.items()}
    return full
