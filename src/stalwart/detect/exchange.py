"""The monitor's exchange: rank 0's alarm down, every rank's compute samples up, one row each.

Protocol: every rank contributes one row -- a header (rank 0's alarm, the number of entries,
the next exchange period) and its (step, compute) samples since the last exchange -- over the
rank-0 control channel (stalwart/rowlink.py: a TCP connection to rank 0, or the monitor
group's all-gather if any rank could not set one up). A row is issued every ``check_every``
checks and read at a check fixed when it was issued (the next one; ``lag`` exchanges later
with a fixed period), so no rank ever blocks on it and every rank reads the same rows at the
same checks. The exchange is transport only: ``read`` hands the rows and rank 0's alarm to
the decision path (``Detector.step``), which gives back the alarm ``issue`` sends; it reads
the decision state only to choose a period (``DecisionCore.alert``).

Exchange period: with ``check_every=None`` rank 0 chooses it each exchange -- the smallest k
that keeps the exchange within ``EXCHANGE_BUDGET`` of the process's CPU time per step, capped
at ``max_every``, and 1 while a decision is under way, a change detector's posterior has
fired, or another rank asked (its own compute jumped ``ALERT_JUMP`` above its recent median
twice in a row); rank 0's row carries the period, so every rank switches at the same check.

Row layout: ``RowHead`` and ``ExchangeRow`` below are the only code that knows it (``pack``,
``unpack``; rank 0's read of every rank's row, ``ExchangeRow.by_step`` and
``ExchangeRow.least_every``, reads the same layout column-wise).

Cost: a few ~100-byte socket sends and receives per exchange on the calling thread; the
process CPU of one exchange is measured once at construction (rowlink.exchange_cost).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from stalwart.detect.alarms import Alarm
from stalwart.detect.decision import DecisionCore
from stalwart.rowlink import GlooRows, StarRows

try:  # rank 0's read of the rows in one call (detect/_native/channels.c)
    from stalwart.detect._channels import by_step as _by_step  # type: ignore[import-not-found]
except ImportError:  # no compiler at install
    _by_step = None

_new = tuple.__new__  # (``_new(Alarm, (...))``: ``Alarm(...)`` without its Python __new__)
EXCHANGE_BUDGET = 0.002  # the exchange may cost this fraction of a step's CPU time
ALERT_CHECKS = 4  # exchange every step this long after a change detector fired
ALERT_JUMP = 0.25  # a rank's compute this much above its recent median, twice, asks k = 1


@dataclass(frozen=True)
class RowHead:
    """A row's header: rank 0's alarm (QUIET in the other ranks' rows), the number of (step,
    compute) entries the row carries, and an exchange period -- in rank 0's row the one in
    force from the check that reads it, in another rank's the one it asks for.

    Wire: ``SIZE`` floats, ``action, onset, severity, suspect, entries, every``; integers
    travel as floats (exact below 2**53)."""

    alarm: Alarm
    entries: int
    every: int

    SIZE: ClassVar[int] = 6
    ENTRIES: ClassVar[int] = 4  # (where ``entries`` and ``every`` sit: rank 0's column reads)
    EVERY: ClassVar[int] = 5

    def pack(self) -> list[float]:
        """The header's floats (``SIZE`` of them)."""
        a = self.alarm
        return [float(a.action), float(a.onset), float(a.severity), float(a.suspect),
                float(self.entries), float(self.every)]

    @classmethod
    def unpack(cls, row: Sequence[float]) -> RowHead:
        """The header at the start of ``row`` (``pack``'s inverse)."""
        return cls(cls.alarm_of(row), int(row[4]), int(row[5]))

    @staticmethod
    def alarm_of(row: Sequence[float]) -> Alarm:
        """``unpack(row).alarm`` without the header object (read at every exchange)."""
        return Alarm(int(row[0]), int(row[1]), float(row[2]), int(row[3]))


