"""Receive-side state of one round: the buffers a round's packets are placed into.

Mechanism: the per-round bookkeeping of "Distributed Training under Packet Loss" -- for each
round, the owner's sum and per-chunk counts of contributions (``aggregate.ShardAccumulator``),
the owners' broadcast values as their chunks land, which chunks arrived, the announced counts of
the end-of-phase markers, and the erasure decoder's state per (phase, sender). ``ROUNDS_OPEN``
of these exist at once (the current round and the next three), reused round after round: a
faster peer's packets of a later round wait in their own buffers.

Both engines write the same numpy arrays: the Python engine from ``receiving.Receiving``, the
native one from C (it holds pointers to these arrays; ``reset`` clears them in place for that
reason, never replaces them -- all but the owner's sum, which a chunk's count makes valid:
``aggregate.ShardAccumulator``). Cost: per open round a full-size value buffer and tags
(4 + 16/chunk bytes per parameter), plus, with erasure codes, every sender's contributions to
this rank's shard (4 x world bytes per element of the shard).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from stalwart.comm import fec
from stalwart.comm.aggregate import ShardAccumulator
from stalwart.comm.layout import Layout
from stalwart.comm.wire import TAG_BYTES

ROUNDS_OPEN = 4  # the current round and the next three accept packets


@dataclass
class FecRx:
    """Receive side of one sender's erasure-coded phase in one round."""

    geo: fec.Stripes
    par: np.ndarray  # (m*S, chunk) float32: parity payloads as they arrive
    pseen: np.ndarray  # (m*S,) bool
    have: np.ndarray  # (S,) packets of each stripe in hand: data + parity + virtual
    done: np.ndarray  # (S,) bool: the stripe's data is complete (arrived or rebuilt)


@dataclass
class RoundState:
    """Receive-side state of one round (``ROUNDS_OPEN`` of these rotate)."""

    rnd: int
    acc: ShardAccumulator
    vals: np.ndarray  # the owners' values, written as chunks arrive
    vseen: list[np.ndarray]  # per shard, per chunk: arrived
    norm: np.ndarray  # (world,): owners' squared norms (PHASE_NORM)
    got: np.ndarray  # (3 phases, world): data packets accepted per sender
    marker: np.ndarray  # (3 phases, world): announced count, -1 = no marker yet
    gtag: np.ndarray  # (world, own shard's chunks, 16): tag of each placed contribution
    vtag: np.ndarray  # (all chunks, 16): tag of each placed owner chunk (by global chunk)
    closed: list[bool] = field(default_factory=lambda: [False, False, False])
    fec: dict[tuple[int, int], FecRx] = field(default_factory=dict)  # (phase, sender)
    recovered: np.ndarray = field(default_factory=lambda: np.zeros(3, np.int64))

    @classmethod
    def new(cls, lay: Layout, rank: int, rnd: int, keep: bool) -> RoundState:
        """Empty state of round ``rnd`` at ``rank``; ``keep``: every sender's contributions
        are kept (the erasure decoder rebuilds a lost chunk from the others of its stripe)."""
        world = lay.world
        # the value buffer is written in full now (pages faulted in here, once): with the
        # native engine's direct placement (``collective.broadcast(direct=True)``) only the
        # chunks that arrive before their round's broadcast starts land in it, and each first
        # touch of a lazily zeroed page there cost the receive thread a page fault and a
        # 2 MB huge-page clear (measured: 3% of a loss-free all-reduce's CPU at MTU 1500)
        vals = np.empty(lay.numel, np.float32)
        vals.fill(0.0)
        return cls(rnd, ShardAccumulator(lay, rank, keep=keep), vals,
                   [np.zeros(lay.n_chunks(s), bool) for s in range(world)],
                   np.zeros(world), np.zeros((3, world), np.int64),
                   np.full((3, world), -1, np.int64),
                   np.zeros((world, lay.n_chunks(rank), TAG_BYTES), np.uint8),
                   np.zeros((sum(lay.n_chunks(s) for s in range(world)), TAG_BYTES), np.uint8))

    def reset(self, rnd: int) -> None:
        """Make this the state of round ``rnd``: arrays cleared in place (the native engine
        holds pointers to them); its own state is reset by the caller."""
        self.rnd = rnd
        self.fec = {}
        self.recovered[:] = 0
        self.acc.reset()
        for v in self.vseen:
            v[:] = False
        self.got[:] = 0
        self.marker[:] = -1
        self.norm[:] = 0
        self.closed = [False, False, False]


@dataclass
class PhaseStats:
    sent: int = 0
    recv: int = 0
    lost: int = 0
    deadline_hit: bool = False
    elapsed: float = 0.0
    silent: list[int] = field(default_factory=list)
    copies: int = 1  # most copies of a data packet sent to any peer in this phase
    parity: int = 0  # erasure-code parity packets sent
    recovered: int = 0  # data chunks this rank rebuilt from parity
    # where the phase's time went (``Phases._wait``; seconds from the phase's start, as this
    # rank observed them at its wake-ups): until its own packets, parity and markers were
    # sent (t_sent), until every live peer had started the round (skew), until every one had
    # completed or sent its end marker (transfer), and how the
    # phase ended (``phase.COMPLETE`` / ``ENDED``: markers + grace / ``DEADLINE``); ``last``
    # is the peer that completed or ended last (-1: none)
    end: str = ""
    t_sent: float = 0.0
    t_started: float = 0.0
    t_ended: float = 0.0
    last: int = -1


