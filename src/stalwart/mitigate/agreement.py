"""Agreement on the plan in force: one decision, a version and the step it starts, on every rank.

FALCON's public code lets every rank poll a plan file each iteration, so ranks can switch one
step apart -- and a step in which two ranks disagree on who computes which micro-batch uses
some samples twice and others never. Here rank 0 alone decides, and its decision travels on
the rank-0 control channel (stalwart/rowlink.py, the detector's exchange uses the same kind):
every ``every`` steps each rank sends its measurements up and rank 0 its decision down; the
message is read ``every`` steps later (it has long arrived by then, so no rank blocks on it).
At each exchange a rank first receives the previous message, rank 0 decides from every rank's
rows in it, then every rank sends the next one. Every rank reads a given message at the end
of the same step, and the decision names the step it starts (the step after that read), so
every rank switches at that step: never one step apart, whatever each rank's speed.

Guarantees: identical ``Decision`` objects on every rank, installed for the same step; a peer
that exits makes the next read raise (``RowLinkError``) instead of hanging; ``close()`` reads
what is in flight, so no peer's last message is cut off.
Cost: one ~100-byte send (rank 0: one per peer) and receive per exchange on the calling
thread; a gloo all-gather here cost ~0.85 ms of process CPU per rank per exchange.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch.distributed as dist

from stalwart.mitigate.decisions import (  # noqa: F401 (re-exported)
    EXCLUDE,
    KIND_NAMES,
    NONE,
    REBALANCE,
    REMAP,
    RESTORE,
    REVERT,
    Decision,
)
from stalwart.rowlink import GlooRows, StarRows, open_rows

_HEAD = 5  # kind, version, start step, target, predicted gain (x1e6)


class PlanChannel:
    """Measurements up and rank 0's decision down, once per exchange (see the docstring)."""

    def __init__(self, world: int, groups: int, row_len: int, every: int = 2,
                 group: Any = None, slots: int | None = None) -> None:
        """``slots``: the decision's room for numbers (at least ``groups``: a plan's counts;
        ``world`` fits an S3 re-map's rank -> host map when tensor parallelism makes the
        groups fewer than the ranks). Collective when distributed: every rank builds its
        channel at the same point."""
        self.world = world
        self.groups = groups
        self.slots = max(slots or groups, groups)
        self.row_len = row_len
        self.every = every
        self.width = _HEAD + self.slots + row_len
        self.distributed = dist.is_available() and dist.is_initialized() and world > 1
        self._rows: StarRows | GlooRows | None = None
        if self.distributed:
            pg = group if group is not None else dist.new_group(backend="gloo")
            self._rows = open_rows(dist.get_rank(), world, self.width, pg, name="plan")
        self._inflight: deque[int] = deque()  # sequence numbers sent, not yet received
        self._local: dict[int, list[float]] = {}  # one process: its own messages
        self._seq = 0

    def due(self, step: int) -> bool:
        return (step + 1) % self.every == 0

    def start_for(self, step: int) -> int:
        """The step a decision sent at the end of ``step`` takes effect: the step after the
        exchange that reads it."""
        return step + self.every + 1

    def receive(self) -> tuple[list[list[float]] | None, Decision | None]:
        """At an exchange step, first: the previous exchange's rows -- every rank's on rank
        0, rank 0's on the others -- and rank 0's decision in it; (None, None) at the first
        exchange."""
        if not self._inflight:
            return None, None
        seq = self._inflight.popleft()
        rows = self._rows.read(seq) if self._rows is not None else [self._local.pop(seq)]
        got = rows[0]  # rank 0's row comes first, on every rank
        dec = None
        if int(got[0]) != NONE:
            n = self.slots if int(got[0]) in (REMAP, RESTORE) else self.groups
            counts = [int(c) for c in got[_HEAD:_HEAD + n]]
            dec = Decision(int(got[0]), int(got[1]), int(got[2]), counts, int(got[3]),
                           float(got[4]) / 1e6)
        return [list(r[_HEAD + self.slots:]) for r in rows], dec

    def send(self, row: list[float], decision: Decision | None) -> None:
        """Then: this rank's row (and rank 0's decision, made from what ``receive`` gave)."""
        msg = [0.0] * self.width
        if decision is not None:
            msg[:_HEAD] = [float(decision.kind), float(decision.version),
                           float(decision.start_step), float(decision.target),
                           float(round(decision.predicted_gain * 1e6))]
            counts = [float(c) for c in decision.counts or ()]
            msg[_HEAD:_HEAD + len(counts)] = counts
        vals = [float(x) for x in row[:self.row_len]]
        msg[_HEAD + self.slots:_HEAD + self.slots + len(vals)] = vals
        seq, self._seq = self._seq, self._seq + 1
        if self._rows is not None:
            self._rows.issue(seq, msg)
        else:
            self._local[seq] = msg
        self._inflight.append(seq)

    def close(self) -> None:
        """Read what is in flight (every rank sent it), then close the connections."""
        try:
            while self._inflight and self._rows is not None:
                self._rows.read(self._inflight.popleft())
        finally:
            self._inflight.clear()
            if self._rows is not None:
                self._rows.close()
