"""The columnar trace every reader produces: one row per operation of one rank.

Columns (the documented schema of a CSV or parquet trace, docs/detect.md):

| column | type | meaning |
|---|---|---|
| ``rank`` | int | global rank that ran the operation |
| ``step`` | int | training step (iteration) it belongs to |
| ``name`` | str | operation name (Megatron-LM timer, Kineto op or kernel, or your own) |
| ``start`` | float | start time (any origin, per rank), in ``unit`` (default seconds) |
| ``duration`` | float | its duration, in ``unit`` |
| ``micro`` | int, optional | micro-batch index within the step (empty or -1: none) |

Guarantees: arrays of equal length, times in seconds, ``micro`` -1 where absent.
Cost: the arrays themselves (about 40 bytes per operation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

REQUIRED = ("rank", "step", "name", "start", "duration")
OPTIONAL = ("micro",)
COLUMNS = REQUIRED + OPTIONAL
UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


@dataclass
class Trace:
    rank: np.ndarray  # int64
    step: np.ndarray  # int64
    name: np.ndarray  # object (str)
    start: np.ndarray  # float64, seconds
    duration: np.ndarray  # float64, seconds
    micro: np.ndarray  # int64, -1 where absent
    source: str = ""
    fmt: str = ""
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rank)

    @staticmethod
    def from_columns(rank: list[int], step: list[int], name: list[str], start: list[float],
                     duration: list[float], micro: list[int] | None = None, *,
                     source: str = "", fmt: str = "") -> Trace:
        n = len(rank)
        return Trace(
            rank=np.asarray(rank, dtype=np.int64).reshape(n),
            step=np.asarray(step, dtype=np.int64).reshape(n),
            name=np.asarray(name, dtype=object).reshape(n),
            start=np.asarray(start, dtype=np.float64).reshape(n),
            duration=np.asarray(duration, dtype=np.float64).reshape(n),
            micro=(np.full(n, -1, dtype=np.int64) if micro is None
                   else np.asarray(micro, dtype=np.int64).reshape(n)),
            source=source, fmt=fmt)

    @staticmethod
    def concat(parts: list[Trace], source: str, fmt: str) -> Trace:
        cat = {k: np.concatenate([getattr(p, k) for p in parts]) if parts else np.zeros(0)
               for k in ("rank", "step", "name", "start", "duration", "micro")}
        notes = [n for p in parts for n in p.notes]
        return Trace(**cat, source=source, fmt=fmt, notes=notes)
