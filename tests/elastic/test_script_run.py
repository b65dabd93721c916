"""The elastic API under ``stalwart run --script`` (the launcher's own store, testbed faults):
a rank of examples/elastic_ddp.py killed by the launcher's ``kill`` fault leaves the others
training in place, and the job succeeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalwart.elastic.launcher import IterationLog, announce, registered
from tests.elastic.cluster import SCRIPT, Records, check_same_training, trained_every_step
from tests.helpers import stalwart

BATCH = 64


def test_ranks_that_joined_are_registered_and_their_steps_logged(tmp_path: Path) -> None:
    assert registered(tmp_path) == set()
    announce(tmp_path, 2, 7)
    announce(tmp_path, 0, 5)
    assert registered(tmp_path) == {0, 2}
    log = IterationLog(tmp_path, 2)
    log.step(4, 1, 3, 2)
    log.close()
    line = json.loads((tmp_path / "iterations.jsonl").read_text())
    assert (line["step"], line["rank"], line["launch_rank"], line["world"], line["gen"]) == \
        (4, 1, 2, 3, 2)


@pytest.mark.slow
def test_a_rank_killed_by_the_launcher_leaves_the_others_training_in_place(
        tmp_path: Path) -> None:
    steps = 40
    rec = tmp_path / "rec"
    r = stalwart("run", "--script", str(SCRIPT), "--nproc", "3", "--detect",
                 "--fault", "kill:rank=1,at=12", "--out", str(tmp_path), "--name", "run",
                 "--no-progress", "--", "--steps", str(steps), "--compute-ms", "5",
                 "--out", str(rec), timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 1 lost" in r.stdout
    run = tmp_path / "run"
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    lost = [e for e in events if e["event"] == "rank_lost"]
    assert [(e["rank"], e["exit_code"]) for e in lost] == [(1, -9)]
    assert registered(run) == {0, 1, 2}
    c = Records(rec)
    check_same_training(c, steps, BATCH)
    # the survivors were never restarted: two processes trained every step, the third
    # stopped at the kill; every step after it ran at world 2
    files = list(c.files().values())
    full = [rs for rs in files if trained_every_step(rs, steps)]
    assert len(files) == 3 and len(full) == 2
    by = c.by_step()
    assert by[steps - 1][0]["world"] == 2 and by[0][0]["world"] == 3
    assert len({rs[-1]["val_loss"] for rs in full}) == 1 and all(rs[-1].get("final")
                                                                  for rs in full)


@pytest.mark.slow
def test_a_rank_killed_and_started_again_by_the_launcher_rejoins_live(tmp_path: Path) -> None:
    """``kill:rank=1,at=12,back=1s``: a node that crashed and restarted. The launcher starts
    rank 1 again a second after the kill, as it was first started (the store's address
    included); it joins the running job without restarting the others, and the job trains
    every step once on the whole global batch, at world 3 again to the end. Paced at 40 ms a
    step, the ~800 steps after the kill last ~30 s: the joiner's start-up (a Python that
    imports torch, seconds) fits in them many times over."""
    steps = 800
    rec = tmp_path / "rec"
    r = stalwart("run", "--script", str(SCRIPT), "--nproc", "3", "--detect",
                 "--fault", "kill:rank=1,at=12,back=1s", "--out", str(tmp_path), "--name",
                 "run", "--no-progress", "--", "--steps", str(steps), "--compute-ms", "40",
                 "--out", str(rec), timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 1 lost" in r.stdout and "rank 1 started again" in r.stdout, r.stdout
    run = tmp_path / "run"
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events if e["event"] in ("rank_lost", "rank_restarted")]
    assert kinds == ["rank_lost", "rank_restarted"], kinds
    c = Records(rec)
    check_same_training(c, steps, BATCH)
    files = list(c.files().values())
    full = [rs for rs in files if rs[-1].get("final")]
    # the two survivors trained every step, never restarted; the restarted process joined
    # (its own file, from a later step) and trained to the end with them
    assert len(files) == 4 and len(full) == 3, [len(rs) for rs in files]
    survivors = [rs for rs in full if trained_every_step(rs, steps)]
    assert len(survivors) == 2
    by = c.by_step()
    assert by[0][0]["world"] == 3 and by[steps - 1][0]["world"] == 3
    assert any(row["world"] == 2 for rows in by.values() for row in rows)
    assert len({rs[-1]["val_loss"] for rs in full}) == 1
