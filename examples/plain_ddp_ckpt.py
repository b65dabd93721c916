"""The training of examples/elastic_ddp.py without stalwart: plain DDP with checkpoint and
resume, what torchrun's elastic restart gives a job (its workers restarted on a membership
change, training resumed from the last checkpoint).

    torchrun --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 examples/plain_ddp_ckpt.py --steps 300 --out OUT \\
        --ckpt OUT/ckpt.pt --ckpt-every 20

Same data, model, optimizer and global batch as elastic_ddp.py (imported from it), and the
same split: rank r of W computes the r-th contiguous share of the step's global batch
(sample indices ``step * batch + ...``), each micro-batch loss weighted by its share
(``n / batch``; times W, as DDP averages the ranks' gradients). Output: the same JSONL as
elastic_ddp.py (``steps-<host>-<pid>.jsonl``; "gen" is torchrun's restart count, "member" the
global rank), so that the bench compares the two line by line; steps redone after a restart
appear again with later times.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from elastic_ddp import make_data, make_model  # noqa: E402 -- the same training, by import


def share(batch: int, world: int, rank: int) -> range:
    """Rank ``rank``'s contiguous positions of a global batch (the first ``batch % world``
    ranks one more), as stalwart.elastic splits it with equal weights."""
    base, extra = divmod(batch, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def main() -> int:
    t_start = time.time()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--samples", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compute-ms", type=float, default=0.0)
    p.add_argument("--out", default="plain-out")
    p.add_argument("--ckpt", default=None, help="checkpoint file (default OUT/ckpt.pt)")
    p.add_argument("--ckpt-every", type=int, default=20)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(a.seed)
    x, y = make_data(a.samples, a.seed)
    xv, yv = make_data(2048, a.seed + 1)
    model = make_model(hidden=a.hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Path(a.ckpt) if a.ckpt else out / "ckpt.pt"
    start = 0
    if ckpt.is_file():
        ck = torch.load(ckpt, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        start = int(ck["step"])
    ddp = DDP(model)  # broadcasts rank 0's weights
    gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = open(out / f"steps-{socket.gethostname()}-{os.getpid()}.jsonl", "a")  # noqa: SIM115
    log.write(json.dumps({"start": True, "t_start": t_start, "t_joined": time.time(),
                          "member": rank, "node": socket.gethostname(),
                          "local_rank": int(os.environ.get("LOCAL_RANK", "0"))}) + "\n")
    mine = share(a.batch, world, rank)
    for step in range(start, a.steps):
        opt.zero_grad()
        idx = torch.tensor([step * a.batch + i for i in mine]) % len(x)
        loss = F.cross_entropy(ddp(x[idx]), y[idx]) * (len(mine) / a.batch) * world
        loss.backward()
        time.sleep(a.compute_ms / 1000)
        opt.step()
        total = torch.tensor([float(loss.detach()) / world])
        dist.all_reduce(total)
        log.write(json.dumps({"step": step, "t": time.time(), "samples": len(mine),
                              "world": world, "gen": gen, "loss": float(total),
                              "member": rank, "node": socket.gethostname(),
                              "local_rank": int(os.environ.get("LOCAL_RANK", "0"))}) + "\n")
        log.flush()
        if rank == 0 and (step + 1) % a.ckpt_every == 0:
            tmp = ckpt.with_suffix(f".tmp{os.getpid()}")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "step": step + 1}, tmp)
            os.replace(tmp, ckpt)
    with torch.no_grad():
        val = float(F.cross_entropy(model(xv), yv))
    log.write(json.dumps({"final": True, "steps": a.steps, "val_loss": val}) + "\n")
    log.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
