"""Reading traces from files: CSV, parquet, PyTorch profiler (Kineto) Chrome-trace JSON.

``read_trace(path, unit)`` picks the reader by the file's suffix (a directory: every
``*.json``/``*.json.gz``/``*.csv``/``*.parquet`` in it, one file per rank as Kineto writes
them). ``read_sidecar(path)`` reads the optional layout file next to a trace.

Kineto: steps come from the ``ProfilerStep#N`` annotations; the rank from the file's
``distributedInfo`` (or a ``rank<N>`` in its name). With GPU kernels in the file, the kernels
are the operations (each placed in the step of the CPU launch that issued it, through the
launch's correlation id): compute and NCCL kernels. Without kernels (a CPU job), the
operations are the outermost CPU ops and annotations whose names map to compute or
communication; a compute op's time excludes the communication ops nested in it.

Guarantees: bad input raises ``ConfigError`` naming the file or the value; nothing else is
written or changed. Cost: one pass over each file (Kineto JSON is parsed whole in memory).
"""

from __future__ import annotations

import bisect
import csv
import gzip
import json
import re
from pathlib import Path
from typing import Any

from stalwart.errors import ConfigError
from stalwart.traces.opnames import COMM, COMPUTE, STEP, OpMap
from stalwart.traces.schema import COLUMNS, REQUIRED, UNITS, Trace

SUFFIXES = (".csv", ".parquet", ".json", ".json.gz")
_STEP_RE = re.compile(r"ProfilerStep#(\d+)")
_RANK_RE = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
CPU_CATS = ("cpu_op", "user_annotation", "python_function")


def sidecar_path(trace: Path) -> Path:
    """``DIR/layout.json`` for a directory, ``FILE.layout.json`` beside a file."""
    return trace / "layout.json" if trace.is_dir() else trace.with_name(trace.name + ".layout.json")


def read_sidecar(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"layout file {path}: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"layout file {path}: expected a JSON object")
    bad = sorted(set(d) - {"dp", "pp", "tp", "order", "ranks_per_host", "unit", "map"})
    if bad:
        raise ConfigError(f"layout file {path}: unknown key {bad[0]!r} (known: dp, pp, tp, "
                          "order, ranks_per_host, unit, map)")
    return d


def _files(path: Path) -> list[Path]:
    if not path.exists():
        raise ConfigError(f"--trace {path}: no such file or directory")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.name.endswith(SUFFIXES)
                       and p.name != "layout.json" and not p.name.endswith(".layout.json"))
        if not files:
            raise ConfigError(f"--trace {path}: no .csv, .parquet or .json trace files in it")
        return files
    if not path.name.endswith(SUFFIXES):
        raise ConfigError(f"--trace {path}: unknown format (expected "
                          f"{', '.join(SUFFIXES)} or a directory of them)")
    return [path]


def read_trace(path: Path, unit: str = "s", opmap: OpMap | None = None) -> Trace:
    """Every operation of the trace at ``path``; ``unit`` applies to CSV/parquet times."""
    if unit not in UNITS:
        raise ConfigError(f"--unit {unit!r}: one of {', '.join(UNITS)}")
    opmap = opmap or OpMap()
    parts = []
    fmts = set()
    for f in _files(path):
        if f.name.endswith(".csv"):
            parts.append(read_csv(f, unit))
            fmts.add("csv")
        elif f.name.endswith(".parquet"):
            parts.append(read_parquet(f, unit))
            fmts.add("parquet")
        else:
            parts.append(read_kineto(f, opmap))
            fmts.add("kineto")
    t = Trace.concat(parts, source=str(path), fmt="+".join(sorted(fmts)))
    if len(t) == 0:
        raise ConfigError(f"--trace {path}: no operations in it")
    return t


def _check_columns(f: Path, cols: list[str]) -> None:
    unknown = [c for c in cols if c not in COLUMNS]
    if unknown:
        raise ConfigError(f"--trace {f}: unknown column {unknown[0]!r} (the schema: "
                          f"{', '.join(COLUMNS)})")
    missing = [c for c in REQUIRED if c not in cols]
    if missing:
        raise ConfigError(f"--trace {f}: missing column {missing[0]!r}")


def _build(f: Path, cols: dict[str, list[Any]], unit: str, fmt: str) -> Trace:
    scale = UNITS[unit]
    n = len(cols["rank"])
    try:
        micro = None
        if "micro" in cols:
            micro = [-1 if v in (None, "") else int(float(v)) for v in cols["micro"]]
        t = Trace.from_columns(
            [int(float(v)) for v in cols["rank"]], [int(float(v)) for v in cols["step"]],
            [str(v) for v in cols["name"]], [float(v) * scale for v in cols["start"]],
            [float(v) * scale for v in cols["duration"]], micro, source=str(f), fmt=fmt)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--trace {f}: a value is not a number ({e})") from None
    if n and (t.rank.min() < 0 or (t.duration < 0).any()):
        raise ConfigError(f"--trace {f}: negative rank or duration")
    return t


def read_csv(f: Path, unit: str = "s") -> Trace:
    with f.open(newline="") as fh:
        rows = csv.reader(fh)
        try:
            header = [h.strip() for h in next(rows)]
        except StopIteration:
            raise ConfigError(f"--trace {f}: empty file") from None
        _check_columns(f, header)
        cols: dict[str, list[Any]] = {h: [] for h in header}
        for line_no, row in enumerate(rows, start=2):
            if not row:
                continue
            if len(row) != len(header):
                raise ConfigError(f"--trace {f}: line {line_no} has {len(row)} fields, the "
                                  f"header {len(header)}")
            for h, v in zip(header, row, strict=True):
                cols[h].append(v.strip())
    return _build(f, cols, unit, "csv")


