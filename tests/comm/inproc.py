"""Several ranks of the real UDP collective in one process, one thread per rank.

Setup (secret, addresses, barrier) goes through ``ThreadExchange`` instead of torch.distributed:
the same three operations over a ``threading.Barrier``. Everything else -- sockets, receiving
threads, packets, deadlines -- is the real thing. Cheaper than spawning processes on a shared
two-core machine, and a test can reach into one rank while the others run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from stalwart.comm.collective import LossyCollective
from stalwart.comm.deadline import AdaptiveDeadline
from stalwart.comm.wire import FLAG_END, HEADER, HEADER_BYTES

# a drop rule: (sender, phase bit mask, end marker 0/1, chunk lo, chunk hi, round); -1 = any
Rule = tuple[int, int, int, int, int, int]


class Dropping(LossyCollective):
    """A collective that drops received datagrams before any check, with either engine: every
    ``period``-th run of ``burst`` datagrams (end markers excepted), and those matching a
    ``Rule``. The native engine does it in its receive thread (``Engine.set_drop``); the Python
    engine here, with the same arithmetic."""

    period = burst = count = 0
    rules: Sequence[Rule] = ()
    _dropped = 0

    def set_drop(self, period: int = 0, burst: int = 0, rules: Sequence[Rule] = ()) -> None:
        self.period, self.burst, self.rules = period, burst, tuple(rules)
        if self._eng is not None:
            self._eng.set_drop(period, burst, list(self.rules))

    @property
    def dropped(self) -> int:
        return self._eng.counters()["dropped"] if self._eng is not None else self._dropped

    def _on_batch(self, rows: np.ndarray, sizes: np.ndarray, src_ok: np.ndarray) -> None:
        n = rows.shape[0]
        hdr = np.ascontiguousarray(rows[:, :HEADER_BYTES]).view(HEADER).reshape(n)
        end = (hdr["flags"] & FLAG_END) != 0
        drop = np.zeros(n, bool)
        if self.period:
            drop = ((self.count + np.arange(n)) % self.period < self.burst) & ~end
        self.count += n
        chunk = hdr["offset"].astype(np.int64) // self.chunk
        for snd, mask, e, lo, hi, rnd in self.rules:
            drop |= (((snd < 0) | (hdr["sender"] == snd)) & ((mask >> hdr["phase"]) & 1 == 1)
                     & ((e < 0) | (end == bool(e))) & (end | ((chunk >= lo) & (chunk < hi)))
                     & ((rnd < 0) | (hdr["round"] == rnd)))
        self._dropped += int(drop.sum())
        super()._on_batch(rows[~drop], sizes[~drop], src_ok[~drop])


class ThreadExchange:
    """Setup-time exchange between ``world`` threads (``LossyCollective(exchange=...)``).

    ``rewrite(rank, obj)`` (optional) replaces what a rank contributes to ``all_gather``: a test
    uses it to advertise an address that its peers cannot reach.
    """

    def __init__(self, world: int,
                 rewrite: Callable[[int, Any], Any] | None = None) -> None:
        self.world = world
        self._bar = threading.Barrier(world)
        self._box: list[Any] = [None] * world
        self._rewrite = rewrite

    def for_rank(self, rank: int) -> _RankExchange:
        return _RankExchange(self, rank)


class _RankExchange:
    def __init__(self, ex: ThreadExchange, rank: int) -> None:
        self.ex, self.rank = ex, rank

    def broadcast_from_0(self, obj: Any) -> Any:
        if self.rank == 0:
            self.ex._box[0] = obj
        self.ex._bar.wait()
        out = self.ex._box[0]
        self.ex._bar.wait()
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        if self.ex._rewrite is not None:
            obj = self.ex._rewrite(self.rank, obj)
        self.ex._box[self.rank] = obj
        self.ex._bar.wait()
        out = list(self.ex._box)
        self.ex._bar.wait()
        return out

    def barrier(self) -> None:
        self.ex._bar.wait()


def run_threads(fns: list[Callable[[], Any]], timeout: float = 60.0) -> list[Any]:
    """Run one function per rank on its own thread; return results or the exceptions raised.
    A thread still running after ``timeout`` is reported as ``TimeoutError`` (a hang)."""
    out: list[Any] = [TimeoutError("still running")] * len(fns)

    def wrap(i: int, fn: Callable[[], Any]) -> None:
        try:
            out[i] = fn()
        except BaseException as e:  # noqa: BLE001 -- the test inspects it
            out[i] = e

    threads = [threading.Thread(target=wrap, args=(i, f), daemon=True)
               for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return out


def make_group(world: int, numel: int, cls: type[LossyCollective] = LossyCollective,
               rewrite: Callable[[int, Any], Any] | None = None, cap: float = 1.0,
               floor: float = 0.5, host: str | None = "127.0.0.1",
               **kw: Any) -> list[LossyCollective]:
    """``world`` collectives, built concurrently (their setup is collective); ``host`` None
    binds where ``transport.default_host()`` says."""
    ex = ThreadExchange(world, rewrite)

    def build(r: int) -> LossyCollective:
        dl = AdaptiveDeadline(initial=cap, cap=cap, floor=floor)
        return cls(numel, world=world, rank=r, exchange=ex.for_rank(r), host=host,
                   deadline=dl, **kw)

    got = run_threads([lambda r=r: build(r) for r in range(world)])
    for g in got:
        if isinstance(g, BaseException):
            for c in got:
                if isinstance(c, LossyCollective):
                    c.close()
            raise g
    return got
