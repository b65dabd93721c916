"""NVIDIA's straggler detector's reports in a run directory, as decisions the bench scores
like stalwart's own (torch-free; the rank side that writes them is ``stalwart.bench.peers.nvrx``).

A report (one line of RUN_DIR/nvrx.jsonl, rank 0, every ~5 s) names, per section and per score
kind (relative: against the best rank; individual: against the rank's own best), the ranks
whose score fell below the threshold. A user acts on a rank when it *becomes* flagged, so a
decision here is a rank entering the flagged set of the scored sections (it was not flagged in
the previous report): one ``straggler_detected`` per new flag, at the report's wall time, kind
"compute" (the detector times code sections; it has no notion of a link). A rank flagged for
a whole clean run is one false positive, not one per report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPORTS = "nvrx.jsonl"  # written by the rank side, stalwart.bench.peers.nvrx
COST = "nvrx_cost.json"
RECOMMENDED = ("fwd",)  # the section the package's documentation recommends (forward)
KINDS = ("relative", "individual")


def load(run_dir: Path) -> list[dict[str, Any]] | None:
    """The run's reports in order; None when the detector did not run there (no file)."""
    path = Path(run_dir) / REPORTS
    if not path.exists():
        return None
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut short by a killed rank
        if isinstance(rec, dict) and "time" in rec:
            out.append(rec)
    return out


def flagged(report: dict[str, Any], sections: tuple[str, ...] = RECOMMENDED,
            kinds: tuple[str, ...] = KINDS, threshold: float | None = None) -> set[int]:
    """Ranks the report flags in any of ``sections`` by any of ``kinds``: as the detector
    flagged them (``threshold`` None: 0.75), or re-thresholded from the scores it reported."""
    out: set[int] = set()
    if threshold is not None:
        for kind in kinds:
            for section, scores in (report.get(kind) or {}).items():
                if section in sections:
                    out.update(int(r) for r, v in scores.items() if float(v) < threshold)
        return out
    by_kind = report.get("flagged") or {}
    for kind in kinds:
        for section, ranks in (by_kind.get(kind) or {}).items():
            if section in sections:
                out.update(int(r) for r in ranks)
    return out


def decisions(reports: list[dict[str, Any]], sections: tuple[str, ...] = RECOMMENDED,
              kinds: tuple[str, ...] = KINDS,
              threshold: float | None = None) -> list[dict[str, Any]]:
    """One ``straggler_detected`` per rank entering the flagged set, in report order."""
    out: list[dict[str, Any]] = []
    before: set[int] = set()
    for rep in sorted(reports, key=lambda r: r["time"]):
        now = flagged(rep, sections, kinds, threshold)
        new = sorted(now - before)
        if new:
            out.append({"event": "straggler_detected", "time": float(rep["time"]),
                        "step": None, "iteration": rep.get("iteration"), "kind": "compute",
                        "ranks": new, "source": "nvrx"})
        before = now
    return out


def cost(run_dir: Path) -> dict[str, Any] | None:
    """Rank 0's per-iteration CPU cost of the detector in one run (None: not recorded)."""
    path = Path(run_dir) / COST
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None
