"""A small DDP job for the detect tests: N gloo ranks on loopback, one can be made slow.

Run one process per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set. The slow rank is
slowed for real: from step --slow-at on it
shares its core with a busy-looping competitor process (os.sched_setaffinity) and its nice
value is raised, so it gets a small share of that core -- a CPU-contention straggler, not a
sleep.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from stalwart.detect import Monitor

HOG = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=70)
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-at", type=int, default=30)
    ap.add_argument("--hint", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--hogs", type=int, default=1)
    ap.add_argument("--nice", type=int, default=8)
    ap.add_argument("--check-every", type=int, default=0, help="0: chosen by the monitor")
    ap.add_argument("--lag", type=int, default=1)
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    ncpu = os.cpu_count() or 1
    os.sched_setaffinity(0, {rank % ncpu})
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    mon = Monitor(run_dir=a.out if rank == 0 else None, rank=rank, world=world,
                  compute_reps=48, check_every=a.check_every or None, lag=a.lag)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(a.width, a.width), nn.ReLU(),
                              nn.Linear(a.width, a.width), nn.ReLU(),
                              nn.Linear(a.width, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(512, a.width)
    y = torch.randint(0, 8, (512,))
    hogs: list[subprocess.Popen] = []
    try:
        for step in range(a.steps):
            if rank == a.slow_rank and step == a.slow_at:
                for _ in range(a.hogs):
                    # it spins while its rank lives: a rank killed by the test's timeout
                    # (no finally) must not leave a core-pinned spinner slowing later jobs
                    hogs.append(subprocess.Popen([sys.executable, "-c", HOG]))
                    os.sched_setaffinity(hogs[-1].pid, {rank % ncpu})
                # and a lower CPU weight, so the slowdown stays large on a machine that other
                # jobs load too (CFS shares by weight: nice 8 vs 0 is about 1:6)
                os.nice(a.nice)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if a.hint:
                mon.step(step)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    recs = list(mon.tracker.records)
    out = {"rank": rank, "findings": mon.report(), "period": mon.periods.period,
           "samples_ms": [round(s.seconds * 1e3, 2) for s in mon.samples], "ops": len(recs),
           "ddp_ops": sum(r.source == "ddp" for r in recs)}
    mon.close()
    (a.out / f"rank-{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
