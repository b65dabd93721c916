"""Real kernel packet loss (nftables on testbed hosts): the collective completes, counts its
losses, and every value it returns is a legitimate partial average or a stale copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from itertools import combinations
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.root]

HERE = Path(__file__).parent


def run_ranks(world: int, loss: float, kind: str, kw: dict, timeout: float = 90) -> list[dict]:
    from stalwart.testbed import Hosts
    from stalwart.testbed.loss import dropped

    with Hosts(world) as h, tempfile.TemporaryDirectory() as d:
        for i in range(world):
            h.set_loss(i, loss)
        procs = []
        try:
            for i in range(world):
                env = dict(os.environ, RANK=str(i), WORLD_SIZE=str(world), MASTER_ADDR=h.addr(0),
                           MASTER_PORT="29500", STALWART_HOST_ADDR=h.addr(i),
                           GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
                procs.append(subprocess.Popen(
                    [*h.exec_prefix(i), sys.executable, str(HERE / "mp_workers.py"), kind, d,
                     json.dumps(kw)], env=env))
            for p in procs:
                assert p.wait(timeout=timeout) == 0
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert sum(dropped(h.ns(i)) for i in range(world)) > 0  # the kernel really dropped
        return [json.loads(Path(d, f"rank-{r}.json").read_text()) for r in range(world)]


def test_allreduce_under_10pct_loss_returns_only_partial_averages_or_stale_copies() -> None:
    world, numel = 3, 6000
    recs = run_ranks(world, 0.10, "allreduce",
                     {"numel": numel, "rounds": 6, "values": "rank", "cap": 2.0, "floor": 0.5})
    # rank i contributes 2**i: the owner of a shard averages a subset that contains itself
    lost = 0
    for i, r in enumerate(recs):
        assert len(r["out"]) == 6  # no hang: every round finished
        assert set(r["rejected"]) <= {"late", "old_round", "future_round", "duplicate"}
        lost += sum(sum(x) for x in r["lost"])
        bounds = [0, 2000, 4000, 6000]
        for out in r["out"]:
            for s in range(world):
                ok = {sum(2.0 ** j for j in S) / len(S) for k in range(1, world + 1)
                      for S in combinations(range(world), k) if s in S}
                if s != i:
                    ok.add(2.0 ** i)  # broadcast lost: the stale (here: own input) copy
                vals = set(out[bounds[s]: bounds[s + 1]])
                assert all(min(abs(v - o) for o in ok) < 1e-5 for v in vals), (i, s, vals)
    assert lost > 0  # 10% loss over thousands of packets: some were lost and counted


def test_ddp_training_under_10pct_loss_keeps_replicas_close() -> None:
    recs = run_ranks(3, 0.10, "ddp", {"steps": 12, "comm": "lossy", "patient": False})
    # (the kernel dropped packets: run_ranks checks its counter; with 3 copies a chunk is lost
    # with p**3, so on this tiny model often none is in 12 steps -- the estimate below is what
    # shows the loss was seen)
    # rejections (packets of rounds a lagging peer already left) stay a minority of what each
    # rank received; checked per rank over the run -- a single step after a deadline can have
    # received only a few packets, which made a per-step comparison fail at random in CI
    for r in recs:
        rejected = sum(s["pkts_rejected"] for s in r["stats"])
        assert rejected < sum(s["pkts_recv"] for s in r["stats"]), r["stats"]
    import numpy as np

    # "auto" protection measured the 10% loss and kept the copies up (0.1**5 <= the 2e-5
    # target < 0.1**4), far from the floor of 2 that a clean network falls to
    for r in recs:
        assert 0.04 < r["stats"][-1]["loss_in"] < 0.3, r["stats"][-1]
        assert r["stats"][-1]["copies"] >= 4
    p = [np.array(r["params"]) for r in recs]
    # replicas differ only by stale chunks: a handful of lr-sized updates at most (lr 1e-2)
    assert max(np.abs(x - p[0]).max() for x in p) < 0.2
    assert all(np.isfinite(x).all() for x in p)
