"""Two micro-measurements behind the monitor's cost figures: a by-hand script (not a test).

``exchange``: the process CPU time of one exchange of an 80-byte row between N gloo ranks on
loopback, as the monitor did it (an asynchronous gloo all-gather on its own group) and as it
does it now (rowlink.StarRows), 20 ms apart like training steps; "none" is the floor of the
same loop without an exchange. Each rank prints its medians in microseconds.

``cold``: the thread CPU time of the detectors' work for one step (the iteration channel,
four per-rank channels in one bank, the CUSUM bank) with warm caches, and with a training
step's worth of other work (three 512x512 matmuls and an 8M-element numpy update) between
samples, as in a training process.

    python tests/detect/micro_costs.py exchange --nproc 4
    python tests/detect/micro_costs.py cold
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time


def exchange_worker(steps: int) -> None:
    import torch
    import torch.distributed as dist

    from stalwart.rowlink import StarRows

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    pg = dist.new_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    star = StarRows(rank, world, 10, pg, "127.0.0.1")
    msg = torch.zeros(10, dtype=torch.float64)
    res = {}
    for mode in ("gloo_allgather", "star", "none"):
        costs = []
        for i in range(steps):
            time.sleep(0.02)
            c0 = time.process_time()
            if mode == "gloo_allgather":
                rows = [torch.empty(10, dtype=torch.float64) for _ in range(world)]
                work = pg.allgather([rows], [msg])
                time.sleep(0.005)
                work.wait()
            elif mode == "star":
                star.issue(i, [0.0] * 10)
                time.sleep(0.005)
                star.read(i)
            else:
                time.sleep(0.005)
            costs.append(time.process_time() - c0)
        res[mode] = round(1e6 * statistics.median(costs[10:]), 1)
    print(f"rank {rank}: process CPU us per exchange (median) {res}", flush=True)
    star.close()
    dist.destroy_process_group()


def cold(samples: int = 300) -> None:
    import numpy as np
    import torch

    from stalwart.detect.bocpd import BOCPDBank
    from stalwart.detect.changepoint import ChangeDetector
    from stalwart.detect.cusum import CusumBank

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    it = np.exp(rng.normal(np.log(0.08), 0.09, samples))
    rel = np.exp(rng.normal(0, 0.04, (samples, 4)))
    a, big = torch.randn(512, 512), np.zeros(8_000_000)
    for is_cold in (False, True):
        d = ChangeDetector()
        bank = BOCPDBank()
        ds = [ChangeDetector(min_shift=0.15, bank=bank) for _ in range(4)]
        cb = CusumBank(4)
        ts = []
        for k in range(samples):
            if is_cold:
                for _ in range(3):
                    a @ a
                big += 1.0
            t = time.thread_time()
            d.add(k, float(it[k]))
            ChangeDetector.add_many(ds, k, list(rel[k]))
            cb.add(k, rel[k])
            ts.append(time.thread_time() - t)
        print(f"{'cold' if is_cold else 'warm'}: {1e6 * statistics.median(ts[50:]):.1f} us "
              "thread CPU per step (iteration channel + 4 per-rank channels + CUSUM)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("exchange", "cold"))
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--worker", action="store_true")
    a = ap.parse_args()
    if a.what == "cold":
        cold()
        return 0
    if a.worker:
        exchange_worker(a.steps)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--worker"],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(a.nproc),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in range(a.nproc)]
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
