"""``stalwart replay --score``: replayed decisions against each run's ground truth.

For every run directory: the faults the testbed applied (events.jsonl, ``detect.truth``), and
what the replayed detector made of them -- detected or missed, localised right or wrong,
latency in steps (decision step - applied step) and seconds (rank 0's step times over those
steps: the training time the fault ran undetected; a fault present from the start counts
from the first recorded step), the onset it gave, and ``never_healthy`` for a fault present
from step 0. False positives: every ``straggler_detected`` in a run with no straggler fault,
and, in a faulted run, every one decided before the first fault was applied or naming a
culprit that no fault explains -- ranks read in the launch's numbering, through the
regroups the run recorded (a re-map moves ranks between hosts). ``slowdown_unexplained``
decisions are counted apart
(``unexplained``; the job as a whole slowed, which a clean run's neighbours can cause).
A run is *right* when it has no false positive and every fault is detected and localised.

Totals over the runs: ``detection_rate`` (detected / faults), ``localization_accuracy``
(right / detected), median latencies, ``false_positives``, ``clean_runs_with_findings``.
Deterministic (the replay is); cost: the replay's.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from stalwart.detect.truth import Truth, ground_truth, localised, match, straggler_findings
from stalwart.events import Regroup, SlowdownUnexplained
from stalwart.rundir import CONFIG, EVENTS, ITERATIONS, METRICS, read_jsonl


def _decisions(res: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for inc in res["incarnations"] for e in inc["detect"]]


def _step_seconds(run_dir: Path) -> dict[int, float]:
    """Rank 0's step time at each step (the last incarnation's where steps repeat)."""
    series = METRICS if (run_dir / METRICS).is_file() else ITERATIONS
    return {int(m["step"]): float(m["step_time"]) for m in read_jsonl(run_dir / series)
            if int(m["rank"]) == 0}


def _explains(d: dict[str, Any], truths: list[Truth]) -> bool:
    return any(localised(d, t) for t in truths)


def _in_launch_terms(found: list[dict[str, Any]], events: list[dict[str, Any]]
                     ) -> list[dict[str, Any]]:
    """Findings with their ranks in the numbering the faults were given in: after a regroup
    (a re-map, an exclusion) rank i of the new world is the launch's rank ``members[i]`` on
    host ``hosts[i]``; a compute finding names processes (members), a link finding hosts."""
    regroups = sorted(((int(e["step"]), e) for e in events if e.get("event") == Regroup.name
                       and e.get("members") is not None), key=lambda x: x[0])
    if not regroups:
        return found
    out = []
    for d in found:
        g = [e for s, e in regroups if s <= int(d["step"])]
        if not g:
            out.append(d)
            continue
        m = g[-1]["members"] if d.get("kind") == "compute" else g[-1].get("hosts", [])

        def to(r: int, m: list[int] = m) -> int:
            return int(m[r]) if 0 <= r < len(m) else r
        out.append(dict(d, ranks=[to(int(r)) for r in d.get("ranks") or []],
                        link=None if d.get("link") is None else [to(int(r)) for r in d["link"]]))
    return out


def score_run(run_dir: Path, res: dict[str, Any]) -> dict[str, Any]:
    """One run's score (module docstring)."""
    run_dir = Path(run_dir)
    events = read_jsonl(run_dir / EVENTS) if (run_dir / EVENTS).is_file() else []
    truths = ground_truth(events)
    decisions = _decisions(res)
    found = _in_launch_terms(straggler_findings(decisions), events)
    secs = _step_seconds(run_dir)
    first = min(secs, default=0)
    last = max((inc["last_step"] for inc in res["incarnations"]), default=0)
    faults = []
    for t in truths:
        d = match(found, t, last)
        row: dict[str, Any] = {"kind": t.kind, "applied": t.applied, "removed": t.removed,
                               "rank": t.rank, "hosts": t.hosts, "detected": d is not None}
        if d is not None:
            start = max(t.applied, first)
            row.update(step=d["step"], onset=d.get("onset_step"), found_kind=d.get("kind"),
                       ranks=d.get("ranks"), link=d.get("link"), right=localised(d, t),
                       latency_steps=d["step"] - start,
                       latency_s=round(sum(s for k, s in secs.items()
                                           if start < k <= d["step"]), 3))
            if t.applied <= first:
                row["never_healthy"] = bool((d.get("evidence") or {}).get("never_healthy"))
        faults.append(row)
    t0 = min((t.applied for t in truths), default=None)
    fps = [d for d in found if t0 is None or d["step"] < t0 or not _explains(d, truths)]
    unexplained = sum(d.get("event") == SlowdownUnexplained.name for d in decisions)
    right = not fps and all(f["detected"] and f.get("right") for f in faults)
    return {"run": res["run"], "faults": faults, "false_positives": len(fps),
            "false_positive_findings": [{k: d.get(k) for k in ("step", "kind", "ranks", "link")}
                                        for d in fps],
            "unexplained": unexplained, "unmatched": res.get("unmatched", 0), "right": right}


