"""Loss-tolerant reduce-scatter and owner broadcast over the UDP transport.

Mechanism: the two phases of "Distributed Training under Packet Loss" (Weintraub et al., 2025):
  1. reduce-scatter -- every rank sends chunk k of shard s of its vector to shard s's owner;
     the owner averages per chunk over the contributions that arrived, its own included
     (``aggregate.ShardAccumulator``: unbiased);
  2. broadcast -- every owner sends its shard's values (updated parameters, or averaged
     gradients in the naive variant / the all-reduce benchmark) to every rank; a rank that
     misses a chunk keeps whatever it had there (its stale copy).
Each phase ends at the first of: all expected packets arrived; every live sender's end-of-phase
marker arrived + grace; the agreed adaptive deadline (``deadline.AdaptiveDeadline``). There are
no retransmissions, so a phase's duration is bounded by the cap whatever the network does.

Setup goes through torch.distributed (gloo or any backend with object collectives): rank 0
draws the per-job secret and job id with ``os.urandom`` and broadcasts them; every rank binds
its socket to ``transport.default_host()`` (``STALWART_HOST_ADDR``, else the interface that
routes to ``MASTER_ADDR``) and the addresses are exchanged with ``all_gather_object``, with
each rank's host name: a job that spans hosts while a rank bound a loopback address fails at
setup with one line, instead of every rank training on its own gradient.

Rounds: every rank calls ``begin_round()`` once per step, in lockstep, so round numbers agree.
The receiving thread keeps the current and the next ``ROUNDS_OPEN - 1`` rounds open (a faster
peer may already be several rounds ahead: its packets wait for this rank, which then catches up
at once instead of losing them; with only the next round open, a pair of ranks two rounds ahead
of the other pair -- seen after the two pairs left a slow gloo ``new_group`` 1 s apart at 10%
loss -- lost everything to each other for the rest of the run); anything older is rejected as
``old_round`` -- that is also what makes a replay from an earlier step harmless. Memory: each
open round holds a full-size value buffer (``ROUNDS_OPEN`` x 4 bytes x parameters). A peer
that sent nothing (of any round) for a deadline cap, in a phase that hit the deadline
is marked silent and is not waited for until any authenticated packet from it arrives again:
a dead rank costs its peers at most a deadline cap of waiting, not a hang. A peer that stays
silent for ``give_up_s`` (default 60 s, counted from the first phase) -- dead, or never heard
at all because its packets cannot reach this rank -- raises ``PeerLost``: training on without
its shard's updates, or alone, would be a silent failure.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from stalwart.comm import fec, native
from stalwart.comm.aggregate import ShardAccumulator
from stalwart.comm.copies import CopyPolicy, LossEstimator
from stalwart.comm.deadline import AdaptiveDeadline
from stalwart.comm.layout import Layout
from stalwart.comm.transport import (
    UdpTransport,
    _ip_u32,
    default_host,
    default_mtu,
    is_loopback,
)
from stalwart.comm.wire import (
    FB_SCALE,
    FB_UNKNOWN,
    FLAG_END,
    FLAG_PARITY,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    OVERHEAD,
    PHASE_GRAD,
    PHASE_NORM,
    PHASE_VALUE,
    REASONS,
    TAG_BYTES,
    R,
    Wire,
    max_floats_for_mtu,
)

_UNAUTHENTICATED = (R["malformed"], R["bad_tag"], R["unknown_sender"], R["spare"])
_OLD, _LATE, _SPARE = R["old_round"], R["late"], R["spare"]
# data datagrams that count as arrived for the loss estimate: authenticated ones only -- placed,
# late, of a round that already ended (wire.check tags these too), or, for a copy of a chunk
# already placed (dropped before its tag is computed), one whose tag equals the placed copy's
# (copies are the same sealed bytes). Counting unchecked spares let forged packets hide real
# loss and talk a link down to fewer copies. Markers are booked in the same cases, in time or
# not: when only in-time markers were booked, copies that arrived after their round ended were
# counted with no debt, and a real 1% loss read as 0.0-0.3%.
_ARRIVED = (0, R["duplicate"], _OLD)
# an end marker is lost only if all copies are: p**4 (0.01% at 10% independent loss; the copies
# go back to back, so a burst of 4 packets takes them all: 38 of 840 on the testbed's bursts)
MARKER_COPIES = 4
# a norm is the whole phase (one float per owner), and a lost one holds its receiver a full
# deadline while the others go on to the broadcast without it: 1e-8 at 10% loss
NORM_COPIES = 8
ROUNDS_OPEN = 4  # the current round and the next three accept packets
MAX_ANNOUNCED_COPIES = 16  # a marker's copy count is believed up to this (sanity bound)
# a peer silent this long (seconds from the first phase, or from its last packet) stops the job:
# long enough for a restart of a neighbour's eval or checkpoint under loss (seconds), short
# enough that a dead rank or a blocked path is reported within the first minute
GIVE_UP_S = 60.0
# receive-handler failures (each one loses a batch of up to 64 datagrams) past which the job
# stops: a handler bug repeats on every batch, so this is reached within milliseconds, while
# letting it pass would silently turn a code bug into "packet loss" for the rest of the run
MAX_HANDLER_ERRORS = 10
# protection of a link not measured yet (the first step): parity sized for this loss rate.
# Early training is the most sensitive to lost chunks (docs/comm.md), and the benchmark's
# worst case is 20% loss
FEC_INITIAL_LOSS = 0.2
# reports a link's parity waits for before it trusts them: the first windows hold a few hundred
# datagrams, and between two bursts of loss they read nearly 0 (seen on the testbed: a link
# that lost 10% in bursts of 32 datagrams read 0.25% after its first phase)
FEC_MIN_REPORTS = 4
FEC_MODES = ("copies", "rs", "none")


class PeerLost(RuntimeError):
    """A peer sent nothing for ``give_up_s``: dead, or its packets cannot reach this rank."""


class ReceiveFailed(RuntimeError):
    """The receiving thread's handler failed more than ``MAX_HANDLER_ERRORS`` times."""


def check_addresses(addrs: list[tuple[str, int]], hosts: list[str]) -> None:
    """Raise (one line) when the job spans hosts and a rank bound a loopback address: its
    peers' packets to it would land on their own loopback and never reach it."""
    if len(set(hosts)) < 2:
        return
    for r, ((a, port), h) in enumerate(zip(addrs, hosts, strict=True)):
        if is_loopback(a):
            raise RuntimeError(
                f"stalwart.comm: rank {r} on host {h!r} bound loopback {a}:{port} but the job "
                f"spans hosts {sorted(set(hosts))}; set STALWART_HOST_ADDR (or MASTER_ADDR) to "
                f"an address the other hosts can reach")


