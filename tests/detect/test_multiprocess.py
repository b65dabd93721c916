"""Real multi-process gloo jobs on loopback with a really slow rank (CPU contention)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.rundir import RunData
from tests.helpers import free_port

JOB = Path(__file__).with_name("gloo_job.py")




def run_job(out: Path, world: int, *args: str) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    procs = []
    try:
        for r in range(world):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=port)
            procs.append(subprocess.Popen([sys.executable, str(JOB), "--out", str(out), *args],
                                          env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        for p in procs:
            log, _ = p.communicate(timeout=150)
            assert p.returncode == 0, log[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def check_slow_rank_found(res: list[dict], slow: int) -> dict:
    # every rank holds the same verdicts
    assert all(r["findings"] == res[0]["findings"] for r in res)
    # a job-wide slowdown that validation pins on nobody (kind "unknown", logged as
    # slowdown_unexplained) is by design not a straggler verdict: one before the fault made
    # this test fail once in CI on a busy 2-core machine. The first straggler verdict counts.
    found = [f for f in res[0]["findings"] if f["kind"] != "unknown"]
    assert found, f"nothing detected; iteration times (ms): {res[0]['samples_ms']}"
    first = found[0]
    assert first["kind"] == "compute" and first["ranks"] == [slow], first
    assert first["severity"] > 1.1
    return first


@pytest.mark.slow
def test_slow_rank_is_found_with_step_hints(tmp_path: Path) -> None:
    res = run_job(tmp_path, 2, "--slow-rank", "1", "--slow-at", "30", "--steps", "60")
    first = check_slow_rank_found(res, 1)
    assert 27 <= first["onset_step"] <= 34
    assert first["step"] - first["onset_step"] <= 8
    ev = RunData.load(tmp_path).events_of("straggler_detected")
    assert ev and ev[0]["ranks"] == [1] and ev[0]["kind"] == "compute"


@pytest.mark.slow
def test_slow_rank_is_found_with_batched_exchanges(tmp_path: Path) -> None:
    # what --comm lossy runs use: one exchange every few steps, carrying every step's
    # sample, two in flight -- same verdict and onset, a few steps more latency
    res = run_job(tmp_path, 2, "--slow-rank", "1", "--slow-at", "30", "--steps", "70",
                  "--check-every", "4", "--lag", "2")
    first = check_slow_rank_found(res, 1)
    # the finding's evidence and the iteration times say where a wrong onset came from (CI
    # once read 21 here; 8 of 8 runs on a quiet machine read 30)
    assert 27 <= first["onset_step"] <= 34, (first, res[0]["samples_ms"])
    # latency: the per-step bound (8), plus the samples' delay in flight (lag x check_every
    # = 8), plus the check grid: a verdict is read only at an exchange step, every 4, so the
    # latency moves in steps of 4 (measured 10, 14 locally; 18 once in CI) -- up to 3 more
    assert first["step"] - first["onset_step"] <= 8 + 2 * 4 + (4 - 1), first


@pytest.mark.slow
def test_slow_rank_is_found_without_any_call_from_the_loop(tmp_path: Path) -> None:
    res = run_job(tmp_path, 2, "--slow-rank", "1", "--slow-at", "30", "--steps", "60",
                  "--hint", "0")
    assert all(r["period"] == res[0]["period"] is not None for r in res)
    assert all(r["ddp_ops"] > 0 for r in res)
    check_slow_rank_found(res, 1)


@pytest.mark.slow
def test_a_rank_slow_from_its_first_step_is_named_since_the_start(tmp_path: Path) -> None:
    # no change point exists: the rank competes for its core from step 0 on; the outlier
    # test or the audit must name it, with no healthy "before" (issue 24)
    res = run_job(tmp_path, 2, "--slow-rank", "1", "--slow-at", "0", "--steps", "80")
    first = check_slow_rank_found(res, 1)
    assert first["evidence"]["never_healthy"] is True, first
    assert first["evidence"]["detected_by"] in ("outlier", "audit"), first
    assert first["onset_step"] <= 2, first  # the monitor's first sample
    ev = RunData.load(tmp_path).events_of("straggler_detected")
    assert ev and ev[0]["ranks"] == [1] and ev[0]["evidence"]["never_healthy"] is True
