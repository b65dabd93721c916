"""A plain DDP training script that is not stalwart's: the suite runs it with `stalwart run
--script`. It imports nothing from stalwart: a small MLP classifier, its own Adam optimizer and
loop, env:// rendezvous from torchrun's variables.

--batch B     samples per rank and step (default 256)
--seconds S   train for about S seconds (every rank stops at the same step: the decision is
              all-reduced every few steps, so no rank leaves while its peers wait in a
              collective)
--crash-rank R --crash-at N   rank R raises at step N (the suite's crash)
--env-out DIR                 each rank writes what it was started with to DIR/rank-R.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--crash-rank", type=int, default=-1)
    p.add_argument("--crash-at", type=int, default=5)
    p.add_argument("--env-out", type=Path, default=None)
    a = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if a.env_out is not None:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT", "STALWART_HOST_ADDR", "TORCHELASTIC_RUN_ID")
        (a.env_out / f"rank-{rank}.json").write_text(json.dumps({
            "env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv,
            "name": __name__, "path0": sys.path[0]}))

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(
        nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(a.batch, 128, generator=g)
    y = torch.randint(0, 10, (a.batch,), generator=g)
    t0 = time.monotonic()
    step = 0
    while True:
        if rank == a.crash_rank and step == a.crash_at:
            raise RuntimeError(f"injected crash on rank {rank} at step {step}")
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
