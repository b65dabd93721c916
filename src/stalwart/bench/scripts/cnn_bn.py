"""A user's plain DDP script (not stalwart's): a small CNN with BatchNorm, SGD with momentum.

`stalwart bench detect` runs it with `stalwart run --script`. It imports nothing from stalwart.
BatchNorm gives DDP buffers to keep equal: with DDP's default ``broadcast_buffers=True`` every
forward starts with a broadcast of the running statistics from rank 0 -- a collective inside
the forward pass, which plain MLPs do not have. Inputs are random 3x32x32 images (a fixed set
per rank), 10 classes. Every rank stops at the same step (the stop decision is all-reduced
every 5 steps).

--seconds S   train for about S seconds
Opt-in for the bench only: with STALWART_BENCH_NVRX set, NVIDIA's straggler detector is
attached through the bench's harness (stalwart.bench.peers.nvrx); a user never sets it.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--batch", type=int, default=16)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if os.environ.get("STALWART_BENCH_NVRX"):
        from stalwart.bench.peers.nvrx import install_from_env

        install_from_env()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    images = torch.randn(8 * a.batch, 3, 32, 32, generator=g)
    labels = torch.randint(0, 10, (8 * a.batch,), generator=g)
    model.train()
    t0 = time.monotonic()
    step = 0
    while True:
        i = (step % 8) * a.batch
        x, y = images[i:i + a.batch], labels[i:i + a.batch]
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % 5 == 0:
            done = torch.tensor([float(time.monotonic() - t0 >= a.seconds)])
            dist.all_reduce(done, op=dist.ReduceOp.MAX)
            if done.item():
                break
    if rank == 0:
        print(f"trained {step} steps, loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
