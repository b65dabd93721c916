"""Micro-batch rebalancing in your own DDP script (stalwart.mitigate.Rebalancer).

    torchrun --standalone --nproc-per-node 4 examples/rebalance_ddp.py
    SLOW_RANK=2 torchrun --standalone --nproc-per-node 4 examples/rebalance_ddp.py

    sudo SLOW_RANK=2 .venv/bin/torchrun --standalone --nproc-per-node 4 examples/rebalance_ddp.py

With SLOW_RANK=r (as root), rank r puts itself into a cgroup holding it at half its fair CPU
share from step 20 on (stalwart.testbed.CpuGroup: a real 2x slower CPU, which the detector's
own compute test confirms; a sleep would not be); the plan moves micro-batches away from it.

Each step's global batch is M micro-batches that are a function of (step, index) only; the
Rebalancer says which indices this rank computes and how to weight their losses, so the
update is the same as on the uniform plan whatever the plan. A straggler found by the
detector (stalwart.detect.Monitor) gets fewer micro-batches until it recovers.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stalwart.detect
from stalwart.mitigate import Rebalancer
from stalwart.testbed import CpuGroup, find_backend
from stalwart.testbed.cpu import fair_share

M, MICRO, DIM, STEPS = 16, 64, 256, 120
SLOW_RANK = int(os.environ.get("SLOW_RANK", "-1"))


def micro_batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100_003 + index)  # same sample on every rank
    x = torch.randn(MICRO, DIM, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def slow_down(factor: float) -> CpuGroup:
    """Hold this process at 1/factor of its fair CPU share (a cgroup CPU quota; root)."""
    group = CpuGroup(find_backend(), f"stw-{os.getpid()}-0-r{dist.get_rank()}")
    group.add(os.getpid())
    group.set_limit(factor, 0, fair_share(dist.get_world_size()))
    return group


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    monitor = stalwart.detect.Monitor()  # before DDP: it tracks the collectives
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(DIM, 1024), nn.ReLU(), nn.Linear(1024, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reb = Rebalancer(monitor, micro_batches=M)
    # Local compute ends when this rank's last gradient is accumulated; after that, the last
    # micro-batch's backward only waits for DDP's all-reduce (peers). Time to that point is
    # what the Rebalancer must see, not the wait.
    last_grad = [0.0]
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _p: last_grad.__setitem__(
            0, time.perf_counter()))
    slow, seen = None, 0
    for step in range(STEPS):
        if step == 20 and dist.get_rank() == SLOW_RANK:
            slow = slow_down(2.0)
        t0 = time.perf_counter()
        share = reb.assign(step)
        for k, index in enumerate(share.indices):
            x, y = micro_batch(step, index)
            last = k == len(share.indices) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = nn.functional.mse_loss(model(x), y)
                (loss * share.micro_weight).backward()
        compute_s = max(last_grad[0] - t0, 0.0)
        opt.step()
        opt.zero_grad()
        step_s = time.perf_counter() - t0
        monitor.step(step, {"step_time": step_s, "compute_time": reb.normalised(compute_s),
                            "comm_time": step_s - compute_s})
        reb.end_step(step, compute_s, step_s)
        if dist.get_rank() == 0 and reb.version != seen:
            seen = reb.version
            print(f"step {step}: plan v{reb.version} {reb.counts} (step {step_s * 1e3:.0f} ms)")
    if dist.get_rank() == 0:
        print(f"plan in force: v{reb.version} {reb.counts}; findings: {monitor.report()}")
    reb.close()
    monitor.close()
    if slow is not None:
        slow.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
