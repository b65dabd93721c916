"""The elastic API under ``stalwart run --script`` (the launcher's own store, testbed faults):
a rank of examples/elastic_ddp.py killed by the launcher's ``kill`` fault leaves the others
training in place, and the job succeeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalwart.elastic.launcher import IterationLog, announce, registered
from tests.elastic.cluster import SCRIPT, Records, check_same_training
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
    full = [rs for rs in files if [x["step"] for x in rs if "step" in x] == list(range(steps))]
    assert len(files) == 3 and len(full) == 2
    by = c.by_step()
    assert by[steps - 1][0]["world"] == 2 and by[0][0]["world"] == 3
    assert len({rs[-1]["val_loss"] for rs in full}) == 1 and all(rs[-1].get("final")
                                                                  for rs in full)
