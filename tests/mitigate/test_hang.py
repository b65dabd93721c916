"""A rank that hangs or is cut off, on the built-in trainer under ``stalwart run``: the
launcher finds it by its missing heartbeat (heartbeat.py), kills it, and from there it is a
dead rank -- in a job that regroups in place the survivors train on, in any other the job
stops with one line naming the silence instead of waiting out gloo's timeout. Real processes,
gloo, SIGSTOP and (root) nftables on the netns testbed."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from stalwart.events import RankUnresponsive, parse
from stalwart.heartbeat import SILENT_S
from stalwart.rundir import RunData
from tests.helpers import goes_on_after_its_last_completed_step, stalwart

pytestmark = pytest.mark.slow

RUN = ["run", "--nproc", "3", "--steps", "14", "--eval-every", "7", "--eval-batches", "4",
       "--ckpt-every", "100", "--no-progress"]


def _samples_per_step(run: RunData) -> dict[int, int]:
    by: dict[tuple[int, int], list[int]] = defaultdict(list)
    for m in run.metrics:
        by[(m["step"], m["world"])].append(m["samples"])
    return {s: sum(v) for (s, w), v in by.items() if len(v) == w}


def _dropped_for_silence(run: RunData, victim: int) -> None:
    """The victim was judged silent once, at the short bound (it had been set up), killed,
    and nobody else was."""
    silent = run.events_of("rank_unresponsive")
    assert [(e["rank"], e["bound_s"], e["heard"]) for e in silent] == [(victim, SILENT_S, True)]
    assert silent[0]["silent_s"] >= SILENT_S
    ev = parse(silent[0])
    assert isinstance(ev, RankUnresponsive) and ev.rank == victim


def _trained_on_without(run: RunData, victim: int) -> None:
    assert [e["rank"] for e in run.events_of("rank_lost")] == [victim]
    regroup = run.events_of("regroup")
    assert [(e["world"], e["lost"]) for e in regroup] == [(2, [victim])]
    assert sorted({m["step"] for m in run.metrics}) == list(range(14))
    per_step = _samples_per_step(run)
    assert all(n == 24 for n in per_step.values()), per_step
    goes_on_after_its_last_completed_step(run, regroup[0]["step"], 3, {0, 1, 2} - {victim})
    assert run.events_of("run_finished")[-1]["ok"] is True


def test_a_hung_rank_is_dropped_and_the_job_trains_on_in_place(tmp_path: Path) -> None:
    got = stalwart(*RUN, "--mitigate", "auto", "--fault", "hang:rank=2,at=6",
                   "--out", str(tmp_path), "--name", "hang")
    assert got.returncode == 0, got.stdout + got.stderr
    run = RunData.load(tmp_path / "hang")
    assert [e["kind"] for e in run.events_of("fault_applied")] == ["hang"]
    _dropped_for_silence(run, 2)
    _trained_on_without(run, 2)


def test_without_mitigation_a_hung_rank_stops_the_job_with_one_line(tmp_path: Path) -> None:
    got = stalwart(*RUN, "--mitigate", "off", "--fault", "hang:rank=1,at=4",
                   "--out", str(tmp_path), "--name", "off")
    assert got.returncode == 1, got.stdout + got.stderr
    run = RunData.load(tmp_path / "off")
    _dropped_for_silence(run, 1)
    failed = run.events_of("rank_failed")
    assert [e["rank"] for e in failed] == [1]
    assert "no heartbeat" in failed[0]["error"] and "hung or cut off" in failed[0]["error"]
    line = [ln for ln in got.stdout.splitlines() if "rank 1 failed" in ln]
    assert len(line) == 1 and "no heartbeat" in line[0]


@pytest.mark.root
def test_a_host_cut_off_is_dropped_and_the_job_trains_on_in_place(tmp_path: Path) -> None:
    """``cut:host=1``: every packet to and from host 1 dropped (its process still runs): its
    beats stop reaching the launcher's control namespace like its gloo traffic."""
    got = stalwart(*RUN, "--testbed", "netns", "--mitigate", "auto", "--fault",
                   "cut:host=1,start=6", "--out", str(tmp_path), "--name", "cut")
    assert got.returncode == 0, got.stdout + got.stderr
    run = RunData.load(tmp_path / "cut")
    applied = run.events_of("fault_applied")
    assert [e["kind"] for e in applied] == ["cut"] and "stw_cut" in applied[0]["mechanism"]
    _dropped_for_silence(run, 1)
    _trained_on_without(run, 1)
