"""Receive-side state of one round: the buffers a round's packets are placed into.

Mechanism: the per-round bookkeeping of "Distributed Training under Packet Loss" -- for each
round, the owner's sum and per-chunk counts of contributions (``aggregate.ShardAccumulator``),
the owners' broadcast values as their chunks land, which chunks arrived, the announced counts of
the end-of-phase markers, and the erasure decoder's state per (phase, sender). ``ROUNDS_OPEN``
of these exist at once (the current round and the next three), reused round after round: a
faster peer's packets of a later round wait in their own buffers.

``RoundRing`` owns the ``ROUNDS_OPEN`` states and the current round number: ``begin`` moves
the ring to the next round (the state of the round that just ended becomes the newest open
one's); ``states[rnd % ROUNDS_OPEN]`` holds round ``rnd``'s buffers while its ``rnd`` says so.
Every rank calls ``begin_round()`` once per step, in lockstep, so round numbers agree. The
current and the next ``ROUNDS_OPEN - 1`` rounds are open: a faster peer may already be several
rounds ahead (two pairs of ranks that left a slow gloo ``new_group`` 1 s apart end up two
rounds apart), and its packets wait for this rank, which then catches up at once instead of
losing them; with only the next round open, such pairs lost everything to each other for the
rest of the run.
Anything older is rejected as ``old_round`` -- that is also what makes a replay from an
earlier step harmless.

Both engines write the same numpy arrays: the Python engine from ``receiving.Receiver``, the
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
from stalwart.comm.wire import PHASE_NORM, TAG_BYTES

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


class RoundRing:
    """The open rounds of one rank: ``ROUNDS_OPEN`` ``RoundState`` reused in turn, and the
    current round number (-1 before the first ``begin``).

    Guarantees: after ``begin()`` returns r, the states of rounds r .. r + ROUNDS_OPEN - 1
    are open (each cleared when it was taken over, its arrays kept in place), and the native
    engine, when attached, has been told the same. Callers hold the collective's lock around
    ``begin``. Cost: ``ROUNDS_OPEN`` states (module docstring); ``begin`` clears one state's
    arrays per round.
    """

    def __init__(self, lay: Layout, rank: int, keep: bool) -> None:
        self.layout, self.rank = lay, rank
        self.states = [RoundState.new(lay, rank, i, keep) for i in range(ROUNDS_OPEN)]
        self.round = -1
        # global index of each shard's first chunk (where its tags start in RoundState.vtag)
        self.chunk_base = np.concatenate(
            [[0], np.cumsum([lay.n_chunks(s) for s in range(lay.world)])]).astype(int)
        self.eng = None  # the native engine bound to these states (``attach``)

    def attach(self, eng) -> None:
        """The native engine holds pointers to the states' arrays: tell it each reset."""
        self.eng = eng

    @property
    def slot(self) -> int:
        """Index of the current round's state (its slot in the native engine too)."""
        return self.round % ROUNDS_OPEN

    @property
    def current(self) -> RoundState:
        return self.states[self.round % ROUNDS_OPEN]

    def begin(self) -> int:
        """Start the next round; returns its number."""
        self.round += 1
        r = self.round
        for k in range(ROUNDS_OPEN):  # round r-1 is over: its state becomes r+OPEN-1's
            st = self.states[(r + k) % ROUNDS_OPEN]
            if st.rnd != r + k:
                st.reset(r + k)
                if self.eng is not None:
                    self.eng.reset_round((r + k) % ROUNDS_OPEN, r + k)
        if self.eng is not None:
            self.eng.set_round(r)
        return r

    def norm_total(self, own_sq: float) -> float:
        """The current round's sum of the owners' squared shard norms, this rank's being
        ``own_sq``; a norm that did not arrive is estimated from the others' mean per element
        times that shard's size."""
        st = self.current
        lens = np.array(self.layout.shard_lens, np.float64)
        have = st.got[PHASE_NORM] > 0
        have[self.rank] = True
        vals = st.norm.copy()
        vals[self.rank] = own_sq
        if not have.all():
            per_elem = vals[have].sum() / max(lens[have].sum(), 1.0)
            vals[~have] = per_elem * lens[~have]
        return float(vals.sum())

    def landed(self, st: RoundState, shard_values: np.ndarray, out: np.ndarray,
               stale: np.ndarray | None, want_mask: bool = True, direct: bool = False
               ) -> np.ndarray | None:
        """Write the owners' chunks of round ``st`` that arrived into ``out`` (``stale``'s
        values elsewhere, when given) and this rank's shard (unless it is already there:
        ``reduce_scatter`` averaged into it); returns the per-element mask of what arrived
        (None unless ``want_mask``). A shard that arrived whole -- the common case -- is one
        copy, not a masked one; with ``direct`` (the engine placed them in ``out`` itself)
        the owners' chunks are not copied at all. Cost: one pass over ``out`` at most."""
        lay = self.layout
        mask = np.empty(lay.numel, bool) if want_mask else None
        b = lay.bounds
        for s in range(lay.world):
            lo, hi = b[s], b[s + 1]
            if s == self.rank:
                if hi > lo and out[lo:hi].ctypes.data != shard_values.ctypes.data:
                    out[lo:hi] = shard_values
                if mask is not None:
                    mask[lo:hi] = True
            elif st.vseen[s].all():
                if not direct:
                    out[lo:hi] = st.vals[lo:hi]
                if mask is not None:
                    mask[lo:hi] = True
            else:
                m = lay.expand(s, st.vseen[s])
                if mask is not None:
                    mask[lo:hi] = m
                if direct:
                    continue
                if stale is not None:
                    out[lo:hi] = stale[lo:hi]
                np.copyto(out[lo:hi], st.vals[lo:hi], where=m)
        return mask


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
    # where the phase's time went (``phase.PhaseWait``; seconds from the phase's start, as this
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


