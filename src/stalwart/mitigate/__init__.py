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

from typing import TYPE_CHECKING, Any

from stalwart.mitigate import remap
from stalwart.presets import PRESETS

if TYPE_CHECKING:
    from stalwart.mitigate.rebalance import Detection, Rebalancer, StaticPlan

__all__ = ["Assignment", "Rebalancer",
           "StaticPlan", "work_plan"]


def work_plan(cfg: Any, monitor: Detection | None, rank: int, world: int, run_dir: Any,
              n_params: int = 0, regroup_s: float | None = None,
              link: Any = None) -> Rebalancer | StaticPlan:
    """The worker's seam: which micro-batches each rank computes, per the run's --mitigate.
    ``n_params``: the model's parameters per rank (sizes the traffic that S3 re-maps).
    ``regroup_s``: S3/S4's price when they regroup in place (mitigate/regroup.py) instead of
    restarting; None: a restart's, measured. ``link``: the launch's records in a job that
    regroups in place (elastic/ranklink.py)."""
    from stalwart.mitigate.rebalance import Rebalancer, StaticPlan  # torch: only in a rank

    micro = cfg.global_micro_batches()
    groups = world // cfg.train.tp
    if cfg.policy.mode == "off" or groups < 2:
        return StaticPlan(micro, groups, rank // cfg.train.tp)
    # a lossy job's S4 regroups in place, re-sharding the owners' optimizer state; as a
    # restart it would need a checkpoint that resumes at another world size, which the lossy
    # optimizer's sharded state does not (train/checkpoint.py): then S2 only. S3 stays off
    # for lossy jobs in any case (``_traffic``: their all-to-all is not a ring)
    from stalwart.mitigate.membership import in_place_ok

    mode = "rebalance" if cfg.comm.mode == "lossy" and not in_place_ok(cfg) else cfg.policy.mode
    traffic = _traffic(cfg, world, n_params) if rank == 0 else None  # rank 0 decides
    pc = cfg.policy
    return Rebalancer(monitor, micro, rank=rank, world=world, tp=cfg.train.tp, mode=mode,
                      every=pc.every, run_dir=run_dir,
                      hosts=list(cfg.job.hosts) if cfg.job.hosts else None, traffic=traffic,
                      policy={"min_gain": pc.min_gain, "replan_gain": pc.replan_gain,
                              "revert_windows": pc.revert_windows},
                      restart_s=regroup_s, in_place=regroup_s is not None,
                      ranks_per_host=cfg.testbed.ranks_per_host, link=link)


def _traffic(cfg: Any, world: int, n_params: int) -> dict[tuple[int, int], float] | None:
    """Bytes per step on each rank pair (remap.py) for S3; None under the lossy transport."""
    if cfg.comm.mode == "lossy":
        return None
    m = PRESETS[cfg.train.preset]["model"]
    dp, tp = remap.model_bytes(n_params, cfg.global_micro_batches() / (world // cfg.train.tp),
                               cfg.resolved_micro_batch_size(), m.block_size, m.n_embd,
                               m.n_layer, cfg.train.tp)
    return remap.pair_traffic(world, cfg.train.tp, dp, tp)


def __getattr__(name: str) -> Any:
    # the step-loop objects need torch; the decision modules (policy, planner, remap) do not,
    # and importing them must not import it (replay, simulation)
    if name in ("Assignment", "Rebalancer", "StaticPlan"):
        from stalwart.mitigate import rebalance

        return getattr(rebalance, name)
    raise AttributeError(f"module 'stalwart.mitigate' has no attribute {name!r}")
