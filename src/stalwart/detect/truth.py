"""Ground truth of a recorded run and whether a decision got it right (torch-free).

The truth is what the testbed wrote in events.jsonl: every ``fault_applied`` (kind, step,
wall time, the faulty rank or hosts) and its ``fault_removed`` (not the one at close). Packet
loss on every host (``loss``) is the lossy scenarios' weather, not a straggler. A fault is
detected by the first ``straggler_detected`` decided while it was active (from the applied
step to ``SLACK_STEPS`` after removal or the run's last step); it is localised when the kind
matches (compute/contention -> "compute", link/pairlink -> "link") and the ranks are exactly
the faulty rank (compute) -- or, for compute faults applied together at one step (a host's
ranks slowed alike: one slow worker), exactly all of their ranks --, the faulty host is the
named rank or an end of the named link (link), or the named link is the faulty pair
(pairlink). Used by ``stalwart replay --score`` and ``stalwart bench detect``
(bench/detect_score.py). Cost: a pass over the events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SLACK_STEPS = 5


@dataclass
class Truth:
    kind: str
    applied: int
    removed: int | None
    rank: int | None
    hosts: list[int]
    t_applied: float | None = None
    t_removed: float | None = None
    together: list[int] | None = None  # compute: the ranks of faults applied with it


def _together(out: list[Truth]) -> None:
    """Each compute truth's ``together``: the ranks of the compute faults applied at the
    same step (itself included), sorted."""
    cpu = [t for t in out if t.kind in ("compute", "contention") and t.rank is not None]
    for t in cpu:
        t.together = sorted(int(u.rank) for u in cpu if u.applied == t.applied
                            and u.rank is not None)


def ground_truth(events: list[dict[str, Any]]) -> list[Truth]:
    out: list[Truth] = []
    for e in events:
        if e.get("kind") == "loss":
            continue  # the lossy scenarios' weather, not a straggler
        if e.get("event") == "fault_applied":
            out.append(Truth(e["kind"], int(e["step"]), None, e.get("rank"),
                             list(e.get("hosts", [])), t_applied=e.get("time")))
        elif e.get("event") == "fault_removed" and not e.get("at_close"):
            for t in out:
                if t.kind == e["kind"] and t.removed is None:
                    t.removed = int(e["step"])
                    t.t_removed = e.get("time")
    _together(out)
    return out


def localised(d: dict[str, Any], t: Truth) -> bool:
    ranks, link = list(d.get("ranks") or []), list(d.get("link") or [])
    if t.kind in ("compute", "contention"):
        return d.get("kind") == "compute" and ranks == (t.together or [t.rank])
    if t.kind == "link":
        host = (d.get("evidence") or {}).get("host")
        if host is not None:  # named as a host (several ranks per host: hostlink.py)
            return d.get("kind") == "link" and str(host) == str(t.hosts[0])
        return d.get("kind") == "link" and (ranks == t.hosts or t.hosts[0] in link)
    if t.kind == "pairlink":
        return d.get("kind") == "link" and sorted(link) == sorted(t.hosts)
    return False


def straggler_findings(dets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in dets if d.get("event") == "straggler_detected"]


def match(dets: list[dict[str, Any]], t: Truth, last_step: int) -> dict[str, Any] | None:
    """The first decision on the step clock while ``t`` was active."""
    end = (t.removed if t.removed is not None else last_step) + SLACK_STEPS
    for d in straggler_findings(dets):
        if d.get("step") is not None and t.applied <= d["step"] <= end:
            return d
    return None
