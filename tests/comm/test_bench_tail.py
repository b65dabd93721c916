"""The lossy bench's tail account (``bench.lossy.tail_account``), its barrier for timed
operations (``bench.lossy_worker.FileBarrier``) and how its training runs name their
protection (``bench.lossy.bench_training``)."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest

import stalwart.launch
from stalwart.bench.lossy import bench_training, how_ended, tail_account
from stalwart.bench.lossy_worker import FileBarrier
from stalwart.config import RunConfig
from stalwart.rundir import RunData


def test_how_ended_names_every_way_a_phase_ends() -> None:
    assert how_ended("complete", 0) == "data"
    assert how_ended("complete", 3) == "parity"
    assert how_ended("ended", 5) == "markers"
    assert how_ended("deadline", 0) == "deadline"


def _phase(end: str, started: float, ended: float, elapsed: float, sent: float,
           recovered: int = 0) -> list:
    return [end, started, ended, elapsed, 1, 0, recovered, sent, 4]


def test_tail_account_splits_the_slowest_rank_and_reads_start_skew() -> None:
    # 2 ranks, 10 iterations; iteration 9 is slow because rank 1 started 0.2 s late: rank 0
    # waited for it to start (skew), then for its packets (transfer)
    fast = [_phase("complete", 0.01, 0.02, 0.02, 0.01), _phase("complete", 0.01, 0.01, 0.01, 0.01)]
    slow0 = [_phase("complete", 0.21, 0.23, 0.235, 0.01, recovered=2),
             _phase("complete", 0.01, 0.01, 0.01, 0.01)]
    waits = [[fast] * 9 + [slow0], [fast] * 10]
    starts = [[float(i) for i in range(10)], [float(i) for i in range(9)] + [9.2]]
    ours = [0.03] * 9 + [0.245]
    acc = tail_account(ours, waits, starts)
    rows = acc["iterations"]
    assert {r["iter"] for r in rows} == {9} and rows[0]["rank"] == 0
    rs = rows[0]
    assert abs(rs["skew_s"] - 0.2) < 1e-9 and abs(rs["transfer_s"] - 0.02) < 1e-9
    assert abs(rs["end_wait_s"] - 0.005) < 1e-9 and abs(rs["after_send_s"] - 0.225) < 1e-9
    assert rs["how"] == "parity" and rs["parity"] == 4
    assert abs(rs["start_skew_s"] - 0.2) < 1e-9 and acc["start_skew_s"][0] == 0.0
    assert acc["ends"] == {"data": 39, "parity": 1}  # every phase of every rank, counted


def test_file_barrier_releases_nobody_before_everyone_entered(tmp_path) -> None:
    world, calls = 4, 25
    entered = [[0.0] * calls for _ in range(world)]
    left = [[0.0] * calls for _ in range(world)]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            b = FileBarrier(tmp_path / "sync", r, world)
            rng = random.Random(r)
            for n in range(calls):
                time.sleep(rng.random() * 2e-3)  # arrive in a different order every call
                entered[r][n] = time.perf_counter()
                b()
                left[r][n] = time.perf_counter()
            b.close()
        except BaseException as e:  # noqa: BLE001 -- reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    for n in range(calls):
        last_in = max(entered[r][n] for r in range(world))
        assert all(left[r][n] >= last_in for r in range(world)), n



class _NoRun:
    """What ``bench_training`` reads of a finished run, for a run that was not made."""

    metrics: list[dict] = []

    def final_val_loss(self) -> float:
        return 0.0

    def total_tokens_per_s(self) -> float:
        return 1.0


def test_the_training_runs_name_their_protection_in_the_configuration(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench_training`` passes each run's protection as ``comm.fec`` (what config.json
    records and the ranks read) and leaves the environment alone. The launcher stands in
    for the ten 4-rank training runs on the testbed."""
    seen: list[tuple[str, str | None]] = []

    def launch(cfg: RunConfig, **_k: object) -> int:
        seen.append((cfg.comm.mode, cfg.comm.fec))
        assert "STALWART_FEC" not in os.environ
        return 0

    monkeypatch.setattr(stalwart.launch, "launch", launch)
    monkeypatch.setattr(RunData, "load", classmethod(lambda cls, path: _NoRun()))
    monkeypatch.delenv("STALWART_FEC", raising=False)
    out = bench_training(9000, 2, tmp_path, repeat=False)
    assert seen == [("reliable", None), ("lossy", "rs"), ("reliable", None), ("lossy", "rs"),
                    ("lossy", "rs"), ("lossy", "rs"), ("lossy", "rs"), ("lossy", "none"),
                    ("lossy", "none"), ("lossy", "none")]
    assert {"lossy0.01-none", "lossy0.05-none", "lossy0.1-none"} <= set(out)
