"""Micro-batch rebalancing in your own DDP script (stalwart.mitigate.Rebalancer).

    torchrun --standalone --nproc-per-node 4 examples/rebalance_ddp.py

Each step's global batch is M micro-batches that are a function of (step, index) only; the
Rebalancer says which indices this rank computes and how to weight their losses, so the
update is the same as on the uniform plan whatever the plan. A straggler found by the
detector (stalwart.detect.Monitor) gets fewer micro-batches until it recovers.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stalwart.detect
from stalwart.mitigate import Rebalancer

M, MICRO, DIM, STEPS = 16, 8, 64, 60


def micro_batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100_003 + index)  # same sample on every rank
    x = torch.randn(MICRO, DIM, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    monitor = stalwart.detect.Monitor()  # before DDP: it tracks the collectives
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(DIM, 128), nn.ReLU(), nn.Linear(128, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reb = Rebalancer(monitor, micro_batches=M)
    for step in range(STEPS):
        t0 = time.perf_counter()
        share = reb.assign(step)
        for k, index in enumerate(share.indices):
            x, y = micro_batch(step, index)
            last = k == len(share.indices) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = nn.functional.mse_loss(model(x), y)
                (loss * share.micro_weight).backward()
        compute_s = time.perf_counter() - t0
        opt.step()
        opt.zero_grad()
        step_s = time.perf_counter() - t0
        monitor.step(step, {"step_time": step_s, "compute_time": reb.normalised(compute_s),
                            "comm_time": step_s - compute_s})
        reb.end_step(step, compute_s, step_s)
    if dist.get_rank() == 0:
        print(f"plan in force: v{reb.version} {reb.counts}; findings: {monitor.report()}")
    reb.close()
    monitor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
