"""The worker seam: ``build_tp_trainer`` -> a TP GPT plus its step executor (docs/CONTRACTS.md).

Builds the reference GPT, shards it over the TP group (``TPGPT.from_full``: the same
initialisation as the single-process model, made identical on every rank by a broadcast from
global rank 0), and wraps it in ``Interleaved`` with the run's schedule ("off" = sequential
micro-batches, "si" = strand interleaving; "async" = intra-micro-batch overlap, used by the
benchmark). The plan is stored as ``RUN_DIR/overlap-plan.json`` and reused on resume.

Guarantee: ``trainer.forward_backward(micro_batches)`` leaves in ``.grad`` the gradient of the
mean micro-batch loss, averaged over the DP group -- the same whatever the schedule.
``trainer.clip_grad_norm_`` clips by the *global* norm (sharded parameters' squares summed over
the TP group, replicated ones counted once), which is what the unsharded model would clip by;
a per-rank ``torch.nn.utils.clip_grad_norm_`` would scale the TP ranks differently.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from stalwart.events import OverlapPlan
from stalwart.overlap.comm import TPComm, retire
from stalwart.overlap.executor import SCHEDULES, Interleaved, MicroBatch
from stalwart.overlap.layers import is_sharded
from stalwart.overlap.tpgpt import TPGPT
from stalwart.rundir import EventLog
from stalwart.train.model import GPT, GPTConfig

PLAN_FILE = "overlap-plan.json"


def tp_grad_norm(params: list[torch.Tensor], comm: TPComm) -> torch.Tensor:
    """The L2 norm of the full (unsharded) gradient."""
    dev = params[0].device if params else torch.device("cpu")
    sq = torch.zeros(2, dtype=torch.float64, device=dev)
    for p in params:
        if p.grad is not None:
            sq[0 if is_sharded(p) else 1] += p.grad.detach().double().pow(2).sum()
    if comm.world > 1:
        shard = sq[:1].clone()
        dist.all_reduce(shard, group=comm.group)
        sq[0] = shard[0]
    return sq.sum().sqrt()


class TPTrainer:
    def __init__(self, model: TPGPT, step: Interleaved, run_dir: Path | None) -> None:
        self.model = model
        self.step = step
        self.run_dir = run_dir
        self._logged_plan: str | None = None

    @property
    def comm(self) -> TPComm:
        return self.model.comm

    def rebind(self, tp_group: dist.ProcessGroup | None,
               dp_group: dist.ProcessGroup | None) -> None:
        """Run on new TP and DP groups from the next step (an in-place regroup): the layers'
        collectives and the gradient all-reduce; the parameters stay (a shard moved here is
        loaded into them). Its TP index (the group rank) may change with the regroup."""
        self.comm.rebind(tp_group)
        retire(self.step.dp_group)
        self.step.dp_group = dp_group
        self.step.dp_world = dist.get_world_size(dp_group) if dp_group is not None else 1

    def forward_backward(self, micro_batches: list[MicroBatch],
                         micro_weight: float | None = None) -> tuple[float, dict[str, float]]:
        loss, timings = self.step.forward_backward(micro_batches, micro_weight)
        self._log_plan()
        return loss, timings

    def clip_grad_norm_(self, max_norm: float) -> float:
        params = list(self.model.parameters())
        norm = tp_grad_norm(params, self.comm)
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return float(norm)

    def _log_plan(self) -> None:
        plan = self.step.plan
        if plan is None or self.run_dir is None or plan.key == self._logged_plan:
            return
        self._logged_plan = plan.key
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        with EventLog(self.run_dir) as log:
            log.emit(OverlapPlan(
                source=self.step.plan_source, key=plan.key,
                steps="".join({"F": "f", "B": "b", "FB": "P"}[s] for s in plan.steps),
                pairs=sum(s == "FB" for s in plan.steps),
                predicted_time=plan.predicted_time, sequential_time=plan.sequential_time))


def build_tp_trainer(model_cfg: GPTConfig, tp_group: dist.ProcessGroup | None,
                     dp_group: dist.ProcessGroup | None, schedule: str,
                     run_dir: Path | str | None, profile_reps: int = 2,
                     device: torch.device | str = "cpu") -> TPTrainer:
    """A TP GPT over `tp_group` and its step executor (see module docstring), its parameters
    on `device`."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown overlap schedule {schedule!r} "
                         f"(choose from {', '.join(SCHEDULES)})")
    comm = TPComm(tp_group)
    full = GPT(model_cfg)
    if dist.is_initialized() and dist.get_world_size() > 1:
        for t in full.state_dict().values():  # head.weight is wte.weight: sent twice, harmless
            dist.broadcast(t, src=0)
    model = TPGPT.from_full(full, comm).to(device)
    del full
    run_dir = Path(run_dir) if run_dir is not None else None
    step = Interleaved(model, comm, schedule=schedule, dp_group=dp_group,
                       plan_path=run_dir / PLAN_FILE if run_dir is not None else None,
                       profile_reps=profile_reps)
    return TPTrainer(model, step, run_dir)