@dataclass
class _FecRx:
    """Receive side of one sender's erasure-coded phase in one round."""

    geo: fec.Stripes
    par: np.ndarray  # (m*S, chunk) float32: parity payloads as they arrive
    pseen: np.ndarray  # (m*S,) bool
    have: np.ndarray  # (S,) packets of each stripe in hand: data + parity + virtual
    done: np.ndarray  # (S,) bool: the stripe's data is complete (arrived or rebuilt)


@dataclass
class _Round:
    """Receive-side state of one round (two of these alternate)."""

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
    fec: dict[tuple[int, int], _FecRx] = field(default_factory=dict)  # (phase, sender)
    recovered: np.ndarray = field(default_factory=lambda: np.zeros(3, np.int64))

    def reset(self, rnd: int) -> None:
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


class LossyCollective:
    """Reduce-scatter + broadcast of a flat float32 vector of ``numel`` elements over UDP."""

    def __init__(self, numel: int, *, group=None, host: str | None = None,
                 mtu: int | None = None, deadline: AdaptiveDeadline | None = None,
                 pace_bytes_per_s: float = 0.0, key: bytes | None = None,
                 world: int | None = None, rank: int | None = None,
                 exchange=None, value_copies: int = 1, grad_copies: int = 1,
                 copies_target: float | None = None, max_copies: int = 3,
                 min_copies: int = 1, give_up_s: float = GIVE_UP_S, fec_mode: str = "copies",
                 fec_target: float = 2e-5,
                 fec_initial_loss: float = FEC_INITIAL_LOSS, engine: str | None = None) -> None:
        import torch.distributed as dist

        self.engine = native.engine_name(engine)

        if fec_mode not in FEC_MODES:
            raise ValueError(f"unknown fec mode {fec_mode!r} ({', '.join(FEC_MODES)})")
        # "rs": systematic Reed-Solomon parity per stripe of each phase (fec.py), sized per
        # link from its measured loss for ``fec_target``; "copies": repetition (below);
        # "none": neither (the bare algorithm)
        self.fec_mode = fec_mode
        self.fec_target = float(fec_target)
        self.fec_initial_loss = float(fec_initial_loss)
        if fec_mode != "copies":
            value_copies, grad_copies, copies_target = 1, 1, None
        self.group = group
        # Forward error protection of the broadcast (no retransmission: every chunk is simply
        # sent value_copies times): a missed parameter chunk makes a replica compute its next
        # gradient at a stale point -- a delayed-gradient effect that costs accuracy at high
        # learning rates -- while the copies cost only bandwidth. Loss p -> p**value_copies.
        self.value_copies = max(1, int(value_copies))
        self.grad_copies = max(1, int(grad_copies))  # same for contributions to the owners
        # copies_target set: the counts above are only where each link starts; then every
        # link gets the fewest copies that bring its measured loss to the target (copies.py)
        self._may_copy = (copies_target is not None or self.value_copies > 1
                          or self.grad_copies > 1)
        if world is None:
            world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.world, self.rank = int(world), int(rank)
        self._vpol = CopyPolicy(self.world, self.value_copies, copies_target, max_copies,
                                min_copies)
        self._gpol = CopyPolicy(self.world, self.grad_copies, copies_target, max_copies,
                                min_copies)
        self.loss_in = LossEstimator(self.world)
        mtu = mtu or default_mtu()
        self.chunk = max_floats_for_mtu(mtu)
        self.layout = Layout(int(numel), self.world, self.chunk)
        self.slot = OVERHEAD + 4 * self.chunk
        # secret + job id from rank 0; addresses from everyone
        ex = exchange or _DistExchange(group)
        secret = key if key is not None else os.urandom(32)
        job = int.from_bytes(os.urandom(4), "little")
        secret, job = ex.broadcast_from_0((secret, job))
        self.transport = UdpTransport(host or default_host(), self.slot,
                                      pace_bytes_per_s=pace_bytes_per_s)
        peers = ex.all_gather((self.transport.addr, socket.gethostname()))
        addrs = [(str(a[0]), int(a[1])) for a, _ in peers]
        try:
            check_addresses(addrs, [str(h) for _, h in peers])
        except RuntimeError:
            self.transport.close()
            raise
        self.transport.set_peers(addrs)
        self.give_up_s = float(give_up_s)
        self.wire = Wire(secret, job, self.world, self.rank, self.layout.shard_lens, self.chunk,
                         rounds_open=ROUNDS_OPEN)
        self.deadline = deadline or AdaptiveDeadline()
        b = self.layout.bounds
        self._lo, self._hi = b[self.rank], b[self.rank + 1]
        # global index of each shard's first chunk (where its tags start in _Round.vtag)
        self._chunk_base = np.concatenate(
            [[0], np.cumsum([self.layout.n_chunks(s) for s in range(self.world)])]).astype(int)
        self._rounds = [self._new_round(i) for i in range(ROUNDS_OPEN)]
        self.round = -1
        self.silent: set[int] = set()
        # perf_counter of each peer's latest packet (start: now, so a peer that never speaks
        # is given up on after one cap like any other)
        self._heard = np.full(self.world, time.perf_counter())
        self._ever = np.zeros(self.world, bool)  # any authenticated packet from it, ever
        self._t_first: float | None = None  # when the first phase started
        self._booked = np.full((3, self.world), -1, np.int64)  # last marker round booked
        self.rejected = np.zeros(len(REASONS), np.int64)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._rows_cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._eng = None
        self._silenced_at = np.zeros(self.world)
        if self.engine == "native":
            self._start_native()
        else:
            self.transport.on_error = self._wake
            self.transport.start(self._on_batch)
        ex.barrier()  # every socket is bound and draining before anyone sends

    def _start_native(self) -> None:
        """The native engine receives instead of the transport's thread, into this
        collective's own round buffers and counters, and seals every packet (it owns the nonce
        counter)."""
        mod = native.module()
        t = self.transport
        eng = mod.Engine(fd=t.sock.fileno(), key=self.wire.job_key, job=self.wire.job,
                         world=self.world, me=self.rank, shard_lens=self.layout.shard_lens,
                         chunk=self.chunk, slot=self.slot, rounds_open=ROUNDS_OPEN,
                         may_copy=self._may_copy, batch=t.batch, rx_segments=t.rx_segments)
        eng.set_peers([_ip_u32(h) for h, _ in t.peers], [p for _, p in t.peers])
        for i, st in enumerate(self._rounds):
            eng.bind_round(i, st.acc.sum, st.acc.count, st.acc.seen, st.acc.contrib, st.vals,
                           st.vseen, st.norm, st.got, st.marker, st.gtag, st.vtag,
                           st.recovered)
            eng.reset_round(i, st.rnd)
        eng.bind_shared(self._heard, self._ever, self.rejected, self.loss_in.got,
                        self.loss_in.owed)
        self.wire.sealer = eng.seal
        self._eng = eng
        self._cond = _NativeCond(eng)
        eng.start()

    def _sync(self) -> None:
        """Apply what the native engine gathered since the last call (under the lock): deadline
        proposals and loss feedback from markers, and peers marked silent that spoke since.
        (The Python engine does all of this as each packet is handled.)"""
        if self._eng is None:
            return
        hints, fb = self._eng.drain()
        for s, secs in hints:
            self.deadline.hear(s, secs)
        for s, rate in fb:
            self._vpol.feedback(s, rate)
            self._gpol.feedback(s, rate)
        for s in [s for s in self.silent if self._heard[s] > self._silenced_at[s]]:
            self.silent.discard(s)

    def _new_round(self, rnd: int) -> _Round:
        lay = self.layout
        return _Round(rnd, ShardAccumulator(lay, self.rank, keep=self.fec_mode == "rs"),
                      np.zeros(lay.numel, np.float32),
                      [np.zeros(lay.n_chunks(s), bool) for s in range(self.world)],
                      np.zeros(self.world), np.zeros((3, self.world), np.int64),
                      np.full((3, self.world), -1),
                      np.zeros((self.world, lay.n_chunks(self.rank), TAG_BYTES), np.uint8),
                      np.zeros((int(self._chunk_base[-1]), TAG_BYTES), np.uint8))

    # ---- receiving thread -----------------------------------------------------------------
    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()  # a waiting phase re-checks the handler's failures

    def _check_handler(self) -> None:
        n = self.transport.handler_errors
        if n > MAX_HANDLER_ERRORS:
            raise ReceiveFailed(
                f"stalwart.comm: rank {self.rank}'s receive handler failed {n} times (bound "
                f"{MAX_HANDLER_ERRORS}); last: {self.transport.last_error!r}")

    def _on_batch(self, rows: np.ndarray, sizes: np.ndarray, src_ok: np.ndarray) -> None:
        hdr, reasons = self.wire.check(rows, sizes, src_ok, max(self.round, 0), self._placed)
        with self._cond:
            done = self._place_batch(rows, hdr, reasons)
        if done.any():
            keep = ~done
            rows, hdr, reasons = rows[keep], hdr[keep], reasons[keep]
            if not len(reasons):
                with self._cond:
                    self._cond.notify_all()
                return
        self._on_rest(rows, hdr, reasons)

    def _place_batch(self, rows: np.ndarray, hdr: np.ndarray, reasons: np.ndarray) -> np.ndarray:
        """The common case, vectorised per (round, phase, sender): accepted whole-chunk data
        packets of an open phase -- placed, booked as arrivals, their senders marked alive,
        with numpy operations per group instead of Python per datagram. Returns which
        datagrams it handled (the rest, and anything unusual, go through ``_on_rest``).
        Called under the lock."""
        C, world = self.chunk, self.world
        handled = np.zeros(len(reasons), bool)
        cand = ((reasons == 0) & (hdr["flags"] == 0) & (hdr["phase"] != PHASE_NORM)
                & (hdr["length"] == C) & (hdr["sender"] < world))
        # only datagrams before the batch's first marker: a marker books the arrivals counted
        # before it, so the order matters (data of the next phase counted ahead of a marker
        # read as loss in the next window: a clean loopback measured ~0.5%)
        ends = np.flatnonzero(hdr["flags"] == FLAG_END)
        if ends.size:
            cand[ends[0]:] = False
        if not cand.any():
            return handled
        idx = np.flatnonzero(cand)
        snd = hdr["sender"][idx].astype(np.int64)
        rnd = hdr["round"][idx].astype(np.int64)
        ph = hdr["phase"][idx].astype(np.int64)
        chk = hdr["offset"][idx].astype(np.int64) // C
        key = (rnd * 3 + ph) * world + snd
        order = np.argsort(key, kind="stable")
        bounds_k = np.flatnonzero(np.diff(key[order])) + 1
        now = time.perf_counter()
        lay = self.layout
        for grp in np.split(order, bounds_k):
            r, p, s = int(rnd[grp[0]]), int(ph[grp[0]]), int(snd[grp[0]])
            st = self._rounds[r % ROUNDS_OPEN]
            if st.rnd != r or st.closed[p]:
                continue  # the slow path decides (late, old round, ...)
            seen = st.acc.seen[s] if p == PHASE_GRAD else st.vseen[s]
            c = chk[grp]
            rows_i = idx[grp]
            # first copy of each chunk not placed yet; the others are duplicates
            c_u, first = np.unique(c, return_index=True)
            new = ~seen[c_u]
            c_new, i_new = c_u[new], rows_i[first[new]]
            dup = len(grp) - c_new.size
            if c_new.size:
                pay = rows[i_new, HEADER_BYTES: HEADER_BYTES + 4 * C].view("<f4")
                tags = rows[i_new, HEADER_BYTES + 4 * C: HEADER_BYTES + 4 * C + TAG_BYTES]
                seen[c_new] = True
                if p == PHASE_GRAD:
                    acc = st.acc
                    nfull = acc.sum.size // C
                    full = c_new < nfull  # (length == C, so all of them; keeps views safe)
                    acc.sum[: nfull * C].reshape(nfull, C)[c_new[full]] += pay[full]
                    acc.count[c_new] += 1
                    if acc.contrib is not None:
                        acc.contrib[s].reshape(-1, C)[c_new] = pay
                    st.gtag[s, c_new] = tags
                else:
                    lo = lay.bounds[s]
                    nfull = lay.shard_len(s) // C
                    st.vals[lo: lo + nfull * C].reshape(nfull, C)[c_new] = pay
                    st.vtag[self._chunk_base[s] + c_new] = tags
                st.got[p, s] += c_new.size
                rx = st.fec.get((p, s))
                if rx is not None:
                    stripes = c_new % rx.geo.S
                    np.add.at(rx.have, stripes, 1)
                    for i in np.unique(stripes).tolist():
                        self._maybe_decode(st, p, s, rx, i)
            if dup and not self._may_copy:
                self.rejected[R["duplicate"]] += dup
            # all of them authenticated data datagrams from s: alive, and arrived
            self._heard[s] = now
            self._ever[s] = True
            self.silent.discard(s)
            self.loss_in.arrived(s, (r, p), len(grp))
            handled[rows_i] = True
        return handled

    def _on_rest(self, rows: np.ndarray, hdr: np.ndarray, reasons: np.ndarray) -> None:
        # plain Python ints once per batch: per-field numpy scalar access is what costs here
        why_l = reasons.tolist()
        snd_l = hdr["sender"].tolist()
        rnd_l = hdr["round"].tolist()
        ph_l = hdr["phase"].tolist()
        fl_l = hdr["flags"].tolist()
        off_l = hdr["offset"].tolist()
        len_l = hdr["length"].tolist()
        hint_l = hdr["hint"].tolist()
        fb_l = hdr["fb"].tolist()
        cp_l = hdr["copies"].tolist()
        C = self.chunk
        bounds = self.layout.bounds
        now = time.perf_counter()
        with self._cond:
            for i, why in enumerate(why_l):
                s = snd_l[i]
                # authenticated: its tag was checked (wire.check tag-checks an ended round's
                # data packets too), so the sender is alive, whatever the round
                if why not in _UNAUTHENTICATED and s < self.world:
                    self._heard[s] = now  # of any round: it is alive
                    self._ever[s] = True
                    if s in self.silent:
                        self.silent.discard(s)  # it speaks again: wait for it again
                if s < self.world and ph_l[i] != PHASE_NORM:
                    if not fl_l[i] & FLAG_END:
                        # an authenticated data datagram from s reached us
                        if why in _ARRIVED or (why == _SPARE and self._same_tag(
                                rows[i], rnd_l[i], ph_l[i], s, off_l[i], len_l[i])):
                            self.loss_in.arrived(s, (rnd_l[i], ph_l[i]))
                    elif why == 0 or why == _OLD:
                        # an authenticated marker (the tag is checked before the round), in
                        # time or not: book its datagrams once (a sender's markers arrive in
                        # round order, so the first copy of a newer round is the one to book)
                        if rnd_l[i] > self._booked[ph_l[i], s]:
                            self._booked[ph_l[i], s] = rnd_l[i]
                            self.loss_in.owe(
                                s, off_l[i] * min(max(cp_l[i], 1), MAX_ANNOUNCED_COPIES)
                                + len_l[i], (rnd_l[i], ph_l[i]))
                            # the feedback too: once per marker, not per copy (the recent
                            # reports' maximum sizes the parity)
                            if fb_l[i] != FB_UNKNOWN:
                                rate = fb_l[i] / FB_SCALE
                                self._vpol.feedback(s, rate)
                                self._gpol.feedback(s, rate)
                if why == 0:
                    why = self._place(rows[i], rnd_l[i], ph_l[i], s, fl_l[i], off_l[i],
                                      len_l[i], hint_l[i], C, bounds)
                elif why == _OLD and rnd_l[i] == self.round - 1:
                    why = _LATE  # the round that just ended: a late packet or a spare copy
                if why:
                    self.rejected[why] += 1
            self._cond.notify_all()

    def _same_tag(self, row: np.ndarray, rnd: int, ph: int, s: int, off: int, n: int) -> bool:
        """Whether a spare copy carries the tag of the copy placed for its chunk this round
        (so it is a copy of an authenticated packet). Called under the lock."""
        st = self._rounds[rnd % ROUNDS_OPEN]
        if st.rnd != rnd or s == self.rank:
            return False  # the round moved on since wire.check: not booked (a harmless miss)
        c = off // self.chunk
        if ph == PHASE_GRAD:
            if c >= st.gtag.shape[1] or not st.acc.seen[s][c]:
                return False
            ref = st.gtag[s, c]
        else:
            if c >= st.vseen[s].size or not st.vseen[s][c]:
                return False
            ref = st.vtag[self._chunk_base[s] + c]
        at = HEADER_BYTES + 4 * n
        return bool(np.array_equal(row[at: at + TAG_BYTES], ref))

    def _placed(self, hdr: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """Which datagrams ``idx`` name a data chunk this rank already placed (read without the
        lock: "seen" only goes from False to True within a round, and a packet misjudged
        during a round change is of an old round, rejected anyway)."""
        out = np.zeros(idx.size, bool)
        if not self._may_copy:
            return out  # no deliberate copies: keep counting replays as duplicates
        h = hdr[idx]
        C, me, world = self.chunk, self.rank, self.world
        for j, (rnd, ph, fl, s, off) in enumerate(zip(
                h["round"].tolist(), h["phase"].tolist(), h["flags"].tolist(),
                h["sender"].tolist(), h["offset"].tolist(), strict=True)):
            st = self._rounds[rnd % ROUNDS_OPEN]
            if fl or st.rnd != rnd or s >= world or s == me:
                continue
            c = off // C
            if ph == PHASE_GRAD:
                seen = st.acc.seen[s]
            elif ph == PHASE_VALUE:
                seen = st.vseen[s]
            else:
                continue
            if c < seen.size and seen[c]:
                out[j] = True
        return out

    def _place(self, row: np.ndarray, rnd: int, ph: int, s: int, flags: int, off: int, n: int,
               hint: int, C: int, bounds: list[int]) -> int:
        st = self._rounds[rnd % ROUNDS_OPEN]
        if st.rnd != rnd:
            return R["old_round"] if rnd < self.round else R["future_round"]
        is_end = flags & FLAG_END
        if st.closed[ph]:
            # a spare copy (end marker, norm, a data chunk already placed) after the phase is
            # harmless; a chunk that had not arrived before the phase ended is late
            if is_end or ph == PHASE_NORM:
                return 0
            if flags & FLAG_PARITY:
                return R["spare"]  # the phase is over: nothing left for it to rebuild
            seen = st.acc.seen[s] if ph == PHASE_GRAD else st.vseen[s]
            return 0 if seen[off // C] else R["late"]
        if is_end:
            st.marker[ph, s] = off
            self.deadline.hear(s, hint / 1e6)
            return 0
        pay = row[HEADER_BYTES: HEADER_BYTES + 4 * n].view("<f4")
        if flags & FLAG_PARITY:
            hdr = row[:HEADER_BYTES].view(HEADER)[0]
            return self._place_parity(st, ph, s, off, int(hdr["fb"]), int(hdr["copies"]), pay)
        if ph == PHASE_NORM:
            if st.got[ph, s]:
                return 0  # one of the deliberate copies
            st.norm[s] = float(pay[0])
        elif ph == PHASE_GRAD:
            if not st.acc.add(s, off, pay):  # never counted twice
                return 0 if self._may_copy else R["duplicate"]
            st.gtag[s, off // C] = row[HEADER_BYTES + 4 * n: HEADER_BYTES + 4 * n + TAG_BYTES]
            self._fec_data_arrived(st, ph, s, off // C)
        else:
            seen = st.vseen[s]
            c = off // C
            if seen[c]:  # an identical copy of values already written: ignore, never harmful
                return 0 if self._may_copy else R["duplicate"]
            seen[c] = True
            lo = bounds[s] + off
            st.vals[lo: lo + n] = pay
            st.vtag[self._chunk_base[s] + c] = row[HEADER_BYTES + 4 * n:
                                                   HEADER_BYTES + 4 * n + TAG_BYTES]
            self._fec_data_arrived(st, ph, s, c)
        st.got[ph, s] += 1
        return 0

    # ---- erasure decoding (receiving thread, under the lock) ------------------------------
    def _seen(self, st: _Round, ph: int, s: int) -> np.ndarray:
        return st.acc.seen[s] if ph == PHASE_GRAD else st.vseen[s]

    def _place_parity(self, st: _Round, ph: int, s: int, q: int, S: int, m: int,
                      pay: np.ndarray) -> int:
        shard = self.rank if ph == PHASE_GRAD else s
        n = self.layout.n_chunks(shard)
        rx = st.fec.get((ph, s))
        if rx is None:
            geo = fec.Stripes(n, S, m)
            if not geo.valid():
                return R["bad_range"]
            seen = self._seen(st, ph, s)
            k = geo.k
            have = np.bincount(np.flatnonzero(seen) % S, minlength=S).astype(np.int64)
            have += np.bincount(np.arange(n, k * S) % S, minlength=S)  # virtual: known zeros
            rx = _FecRx(geo, np.empty((m * S, self.chunk), np.float32),
                        np.zeros(m * S, bool), have, np.zeros(S, bool))
            st.fec[(ph, s)] = rx
        elif (rx.geo.S, rx.geo.m) != (S, m):
            return R["bad_range"]  # one geometry per sender, phase and round
        if rx.pseen[q]:
            return R["duplicate"]
        rx.pseen[q] = True
        rx.par[q] = pay
        i = q % S
        rx.have[i] += 1
        self._maybe_decode(st, ph, s, rx, i)
        return 0

    def _fec_data_arrived(self, st: _Round, ph: int, s: int, c: int) -> None:
        rx = st.fec.get((ph, s))
        if rx is not None:
            i = c % rx.geo.S
            rx.have[i] += 1
            self._maybe_decode(st, ph, s, rx, i)

    def _maybe_decode(self, st: _Round, ph: int, s: int, rx: _FecRx, i: int) -> None:
        """Rebuild stripe i's lost data chunks once k of its packets are in (only stripes
        that lost data are ever decoded)."""
        geo = rx.geo
        k, S, n = geo.k, geo.S, geo.n
        if rx.done[i] or rx.have[i] < k:
            return
        rx.done[i] = True
        seen = self._seen(st, ph, s)
        rows = np.arange(i, n, S)  # the stripe's real data packets (members 0..)
        missing = np.flatnonzero(~seen[rows]).tolist()
        if not missing:
            return
        e = len(missing)
        prow = [j for j in range(geo.m) if rx.pseen[j * S + i]][:e]
        C = self.chunk
        shard = self.rank if ph == PHASE_GRAD else s
        slen = self.layout.shard_len(shard)
        keep = []  # buffers that must stay alive during the native call
        if ph == PHASE_GRAD:
            buf, base = st.acc.contrib[s], 0  # chunk-aligned, zero past the shard's end
        else:
            buf, base = st.vals, self.layout.bounds[s]
        zero = np.zeros(C, np.float32)
        keep.append(zero)
        miss = set(missing)
        src = []
        for j in range(k):
            if j in miss:
                continue
            r = j * S + i
            if r >= n:
                src.append(zero.ctypes.data)
            elif (r + 1) * C > slen and ph != PHASE_GRAD:
                tail = np.zeros(C, np.float32)  # the short last chunk, zero-padded
                tail[: slen - r * C] = buf[base + r * C: base + slen]
                keep.append(tail)
                src.append(tail.ctypes.data)
            else:
                src.append(buf.ctypes.data + 4 * (base + r * C))
        src += [rx.par.ctypes.data + 4 * C * (j * S + i) for j in prow]
        coef = fec.decode_matrix(k, geo.m, missing, prow)
        out = fec.decode(coef, np.array(src, np.uint64), 4 * C).view(np.float32)
        del keep
        for x, j in enumerate(missing):
            r = j * S + i
            length = min(C, slen - r * C)
            vals = out[x, :length]
            if not np.isfinite(vals).all():  # the same rule as for a data packet
                self.rejected[R["nonfinite"]] += 1
                continue
            if ph == PHASE_GRAD:
                st.acc.add(s, r * C, vals)
            else:
                st.vseen[s][r] = True
                st.vals[base + r * C: base + r * C + length] = vals
            st.got[ph, s] += 1
            st.recovered[ph] += 1

    # ---- sending --------------------------------------------------------------------------
    def _rows(self, phase: int, shard: int, values: np.ndarray,
              hint_us: int) -> tuple[np.ndarray, np.ndarray]:
        """Sealed packets carrying ``values`` (shard ``shard``'s elements) for this round."""
        lay = self.layout
        nc = lay.n_chunks(shard)
        key = (phase, shard)
        if key not in self._rows_cache:
            self._rows_cache[key] = (np.zeros((nc, self.slot), np.uint8),
                                     lay.chunk_lengths(shard))
        rows, lengths = self._rows_cache[key]
        if nc == 0:
            return rows, lengths
        h = np.zeros(nc, HEADER)
        h["magic"], h["phase"], h["job"], h["round"] = MAGIC, phase, self.wire.job, self.round
        h["sender"], h["shard"], h["hint"] = self.rank, shard, hint_us
        h["fb"] = FB_UNKNOWN
        h["offset"], h["length"] = lay.chunk_offsets(shard), lengths
        rows[:, :HEADER_BYTES] = h.view(np.uint8).reshape(nc, HEADER_BYTES)
        if self._eng is not None:  # copy and tag row by row, in one pass (native)
            self.wire.seal_rows(rows, lengths, values)
            return rows, lengths
        C = self.chunk
        pay = rows[:, HEADER_BYTES: HEADER_BYTES + 4 * C].view("<f4")
        full = values.size // C
        pay[:full] = values[: full * C].reshape(full, C)
        if full < nc:
            pay[full, : values.size - full * C] = values[full * C:]
        self.wire.seal_rows(rows, lengths)
        return rows, lengths

    def _link_loss(self, dest: int) -> float:
        """The loss rate that ``dest`` reports on our packets to it (the upper estimate of
        ``copies.LossEstimator``, fed back in its markers; the highest of its recent reports,
        since loss is bursty); ``fec_initial_loss`` until then."""
        if len(self._gpol.history[dest]) < FEC_MIN_REPORTS:
            return self.fec_initial_loss
        p = self._gpol.recent_max(dest)
        return self.fec_initial_loss if p is None else p

    def _parity(self, phase: int, shard: int, values: np.ndarray, dests: list[int],
                hint_us: int) -> tuple[list[tuple[np.ndarray, np.ndarray, int]], dict[int, int]]:
        """Parity packets of ``values`` (shard ``shard``'s elements) for each destination, sized
        from that link's loss; destinations with the same geometry share the packets (their
        headers do not name the receiver). Returns (send plan, parity packets per dest)."""
        plan: list[tuple[np.ndarray, np.ndarray, int]] = []
        counts = {d: 0 for d in dests}
        if self.fec_mode != "rs":
            return plan, counts
        n = self.layout.n_chunks(shard)
        run = self.transport.gso_segments
        made: dict[fec.Stripes, tuple[np.ndarray, np.ndarray]] = {}
        for d in dests:
            geo = fec.plan(n, self._link_loss(d), self.fec_target, run)
            if geo is None:
                continue
            if geo not in made:
                made[geo] = self._parity_rows(phase, shard, values, geo, hint_us)
            rows, lengths = made[geo]
            plan.append((rows, lengths, d))
            counts[d] = len(lengths)
        return plan, counts

    def _parity_rows(self, phase: int, shard: int, values: np.ndarray, geo: fec.Stripes,
                     hint_us: int) -> tuple[np.ndarray, np.ndarray]:
        par = fec.encode(values, self.chunk, geo)
        q = par.shape[0]
        rows = np.zeros((q, self.slot), np.uint8)
        lengths = np.full(q, self.chunk, np.int64)
        h = np.zeros(q, HEADER)
        h["magic"], h["phase"], h["flags"] = MAGIC, phase, FLAG_PARITY
        h["job"], h["round"], h["sender"], h["shard"] = self.wire.job, self.round, self.rank, shard
        h["offset"], h["length"], h["hint"] = np.arange(q), self.chunk, hint_us
        h["fb"], h["copies"] = geo.S, geo.m
        rows[:, :HEADER_BYTES] = h.view(np.uint8).reshape(q, HEADER_BYTES)
        rows[:, HEADER_BYTES: HEADER_BYTES + 4 * self.chunk] = par.view(np.uint8)
        self.wire.seal_rows(rows, lengths)
        return rows, lengths

    def _send(self, plan: list[tuple[np.ndarray, np.ndarray, int]]) -> int:
        """Send each (rows, lengths, dest), destinations interleaved so that no receiver gets a
        long burst; the rows are sent in place (no copy). With segmentation offload, runs of
        ``gso_segments`` consecutive rows to one destination go as one message (every row but
        a shard's last is exactly one slot, so a run is one contiguous buffer)."""
        plan = [p for p in plan if len(p[1])]
        if not plan:
            return 0
        g = self.transport.gso_segments
        pos, which, ptrs, sizes, dests, counts = [], [], [], [], [], []
        for j, (rows, lengths, d) in enumerate(plan):
            nc = len(lengths)
            first = np.arange(0, nc, g)
            last = np.minimum(first + g, nc) - 1
            pos.append(np.arange(first.size))
            which.append(np.full(first.size, j))
            ptrs.append(rows.ctypes.data + first.astype(np.uint64) * np.uint64(rows.shape[1]))
            sizes.append((last - first) * self.slot + OVERHEAD + 4 * lengths[last])
            dests.append(np.full(first.size, d))
            counts.append(last - first + 1)
        order = np.lexsort((np.concatenate(which), np.concatenate(pos)))  # by run, then dest
        return self.transport.send_ptrs(np.concatenate(ptrs)[order],
                                        np.concatenate(sizes)[order],
                                        np.concatenate(dests)[order],
                                        keepalive=[r for r, _, _ in plan],
                                        counts=np.concatenate(counts)[order])

    def _send_copies(self, plan: list[tuple[np.ndarray, np.ndarray, int]],
                     policy: CopyPolicy) -> tuple[int, dict[int, int]]:
        """Send the plan, each destination's packets as many times as its policy says (all
        first copies, then all second copies, ...: copies of one packet are spread in time,
        so a burst of loss rarely takes all of them). Returns (sent, copies per destination)."""
        want = {d: policy.copies(d) for _, _, d in plan}
        sent = 0
        for k in range(max(want.values(), default=1)):
            sent += self._send([p for p in plan if want[p[2]] > k])
        return sent, want

    def _send_markers(self, phase: int, counts: dict[int, int], hint_us: int,
                      copies: dict[int, int], parity: dict[int, int] | None = None) -> int:
        pkts = []
        for d, c in counts.items():
            shard = d if phase == PHASE_GRAD else self.rank
            est = self.loss_in.loss(d)  # what we measure on d's packets, fed back to d
            fb = FB_UNKNOWN if est is None else int(round(est * FB_SCALE))
            pkts.append((d, self.wire.packet(phase, self.round, shard, c,
                                             np.zeros(0, np.float32), flags=FLAG_END,
                                             hint=hint_us, fb=fb, copies=copies.get(d, 1),
                                             length=(parity or {}).get(d, 0))))
        if not pkts:
            return 0
        slot = max(len(p) for _, p in pkts)
        rows = np.zeros((len(pkts) * MARKER_COPIES, slot), np.uint8)
        sizes = np.zeros(len(rows), np.int64)
        dests = np.zeros(len(rows), np.int64)
        for c in range(MARKER_COPIES):
            for j, (d, p) in enumerate(pkts):
                i = c * len(pkts) + j
                rows[i, : len(p)] = np.frombuffer(p, np.uint8)
                sizes[i], dests[i] = len(p), d
        return self.transport.send(rows, sizes, dests)

    # ---- phases ---------------------------------------------------------------------------
    def begin_round(self) -> int:
        with self._cond:
            self.round += 1
            r = self.round
            for k in range(ROUNDS_OPEN):  # round r-1 is over: its state becomes r+OPEN-1's
                st = self._rounds[(r + k) % ROUNDS_OPEN]
                if st.rnd != r + k:
                    st.reset(r + k)
                    if self._eng is not None:
                        self._eng.reset_round((r + k) % ROUNDS_OPEN, r + k)
            if self._eng is not None:
                self._eng.set_round(r)
            self._sync()
        return r

    def _expected(self, phase: int) -> dict[int, int]:
        if phase == PHASE_NORM:
            return {s: 1 for s in range(self.world) if s != self.rank}
        if phase == PHASE_GRAD:
            n = self.layout.n_chunks(self.rank)
            return {s: n for s in range(self.world) if s != self.rank}
        return {s: self.layout.n_chunks(s) for s in range(self.world) if s != self.rank}

    def _wait(self, phase: int, t0: float, adapt: bool = True) -> PhaseStats:
        st = self._rounds[self.round % ROUNDS_OPEN]
        exp = self._expected(phase)
        total = sum(exp.values())
        limit = self.deadline.current()
        out = PhaseStats()
        grace_from: float | None = None
        waited_late = False  # waited past the deadline for a peer that had not started
        was_late = False
        base = t0  # when this phase's deadline started to run
        if self._t_first is None:
            self._t_first = t0
        with self._cond:
            while True:
                self._check_handler()
                self._sync()
                now = time.perf_counter()
                live = [s for s in exp if s not in self.silent]
                if not live:
                    # every peer silent: it is THIS rank that is out of step (ahead after the
                    # others lost a deadline to it, or cut off); finishing at once would let it
                    # train alone, rounds ahead, with every packet rejected as out of round.
                    # Wait for them instead: their packets of this round un-silence them.
                    live = list(exp)
                done = [s for s in live if st.got[phase, s] >= exp[s]]
                if len(done) == len(live):
                    break
                ended = all(st.got[phase, s] >= exp[s] or st.marker[phase, s] >= 0
                            for s in live)
                if ended and grace_from is None:
                    grace_from = now
                # a live peer of which nothing of this ROUND has arrived has not started it
                # (loss never takes all of a phase's packets and its 4 marker copies): it is
                # late -- held by its own gloo traffic, eval or checkpoint, where TCP waits
                # out retransmission timeouts under loss -- so wait for it up to the cap, and
                # once it has started, give it the phase's deadline from then on. Ending at
                # the adaptive deadline instead left the early ranks a phase ahead with
                # nothing of it (seen at 10% loss: a rank entered a step 0.6-4.8 s before the
                # others, got 0 of 519 packets, and the run ended 2.2% off); counting that
                # deadline from the phase's start cut off a late peer's packets as soon as
                # its first ones arrived (116 chunks lost). Evidence is per round, not per
                # phase: a peer whose gradients arrived but whose one-float norm was lost
                # (all copies) is not late, and waiting a cap for it stalled everyone 5 s.
                late = any(not st.got[:, s].any() and (st.marker[:, s] < 0).all()
                           for s in live)
                if was_late and not late:
                    base = now  # the late peer has started: its deadline runs from here
                was_late = late
                wake = t0 + self.deadline.cap if late else base + limit
                waited_late |= late and now >= t0 + limit
                if grace_from is not None:
                    wake = min(wake, grace_from + self.deadline.grace(grace_from - base))
                if now >= wake:
                    out.deadline_hit = now >= base + limit or late
                    break
                if self._eng is not None:  # wake only when something the loop reads changes
                    self._eng.watch(self.round, phase,
                                    [exp.get(s, -1) for s in range(self.world)],
                                    [s in self.silent for s in range(self.world)])
                self._cond.wait(timeout=wake - now)
            st.closed[phase] = True
            if self._eng is not None:
                self._eng.close_phase(self.round % ROUNDS_OPEN, phase)
            out.elapsed = time.perf_counter() - t0
            recv = int(st.got[phase].sum())
            out.recv = recv
            out.lost = total - recv
            if out.deadline_hit:
                for s in exp:
                    # silent = nothing authenticated from it, of ANY round, for a whole
                    # deadline cap. A peer that is merely stalled (a TCP retransmission in
                    # the job's eval or checkpoint traffic holds a rank 0.2-1 s under loss)
                    # or a round out of step is not dead: giving up on it after one short
                    # deadline let the others run rounds ahead, beyond the rounds it buffers,
                    # and the two groups never met again (seen at 10% loss: two pairs of
                    # ranks, 13% of chunks lost for the rest of the run). A dead peer costs
                    # at most one cap of deadlines, then is not waited for.
                    quiet = time.perf_counter() - self._heard[s]
                    if (st.got[phase, s] == 0 and st.marker[phase, s] < 0
                            and quiet >= self.deadline.cap):
                        self.silent.add(s)
                        self._silenced_at[s] = time.perf_counter()
                out.silent = sorted(self.silent)
        completion = recv / total if total else 1.0
        # (a wait for a late peer measures its lateness, not the network: not a sample)
        if adapt and not waited_late and (not out.deadline_hit or completion > 0):
            self.deadline.observe(self.rank, out.elapsed, completion)
        self._check_silence()
        return out

    def _check_silence(self) -> None:
        """Raise ``PeerLost`` for a peer silent for ``give_up_s``. A silent peer costs no wait
        once marked, so without this bound a dead owner's shard would freeze for the rest of the
        run (or, with every peer silent, each phase would wait a deadline forever) and a rank
        that never hears anyone -- a bind address its peers cannot reach -- would train on its
        own gradient."""
        assert self._t_first is not None
        now = time.perf_counter()
        for s in sorted(self.silent):
            quiet = now - max(self._heard[s], self._t_first)
            if quiet < self.give_up_s:
                continue
            me = f"{self.transport.addr[0]}:{self.transport.addr[1]}"
            if not self._ever[s]:
                peer = self.transport.peers[s]
                raise PeerLost(
                    f"stalwart.comm: rank {self.rank} (bound to {me}) never received a packet "
                    f"from rank {s} (at {peer[0]}:{peer[1]}) in {quiet:.0f} s: UDP between them "
                    f"is blocked or an address is wrong (set STALWART_HOST_ADDR to an address "
                    f"the other hosts can reach)")
            raise PeerLost(
                f"stalwart.comm: rank {s} sent nothing to rank {self.rank} for {quiet:.0f} s "
                f"(give_up_s={self.give_up_s:g}): it died or its path is cut; stopping instead "
                f"of training without it")

    def reduce_scatter(self, flat: np.ndarray) -> tuple[np.ndarray, PhaseStats]:
        """Phase 1 of the current round: returns this rank's shard, averaged per chunk over the
        contributions that arrived (its own always)."""
        flat = np.ascontiguousarray(flat, dtype=np.float32)
        t0 = time.perf_counter()
        st = self._rounds[self.round % ROUNDS_OPEN]
        with self._cond:
            st.acc.add_own(flat[self._lo: self._hi])
        hint = int(self.deadline.proposals.get(self.rank, self.deadline.current()) * 1e6)
        b = self.layout.bounds
        plan = []
        counts = {}
        for k in range(1, self.world):  # start at the next rank: owners see spread-out load
            d = (self.rank + k) % self.world
            rows, lengths = self._rows(PHASE_GRAD, d, flat[b[d]: b[d + 1]], hint)
            plan.append((rows, lengths, d))
            counts[d] = len(lengths)
        sent, want = self._send_copies(plan, self._gpol)
        # parity after all the data: a receiver decodes a stripe once k of its packets are in
        par_plan: list[tuple[np.ndarray, np.ndarray, int]] = []
        npar: dict[int, int] = {}
        for k in range(1, self.world):
            d = (self.rank + k) % self.world
            pp, cnt = self._parity(PHASE_GRAD, d, flat[b[d]: b[d + 1]], [d], hint)
            par_plan += pp
            npar.update(cnt)
        sent += self._send(par_plan)
        sent += self._send_markers(PHASE_GRAD, counts, hint, want, npar)
        out = self._wait(PHASE_GRAD, t0)
        out.sent, out.copies = sent, max(want.values(), default=1)
        out.parity, out.recovered = sum(npar.values()), int(st.recovered[PHASE_GRAD])
        return st.acc.average(), out

    def broadcast(self, shard_values: np.ndarray, out: np.ndarray,
                  stale: np.ndarray | None = None) -> tuple[np.ndarray, PhaseStats]:
        """Phase 2: send this rank's shard values to all; write the owners' chunks that arrived
        into ``out`` (the full vector; this rank's own shard is always written; where nothing
        arrived ``out`` keeps its values, or takes ``stale``'s when given). Returns a
        per-element mask of what was written and the phase statistics."""
        t0 = time.perf_counter()
        shard_values = np.ascontiguousarray(shard_values, dtype=np.float32)
        hint = int(self.deadline.proposals.get(self.rank, self.deadline.current()) * 1e6)
        rows, lengths = self._rows(PHASE_VALUE, self.rank, shard_values, hint)
        peers = [(self.rank + k) % self.world for k in range(1, self.world)]
        sent, want = self._send_copies([(rows, lengths, d) for d in peers], self._vpol)
        par_plan, npar = self._parity(PHASE_VALUE, self.rank, shard_values, peers, hint)
        sent += self._send(par_plan)
        sent += self._send_markers(PHASE_VALUE, {d: len(lengths) for d in peers}, hint, want,
                                   npar)
        ps = self._wait(PHASE_VALUE, t0)
        ps.sent, ps.copies = sent, max(want.values(), default=1)
        st = self._rounds[self.round % ROUNDS_OPEN]
        ps.parity, ps.recovered = sum(npar.values()), int(st.recovered[PHASE_VALUE])
        return self._landed(st, shard_values, out, stale), ps

    def _landed(self, st: _Round, shard_values: np.ndarray, out: np.ndarray,
                stale: np.ndarray | None) -> np.ndarray:
        """Write the owners' chunks that arrived into ``out`` (``stale``'s values elsewhere, when
        given) and this rank's shard; returns the per-element mask of what arrived. A shard
        that arrived whole -- the common case -- is one copy, not a masked one."""
        mask = np.empty(self.layout.numel, bool)
        b = self.layout.bounds
        for s in range(self.world):
            lo, hi = b[s], b[s + 1]
            if s == self.rank:
                out[lo:hi] = shard_values
                mask[lo:hi] = True
            elif st.vseen[s].all():
                out[lo:hi] = st.vals[lo:hi]
                mask[lo:hi] = True
            else:
                m = self.layout.expand(s, st.vseen[s])
                mask[lo:hi] = m
                if stale is not None:
                    out[lo:hi] = stale[lo:hi]
                np.copyto(out[lo:hi], st.vals[lo:hi], where=m)
        return mask

    def global_norm_sq(self, own_sq: float) -> tuple[float, PhaseStats]:
        """Sum over owners of their averaged shards' squared norms (for global clipping).

        Every owner sends its value to every rank (``NORM_COPIES`` copies: a one-float packet
        is cheap to repeat). A value still missing at the deadline is estimated from the
        others' mean per element times that shard's size.
        """
        t0 = time.perf_counter()
        pkt = self.wire.packet(PHASE_NORM, self.round, self.rank, 0,
                               np.array([own_sq], np.float32))
        peers = [d for d in range(self.world) if d != self.rank]
        rows = np.zeros((len(peers) * NORM_COPIES, len(pkt)), np.uint8)
        rows[:] = np.frombuffer(pkt, np.uint8)
        sent = self.transport.send(rows, np.full(len(rows), len(pkt)),
                                   np.array(peers * NORM_COPIES))
        ps = self._wait(PHASE_NORM, t0, adapt=False)
        ps.sent = sent
        st = self._rounds[self.round % ROUNDS_OPEN]
        lens = np.array(self.layout.shard_lens, np.float64)
        have = st.got[PHASE_NORM] > 0
        have[self.rank] = True
        vals = st.norm.copy()
        vals[self.rank] = own_sq
        if not have.all():
            per_elem = vals[have].sum() / max(lens[have].sum(), 1.0)
            vals[~have] = per_elem * lens[~have]
        return float(vals.sum()), ps

    def allreduce(self, flat: np.ndarray, out: np.ndarray | None = None) -> tuple[
            np.ndarray, list[PhaseStats]]:
        """Average ``flat`` across ranks (reduce-scatter + broadcast of the averaged shards).
        Chunks whose broadcast was lost keep ``out``'s previous values (``flat``'s if None)."""
        self.begin_round()
        avg, p1 = self.reduce_scatter(flat)
        if out is None:  # chunks that do not arrive keep flat's values
            out = np.empty(self.layout.numel, np.float32)
            _, p2 = self.broadcast(avg, out, stale=np.asarray(flat, np.float32))
        else:
            _, p2 = self.broadcast(avg, out)
        return out, [p1, p2]

    def worst_loss_in(self) -> float:
        """The highest loss rate measured on this rank's incoming links (0 if none yet)."""
        est = [self.loss_in.loss(s) for s in range(self.world) if s != self.rank]
        return max((x for x in est if x is not None), default=0.0)

    def bad_packets(self) -> int:
        """Rejected packets except late ones (authentic, merely after their phase ended --
        already counted as lost by the phase, or spare copies)."""
        return int(self.rejected.sum() - self.rejected[_LATE] - self.rejected[R["spare"]])

    def rejected_counts(self) -> dict[str, int]:
        return {REASONS[i]: int(v) for i, v in enumerate(self.rejected) if i and v}

    def close(self) -> None:
        if self._eng is not None:
            self._eng.stop()  # before the socket closes: the engine reads its descriptor
        self.transport.close()


class _NativeCond:
    """The native engine's mutex and condition variable, used like ``threading.Condition``."""

    def __init__(self, eng) -> None:
        self._eng = eng

    def __enter__(self) -> _NativeCond:
        self._eng.lock()
        return self

    def __exit__(self, *exc: object) -> None:
        self._eng.unlock()

    def wait(self, timeout: float) -> bool:
        return self._eng.wait(timeout)

    def notify_all(self) -> None:
        self._eng.notify()


class _DistExchange:
    """Setup-time exchange over torch.distributed (reliable; used once, before training)."""

    def __init__(self, group) -> None:
        self.group = group

    def broadcast_from_0(self, obj):
        import torch.distributed as dist

        box = [obj]
        # src is a GLOBAL rank: the group's rank 0 (global rank 0 may not be in the group)
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def all_gather(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)
