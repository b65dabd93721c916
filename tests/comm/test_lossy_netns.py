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

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.usefixtures("engine")]

HERE = Path(__file__).parent


def run_ranks(world: int, loss: float, kind: str, kw: dict, timeout: float = 90,
              burst: tuple[int, int] | None = None) -> list[dict]:
    """Ranks on testbed hosts with random loss ``loss`` on every host, or, with ``burst`` =
    (period, n), UDP dropped in bursts of n consecutive packets out of every period."""
    from stalwart.bench.lossy_net import set_udp_burst_loss, udp_dropped
    from stalwart.testbed import Hosts
    from stalwart.testbed.loss import dropped

    with Hosts(world) as h, tempfile.TemporaryDirectory() as d:
        for i in range(world):
            if burst is None:
                h.set_loss(i, loss)
            else:
                set_udp_burst_loss(h.ns(i), *burst)
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
        # the kernel really dropped
        assert sum(dropped(h.ns(i)) + udp_dropped(h.ns(i)) for i in range(world)) > 0
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


def test_erasure_code_rebuilds_chunks_lost_in_kernel_bursts() -> None:
    # 4 consecutive UDP packets of every 40 dropped at each host (10%, all in bursts; on the
    # testbed an offload run is one packet there, so a burst takes up to 32 datagrams):
    # interleaved stripes put a burst's datagrams in different stripes, and the parity sized
    # from the measured rate rebuilds them
    world, numel = 3, 200_000
    recs = run_ranks(world, 0.0, "allreduce",
                     {"numel": numel, "rounds": 6, "fec": "rs", "cap": 3.0, "floor": 1.0},
                     burst=(40, 4))
    lost = sum(sum(sum(x) for x in r["lost"]) for r in recs)
    recv = sum(sum(sum(x) for x in r["recv"]) for r in recs)
    recovered = sum(sum(sum(x) for x in r["recovered"]) for r in recs)
    assert recovered > 0.02 * recv, (recovered, recv)  # bursts hit data, parity rebuilt it
    assert lost <= 1e-3 * (lost + recv), (lost, recv, [r["lost"] for r in recs])
    for r in recs:
        # a round that lost nothing after decoding returns gloo's exact average
        exact = [e for e, x in zip(r["err"], r["lost"], strict=True) if sum(x) == 0]
        assert exact and max(exact) < 1e-5


def test_ddp_training_under_10pct_loss_keeps_replicas_close() -> None:
    recs = run_ranks(3, 0.10, "ddp", {"steps": 12, "comm": "lossy", "patient": False})
    # rejections (packets of rounds a lagging peer already left) stay a minority of what each
    # rank received; checked per rank over the run -- a single step after a deadline can have
    # received only a few packets, which made a per-step comparison fail at random in CI
    for r in recs:
        rejected = sum(s["pkts_rejected"] for s in r["stats"])
        assert rejected < sum(s["pkts_recv"] for s in r["stats"]), r["stats"]
    # "auto" protection measured the 10% loss and sent parity for it on every step
    for r in recs:
        assert 0.04 < r["stats"][-1]["loss_in"] < 0.3, r["stats"][-1]
        assert all(s["parity"] > 0 for s in r["stats"])
    # bounded drift, exactly: every element a replica received in the last step is its
    # owner's value to the bit (a gradient broadcast, a wrong decode or a misplaced chunk
    # breaks this), and with the parity in force almost nothing is stale (without protection
    # ~10% of the chunks would be, each step)
    for r in recs:
        assert r["fresh_mismatch"] == 0.0, r["fresh_mismatch"]
        assert r["stale_elems"] <= 0.01 * len(r["params"]), r["stale_elems"]