def totals(scores: list[dict[str, Any]]) -> dict[str, Any]:
    faults = [f for s in scores for f in s["faults"]]
    det = [f for f in faults if f["detected"]]
    clean = [s for s in scores if not s["faults"]]
    born = [f for f in faults if f["applied"] == 0]
    lat = [f["latency_steps"] for f in det]
    lat_s = [f["latency_s"] for f in det]
    return {"runs": len(scores), "right_runs": sum(s["right"] for s in scores),
            "clean_runs": len(clean), "faults": len(faults), "detected": len(det),
            "detection_rate": round(len(det) / len(faults), 3) if faults else None,
            "localization_accuracy": round(sum(bool(f.get("right")) for f in det) / len(det), 3)
            if det else None,
            "median_latency_steps": statistics.median(lat) if lat else None,
            "median_latency_s": round(statistics.median(lat_s), 3) if lat_s else None,
            "born_faults": len(born), "born_detected": sum(f["detected"] for f in born),
            "born_never_healthy": sum(bool(f.get("never_healthy")) for f in born),
            "false_positives": sum(s["false_positives"] for s in scores),
            "clean_runs_with_findings": sum(s["false_positives"] > 0 for s in clean),
            "unexplained": sum(s["unexplained"] for s in scores),
            "unmatched_alarms": sum(s["unmatched"] for s in scores)}


def lines(s: dict[str, Any]) -> list[str]:
    """One run's score for a terminal."""
    head = f"{s['run']}: {'right' if s['right'] else 'WRONG'}"
    if s["false_positives"]:
        head += f", {s['false_positives']} false positive(s) " + ", ".join(
            f"{d['kind']} {d['ranks'] or d['link']} at {d['step']}"
            for d in s["false_positive_findings"])
    if s["unexplained"]:
        head += f", {s['unexplained']} unexplained slowdown(s)"
    out = [head]
    for f in s["faults"]:
        who = f["rank"] if f["rank"] is not None else f["hosts"]
        if not f["detected"]:
            out.append(f"  {f['kind']} {who} from step {f['applied']}: missed")
            continue
        born = "" if "never_healthy" not in f else (
            ", never healthy" if f["never_healthy"] else ", NOT marked never healthy")
        out.append(f"  {f['kind']} {who} from step {f['applied']}: found at {f['step']} "
                   f"({f['latency_steps']} steps, {f['latency_s']} s) as {f['found_kind']} "
                   f"{f['ranks'] or f['link']}, onset {f['onset']}"
                   f"{'' if f['right'] else ' -- WRONG culprit'}{born}")
    return out


def total_lines(t: dict[str, Any]) -> list[str]:
    return [f"total: {t['runs']} runs ({t['right_runs']} right), {t['faults']} faults: "
            f"detection_rate {t['detection_rate']}, localization_accuracy "
            f"{t['localization_accuracy']}, median latency {t['median_latency_steps']} steps / "
            f"{t['median_latency_s']} s; from step 0: {t['born_detected']} of "
            f"{t['born_faults']} found, {t['born_never_healthy']} as never healthy; "
            f"false_positives {t['false_positives']} "
            f"({t['clean_runs_with_findings']} of {t['clean_runs']} clean runs); "
            f"{t['unexplained']} unexplained slowdowns; {t['unmatched_alarms']} alarms "
            "without recorded validation"]


def is_run_dir(p: Path) -> bool:
    return (p / CONFIG).is_file()
