"""Localisation: from tracked timings and validation results to a verdict (FALCON profiling).

Mechanism (FALCON/Greyhound profiling + validation): a slow rank spends longer computing
between collectives while its peers wait longer inside them; a slow link leaves every rank's
compute unchanged and lengthens communication. The validation tests then decide: the same
matmul on every rank (compute) and equal-size transfers over disjoint pairs (links).

Rules of ``decide`` (thresholds are ratios to the healthy level, i.e. the median of the faster
half of the ranks or pairs -- a fault that slows more than half the job is not a straggler):
- compute suspects: when the detection came from one rank's own compute channel, that rank
  if its validation matmul took >= ``COMPUTE_RATIO`` x the healthy level; otherwise ranks at
  >= ``COMPUTE_ALONE`` x (only the slowest if it stands ``STANDOUT`` x above the next);
- slow links: pairs whose equal-size round trip took >= ``LINK_RATIO`` x; several slow pairs
  sharing one rank mean that rank's own link (its host's uplink) is the culprit;
- a pair >= ``STRONG_LINK`` x slower decides "link" outright (measured here: shaped links
  100x and more, a CPU-throttled rank's pairs 2-6x, noise up to ~4.5x);
- both at once is common -- a throttled rank also moves its bytes slowly -- so the profile
  taken during training arbitrates: if the suspect's compute between collectives grew, or
  every slow pair touches the suspect, the verdict is "compute"; if no rank's compute grew
  (the slowdown was all communication), it is "link";
- profiling alone (one rank's compute grew by >= ``PROFILE_RATIO`` while its peers waited
  longer) gives "compute" with lower confidence; otherwise "unknown" (a job-wide slowdown, or
  a fault that ended before validation).
The evidence dict of the verdict carries the measured ratios so a human can check it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

COMPUTE_RATIO = 1.2  # confirms the rank a per-rank channel pointed at
COMPUTE_ALONE = 1.3  # names a rank on the compute test alone (iteration-time detections)
STANDOUT = 1.15  # the slowest rank must be this much slower than the next to stand alone
LINK_RATIO = 5.0  # equal transfers: a shaped link is many times slower, noise is not
STRONG_LINK = 10.0  # a pair this much slower is a link fault whatever the compute test says
PROFILE_RATIO = 1.15


@dataclass
class RankEvidence:
    """What one rank measured: its profile before/after the onset and its validation times."""

    rank: int
    compute_before: float | None = None  # median seconds per iteration
    compute_after: float | None = None
    comm_before: float | None = None
    comm_after: float | None = None
    compute_test: float | None = None  # seconds
    links: dict[str, float] = field(default_factory=dict)  # "a-b" -> round-trip seconds


@dataclass
class Finding:
    """A verdict for one detected slowdown."""

    kind: str  # "compute" | "link" | "unknown"
    onset_step: int
    step: int  # when decided
    severity: float  # iteration-time slowdown factor (after / before)
    confidence: float
    ranks: list[int] = field(default_factory=list)
    link: list[int] | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    recovered_step: int | None = None

    def event_fields(self) -> dict[str, Any]:
        d: dict[str, Any] = {"step": self.step, "onset_step": self.onset_step,
                             "kind": self.kind, "ranks": self.ranks,
                             "severity": round(self.severity, 3),
                             "confidence": round(self.confidence, 2),
                             "evidence": self.evidence}
        if self.link is not None:
            d["link"] = self.link
        return d


def healthy_level(values: list[float]) -> float:
    """Median of the faster half: the level most of the job runs at."""
    v = sorted(values)
    return statistics.median(v[:max(1, (len(v) + 1) // 2)])


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def profile_ratios(ev: list[RankEvidence]) -> dict[int, dict[str, float | None]]:
    return {e.rank: {"compute": _ratio(e.compute_after, e.compute_before),
                     "comm": _ratio(e.comm_after, e.comm_before)} for e in ev}


def _profile_suspect(ev: list[RankEvidence]) -> tuple[int | None, dict[int, float]]:
    """The one rank whose compute grew (with peers waiting longer), if the profile shows it."""
    ratios = {e.rank: r for e in ev
              if (r := _ratio(e.compute_after, e.compute_before)) is not None}
    if len(ratios) < 2:
        return None, ratios
    top = max(ratios, key=lambda r: ratios[r])
    others = [v for r, v in ratios.items() if r != top]
    if ratios[top] < PROFILE_RATIO or max(others) >= PROFILE_RATIO:
        return None, ratios
    waits = [_ratio(e.comm_after, e.comm_before) for e in ev if e.rank != top]
    peers_wait = [w for w in waits if w is not None]
    if peers_wait and statistics.median(peers_wait) < 1.0:
        return None, ratios
    return top, ratios


def decide(ev: list[RankEvidence], onset_step: int, step: int, severity: float,
           suspect_rank: int | None = None) -> Finding:
    """Combine every rank's evidence into one verdict (pure: same input, same answer).

    ``suspect_rank``: the rank whose own compute time (relative to its peers) triggered the
    detection, if that is how it was found; the compute test must then confirm that rank.
    """
    ev = sorted(ev, key=lambda e: e.rank)
    evidence: dict[str, Any] = {}
    suspect, prof = _profile_suspect(ev)
    evidence["profile_compute_ratio"] = {str(r): round(v, 3) for r, v in prof.items()}
    compute_flat = bool(prof) and all(v < PROFILE_RATIO for v in prof.values())

    # compute test: one rank (or a minority) clearly above the healthy level
    slow: list[int] = []
    cr: dict[int, float] = {}
    tests = {e.rank: e.compute_test for e in ev if e.compute_test is not None}
    if len(tests) >= 2:
        ref = healthy_level(list(tests.values()))
        cr = {r: t / ref for r, t in tests.items()}
        evidence["compute_test_ratio"] = {str(r): round(v, 3) for r, v in cr.items()}
        order = sorted(cr, key=lambda r: -cr[r])
        if suspect_rank is not None and suspect_rank in cr:
            # found by its own compute channel: the test must confirm that very rank
            slow = [suspect_rank] if cr[suspect_rank] >= COMPUTE_RATIO else []
        elif cr[order[0]] >= COMPUTE_ALONE and (
                len(order) == 1 or cr[order[0]] >= STANDOUT * cr[order[1]]):
            slow = [order[0]]  # one rank stands out
        else:
            slow = [r for r in order if cr[r] >= COMPUTE_ALONE]
            if len(slow) > len(ev) // 2:
                slow = []  # most of the job is slow: not a straggler

    # link test: a minority of pairs clearly slower than the healthy level
    links: dict[str, float] = {}
    for e in ev:
        links.update(e.links)
    slow_links: list[str] = []
    lr: dict[str, float] = {}
    if len(links) >= 2:
        ref = healthy_level(list(links.values()))
        lr = {k: t / ref for k, t in links.items()}
        evidence["link_test_ratio"] = {k: round(v, 3) for k, v in lr.items()}
        slow_links = sorted((k for k, v in lr.items() if v >= LINK_RATIO), key=lambda k: -lr[k])
        if len(slow_links) > (len(links) + 1) // 2:
            slow_links = []
    # a throttled rank also moves its own bytes slowly: slow pairs that all touch the compute
    # suspect are explained by it, unless its compute did not grow during training
    touches = bool(slow) and all(str(slow[0]) in k.split("-") for k in slow_links)

    if slow_links and lr[slow_links[0]] >= STRONG_LINK:
        slow = []  # a shaped link is tens of times slower; a throttled rank's pairs are not
    if slow and (not slow_links or (touches and not compute_flat) or suspect == slow[0]):
        conf = 0.6 + (0.2 if cr[slow[0]] >= 1.4 else 0.0) + (0.2 if suspect == slow[0] else 0.0)
        return Finding("compute", onset_step, step, severity, conf, ranks=slow,
                       evidence=evidence)
    if slow_links:
        pairs = [tuple(int(x) for x in k.split("-")) for k in slow_links]
        common = set(pairs[0]).intersection(*map(set, pairs[1:])) if len(pairs) > 1 else set()
        ranks = sorted(common) if len(common) == 1 else []
        conf = 0.6 + (0.2 if lr[slow_links[0]] >= 2.0 else 0.0) + (0.2 if compute_flat else 0.0)
        return Finding("link", onset_step, step, severity, conf, ranks=ranks,
                       link=list(pairs[0]), evidence=evidence)
    if slow:
        return Finding("compute", onset_step, step, severity, 0.5, ranks=slow,
                       evidence=evidence)
    if suspect is not None:
        return Finding("compute", onset_step, step, severity, 0.4, ranks=[suspect],
                       evidence=evidence)
    return Finding("unknown", onset_step, step, severity, 0.3, evidence=evidence)
