"""The evidence a verdict is made from and the verdict itself: what every rank measured around
an alarm (its training-time profile, its validation times, its recent steps) and the finding
that ``localize.decide`` makes of it. Plain data, torch-free; the run directory's
``straggler_detected`` events are a finding's fields (``Finding.event_fields``).
"""

from __future__ import annotations

import math
import os
import socket
import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def this_host() -> str:
    """The host this process runs on, as the link rule groups ranks (detect/hostlink.py):
    ``STALWART_HOST`` when set (the netns testbed names its emulated hosts), else the
    machine's name."""
    return os.environ.get("STALWART_HOST") or socket.gethostname()


@dataclass
class RankEvidence:
    """What one rank measured: its profile before/after the onset and its validation times."""

    rank: int
    compute_before: float | None = None  # median seconds per iteration
    compute_after: float | None = None
    comm_before: float | None = None
    comm_after: float | None = None
    compute_test: float | None = None  # seconds: median of the rounds
    links: dict[str, float] = field(default_factory=dict)  # "a-b" -> round-trip seconds
    compute_rounds: list[float] = field(default_factory=list)  # seconds of each round
    # (step, compute seconds) of the rank's recent steps, up to the decision: where a
    # compute straggler's own time rose relative to its peers' is its onset
    recent: list[tuple[int, float]] = field(default_factory=list)
    # (step, iteration seconds) over the same window: where a slow link found by the audit
    # began, if the step time rose within it
    steps: list[tuple[int, float]] = field(default_factory=list)
    # the rank's host: ranks on one host share its link (hostlink.py); gathered with the rest
    host: str = field(default_factory=this_host)


@dataclass
class Finding:
    """A verdict for one detected slowdown."""

    kind: str  # "compute" | "link" | "unknown"
    onset_step: int
    step: int  # when decided
    severity: float  # iteration-time slowdown factor (after / before, or the job's step
    #                  time over its estimate without the straggler when it was never healthy)
    ranks: list[int] = field(default_factory=list)
    link: list[int] | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    recovered_step: int | None = None

    @classmethod
    def from_event(cls, e: dict[str, Any]) -> Finding:
        """A finding from its event fields (``straggler_detected`` in events.jsonl, or
        ``Monitor.report()``)."""
        link = e.get("link")
        return cls(str(e.get("kind")), int(e.get("onset_step", 0)), int(e.get("step", 0)),
                   float(e.get("severity", 0.0)),
                   ranks=[int(r) for r in e.get("ranks") or []],
                   link=[int(x) for x in link] if link is not None else None,
                   evidence=dict(e.get("evidence") or {}),
                   recovered_step=e.get("recovered_step"))

    def event_fields(self) -> dict[str, Any]:
        d: dict[str, Any] = {"step": self.step, "onset_step": self.onset_step,
                             "kind": self.kind, "ranks": self.ranks,
                             "severity": round(self.severity, 3),
                             "evidence": self.evidence}
        if self.link is not None:
            d["link"] = self.link
        return d


def healthy_level(values: list[float]) -> float:
    """Median of the faster half: the level most of the job runs at."""
    v = sorted(values)
    return statistics.median(v[:max(1, (len(v) + 1) // 2)])


def peer_series(ev: list[RankEvidence], rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``rank``'s (keys, log of compute / the other ranks' median compute) at the steps of
    the evidence that every rank has."""
    by_key: dict[int, dict[int, float]] = {}
    for e in ev:
        for k, c in e.recent:
            by_key.setdefault(int(k), {})[e.rank] = c
    keys, xs = [], []
    for k in sorted(by_key):
        row = by_key[k]
        if len(row) != len(ev) or rank not in row or not row[rank] > 0:
            continue
        peers = statistics.median(v for r, v in row.items() if r != rank) if len(row) > 1 else 0
        if peers > 0:
            keys.append(k)
            xs.append(math.log(row[rank] / peers))
    return np.asarray(keys, dtype=np.int64), np.asarray(xs)
