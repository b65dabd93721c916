"""S2 and S4 as calls a policy drives, on a live job of three members (each a thread of this
process with its own store connections, liveness socket and gloo group -- real ones): new
weights change the batch split from a step on; a parked node's member leaves while the
others train on in place, and comes back live with the state when let back in."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from stalwart import elastic
from stalwart.elastic.store import Keys, client, serve
from tests.helpers import free_port

BATCH = 24


def member(node: str, port: int, rows: list[dict[str, Any]], stop: dict[str, int],
           out: dict[str, Any]) -> None:
    torch.manual_seed(hash(node) % 1000)  # different initial weights: the job's must win
    model = torch.nn.Linear(6, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    env = {"STALWART_STORE": f"127.0.0.1:{port}", "STALWART_MIN_WORLD": "3",
           "STALWART_NODE": node}
    job = elastic.Job(model, opt, global_batch=BATCH, env=env)
    x = torch.randn(BATCH * 8, 6, generator=torch.Generator().manual_seed(1))
    y = x.sum(dim=1, keepdim=True)
    for step in job.steps(100000):
        opt.zero_grad()
        for idx in job.my_batch(step):
            i = torch.tensor(idx) % len(x)
            (F.mse_loss(model(x[i]), y[i]) * job.weight(len(idx))).backward()
        time.sleep(0.01)
        if job.commit():
            rows.append({"node": node, "step": step, "samples": job.samples,
                         "world": job.world, "gen": job.generation})
        if step >= stop.get("at", 1 << 30):
            break
    out[node] = [p.detach().clone() for p in model.parameters()]
    job.close()


def wait_for(cond: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.mark.slow
def test_weights_and_a_parked_node_change_the_job_in_place() -> None:
    port = free_port()
    srv = serve("127.0.0.1", port)
    keys = Keys(client("127.0.0.1", port, "stalwart/job/"), "test")
    rows: list[dict[str, Any]] = []
    stop: dict[str, int] = {}
    out: dict[str, Any] = {}
    ts = [threading.Thread(target=member, args=(n, port, rows, stop, out), daemon=True)
          for n in ("n0", "n1", "n2")]
    for t in ts:
        t.start()
    try:
        wait_for(lambda: len(rows) > 30, "the job did not start")
        keys.set_weights("n0=2")  # S2: n0 takes twice the share
        wait_for(lambda: any(r["node"] == "n0" and r["samples"] == 12 for r in rows),
                 "the weights were not applied")
        keys.park("n2", True)  # S4: n2 leaves, the others go on in place
        wait_for(lambda: any(r["world"] == 2 for r in rows), "n2 was not left out")
        n = len(rows)
        wait_for(lambda: len(rows) > n + 20, "the others did not go on")
        keys.park("n2", False)  # n2 comes back live
        wait_for(lambda: any(r["world"] == 3 and r["node"] == "n2" and r["gen"] > 2
                             for r in rows), "n2 did not come back")
        stop["at"] = max(r["step"] for r in rows) + 20
        for t in ts:
            t.join(60)
            assert not t.is_alive()
    finally:
        del srv
    by: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["step"], []).append(r)
    assert sorted(by) == list(range(stop["at"] + 1))  # every step once, none missing
    for s, rs in by.items():
        assert sum(r["samples"] for r in rs) == BATCH, (s, rs)
        assert len(rs) == rs[0]["world"]
    splits = {tuple(sorted((r["node"], r["samples"]) for r in rs)) for rs in by.values()}
    assert (("n0", 8), ("n1", 8), ("n2", 8)) in splits  # equal at first
    assert (("n0", 12), ("n1", 6), ("n2", 6)) in splits  # S2
    assert (("n0", 16), ("n1", 8)) in splits  # S4: n2 parked, weights kept
    assert len(out) == 3  # the same model on all three at the end
    for p0, p1, p2 in zip(out["n0"], out["n1"], out["n2"], strict=True):
        assert torch.equal(p0, p1) and torch.equal(p0, p2)
