"""Agreement on the plan in force: one decision, a version and the step it starts, on every rank.

FALCON's public code lets every rank poll a plan file each iteration, so ranks can switch one
step apart -- and a step in which two ranks disagree on who computes which micro-batch uses
some samples twice and others never. Here rank 0 alone decides, and its decision travels in
the same message as every rank's measurements: an asynchronous all-gather on a gloo group of
its own, issued every ``every`` steps and read ``every`` steps later (it has long completed by
then, so no rank blocks on it). At each exchange a rank first receives the previous message,
rank 0 decides from the rows in it, then every rank sends the next one. Every rank reads a
given message at the end of the same step, and the decision names the step it starts (the
step after that read), so every rank switches at that step: never one step apart, whatever
each rank's speed.

Guarantees: identical ``Decision`` objects on every rank, installed for the same step; the
channel's collectives are issued in the same order on every rank (one per exchange step);
``close()`` completes what is in flight so the group's op order stays intact.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
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

_HEAD = 5  # kind, version, start step, target, predicted gain (x1e6)


class PlanChannel:
    """The per-exchange all-gather that carries measurements up and rank 0's decision down."""

    def __init__(self, world: int, groups: int, row_len: int, every: int = 2,
                 group: Any = None, slots: int | None = None) -> None:
        """``slots``: the decision's room for numbers (at least ``groups``: a plan's counts;
        ``world`` fits an S3 re-map's rank -> host map when tensor parallelism makes the
        groups fewer than the ranks)."""
        self.world = world
        self.groups = groups
        self.slots = max(slots or groups, groups)
        self.row_len = row_len
        self.every = every
        self.width = _HEAD + self.slots + row_len
        self.distributed = dist.is_available() and dist.is_initialized() and world > 1
        # made at construction (a collective: every rank builds its channel at the same point)
        self.group = group if group is not None or not self.distributed else \
            dist.new_group(backend="gloo")
        self._sent: deque[tuple[Any, list[torch.Tensor]]] = deque()

    def due(self, step: int) -> bool:
        return (step + 1) % self.every == 0

    def start_for(self, step: int) -> int:
        """The step a decision sent at the end of ``step`` takes effect: the step after the
        exchange that reads it."""
        return step + self.every + 1

    def receive(self) -> tuple[list[list[float]] | None, Decision | None]:
        """At an exchange step, first: the previous exchange's rows (every rank's) and rank
        0's decision in it; (None, None) at the first exchange."""
        if not self._sent:
            return None, None
        msg = self._sent.popleft()
        if self.distributed:
            work, rows = msg
            work.wait()
        else:
            rows = msg[1]
        got = rows[0]
        dec = None
        if int(got[0]) != NONE:
            n = self.slots if int(got[0]) in (REMAP, RESTORE) else self.groups
            counts = [int(c) for c in got[_HEAD:_HEAD + n]]
            dec = Decision(int(got[0]), int(got[1]), int(got[2]), counts, int(got[3]),
                           float(got[4]) / 1e6)
        return [r[_HEAD + self.slots:].tolist() for r in rows], dec

    def send(self, row: list[float], decision: Decision | None) -> None:
        """Then: this rank's row (and rank 0's decision, made from what ``receive`` gave)."""
        msg = torch.zeros(self.width, dtype=torch.float64)
        if decision is not None:
            head = [decision.kind, decision.version, decision.start_step, decision.target,
                    round(decision.predicted_gain * 1e6)]
            msg[:_HEAD] = torch.tensor(head, dtype=torch.float64)
            if decision.counts:
                msg[_HEAD:_HEAD + len(decision.counts)] = torch.tensor(
                    decision.counts, dtype=torch.float64)
        msg[_HEAD + self.slots:] = torch.tensor(row[:self.row_len], dtype=torch.float64)
        if not self.distributed:
            self._sent.append((None, [msg]))
            return
        out = [torch.empty(self.width, dtype=torch.float64) for _ in range(self.world)]
        self._sent.append((dist.all_gather(out, msg, group=self.group, async_op=True), out))

    def close(self) -> None:
        while self._sent:
            work = self._sent.popleft()[0]
            if work is not None:
                work.wait()
