"""Benchmark suites behind ``stalwart bench SUITE``.

Each suite is a module ``stalwart.bench.<suite>`` with

    def run(quick: bool, workdir: Path) -> BenchResult

that measures what it claims within one invocation (ratios of configurations run in the same
process, interleaved where possible, because these machines are noisy). The CLI prints the
result as a table and writes it as JSON (``--json FILE``).
"""

from __future__ import annotations

import json
import operator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUITES = ("lossy", "detect", "mitigate", "overlap", "traces", "elastic")

_OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt,
        "==": operator.eq}


@dataclass
class BenchResult:
    suite: str
    figures: dict[str, float]
    # name -> "<= 1.5" style target; figures without a target are informational
    targets: dict[str, str] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    command: str = ""

    def verdicts(self) -> dict[str, bool | None]:
        out: dict[str, bool | None] = {}
        for name, value in self.figures.items():
            tgt = self.targets.get(name)
            if tgt is None or value is None:
                out[name] = None
                continue
            op, num = tgt.split()
            out[name] = bool(_OPS[op](value, float(num)))
        return out

    def to_json(self) -> str:
        d = asdict(self)
        d["met"] = self.verdicts()
        return json.dumps(d, indent=2, default=str)

    def table_rows(self) -> list[tuple[str, str, str, str]]:
        v = self.verdicts()
        rows = []
        for name, value in self.figures.items():
            shown = "n/a" if value is None else f"{value:.4g}"
            verdict = {True: "met", False: "MISSED", None: ""}[v[name]]
            rows.append((name, shown, self.targets.get(name, ""), verdict))
        return rows


class Steps:
    """A suite's progress on stdout, one line per scenario as it starts:
    ``[bench detect] 3/31 compute-1.3x-r2: 4m10s elapsed, about 36m left`` (the estimate is
    the mean time of the scenarios done so far, times those left). A suite names its
    scenarios and their number up front; ``quiet`` (tests) prints nothing."""

    def __init__(self, suite: str, total: int, quiet: bool = False) -> None:
        import time

        self.suite, self.total, self.quiet = suite, max(total, 1), quiet
        self.done = 0
        self._t0 = time.monotonic()

    def start(self, name: str) -> str:
        import time

        elapsed = time.monotonic() - self._t0
        left = "" if self.done == 0 else \
            f", about {_dur(elapsed / self.done * (self.total - self.done))} left"
        self.done += 1
        line = (f"[bench {self.suite}] {min(self.done, self.total)}/{self.total} {name}: "
                f"{_dur(elapsed)} elapsed{left}")
        if not self.quiet:
            print(line, flush=True)
        return line


def _dur(s: float) -> str:
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def fresh_workdir(base: Path, suite: str) -> Path:
    """A new, empty folder of its own for one invocation of ``suite`` under ``base``
    (``base/SUITE-YYYYmmdd-HHMMSS``, with a counter if that exists): a second run of a suite in
    the same folder must not find the first one's run directories (it stopped with "run
    directory already holds a run")."""
    import time

    base.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        path = base / (f"{suite}-{stamp}" + (f"-{i}" if i else ""))
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"cannot make a fresh work folder under {base}")


def save(result: BenchResult, path: Path) -> None:
    from stalwart.rundir import atomic_write_text

    atomic_write_text(path, result.to_json() + "\n")
