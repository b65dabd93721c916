"""A failed in-place regroup falls back to checkpoint-and-relaunch (issue 25). Real processes
and gloo on the local testbed: rank 1 is killed at step 6, and launch rank 0 -- the new
generation's rank 0, which serves its store -- refuses to build the new groups (the
STALWART_TEST_REGROUP_FAIL hook). Every rank must save its state and exit, the launcher must
log ``regroup_failed`` with the reason and the fallback, and relaunch on the hosts of the
membership it could not build (without the dead rank's) from the most advanced state: every
step trained once on the whole global batch, ending at the healthy run's validation loss."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from stalwart.mitigate.fallback import TEST_FAIL_ENV
from stalwart.rundir import RunData
from tests.helpers import goes_on_after_its_last_completed_step, stalwart

pytestmark = pytest.mark.slow

RUN = ["run", "--nproc", "3", "--mitigate", "auto", "--steps", "14", "--eval-every", "7",
       "--eval-batches", "4", "--ckpt-every", "100", "--no-progress"]


def test_a_failed_regroup_falls_back_to_a_relaunch(tmp_path: Path) -> None:
    ok = stalwart(*RUN, "--out", str(tmp_path), "--name", "ok")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    got = stalwart(*RUN, "--out", str(tmp_path), "--name", "fb", "--fault", "kill:rank=1,at=6",
                   env={TEST_FAIL_ENV: "0"})
    assert got.returncode == 0, got.stdout + got.stderr
    a, b = RunData.load(tmp_path / "ok"), RunData.load(tmp_path / "fb")
    assert [e["rank"] for e in b.events_of("rank_lost")] == [1]
    assert not b.events_of("regroup")  # never built in place
    failed = b.events_of("regroup_failed")
    assert len(failed) == 1, b.events_of("regroup_failed", "restart", "rank_failed")
    f = failed[0]
    assert f["fallback"] == "restart" and f["hosts"] == [0, 2] and f["failed"] == [0]
    assert "cannot build the groups" in f["reason"], f
    goes_on_after_its_last_completed_step(b, f["resume_step"], 3, {0, 2})
    restart = b.events_of("restart")
    assert len(restart) == 1 and restart[0]["strategy"] == "fallback"
    assert restart[0]["hosts"] == [0, 2] and restart[0]["step"] == f["resume_step"]
    assert b.events_of("resumed")[-1]["step"] == f["resume_step"]
    # every step trained, each on the whole global batch; those from the resume step on by
    # the relaunch's two ranks, on the hosts of the membership it could not build in place
    by: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for m in b.metrics:
        by[(m["step"], m["world"])].append(m)
    assert sorted({s for s, _ in by}) == list(range(14))
    assert all(sum(m["samples"] for m in v) == 24 for (s, w), v in by.items() if len(v) == w)
    back = f["resume_step"]
    after = [m for m in b.metrics if m["step"] >= back]
    assert {m["world"] for m in after} == {2} and {m["host"] for m in after} == {0, 2}
    assert len(after) == 2 * (14 - back)  # each step once per rank: nothing trained twice
    va, vb = a.final_val_loss(), b.final_val_loss()
    assert va is not None and vb is not None
    assert abs(va - vb) / va <= 1e-3, (va, vb)
    assert b.events_of("run_finished")[-1]["ok"] is True
    assert "in-place regroup failed" in got.stdout + got.stderr


def test_a_failed_regroup_of_a_lossy_job_stops_with_the_reason(tmp_path: Path) -> None:
    # --comm lossy: each rank saved only its own shard of the optimizer state, which a
    # relaunch at another world size cannot load (and the broken groups cannot re-shard):
    # the job stops, saying why, instead of relaunching from a state it cannot read
    got = stalwart(*RUN, "--comm", "lossy", "--out", str(tmp_path), "--name", "fb",
                   "--fault", "kill:rank=1,at=6", env={TEST_FAIL_ENV: "0"})
    assert got.returncode == 1, got.stdout + got.stderr
    b = RunData.load(tmp_path / "fb")
    assert [e["rank"] for e in b.events_of("rank_lost")] == [1]
    assert not b.events_of("regroup") and not b.events_of("restart")
    failed = b.events_of("regroup_failed")
    assert len(failed) == 1 and failed[0]["fallback"] == "none", failed
    assert "cannot build the groups" in failed[0]["reason"], failed
    assert "--comm lossy" in failed[0]["reason"], failed
    assert "no relaunch is possible" in got.stdout + got.stderr
