"""Fail-stop: a rank killed mid-run no longer ends the job. Real processes and gloo on the
local testbed: the survivors regroup in place, redo at most the step in flight with the same
global batch, and end at the healthy run's validation loss."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from stalwart.rundir import RunData
from tests.helpers import stalwart

pytestmark = pytest.mark.slow

RUN = ["run", "--nproc", "3", "--mitigate", "auto", "--steps", "14", "--eval-every", "7",
       "--eval-batches", "4", "--ckpt-every", "100", "--no-progress"]


def _samples_per_step(run: RunData) -> dict[int, int]:
    """Samples per step over the lines of a complete world (every rank of it wrote a line)."""
    by: dict[tuple[int, int], list[int]] = defaultdict(list)
    for m in run.metrics:
        by[(m["step"], m["world"])].append(m["samples"])
    return {s: sum(v) for (s, w), v in by.items() if len(v) == w}


@pytest.mark.parametrize("victim", [0, 2])
def test_a_killed_rank_leaves_and_the_job_trains_on(tmp_path: Path, victim: int) -> None:
    # rank 0 holds the first rendezvous store and writes the events: the hardest to lose
    ok = stalwart(*RUN, "--out", str(tmp_path), "--name", "ok")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    cut = stalwart(*RUN, "--out", str(tmp_path), "--name", "cut",
                   "--fault", f"kill:rank={victim},at=6")
    assert cut.returncode == 0, cut.stdout + cut.stderr
    a, b = RunData.load(tmp_path / "ok"), RunData.load(tmp_path / "cut")
    kill = b.events_of("fault_applied")
    assert [e["kind"] for e in kill] == ["kill"] and kill[0]["rank"] == victim
    lost = b.events_of("rank_lost")
    assert [e["rank"] for e in lost] == [victim]
    regroup = b.events_of("regroup")
    assert len(regroup) == 1 and regroup[0]["world"] == 2 and regroup[0]["lost"] == [victim]
    # every step was trained, each on the whole global batch, the later ones by two ranks
    per_step = _samples_per_step(b)
    assert sorted({m["step"] for m in b.metrics}) == list(range(14))
    assert all(n == 24 for n in per_step.values()), per_step
    back = regroup[0]["step"]
    assert 6 <= back <= 8  # at most the step in flight is redone
    assert {m["world"] for m in b.metrics if m["step"] >= back} == {2}
    assert {m["host"] for m in b.metrics if m["step"] >= back} == {0, 1, 2} - {victim}
    # the same training: same samples per step, so the same validation loss
    va, vb = a.final_val_loss(), b.final_val_loss()
    assert va is not None and vb is not None
    assert abs(va - vb) / va <= 1e-3, (va, vb)
    assert b.events_of("run_finished")[-1]["ok"] is True


def test_without_mitigation_a_killed_rank_still_stops_the_job(tmp_path: Path) -> None:
    off = [a if a != "auto" else "off" for a in RUN]
    got = stalwart(*off, "--out", str(tmp_path), "--name", "off", "--fault", "kill:rank=1,at=4")
    assert got.returncode == 1, got.stdout + got.stderr
    run = RunData.load(tmp_path / "off")
    assert [e["rank"] for e in run.events_of("rank_failed")] == [1]
    assert not run.events_of("regroup")


def test_a_killed_tensor_parallel_rank_takes_its_group_out_and_the_job_trains_on(
        tmp_path: Path) -> None:
    # 4 ranks as 2 TP groups of 2: (0, 1) and (2, 3); rank 3 dies, rank 2 cannot compute its
    # group's shards alone and leaves, and (0, 1) train every later step's whole global batch
    tp = [a if a != "3" else "4" for a in RUN] + ["--tp", "2"]
    ok = stalwart(*tp, "--out", str(tmp_path), "--name", "ok")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    cut = stalwart(*tp, "--out", str(tmp_path), "--name", "cut", "--fault", "kill:rank=3,at=6")
    assert cut.returncode == 0, cut.stdout + cut.stderr
    a, b = RunData.load(tmp_path / "ok"), RunData.load(tmp_path / "cut")
    lost = b.events_of("rank_lost")
    assert [(e["rank"], e["left"]) for e in lost] == [(3, [2])]
    assert [e["rank"] for e in b.events_of("rank_left")] == [2]
    regroup = b.events_of("regroup")
    assert [(e["world"], e["members"], e["lost"]) for e in regroup] == [(2, [0, 1], [3])]
    back = regroup[0]["step"]
    assert 6 <= back <= 8  # at most the step in flight is redone
    assert {m["world"] for m in b.metrics if m["step"] >= back} == {2}
    assert {m["host"] for m in b.metrics if m["step"] >= back} == {0, 1}
    # the same samples every step (counted once per TP group: its ranks share a micro-batch)
    per_step = {s: n // 2 for s, n in _samples_per_step(b).items()}
    assert sorted(per_step) == list(range(14)) and len(set(per_step.values())) == 1, per_step
    va, vb = a.final_val_loss(), b.final_val_loss()
    assert va is not None and vb is not None
    assert abs(va - vb) / va <= 1e-3, (va, vb)
    assert b.events_of("run_finished")[-1]["ok"] is True
