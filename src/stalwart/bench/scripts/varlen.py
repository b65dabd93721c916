"""A user's plain DDP script (not stalwart's) whose step time varies with its input: a small
transformer encoder over token sequences of random length, as in variable-length language or
speech batches.

`stalwart bench detect` runs it with `stalwart run --script`. It imports nothing from stalwart.
Each rank draws its own sequence length per step, uniformly in [--min-len, --max-len], so a
rank's compute time changes from step to step by up to ~max/min and the ranks differ from one
another at every step (the job waits for the longest sequence of each step): the hardest clean
case for a straggler detector, since no rank is slow, only unlucky. Every rank stops at the
same step (the stop decision is all-reduced every 5 steps).

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

VOCAB = 256


class Encoder(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.enc = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=128,
                                              batch_first=True, dropout=0.0)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(tokens)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=96)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if os.environ.get("STALWART_BENCH_NVRX"):
        from stalwart.bench.peers.nvrx import install_from_env

        install_from_env()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(Encoder())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1000 + rank)
    t0 = time.monotonic()
    step = 0
    while True:
        n = int(torch.randint(a.min_len, a.max_len + 1, (1,), generator=g))
        seq = torch.randint(0, VOCAB, (a.batch, n + 1), generator=g)
        logits = model(seq[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
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
