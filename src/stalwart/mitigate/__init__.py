"""Act on stragglers: micro-batch rebalancing, restart without a host, the escalation policy.

- planner.py: exact min-max assignment of a step's micro-batches to data-parallel groups;
- agreement.py: rank 0's decision, its version and start step, reach every rank together;
- policy.py: ski-rental escalation S1 -> S2 (rebalance) -> S3 (re-map) -> S4 (restart
  without the host);
- remap.py: traffic per rank pair, and the placement that avoids a slow pair of hosts (S3);
- rebalance.py: the object the step loop asks each step (``Rebalancer``, ``StaticPlan``).
See docs/mitigate.md.
"""

from __future__ import annotations

from typing import Any

from stalwart.mitigate import remap
from stalwart.mitigate.rebalance import (
    CONTROL_FILE,
    RESTART_EXIT,
    RESTART_FILE,
    Assignment,
    Rebalancer,
    StaticPlan,
)

__all__ = ["CONTROL_FILE", "RESTART_EXIT", "RESTART_FILE", "Assignment", "Rebalancer",
           "StaticPlan", "work_plan"]


def work_plan(cfg: Any, monitor: Any, rank: int, world: int, run_dir: Any
              ) -> Rebalancer | StaticPlan:
    """The worker's seam: which micro-batches each rank computes, per the run's --mitigate."""
    micro = cfg.global_micro_batches()
    groups = world // cfg.tp
    if cfg.mitigate == "off" or groups < 2:
        return StaticPlan(micro, groups, rank // cfg.tp)
    # S4 restarts need a checkpoint that resumes at another world size (train/checkpoint.py):
    # not yet for the lossy optimizer's sharded state, nor (in the policy) for TP
    mode = "rebalance" if cfg.comm == "lossy" else cfg.mitigate
    return Rebalancer(monitor, micro, rank=rank, world=world, tp=cfg.tp, mode=mode,
                      run_dir=run_dir, hosts=cfg.hosts,
                      traffic=_traffic(cfg, world) if rank == 0 else None)  # rank 0 decides


def _traffic(cfg: Any, world: int) -> dict[tuple[int, int], float] | None:
    """Bytes per step on each rank pair (remap.py) for S3; None under the lossy transport."""
    if cfg.comm == "lossy":
        return None
    import torch

    from stalwart.train.model import GPT, PRESETS

    m = PRESETS[cfg.preset]["model"]
    with torch.device("meta"):  # shapes only, no memory
        n_params = sum(p.numel() for p in GPT(m).parameters()) // cfg.tp  # about: TP shards
    dp, tp = remap.model_bytes(n_params, cfg.global_micro_batches() / (world // cfg.tp),
                               cfg.resolved_micro_batch_size(), m.block_size, m.n_embd,
                               m.n_layer, cfg.tp)
    return remap.pair_traffic(world, cfg.tp, dp, tp)