def read_parquet(f: Path, unit: str = "s") -> Trace:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"--trace {f}: reading parquet needs pyarrow (pip install "
                          "'stalwart[traces]' or pip install pyarrow), or give the trace "
                          "as CSV") from None
    try:
        table = pq.read_table(f)
    except Exception as e:  # noqa: BLE001 -- pyarrow raises several types for a bad file
        raise ConfigError(f"--trace {f}: not a readable parquet file ({e})") from None
    _check_columns(f, list(table.column_names))
    return _build(f, table.to_pydict(), unit, "parquet")


def write_parquet(t: Trace, f: Path) -> None:
    """The trace as a parquet file in the schema (needs pyarrow)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"rank": t.rank, "step": t.step, "name": [str(n) for n in t.name],
                      "start": t.start, "duration": t.duration, "micro": t.micro})
    pq.write_table(table, f)


def write_csv(t: Trace, f: Path) -> None:
    with f.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(COLUMNS)
        for i in range(len(t)):
            w.writerow([int(t.rank[i]), int(t.step[i]), t.name[i], f"{t.start[i]:.9f}",
                        f"{t.duration[i]:.9f}", "" if t.micro[i] < 0 else int(t.micro[i])])


# --- Kineto -------------------------------------------------------------------------------

def _load_json(f: Path) -> dict[str, Any]:
    try:
        opener = gzip.open if f.name.endswith(".gz") else open
        with opener(f, "rt") as fh:
            d = json.load(fh)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--trace {f}: not a readable JSON trace ({e})") from None
    if isinstance(d, list):
        d = {"traceEvents": d}
    if not isinstance(d, dict) or not isinstance(d.get("traceEvents"), list):
        raise ConfigError(f"--trace {f}: no traceEvents (not a Chrome/Kineto trace)")
    return d


def _rank_of(f: Path, d: dict[str, Any]) -> int:
    info = d.get("distributedInfo") or {}
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return int(info["rank"])
    m = _RANK_RE.search(f.name)
    if m:
        return int(m.group(1))
    raise ConfigError(f"--trace {f}: which rank? no distributedInfo.rank in it and no "
                      "rank<N> in its name")


def read_kineto(f: Path, opmap: OpMap) -> Trace:
    """One rank's Kineto trace as operations (see the module's docstring for which)."""
    d = _load_json(f)
    rank = _rank_of(f, d)
    events = [e for e in d["traceEvents"]
              if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e and "dur" in e]
    steps = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), int(m.group(1)))
                   for e in events
                   if e.get("cat") in CPU_CATS and (m := _STEP_RE.fullmatch(str(e["name"]))))
    if not steps:
        raise ConfigError(f"--trace {f}: no ProfilerStep#N annotations (profile with "
                          "torch.profiler's schedule and call prof.step() every step)")
    starts = [s[0] for s in steps]

    def step_at(ts: float) -> int | None:
        i = bisect.bisect_right(starts, ts) - 1
        return steps[i][2] if i >= 0 and ts <= steps[i][1] else None

    out: dict[str, list[Any]] = {k: [] for k in ("step", "name", "start", "duration")}

    def add(step: int, name: str, ts: float, dur: float) -> None:
        out["step"].append(step)
        out["name"].append(name)
        out["start"].append(ts * 1e-6)
        out["duration"].append(dur * 1e-6)

    kernels = [e for e in events if e.get("cat") in GPU_CATS]
    notes = []
    if kernels:
        launch = {e["args"]["correlation"]: float(e["ts"]) for e in events
                  if e.get("cat") in ("cuda_runtime", "cuda_driver")
                  and isinstance(e.get("args"), dict) and "correlation" in e["args"]}
        for e in kernels:
            corr = (e.get("args") or {}).get("correlation")
            s = step_at(launch[corr]) if corr in launch else None
            if s is not None:
                add(s, str(e["name"]), float(e["ts"]), float(e["dur"]))
        notes.append(f"rank {rank}: GPU kernels ({len(kernels)})")
    else:
        _outermost_cpu_ops(events, opmap, step_at, add)
        notes.append(f"rank {rank}: CPU ops (no GPU kernels in {f.name})")
    n = len(out["step"])
    t = Trace.from_columns([rank] * n, out["step"], out["name"], out["start"],
                           out["duration"], None, source=str(f), fmt="kineto")
    t.notes = notes
    return t


def _outermost_cpu_ops(events: list[dict[str, Any]], opmap: OpMap, step_at: Any,
                       add: Any) -> None:
    """Per thread: the outermost ops mapped to compute or comm; compute minus nested comm."""
    by_thread: dict[tuple[Any, Any], list[tuple[float, float, str, str]]] = {}
    for e in events:
        if e.get("cat") not in CPU_CATS:
            continue
        kind = opmap.kind(str(e["name"]))
        if kind in (COMPUTE, COMM):
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(
                (float(e["ts"]), float(e["dur"]), str(e["name"]), kind))
    for ops in by_thread.values():
        ops.sort(key=lambda o: (o[0], -o[1]))
        i = 0
        while i < len(ops):
            ts, dur, name, kind = ops[i]
            end = ts + dur
            j, nested_comm = i + 1, 0.0
            comm_end = ts
            while j < len(ops) and ops[j][0] < end:
                if ops[j][3] == COMM and ops[j][0] >= comm_end:  # outermost comm inside
                    nested_comm += min(ops[j][1], end - ops[j][0])
                    comm_end = ops[j][0] + ops[j][1]
                j += 1
            s = step_at(ts)
            if s is not None and kind != STEP:
                add(s, name, ts, dur - nested_comm if kind == COMPUTE else dur)
            i = j
