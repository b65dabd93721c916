"""The run directory: the one format for run data, with its writers and its one reader.

Layout of ``runs/<name>/``::

    config.json      the resolved RunConfig
    metrics.jsonl    one JSON object per rank per step (see METRIC_KEYS)
    events.jsonl     one JSON object per event; every event has "event", "time" (unix seconds)
                     and, when known, "step"; each kind is a type of stalwart.events (e.g.
                     FaultApplied: testbed ground truth, StragglerDetected: detect, Eval,
                     Checkpoint, RunStarted / RunFinished / RankFailed: launcher)
    checkpoints/     step-NNNNNN/rank-R.pt and LATEST, each written atomically
    logs/            rank-R.log: each rank's stdout and stderr
    report.html      + *.png, built by ``stalwart report``

Several processes (the launcher and every rank) append to the same JSONL file. Each line is
written with a single ``os.write`` on an ``O_APPEND`` descriptor, which Linux applies atomically
for regular files, so lines never interleave. Everything else is written to a temporary file,
fsynced and renamed into place: a crash leaves either the old file or the new one, never half.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from stalwart.events import Eval, Event, parse

E = TypeVar("E", bound=Event)

METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
CONFIG = "config.json"
CHECKPOINTS = "checkpoints"
LOGS = "logs"
ITERATIONS = "iterations.jsonl"  # a script run's monitor iterations, one line per rank
ERROR_SUFFIX = ".error.json"  # logs/rank-R.error.json: when and how rank R's script failed

# keys every metrics line has; capabilities add their own (e.g. "pkts_lost", "drift")
METRIC_KEYS = (
    "step", "rank", "time", "loss", "lr", "step_time", "compute_time", "comm_time",
    "samples", "tokens", "tokens_per_s",
)


# ---- writing --------------------------------------------------------------------------------
def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` via temp file + fsync + rename (+ fsync of the folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


class JsonlWriter:
    """Appends JSON lines to a file shared with other processes (one os.write per line)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EventLog(JsonlWriter):
    """events.jsonl: ``emit(Checkpoint(step=20))`` writes
    ``{"event": "checkpoint", "time": ..., "step": 20}``."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(Path(run_dir) / EVENTS)

    def emit(self, ev: Event) -> dict[str, Any]:
        """A typed event (stalwart.events) as its line; returns the line."""
        return self.log(ev.name, **ev.fields())

    def relay(self, rec: dict[str, Any], **tags: Any) -> dict[str, Any]:
        """Another source's record written as it is, ``tags`` first: ``stalwart simulate``'s
        scenario records (simulate/engine.py), whose kinds and fields are the simulator's."""
        return self.log(rec["event"], **tags, **{k: v for k, v in rec.items() if k != "event"})

    def log(self, event: str, **fields: Any) -> dict[str, Any]:
        """An untyped line: only for the writers tests/test_events_typed.py lists as not yet
        typed; every other kind goes through ``emit``."""
        rec = {"event": event, "time": time.time(), **fields}
        self.write(rec)
        return rec


# ---- reading --------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All complete lines of a JSONL file (a torn last line from a crash is ignored)."""
    out: list[dict[str, Any]] = []
    try:
        with open(path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return out


class JsonlTail:
    """Incrementally reads new complete lines of a growing JSONL file (the launcher's view)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._pos = 0
        self._partial = b""

    def poll(self) -> Iterator[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                data = f.read()
                self._pos = f.tell()
        except FileNotFoundError:
            return
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            if line:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue


@dataclass
class RunData:
    """Everything in one run directory, loaded once. Used by report, tests and benchmarks."""

    path: Path
    config: dict[str, Any]
    metrics: list[dict[str, Any]]
    events: list[dict[str, Any]]
    _by_rank: dict[int, list[dict[str, Any]]] = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, path: str | Path) -> RunData:
        p = Path(path)
        if not p.is_dir():
            raise FileNotFoundError(f"not a run directory: {p}")
        cfg_path = p / CONFIG
        config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        return cls(p, config, read_jsonl(p / METRICS), read_jsonl(p / EVENTS))

    # metrics views ------------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        return sorted({m["rank"] for m in self.metrics})

    def rank_metrics(self, rank: int) -> list[dict[str, Any]]:
        if not self._by_rank:
            for m in self.metrics:
                self._by_rank.setdefault(m["rank"], []).append(m)
            for v in self._by_rank.values():
                v.sort(key=lambda m: m["step"])
        return self._by_rank.get(rank, [])

    def series(self, key: str, rank: int = 0) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric for one rank, skipping steps that lack it."""
        rows = [m for m in self.rank_metrics(rank) if key in m and m[key] is not None]
        return [m["step"] for m in rows], [float(m[key]) for m in rows]

    def step_table(self, key: str) -> dict[int, dict[int, float]]:
        """{step: {rank: value}} for one metric."""
        out: dict[int, dict[int, float]] = {}
        for m in self.metrics:
            if key in m and m[key] is not None:
                out.setdefault(m["step"], {})[m["rank"]] = float(m[key])
        return out

    def iteration_times(self) -> tuple[list[int], list[float]]:
        """Per step, the slowest rank's step time: the time the synchronous job took."""
        table = self.step_table("step_time")
        steps = sorted(table)
        return steps, [max(table[s].values()) for s in steps]

    # events views -------------------------------------------------------------------------
    def events_of(self, *kinds: str | type[Event]) -> list[dict[str, Any]]:
        """The lines of these kinds, in the order written: each kind a type of
        stalwart.events (``events_of(Regroup)``) or its name (``events_of("regroup")``)."""
        names = {k if isinstance(k, str) else k.name for k in kinds}
        return [e for e in self.events if e.get("event") in names]

    def typed(self, kind: type[E]) -> list[E]:
        """The lines of one kind read back as its type (stalwart.events.parse), in the order
        written; a line that lacks a field the type needs (an older version's) is left out,
        and a line's "time" is not a field (``events_of`` has it)."""
        got = (parse(e) for e in self.events_of(kind))
        return [e for e in got if isinstance(e, kind)]

    def eval_losses(self) -> tuple[list[int], list[float]]:
        ev = self.events_of(Eval)
        return [e["step"] for e in ev], [float(e["val_loss"]) for e in ev]

    def final_val_loss(self) -> float | None:
        _, losses = self.eval_losses()
        return losses[-1] if losses else None

    def initial_val_loss(self) -> float | None:
        _, losses = self.eval_losses()
        return losses[0] if losses else None

    def total_tokens_per_s(self) -> float:
        """Job throughput: all ranks' tokens over the wall time spanned by the metrics."""
        if not self.metrics:
            return 0.0
        tokens = sum(m.get("tokens", 0) for m in self.metrics)
        t0 = min(m["time"] - m["step_time"] for m in self.metrics)
        t1 = max(m["time"] for m in self.metrics)
        return tokens / max(t1 - t0, 1e-9)
