"""Real multi-process runs on loopback: gloo for setup, the UDP transport for the data."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import mp_workers
import numpy as np
import pytest
import torch.multiprocessing as mp

from stalwart.launch import free_port

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("engine")]


def _run(rank: int, world: int, port: int, out: str, kind: str, kw: dict) -> None:
    fn = {"allreduce": mp_workers.allreduce_worker, "ddp": mp_workers.ddp_worker,
          "subgroup": mp_workers.subgroup_worker}[kind]
    fn(rank, world, port, out=out, **kw)


def spawn(kind: str, world: int, **kw) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_run, args=(world, free_port(), d, kind, kw), nprocs=world, join=True)
        return [json.loads(Path(d, f"rank-{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("world,numel,mtu", [(3, 10_007, 1500), (5, 20_011, 9000)])
def test_allreduce_is_exact_without_loss(world: int, numel: int, mtu: int) -> None:
    recs = spawn("allreduce", world, numel=numel, rounds=3, mtu=mtu)
    for r in recs:
        assert max(r["err"]) < 1e-5
        assert all(sum(x) == 0 for x in r["lost"]) and r["rejected"] == {}


def test_auto_copies_drop_to_one_on_a_clean_network() -> None:
    # forward error protection sized from measured loss: it starts at 2 copies and, once the
    # receivers have counted enough datagrams (~1,000 here) with none missing, asks for 1
    recs = spawn("allreduce", 3, numel=200_000, rounds=8, copies=2, copies_target=1e-3)
    for r in recs:
        assert max(r["err"]) < 1e-5  # and the result stays exact
        assert r["copies"][0] == [2, 2]
        why = {k: r[k] for k in ("copies", "lost", "recv", "kernel_drops", "rejected")}
        assert r["copies"][-3:] == [[1, 1]] * 3, why


def test_a_late_rank_is_waited_for_not_dropped() -> None:
    # rank 2 starts round 3 1.5 s after the others, three times their 0.5 s deadline: a peer
    # that has sent nothing of the round is late, not lossy, so they wait (up to the 3 s cap)
    # and then give it a whole deadline from its first packet on: nothing is lost
    recs = spawn("allreduce", 3, numel=30_000, rounds=5, cap=3.0, floor=0.5, late_rank=2,
                 late_round=3, late_by=1.5)
    for r in recs:
        assert all(sum(x) == 0 for x in r["lost"]), r["lost"]
        assert all(sum(h) == 0 for h in r["hits"]), r["hits"]
        assert max(r["err"]) < 1e-5
    assert max(recs[0]["elapsed"][3], recs[1]["elapsed"][3]) > 1.0  # they did wait


def test_a_subgroup_without_global_rank_0_sets_up_and_reduces() -> None:
    # the secret comes from the GROUP's rank 0 (global rank 1 here); naming global rank 0 as
    # the source failed for every subgroup that does not contain it
    recs = spawn("subgroup", 3, members=[1, 2])
    assert not recs[0]["member"]
    for g in (1, 2):
        assert recs[g]["world"] == 2 and recs[g]["rank"] == g - 1
        assert recs[g]["mean"] == [1.5, 1.5]


def test_a_silent_rank_costs_at_most_one_cap_not_a_hang() -> None:
    recs = spawn("allreduce", 3, numel=3000, rounds=7, silent_rank=2, silent_from=3, cap=1.0,
                 floor=0.5)
    for r in recs[:2]:
        hits = [sum(h) for h in r["hits"]]
        assert len(hits) == 7  # every round completed
        assert hits[:3] == [0, 0, 0]
        # it is waited for until it has been quiet for one cap (1 s: two 0.5 s deadlines
        # here), then never again
        assert 1 <= sum(hits[3:]) <= 2, hits
        assert hits[-2:] == [0, 0], hits
        assert sum(r["elapsed"][3:]) < 2 * 1.0 + 1.0  # bounded: about one cap in all
        assert all(2 in s for s in r["silent"][-2:])  # and it is reported
    assert len(recs[2]["hits"]) == 3


def test_ddp_attach_matches_reliable_ddp_without_loss() -> None:
    # the nanoGPT-style script (two parameter groups, cosine schedule, no_sync accumulation)
    # switched by one line: same parameters as reliable DDP
    rel = spawn("ddp", 3, steps=6, comm="reliable")
    los = spawn("ddp", 3, steps=6, comm="lossy")
    ref = np.array(rel[0]["params"])
    for r in los:
        p = np.array(r["params"])
        np.testing.assert_allclose(p, ref, atol=2e-5)  # float32 summation order only
        assert r["lr"] == rel[0]["lr"]  # the scheduler drove both groups the same way
        assert r["state_keys"] == ["groups", "inner", "mode", "numel", "shard"]
        assert r["fresh_mismatch"] == 0.0 and r["stale_elems"] == 0
        last = r["stats"][-1]
        assert {"pkts_sent", "pkts_recv", "pkts_lost", "pkts_rejected", "deadline_hits",
                "drift", "comm_time", "parity", "recovered"} <= set(last)
        assert last["pkts_lost"] == 0 and last["pkts_rejected"] == 0 and last["pkts_recv"] > 0
        # "auto" protection is erasure coding: one copy of each data packet, parity from the
        # first step (20% loss assumed until links report); later, a link that reports no
        # loss gets none (copies.CLEAN_LOST: test_copies)
        assert all(s["copies"] == 1 for s in r["stats"])
        assert r["stats"][0]["parity"] > 0