@dataclass(frozen=True)
class ExchangeRow:
    """One rank's row of one exchange: its header and its (step, compute) samples since the
    last row, padded with zeros to the width every rank uses (``width``).

    Wire: ``RowHead``'s floats, then ``step, compute`` per sample, then zeros."""

    head: RowHead
    samples: Sequence[tuple[float, float]]

    @staticmethod
    def width(max_every: int) -> int:
        """The floats of a row that carries up to ``max_every`` samples."""
        return RowHead.SIZE + 2 * max_every

    def pack(self, width: int) -> list[float]:
        """The row's ``width`` floats (at least ``width(len(samples))``)."""
        vals = self.head.pack()
        for key, comp in self.samples:
            vals += (key, comp)
        vals += [0.0] * (width - len(vals))
        return vals

    @classmethod
    def unpack(cls, row: Sequence[float]) -> ExchangeRow:
        """A row's header and samples (``pack``'s inverse, padding dropped)."""
        head = RowHead.unpack(row)
        base = RowHead.SIZE
        return cls(head, [(row[j], row[j + 1]) for j in range(base, base + 2 * head.entries, 2)])

    @staticmethod
    def by_step(rows: Sequence[Sequence[float]]) -> list[tuple[int, list[float]]]:
        """Rank 0: one exchange's rows (rank order) as (step, every rank's compute at it),
        for the entries every rank sent, in step order -- the steps of rank 0's row. What
        ``unpack`` of each row then a transpose gives, in one pass over the columns (one C
        call where built: ``_channels.by_step``, the same list)."""
        if _by_step is not None:
            got = _by_step(rows, RowHead.SIZE, RowHead.ENTRIES)
            if got is not None:
                return got
        return ExchangeRow.by_step_ref(rows)

    @staticmethod
    def by_step_ref(rows: Sequence[Sequence[float]]) -> list[tuple[int, list[float]]]:
        """``by_step`` in Python (the reference the C call is tested against)."""
        at = RowHead.ENTRIES
        n = int(min(r[at] for r in rows))
        cols = list(zip(*rows, strict=False))  # (column j: every rank's value j, by rank)
        base = RowHead.SIZE
        return [(int(rows[0][j]), list(cols[j + 1])) for j in range(base, base + 2 * n, 2)]

    @staticmethod
    def least_every(rows: Sequence[Sequence[float]], default: int) -> int:
        """The least period ``rows``' headers carry (``default`` for no rows); the headers'
        ``every`` without unpacking each one (rank 0 reads it at every exchange)."""
        at = RowHead.EVERY
        return min((int(r[at]) for r in rows), default=default)


