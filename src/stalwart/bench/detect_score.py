"""Scoring of ``stalwart bench detect``: a detector's decisions against the testbed's ground
truth (torch-free, the same code for stalwart's monitor, the threshold baseline and NVIDIA's
detector).

Ground truth: the ``fault_applied`` / ``fault_removed`` events the testbed wrote (step and wall
time of each). A fault is detected by the first decision taken while it was active -- on the
step clock (stalwart's events carry the step they were decided at: from the applied step to
5 steps after removal) or on the wall clock (a peer's reports carry only a time: from the
applied time to ``SLACK_S`` after removal, or after the run's last iteration). A fault the
testbed never applied (its start step was never reached) counts as missed.

Latency: in iterations, decision step - applied step; in seconds, decision time - the later of
the fault's application and the run's first iteration (a fault present from the start is
applied before the ranks have built their model; ~10-20 s of start-up is not the detector's).
Localisation is right when the kind matches (compute/contention -> "compute", link/pairlink ->
"link") and the rank is exactly the faulty rank (compute), the faulty host is the named rank or
an end of the named link (link), or the named link is the faulty pair (pairlink).

False positives: every decision in a clean run, every ``slowdown_unexplained`` there, and
every clean run that failed (a crashed run is not silence); a failed faulty run counts its
faults as missed. Decisions taken before a fault was applied are reported as early.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from stalwart.detect.truth import (  # noqa: F401  (the step-clock half; re-exported)
    SLACK_STEPS,
    Truth,
    ground_truth,
    localised,
    match,
)
from stalwart.detect.truth import straggler_findings as _found

SLACK_S = 5.0


class _Scenario(Protocol):
    name: str

    @property
    def stragglers(self) -> int: ...


@dataclass(frozen=True)
class Clock:
    """A run's time span: wall time of its first and last iteration (None: unknown)."""

    first: float | None = None
    last: float | None = None


def match_time(dets: list[dict[str, Any]], t: Truth, clock: Clock) -> dict[str, Any] | None:
    """The first decision on the wall clock while ``t`` was active."""
    if t.t_applied is None:
        return None
    end = t.t_removed if t.t_removed is not None else clock.last
    for d in sorted(_found(dets), key=lambda d: d.get("time", 0.0)):
        if d.get("time") is not None and t.t_applied <= d["time"] and (
                end is None or d["time"] <= end + SLACK_S):
            return d
    return None


def latency_s(d: dict[str, Any], t: Truth, clock: Clock) -> float | None:
    """Seconds from the fault (or the first iteration, if later) to the decision."""
    if d.get("time") is None or t.t_applied is None:
        return None
    start = max(t.t_applied, clock.first) if clock.first is not None else t.t_applied
    return max(0.0, float(d["time"]) - start)


def _early(found: list[dict[str, Any]], t: Truth, by_time: bool) -> int:
    if by_time:
        return sum(1 for x in found if t.t_applied is not None and x.get("time") is not None
                   and x["time"] < t.t_applied)
    return sum(1 for x in found if x.get("step") is not None and x["step"] < t.applied)


def _unpack(run: tuple) -> tuple[Any, list[dict], list[Truth], int, Clock]:
    sc, dets, truths, last = run[:4]
    return sc, dets, truths, last, (run[4] if len(run) > 4 else Clock())


def score(runs: list[tuple], failed: list[Any] | None = None,
          by_time: bool = False) -> dict[str, Any]:
    """runs: (scenario, decisions, truths, last step[, Clock]) -> figures for one detector;
    ``by_time``: match decisions on the wall clock (a peer's reports have no step)."""
    fp = early = detected = right = faults = unexplained = 0
    lat: list[int] = []
    lat_s: list[float] = []
    onset_err: list[int] = []
    rows: list[dict[str, Any]] = []
    for sc in failed or []:
        if sc.stragglers:
            faults += sc.stragglers
        else:
            fp += 1
        rows.append({"scenario": sc.name, "failed": True})
    for run in runs:
        sc, dets, truths, last, clock = _unpack(run)
        found = _found(dets)
        if not sc.stragglers:
            # a clean run must log neither a straggler nor an unexplained slowdown
            n_unexp = sum(d.get("event") == "slowdown_unexplained" for d in dets)
            fp += len(found) + n_unexp
            unexplained += n_unexp
            rows.append({"scenario": sc.name, "detections": len(found),
                         "unexplained_slowdowns": n_unexp})
            continue
        for t in truths:
            faults += 1
            d = match_time(found, t, clock) if by_time else match(found, t, last)
            early += _early(found, t, by_time)
            row: dict[str, Any] = {"scenario": sc.name, "applied": t.applied}
            if d is not None:
                detected += 1
                if d.get("step") is not None:
                    lat.append(d["step"] - t.applied)
                if d.get("onset_step") is not None:
                    onset_err.append(d["onset_step"] - t.applied)
                s = latency_s(d, t, clock)
                if s is not None:
                    lat_s.append(s)
                ok = localised(d, t)
                right += ok
                row.update(step=d.get("step"), onset=d.get("onset_step"), kind=d.get("kind"),
                           ranks=d.get("ranks"), link=d.get("link"), right=ok,
                           latency_s=None if s is None else round(s, 2))
            else:
                row["missed"] = True
            rows.append(row)
        for _ in range(max(0, sc.stragglers - len(truths))):
            faults += 1  # scheduled but never applied (its start was never reached)
            rows.append({"scenario": sc.name, "missed": True, "not_applied": True})
    return {"false_positives": fp, "early_detections": early, "faults": faults,
            "clean_unexplained_slowdowns": unexplained,
            "detected": detected,
            "detection_rate": detected / faults if faults else None,
            "localization_accuracy": right / detected if detected else None,
            "median_latency_iters": statistics.median(lat) if lat else None,
            "median_latency_s": round(statistics.median(lat_s), 2) if lat_s else None,
            "latencies": lat, "latencies_s": [round(x, 2) for x in lat_s],
            "onset_errors": onset_err, "rows": rows}


def severe_missed(runs: list[tuple], by_time: bool = False) -> list[str]:
    """Scenarios with a 2x compute fault (``severe``) that the detector did not find."""
    out = []
    for run in runs:
        sc, dets, truths, last, clock = _unpack(run)
        if not getattr(sc, "severe", False):
            continue
        found = _found(dets)
        hit = [match_time(found, t, clock) if by_time else match(found, t, last)
               for t in truths]
        if len(truths) < sc.stragglers or any(h is None for h in hit):
            out.append(sc.name)
    return out


HELDOUT = Path(__file__).resolve().parents[3] / "tests" / "replay" / "corpus" / "heldout"


def replay_heldout(corpus: Path = HELDOUT) -> dict[str, Any] | None:
    """``stalwart replay --score`` over the corpus's held-out part (recorded with other
    seeds, workloads and world sizes than the part thresholds were set on): its totals, with
    ``right_fraction`` the share of runs whose replayed decisions are right (no false
    positive, every fault found and named). None where the corpus is not there (an
    installed package without the source tree)."""
    from stalwart.replay import replay_run
    from stalwart.replayscore import score_run, totals

    runs = sorted(p for p in corpus.iterdir() if p.is_dir()) if corpus.is_dir() else []
    if not runs:
        return None
    scores = [score_run(p, replay_run(p)) for p in runs]
    t = totals(scores)
    t["right_fraction"] = round(t["right_runs"] / t["runs"], 3)
    t["wrong_runs"] = [s["run"] for s in scores if not s["right"]]
    return t
