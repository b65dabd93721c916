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
    the evidence that every rank has.

    Cost: O(N K) for N ranks' K steps; the audit asks it for every rank of one evidence list,
    so from ``TABLE_RANKS`` ranks on, all ranks' series are computed together once per list
    (``PeerTable``: O(N K log N), vectorised; at 1,000 ranks the per-rank path spent 93 s of
    one simulated audit's CPU) and kept for that list, or one of the same entries
    (``_fingerprint``: evidence is gathered once and never edited in place). The same
    values either way (tests/detect/test_peer_table.py)."""
    if len(ev) >= TABLE_RANKS:
        table = _table_for(ev)
        if table is not None:
            return table.series(rank)
    return _peer_series(ev, rank)


def rows_by_step(ev: list[RankEvidence]) -> dict[int, dict[int, float]]:
    """Step -> {rank: compute} over every rank's recent series (a step some rank lacks has
    fewer entries)."""
    by_key: dict[int, dict[int, float]] = {}
    for e in ev:
        for k, c in e.recent:
            by_key.setdefault(int(k), {})[e.rank] = c
    return by_key


def _peer_series(ev: list[RankEvidence], rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``peer_series`` for one rank (the reference ``PeerTable`` is tested against)."""
    by_key = rows_by_step(ev)
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


TABLE_RANKS = 16  # from this many ranks, peer_series computes every rank's series at once
_cache: list[Any] = [None, None]  # [the evidence list, its PeerTable (or None: not eligible)]


def _fingerprint(ev: list[RankEvidence]) -> tuple[int, ...]:
    """The list's length and the identities of its first, middle and last entries and their
    ``recent`` lists: a list of the same entries (``localize.decide`` sorts a copy of the
    list ``more_rounds`` saw) shares the table; the series do not depend on the order."""
    a, m, b = ev[0], ev[len(ev) // 2], ev[-1]
    return len(ev), id(a), id(a.recent), id(m), id(m.recent), id(b), id(b.recent)


def _table_for(ev: list[RankEvidence]) -> PeerTable | None:
    held = _cache[0]
    if held is None or held[1] != _fingerprint(ev):
        # (the list is held: its entries stay alive, so their ids are not reused)
        _cache[0] = (ev, _fingerprint(ev))
        _cache[1] = PeerTable.build(ev)
    return _cache[1]


class PeerTable:
    """Every rank's ``peer_series`` of one evidence list, computed together.

    Values: the steps every rank has (each rank's last entry per step, as ``peer_series``),
    one row per step in key order; each rank's peers' median is read from the row sorted
    once (removing one value from a sorted row leaves the others sorted), with the same
    arithmetic as ``statistics.median`` (the middle value, or the two middle ones' sum / 2),
    and the log taken by ``math.log`` per value, so the series equal ``peer_series``'s
    exactly. ``build`` returns None (the per-rank path then runs) for evidence it does not
    cover: ranks repeated, or a value that is not finite."""

    def __init__(self, ranks: list[int], keys: np.ndarray, vals: np.ndarray) -> None:
        self.index = {r: i for i, r in enumerate(ranks)}
        self.keys = keys  # (K,) steps every rank has
        self.vals = vals  # (K, N) compute seconds
        n = vals.shape[1]
        self._peers: np.ndarray | None = None
        self._logs: np.ndarray | None = None  # log(own / peers) where both are > 0
        self._ok: np.ndarray | None = None
        self._kept: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        if n < 2 or not len(keys):
            self._peers = np.zeros_like(vals)
            return
        srt = np.sort(vals, axis=1)
        pos = np.empty(vals.shape, dtype=np.int64)  # where each value sits in its sorted row
        for i in range(len(keys)):
            pos[i] = np.searchsorted(srt[i], vals[i])
        m = (n - 1) // 2  # the others' middle (upper middle when they are even in number)

        def other(j: int) -> np.ndarray:  # the others' sorted j-th value, for every rank
            return np.where(j < pos, srt[:, j:j + 1], srt[:, j + 1:j + 2])

        if (n - 1) % 2:
            self._peers = other(m)
        else:
            self._peers = (other(m - 1) + other(m)) / 2

    @classmethod
    def build(cls, ev: list[RankEvidence]) -> PeerTable | None:
        ranks = [e.rank for e in ev]
        if len(set(ranks)) != len(ranks):
            return None
        rows = [{int(k): c for k, c in e.recent} for e in ev]
        common = set(rows[0]).intersection(*rows[1:]) if rows else set()
        keys = sorted(common)
        vals = np.array([[row[k] for row in rows] for k in keys], dtype=float).reshape(
            len(keys), len(ev))
        if not np.all(np.isfinite(vals)):
            return None
        return cls(ranks, np.asarray(keys, dtype=np.int64), vals)

    def series(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """``rank``'s series (kept: the audit asks for each rank several times). The
        arrays returned are shared between calls: read them, do not change them."""
        i = self.index.get(rank)
        if i is None or self._peers is None:
            return np.asarray([], dtype=np.int64), np.asarray([])
        if self._logs is None:
            ok = (self.vals > 0) & (self._peers > 0)
            ratio = np.where(ok, self.vals, 1.0) / np.where(ok, self._peers, 1.0)
            # libm's log per value, as the per-rank path takes it (numpy's may differ in
            # the last place)
            self._logs = np.asarray(list(map(math.log, ratio.ravel().tolist()))).reshape(
                ratio.shape) if ratio.size else np.zeros(ratio.shape)
            self._ok = ok
        got = self._kept.get(i)
        if got is None:
            assert self._ok is not None
            ok = self._ok[:, i]
            got = (self.keys[ok], self._logs[ok, i])
            for a in got:
                a.setflags(write=False)  # shared: a caller that writes gets an error
            self._kept[i] = got
        return got
