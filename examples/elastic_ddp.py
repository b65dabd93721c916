"""A plain data-parallel training script (an MLP on generated data) made elastic with
``stalwart.elastic``: a node killed mid-step leaves the others training in place, a node
started again joins live. The lines marked ``# elastic`` are all it takes over the plain
script (examples/plain_ddp_ckpt.py is the same training with DDP and checkpoint restarts).

Run it as written, one torchrun agent per node joined by stalwart's store (docs/elastic.md):

    python -m stalwart.elastic.store --port 29400 &                  # once, any host
    STALWART_STORE=HOST:29400 STALWART_MIN_WORLD=4 \\
        torchrun --standalone --nproc-per-node 2 examples/elastic_ddp.py --steps 300 --out OUT

(the same line on every node), or on one machine with ``torchrun --nproc-per-node 4 ...``,
or under ``stalwart run --script examples/elastic_ddp.py --nproc 4 -- --steps 300 --out OUT``
(the launcher serves the store; with ``--detect --fault kill:rank=2,at=50`` the other ranks
train on in place).

Output (``--out DIR``), one JSONL file per process, ``steps-<host>-<pid>.jsonl``: first
``{"start": true, "t_start" (wall clock when the script started), "t_joined" (when it was
admitted to the job), "member", "node", "local_rank"}``, then one line per step this process
completed, ``{"step", "t" (wall clock at the step's end, s), "samples" (this
process's share of the step's global batch), "world", "gen" (the membership generation),
"loss" (the global batch's mean loss), "member", "node", "local_rank"}``, then a final line
``{"final": true, "steps", "val_loss"}`` (the validation loss of the trained model) when it
trained to the end. A step is applied on every member or on none: when a member is lost, a
survivor that gave up the step in flight redoes it in the new generation and logs it then; a
step some survivors logged and others did not was applied with contributions of members that
gave up waiting for it (they took the state after), so no sample was lost. Deterministic per
``--seed``: the same global batch of samples at each
step whatever the world, so a run with a node lost and back trains the same steps.
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
import torch.nn.functional as F
from torch import nn

from stalwart import elastic  # elastic


def make_data(n: int, seed: int, dim: int = 32, classes: int = 10) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
    """n samples labelled by a fixed random teacher network (seed 0), inputs from ``seed``."""
    teacher = torch.randn(dim, classes, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    return x, (torch.tanh(x) @ teacher).argmax(dim=1)


def make_model(dim: int = 32, hidden: int = 256, classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Linear(hidden, classes))


def main() -> int:
    t_start = time.time()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=64, help="global batch (samples per step)")
    p.add_argument("--samples", type=int, default=16384, help="training set size")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compute-ms", type=float, default=0.0,
                   help="extra compute time per step (a sleep: stands for a bigger model)")
    p.add_argument("--ckpt", default=None, metavar="PATH",
                   help="checkpoint file: saved every --ckpt-every steps, resumed from at start "
                        "(what a restart uses if the membership store is lost)")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--start-when", default=None, metavar="PATH",
                   help="join the job only once PATH exists (the imports done before: a node "
                        "started again, timed from its join)")
    p.add_argument("--out", default="elastic-out")
    a = p.parse_args()
    torch.manual_seed(a.seed)
    x, y = make_data(a.samples, a.seed)
    xv, yv = make_data(2048, a.seed + 1)
    model = make_model(hidden=a.hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in vars(a).items()
           if k not in ("out", "compute_ms", "start_when", "ckpt", "ckpt_every")}
    while a.start_when and not os.path.exists(a.start_when):
        time.sleep(0.05)
    try:
        job = elastic.Job(model, opt, global_batch=a.batch, config=cfg,  # elastic
                          checkpoint=a.ckpt, checkpoint_every=a.ckpt_every if a.ckpt else 0)
        log = open(out / f"steps-{socket.gethostname()}-{os.getpid()}.jsonl", "a")  # noqa: SIM115
        log.write(json.dumps({"start": True, "t_start": t_start, "t_joined": time.time(),
                              "member": job.member, "node": job.node,
                              "local_rank": int(os.environ.get("LOCAL_RANK", "0"))}) + "\n")
        for step in job.steps(a.steps):  # elastic: for step in range(a.steps)
            opt.zero_grad()
            total = 0.0
            for idx in job.my_batch(step):  # elastic: this rank's samples of the step
                i = torch.tensor(idx) % len(x)
                loss = F.cross_entropy(model(x[i]), y[i]) * job.weight(len(idx))  # elastic
                loss.backward()
                total += float(loss.detach())
            time.sleep(a.compute_ms / 1000)
            if job.commit(total):  # elastic: instead of the DDP all-reduce + opt.step()
                log.write(json.dumps({
                    "step": step, "t": time.time(), "samples": job.samples,
                    "world": job.world, "gen": job.generation, "loss": job.loss,
                    "member": job.member, "node": job.node,
                    "local_rank": int(os.environ.get("LOCAL_RANK", "0"))}) + "\n")
                log.flush()
    except elastic.Refused as e:
        print(e, file=sys.stderr)
        return 2
    except elastic.ElasticError as e:
        print(e, file=sys.stderr)
        return 1
    with torch.no_grad():
        val = float(F.cross_entropy(model(xv), yv))
    log.write(json.dumps({"final": True, "steps": a.steps, "val_loss": val}) + "\n")
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
