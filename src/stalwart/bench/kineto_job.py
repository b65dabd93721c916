"""A real Kineto trace: a small 2-rank gloo DDP job profiled by torch.profiler.

``profile_job(out_dir, slow_rank, factor)`` starts ``world`` processes of this module on
loopback; each trains a small MLP under DDP for 32 steps, torch.profiler records steps 3-32
(``schedule(wait=1, warmup=1, active=30)``) and writes ``out_dir/rank<R>.json`` (the genuine
Chrome-trace format, ProfilerStep#N annotations, CPU ops, gloo collectives). The slow rank
(the marked ground truth) runs every layer's matmul ``factor`` times, forward and backward
(the extra products are added times zero): its compute per step takes ~1.5-2x as long (the
element-wise work is not repeated), its peers wait in the all-reduce. Cost: ~20-40 s on 2
shared cores. Used by ``stalwart bench traces`` and
tests/traces/test_real_kineto.py.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

STEPS = 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def profile_job(out_dir: Path, slow_rank: int = 1, factor: float = 3.0, world: int = 2,
                timeout_s: float = 300.0) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "stalwart.bench.kineto_job",
                               "--rank", str(r), "--world", str(world), "--out", str(out_dir),
                               "--slow-rank", str(slow_rank), "--factor", str(factor)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    try:
        outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [(r, p.returncode, o.decode()[-800:]) for r, (p, o) in enumerate(zip(procs, outs,
                                                                              strict=True))
           if p.returncode != 0]
    if bad:
        raise RuntimeError(f"kineto job failed: {bad}")
    return out_dir


def _rank_main(rank: int, world: int, out: Path, slow_rank: int, factor: float) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    reps = max(1, round(factor)) if rank == slow_rank else 1

    class Slowable(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            for _ in range(reps - 1):  # the marked fault: the product again, forward and back
                out = out + 0.0 * torch.nn.functional.linear(x, self.weight, self.bias)
            return out

    model = DDP(torch.nn.Sequential(Slowable(256, 512), torch.nn.ReLU(), Slowable(512, 512),
                                    torch.nn.ReLU(), Slowable(512, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))

    def ready(prof: profile) -> None:
        prof.export_chrome_trace(str(out / f"rank{rank}.json"))

    with profile(activities=[ProfilerActivity.CPU], on_trace_ready=ready,
                 schedule=schedule(wait=1, warmup=1, active=STEPS - 2)) as prof:
        for _ in range(STEPS):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            prof.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    a = argparse.ArgumentParser()
    a.add_argument("--rank", type=int, required=True)
    a.add_argument("--world", type=int, required=True)
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--slow-rank", type=int, default=1)
    a.add_argument("--factor", type=float, default=2.0)
    ns = a.parse_args()
    _rank_main(ns.rank, ns.world, ns.out, ns.slow_rank, ns.factor)
