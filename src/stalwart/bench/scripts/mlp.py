"""A user's plain DDP script (not stalwart's): an MLP classifier, Adam, its own loop.

`stalwart bench detect` runs it with `stalwart run --script`. It imports nothing from stalwart;
the rendezvous is env:// from torchrun's variables. Every rank stops at the same step: the
stop decision is all-reduced every 5 steps, so no rank leaves while a peer waits.

--seconds S   train for about S seconds
Opt-in for the bench only: with STALWART_BENCH_NVRX set (by `stalwart bench detect`), NVIDIA's
straggler detector is attached through the bench's harness (stalwart.bench.peers.nvrx); a user
running this script never sets it.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=30.0)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if os.environ.get("STALWART_BENCH_NVRX"):
        from stalwart.bench.peers.nvrx import install_from_env

        install_from_env()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(
        nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(256, 128, generator=g)
    y = torch.randint(0, 10, (256,), generator=g)
    t0 = time.monotonic()
    step = 0
    while True:
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
