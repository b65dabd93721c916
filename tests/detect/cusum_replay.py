"""Replay recorded runs through the CUSUM bank: a by-hand script (not a test) behind the choice
of ``CusumBank``'s ``shift`` and ``h``.

For every run directory given, each step's per-rank compute time (metrics.jsonl) relative to
the job's median goes through a fresh bank, as the monitor feeds it. Alarms on a rank that
the testbed did not throttle (or before its fault) are false alarms; on the throttled rank,
the first alarm's step and onset are printed next to the fault's start step. The monitor's
validation tests still stand between an alarm and a verdict: a false alarm costs a pause,
not a false verdict.

    python tests/detect/cusum_replay.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from stalwart.detect.cusum import CusumBank

VARIANTS = [(0.2, 10.0), (0.15, 10.0), (0.15, 8.0), (0.1, 10.0)]


def _series(run: Path) -> tuple[list[int], np.ndarray]:
    by: dict[int, dict[int, float]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        by.setdefault(m["step"], {})[m["rank"]] = m["compute_time"]
    n = max(len(v) for v in by.values())
    steps = sorted(s for s in by if len(by[s]) == n)
    return steps, np.array([[by[s][k] for k in range(n)] for s in steps])


def _fault(run: Path) -> tuple[int, int] | None:
    for line in (run / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == "fault_applied" and e.get("kind") == "compute":
            return int(e["rank"]), int(e["start"])
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    args = ap.parse_args()
    for shift, h in VARIANTS:
        false_alarms, healthy, found = 0, 0, []
        for run in args.runs:
            steps, comp = _series(run)
            rel = comp / np.median(comp, axis=1, keepdims=True)
            fault = _fault(run)
            bank = CusumBank(rel.shape[1], shift=shift, h=h, warmup=10)
            first: tuple[int, int] | None = None
            for s, row in zip(steps, rel, strict=True):
                for r, ch in enumerate(bank.add(s, row)):
                    if ch is None:
                        continue
                    if fault is not None and r == fault[0] and s >= fault[1]:
                        first = first or (s, ch.onset)
                    else:
                        false_alarms += 1
            faulty = sum(s >= fault[1] for s in steps) if fault else 0
            healthy += rel.size - faulty
            if fault is not None:
                found.append(f"{first[0]}/{first[1]}@{fault[1]}" if first else f"-@{fault[1]}")
        print(f"shift {shift} h {h}: {false_alarms} false alarms in {healthy} healthy "
              f"rank-steps; throttled rank first alarm/onset@fault: {' '.join(found)}")


if __name__ == "__main__":
    main()
