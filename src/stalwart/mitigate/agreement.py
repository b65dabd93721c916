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

Message layout: ``PlanMessage`` is the only code that knows it (``pack``, ``unpack``): rank
0's decision (a header, then its counts in ``slots`` places), then the rank's measurements.

Guarantees: identical ``Decision`` objects on every rank, installed for the same step; a peer
that exits makes the next read raise (``RowLinkError``) instead of hanging; ``close()`` reads
what is in flight, so no peer's last message is cut off.
Cost: one ~100-byte send (rank 0: one per peer) and receive per exchange on the calling
thread; a gloo all-gather here cost ~0.85 ms of process CPU per rank per exchange.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

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


@dataclass(frozen=True)
class PlanMessage:
    """One rank's message on the plan channel: rank 0's decision (None: none, and always in
    the other ranks' messages) and the rank's measurements (``PlanChannel.send``'s row).

    Wire, for a channel of ``slots`` and ``row_len``: ``kind, version, start_step, target,
    gain`` (``HEAD`` floats; the predicted gain travels as a whole number of millionths,
    ``GAIN_UNIT``; kind ``NONE`` and zeros without a decision), then the counts in ``slots``
    places (zero-padded), then ``row_len`` measurements (zero-padded, truncated beyond).
    Integers travel as floats (exact below 2**53)."""

    decision: Decision | None
    values: Sequence[float]

    HEAD: ClassVar[int] = 5
    GAIN_UNIT: ClassVar[float] = 1e6  # the gain's resolution: 1e-6

    @classmethod
    def width(cls, slots: int, row_len: int) -> int:
        """The floats of one message."""
        return cls.HEAD + slots + row_len

    def pack(self, slots: int, row_len: int) -> list[float]:
        """The message's ``width(slots, row_len)`` floats. Raises ValueError for a decision
        with more counts than ``slots``."""
        head = self.HEAD
        msg = [0.0] * self.width(slots, row_len)
        d = self.decision
        if d is not None:
            counts = [float(c) for c in d.counts or ()]
            if len(counts) > slots:
                raise ValueError(f"{d.name} v{d.version}: {len(counts)} counts for {slots} "
                                 "slots")
            msg[:head] = [float(d.kind), float(d.version), float(d.start_step),
                          float(d.target), float(round(d.predicted_gain * self.GAIN_UNIT))]
            msg[head:head + len(counts)] = counts
        vals = [float(x) for x in self.values[:row_len]]
        msg[head + slots:head + slots + len(vals)] = vals
        return msg

    @classmethod
    def unpack(cls, msg: Sequence[float], slots: int, groups: int) -> PlanMessage:
        """``pack``'s inverse for a channel of ``slots`` and ``groups``: a decision's counts
        are its first ``groups`` slots (a plan's, an exclusion's) or all ``slots`` (a remap's
        or a restore's rank -> host map); the values are every float after the slots."""
        head = cls.HEAD
        dec = None
        kind = int(msg[0])
        if kind != NONE:
            n = slots if kind in (REMAP, RESTORE) else groups
            counts = [int(c) for c in msg[head:head + n]]
            dec = Decision(kind, int(msg[1]), int(msg[2]), counts, int(msg[3]),
                           float(msg[4]) / cls.GAIN_UNIT)
        return cls(dec, list(msg[head + slots:]))


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
        self.width = PlanMessage.width(self.slots, row_len)
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
        msgs = [PlanMessage.unpack(r, self.slots, self.groups) for r in rows]
        # rank 0's message comes first, on every rank
        return [list(m.values) for m in msgs], msgs[0].decision

    def send(self, row: list[float], decision: Decision | None) -> None:
        """Then: this rank's row (and rank 0's decision, made from what ``receive`` gave)."""
        msg = PlanMessage(decision, row).pack(self.slots, self.row_len)
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
