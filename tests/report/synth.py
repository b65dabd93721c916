"""Synthetic run directories for the report tests, written with stalwart.rundir's writers.

The mitigation records follow the run-directory contract (stalwart.report.mitigation): per-rank
``micro_batches`` / ``plan_version`` / ``host`` in metrics.jsonl, mitigation_* and restart
events in events.jsonl.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from stalwart.rundir import EventLog, JsonlWriter, atomic_write_text

M = 16  # global micro-batches per step


def write_run(path: Path, plans: dict[int, tuple[int, list[int], list[int]]] | None,
              events: list[dict[str, Any]], steps: int = 120, slow: tuple[int, int, int] | None
              = None, nproc: int = 4, legacy: bool = False) -> Path:
    """A run directory with `steps` steps.

    plans: {first step: (plan version, counts per rank, host of each rank)}, in force until the
    next entry (None: uniform on `nproc` ranks, version 0); slow: (rank, start, end) computes
    each micro-batch 2x slower in [start, end); legacy: metrics without the mitigation fields.
    """
    path.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path / "config.json", json.dumps(
        {"nproc": nproc, "tp": 1, "steps": steps, "mitigate": "auto", "global_batch": 2 * M,
         "micro_batch_size": 2}))
    plans = plans or {0: (0, [M // nproc] * nproc, list(range(nproc)))}
    rng = random.Random(0)
    t = 1_000_000.0
    with JsonlWriter(path / "metrics.jsonl") as mw:
        for step in range(steps):
            start = max(s for s in plans if s <= step)
            version, counts, hosts = plans[start]
            per = [0.01 * (2.0 if slow and slow[0] == h and slow[1] <= step < slow[2] else 1.0)
                   * (1 + 0.05 * rng.random()) for h in hosts]
            comp = [n * p for n, p in zip(counts, per, strict=True)]
            step_time = max(comp) + 0.005
            t += step_time
            for rank, (n, c) in enumerate(zip(counts, comp, strict=True)):
                rec: dict[str, Any] = {
                    "step": step, "rank": rank, "time": t + rank * 1e-4, "loss": 5.0 - step / 60,
                    "lr": 3e-4, "step_time": step_time, "compute_time": c,
                    "comm_time": step_time - c, "samples": 2 * n, "tokens": 128 * n,
                    "tokens_per_s": 128 * n / step_time}
                if not legacy:
                    rec.update(micro_batches=n, plan_version=version, host=hosts[rank])
                mw.write(rec)
    with EventLog(path) as ev:
        ev.log("eval", step=0, val_loss=5.4)
        for e in events:
            ev.log(**e)
        ev.log("eval", step=steps - 1, val_loss=3.0)
    return path


FAULT = "compute:rank=2,factor=2,start=30,end=90"

# a compute straggler on rank 2 rebalanced, reverted on recovery, then host 2 excluded
MITIGATED_PLANS = {0: (0, [4, 4, 4, 4], [0, 1, 2, 3]), 37: (1, [5, 5, 2, 4], [0, 1, 2, 3]),
                   94: (2, [4, 4, 4, 4], [0, 1, 2, 3]), 100: (0, [6, 5, 5], [0, 1, 3])}
MITIGATED_EVENTS: list[dict[str, Any]] = [
    {"event": "fault_applied", "step": 30, "kind": "compute", "target": "rank2", "rank": 2,
     "magnitude": 2.0, "spec": FAULT},
    {"event": "straggler_detected", "step": 34, "onset_step": 30, "kind": "compute",
     "ranks": [2], "severity": 2.0},
    {"event": "mitigation_applied", "step": 37, "decided_step": 36, "strategy": "rebalance",
     "plan": [5, 5, 2, 4], "version": 1, "predicted_gain": 0.28, "target": "rank2",
     "reason": "compute straggler on rank 2: 2.0x per micro-batch"},
    {"event": "mitigation_measured", "step": 42, "version": 1, "strategy": "rebalance",
     "predicted_gain": 0.28, "measured_gain": 0.31, "step_time_before": 0.085,
     "step_time_after": 0.0587},
    {"event": "fault_removed", "step": 90, "kind": "compute", "target": "rank2", "rank": 2,
     "magnitude": 2.0, "spec": FAULT},
    {"event": "straggler_recovered", "step": 92},
    {"event": "mitigation_reverted", "step": 94, "decided_step": 93, "strategy": "rebalance",
     "version": 2, "plan": [4, 4, 4, 4], "reason": "straggler recovered"},
    {"event": "mitigation_applied", "step": 100, "decided_step": 99, "strategy": "exclude_host",
     "plan": [0, 1, 3], "version": 3, "predicted_gain": 0.4, "target": "host2",
     "reason": "the job is faster without host 2"},
    {"event": "restart", "step": 100, "nproc": 3, "hosts": [0, 1, 3],
     "strategy": "exclude_host", "reason": "the job is faster without host 2"},
]


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's header."""
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