class Exchange:
    """One rank's side of the exchange (see the module docstring)."""

    def __init__(self, rank: int, rows: StarRows | GlooRows, core: DecisionCore, *,
                 check_every: int | None, max_every: int, lag: int,
                 process_cost: float = 0.0) -> None:
        self.rank = rank
        self.rows = rows
        self.core = core
        self.auto_every = check_every is None
        self.check_every = 1 if check_every is None else check_every  # in force now
        self.max_every = max_every if check_every is None else check_every
        self.lag = lag
        self.exchanges = 0
        self._unsent: list[tuple[float, float]] = []  # (step, compute) since the last one
        # in flight, oldest first: (sequence number, check at which it is read)
        self._inflight: deque[tuple[int, int]] = deque()
        self._requested = self.max_every  # rank 0: the least period the last rows asked
        self._next_issue = self.check_every  # check number of the next exchange
        self._last_issue = 0
        self._alert_until = 0  # rank 0: exchange every step until this check
        # rank 0's costs: CPU seconds per exchange on this thread (measured each time) and of
        # the whole process (measured once), and process CPU seconds per check
        self._exchange_cpu: float | None = None
        self._process_cost = process_cost
        self._cpu_at_check: float | None = None
        self._check_at = 0  # the check it was read at (the monitor skips checks with no work)
        self._step_cpu: deque[float] = deque(maxlen=32)
        self._exchange_costs: deque[float] = deque(maxlen=16)
        self._own_compute: deque[float] = deque(maxlen=16)
        self._own_high = False
        self._own_rows: dict[int, list[float]] = {}  # rank 0: its rows in flight, by seq
        self._drained = -1  # the newest sequence number ``drain`` waited for
        self._width = self.width(self.max_every)  # every row's floats
        # rank 0 measures costs only where it has a period to choose (max_every > 1)
        self._measure = rank == 0 and self.auto_every and self.max_every > 1

    @staticmethod
    def width(max_every: int) -> int:
        """The floats of one row (``ExchangeRow.width``)."""
        return ExchangeRow.width(max_every)

    def add(self, key: int, compute: float) -> None:
        """A new sample of this rank's to send with the next row."""
        self._unsent.append((float(key), float(compute)))

    def add_many(self, samples: list[tuple[int, float]]) -> None:
        """``add(key, compute)`` for each pair, in order."""
        self._unsent.extend([(float(k), float(c)) for k, c in samples])

    def add_floats(self, samples: list[tuple[float, float]]) -> None:
        """``add_many`` for pairs that are floats already (no conversion)."""
        self._unsent.extend(samples)

    def due(self, c: int) -> bool:
        """Whether check ``c`` reads or issues a row (otherwise the check has nothing to do,
        and the monitor skips it)."""
        return bool(self._inflight and self._inflight[0][1] <= c) or c >= self._next_issue

    def next_due(self) -> int:
        """The first check from now that ``due`` holds for (they change only at checks)."""
        due = self._next_issue
        if self._inflight:
            due = min(due, self._inflight[0][1])
        return due

    def issues(self, c: int) -> bool:
        """Whether check ``c`` sends this rank's row (``issue``), after its ``read``."""
        return c >= self._next_issue

    def read(self, c: int) -> tuple[list[tuple[int, list[float]]], Alarm | None]:
        """Check ``c``'s transport in: the rows due now -- on rank 0 every rank's (step,
        compute) entries, in step order, for the per-rank channels -- and the alarm rank 0's
        row carries (None: no row was due). The decision path (``Detector.step``) takes
        both; nothing here feeds the decision state. On rank 0 the same as
        ``read_own`` then, with a row due, ``read_rows``."""
        if self.rank == 0:
            head = self.read_own(c)
            return ([], None) if head is None else (self.read_rows(head[0]), head[1])
        self._count_step(c)
        head = self._read(c)
        return [], None if head is None else head.alarm

    def read_own(self, c: int) -> tuple[int, Alarm] | None:
        """Rank 0: check ``c``'s read from its own row alone (kept when it was sent): the
        sequence number of the row due now and the alarm it carries (None: no row due), the
        period it set in force. The other ranks' rows of that exchange are ``read_rows``'
        and must be read before anything else touches this exchange."""
        self._count_step(c)
        if not self._inflight or self._inflight[0][1] > c:
            return None
        seq, _ = self._inflight.popleft()
        own = self._own_rows.pop(seq)
        if self.auto_every:
            self._set_every(int(own[RowHead.EVERY]))
        # ``RowHead.alarm_of(own)``, without its two Python frames (rank 0's training thread)
        return seq, _new(Alarm, (int(own[0]), int(own[1]), float(own[2]), int(own[3])))

    def read_rows(self, seq: int) -> list[tuple[int, list[float]]]:
        """Rank 0: exchange ``seq``'s rows (``read_own`` took its header): every rank's
        (step, compute) entries, in step order, for the per-rank channels."""
        t0 = time.thread_time() if self._measure else 0.0
        got = self.rows.read(seq)
        if self._measure:
            self._exchange_cpu = (self._exchange_cpu or 0.0) + time.thread_time() - t0
            # the other ranks' requests (rank 0's own row holds its last choice, which must
            # not vote for itself: once 1, the period would stay 1)
            self._requested = ExchangeRow.least_every(got[1:], self.max_every)
        # (``ExchangeRow.by_step(got)``, the C call made here: one Python frame less)
        out = _by_step(got, RowHead.SIZE, RowHead.ENTRIES) if _by_step is not None else None
        return out if out is not None else ExchangeRow.by_step_ref(got)

    def _count_step(self, c: int) -> None:
        """Rank 0, choosing a period: the process CPU per step since the last check."""
        if self._measure:
            cpu = time.process_time()
            if self._cpu_at_check is not None and c > self._check_at:
                # per step: the checks in between had nothing due and were skipped
                self._step_cpu.append((cpu - self._cpu_at_check) / (c - self._check_at))
            self._cpu_at_check, self._check_at = cpu, c

    def _set_every(self, every: int) -> None:
        """The period rank 0's row carries (``every``), in force from this check on every
        rank."""
        self.check_every = max(1, min(every, self.max_every))
        self._next_issue = min(self._next_issue, self._last_issue + self.check_every)

    def issue(self, c: int, alarm: Alarm) -> None:
        """Check ``c``'s transport out: this rank's row, carrying ``alarm`` (rank 0's alarm,
        ``Detector.step``'s ``send``; QUIET on the other ranks) and the samples since the
        last row. Called only when ``issues(c)``. The same as ``send(c, reserve(c),
        alarm)``."""
        self.send(c, self.reserve(c), alarm)

    def reserve(self, c: int) -> int:
        """Check ``c``'s row booked (``issue``'s schedule half): its sequence number, the
        check that reads it, the next issue -- what ``due``, ``issues`` and ``next_due`` read
        from here on -- with its content and its send left to ``send``, which must follow
        before anything else touches this exchange (the monitor's analysis thread sends it).
        Called only when ``issues(c)``."""
        seq = self.exchanges
        due = c + 1 if self.auto_every else c + self.lag * self.check_every
        self._inflight.append((seq, due))
        self._last_issue = c
        self._next_issue = c + self.check_every
        self.exchanges += 1
        return seq

    def send(self, c: int, seq: int, alarm: Alarm) -> None:
        """The row ``reserve(c)`` booked as ``seq``: the samples since the last row and the
        period (rank 0: ``_choose_every``) with ``alarm``, sent."""
        t0 = time.thread_time() if self._measure else 0.0
        # the same length on every rank; a rank with fewer samples sends fewer entries and
        # rank 0 uses the entries every rank has
        unsent = self._unsent[-self.max_every:]
        self._unsent.clear()
        if self.rank == 0:
            every = self._choose_every(c) if self.auto_every else self.check_every
        else:
            every = self._request_every(unsent)
        # ``ExchangeRow(RowHead(alarm, len(unsent), every), unsent).pack(width)``, the same
        # floats without the two objects
        vals = [float(alarm.action), float(alarm.onset), float(alarm.severity),
                float(alarm.suspect), float(len(unsent)), float(every)]
        for pair in unsent:
            vals += pair
        vals += [0.0] * (self._width - len(vals))
        if self.rank == 0:
            self._own_rows[seq] = vals
        self.rows.issue(seq, vals)
        if self._measure:
            self._exchange_cpu = (self._exchange_cpu or 0.0) + time.thread_time() - t0

    def drain(self) -> None:
        """Wait until the exchanges in flight are complete (they stay queued). A drain with
        nothing issued since the last one returns at once (its rows were waited for; a link's
        ``wait`` on them again would do nothing)."""
        inflight = self._inflight
        if inflight and inflight[-1][0] != self._drained:
            for seq, _ in inflight:
                self.rows.wait(seq)
            self._drained = inflight[-1][0]

    def close(self) -> None:
        # every rank issued them: completing them keeps the group's op order intact
        while self._inflight:
            self.rows.read(self._inflight.popleft()[0])
        self._own_rows.clear()
        self.rows.close()

    def _read(self, c: int) -> RowHead | None:
        """Ranks other than 0: the header of rank 0's row due at check ``c`` (None: none
        due)."""
        if not self._inflight or self._inflight[0][1] > c:
            return None
        seq, _ = self._inflight.popleft()
        head = RowHead.unpack(self.rows.read(seq)[0])
        if self.auto_every:
            # rank 0's choice (it folds in the other ranks' requests), read by every rank at
            # this same check
            self._set_every(head.every)
        return head

    def _request_every(self, unsent: list[tuple[float, float]]) -> int:
        """Ranks other than 0: ask for one exchange per step when this rank's own compute
        stands out (two samples in a row above its recent median by ``ALERT_JUMP``: single
        spikes are everyday noise on a loaded machine), so that a rank turning slow gets its
        next samples to rank 0 without batching."""
        hist = self._own_compute
        alert = False
        for _, comp in unsent:
            high = len(hist) >= 8 and comp > (1.0 + ALERT_JUMP) * statistics.median(hist)
            alert = alert or (high and self._own_high)
            self._own_high = high
            hist.append(comp)
        return 1 if alert else self.max_every

    def _choose_every(self, c: int) -> int:
        """Rank 0: steps until the next exchange after this one is read (module docstring);
        the exchange's cost is the larger of the calibrated process cost and the median of
        the last exchanges on this thread."""
        if not self.auto_every:
            return self.check_every
        if not self._measure:
            return 1  # max_every 1: the only period there is
        if self.core.alert() or self._requested <= 1:
            self._alert_until = c + ALERT_CHECKS
        per_exchange = self._exchange_cpu
        self._exchange_cpu = 0.0  # the next exchange's cost accumulates from here
        if per_exchange is not None and per_exchange > 0:
            self._exchange_costs.append(per_exchange)
        if c < self._alert_until or len(self._exchange_costs) < 3 or len(self._step_cpu) < 3:
            return 1
        cost = max(statistics.median(self._exchange_costs), self._process_cost)
        step_cpu = statistics.median(self._step_cpu)
        if not step_cpu > 0:
            return 1
        return max(1, min(self.max_every, math.ceil(cost / (EXCHANGE_BUDGET * step_cpu))))

    def stats(self) -> dict[str, Any]:
        return {"exchanges": self.exchanges, "check_every": self.check_every}
