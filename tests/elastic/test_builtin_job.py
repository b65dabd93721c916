"""The built-in job on the membership store (train/elastic_loop.py): ``stalwart.train.worker``
under two local ``torchrun --standalone`` agents ("nodes") joined by ``python -m
stalwart.elastic.store``; one node killed with its worker mid-run. The other trains on in
place -- every step on the whole global batch -- and ends at the healthy run's validation
loss. Real processes, torchrun, gloo."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.elastic.cluster import TORCHRUN, Cluster

pytestmark = pytest.mark.slow

ARGS = ["--steps", "40", "--eval-every", "20", "--ckpt-every", "1000", "--name", "run"]


def _start(c: Cluster, name: str, out: Path) -> None:
    log = out / f"{name}.log"
    c.logs[name] = log
    c.nodes[name] = subprocess.Popen(
        [TORCHRUN, "--standalone", "--nproc-per-node", "1", "--monitor-interval", "0.5",
         "-m", "stalwart.train.worker", *ARGS, "--out", str(out)],
        env=c.env, stdout=open(log, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
        start_new_session=True)


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] \
        if path.exists() else []


def _run(out: Path, kill_at: int | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Two nodes of one rank; node b killed once a step >= ``kill_at`` is done. The metrics
    and events of the run."""
    out.mkdir(parents=True)
    c = Cluster(out, 2, [])
    try:
        _start(c, "a", out)
        _start(c, "b", out)
        metrics = out / "run" / "metrics.jsonl"
        if kill_at is not None:
            deadline = time.monotonic() + 240
            while not any(r["step"] >= kill_at for r in _rows(metrics)):
                assert time.monotonic() < deadline, c.tail()
                time.sleep(0.05)
            c.kill("b")
        else:
            assert c.wait("b") == 0, c.tail()
        assert c.wait("a") == 0, c.tail()
        return _rows(metrics), _rows(out / "run" / "events.jsonl")
    finally:
        c.close()


def _final_val(events: list[dict[str, Any]]) -> float:
    return [e["val_loss"] for e in events if e["event"] == "eval" and e["step"] == 40][0]


def test_a_killed_node_leaves_the_built_in_job_training_in_place(tmp_path: Path) -> None:
    m, ev = _run(tmp_path / "kill", kill_at=10)
    healthy_m, healthy_ev = _run(tmp_path / "ok", kill_at=None)
    gb = 16  # the tiny preset's global batch at 2 ranks: 8 samples per rank
    by: dict[int, list[dict[str, Any]]] = {}
    for r in m:
        by.setdefault(r["step"], []).append(r)
    assert sorted(by) == list(range(40))  # no step skipped
    # every step on the whole global batch: the lines of its world (a step the killed node
    # logged before dying counts once its partner's line is there too)
    for s, rs in by.items():
        world = max(r["world"] for r in rs)
        mine = [r for r in rs if r["world"] == world]
        assert sum(r["samples"] for r in mine) == gb or world == 2 and len(mine) == 1, (s, rs)
    worlds = [max(r["world"] for r in by[s]) for s in range(40)]
    assert worlds[0] == 2 and worlds[-1] == 1 and worlds == sorted(worlds, reverse=True)
    assert sum(r["samples"] for r in by[39]) == gb and by[39][0]["world"] == 1
    assert [e["event"] for e in ev if e["event"] in ("run_started", "run_finished")] == \
        ["run_started", "run_finished"]
    # the same samples at every step: the healthy run's validation loss, to fp32 sum order
    assert {r["world"] for r in healthy_m} == {2}
    va, vb = _final_val(ev), _final_val(healthy_ev)
    assert abs(va - vb) / vb <= 1e-4, (va, vb)
