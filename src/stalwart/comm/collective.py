"""Loss-tolerant reduce-scatter and owner broadcast over the UDP transport.

The collective is thin: ``sending`` makes and sends a phase's packets, ``receiving`` checks and
places what arrives (the Python engine, or the native data plane: ``native``), ``rounds`` holds
a round's buffers, ``phase`` decides when a phase ends and which peers are silent or lost.

Mechanism: the two phases of "Distributed Training under Packet Loss" (Weintraub et al., 2025):
  1. reduce-scatter -- every rank sends chunk k of shard s of its vector to shard s's owner;
     the owner averages per chunk over the contributions that arrived, its own included
     (``aggregate.ShardAccumulator``: unbiased);
  2. broadcast -- every owner sends its shard's values (updated parameters, or averaged
     gradients in the naive variant / the all-reduce benchmark) to every rank; a rank that
     misses a chunk keeps whatever it had there (its stale copy).
Each phase ends at the first of: all expected packets arrived; every live sender's end-of-phase
marker arrived + grace; the agreed adaptive deadline (``deadline.AdaptiveDeadline``). There are
no retransmissions, so a phase lasts at most its own send plus the cap whatever the network does.

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

import numpy as np

from stalwart.comm import native
from stalwart.comm.copies import CopyPolicy, LossEstimator
from stalwart.comm.deadline import AdaptiveDeadline
from stalwart.comm.layout import Layout

# re-exported: the collective's public names (tests, ddp.py and users import them from here)
from stalwart.comm.phase import GIVE_UP_S, Interrupted, PeerLost, Phases  # noqa: F401
from stalwart.comm.receiving import (  # noqa: F401
    MAX_HANDLER_ERRORS,
    ReceiveFailed,
    Receiving,
    _NativeCond,
)
from stalwart.comm.rounds import ROUNDS_OPEN, PhaseStats, RoundState
from stalwart.comm.sending import FEC_MIN_REPORTS, MARKER_COPIES, Sending  # noqa: F401
from stalwart.comm.transport import UdpTransport, default_host, default_mtu, is_loopback
from stalwart.comm.wire import (
    OVERHEAD,
    PHASE_GRAD,
    PHASE_NORM,
    PHASE_VALUE,
    REASONS,
    R,
    Wire,
    max_floats_for_mtu,
)

# a norm is the whole phase (one float per owner), and a lost one holds its receiver a full
# deadline while the others go on to the broadcast without it: 1e-8 at 10% loss
NORM_COPIES = 8
# protection of a link not measured yet (the first step): parity sized for this loss rate.
# Early training is the most sensitive to lost chunks (docs/comm.md), and the benchmark's
# worst case is 20% loss
FEC_INITIAL_LOSS = 0.2
FEC_MODES = ("copies", "rs", "none")


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


class LossyCollective(Receiving, Sending, Phases):
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
        # (without the extension rank 0 says so in one line; the others stay quiet)
        self.engine = native.engine_name(engine, warn=self.rank == 0)
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
        self.interrupted: str | None = None  # why: every wait for packets raises Interrupted
        # perf_counter of each peer's latest packet (start: now, so a peer that never speaks
        # is given up on after one cap like any other)
        self._heard = np.full(self.world, time.perf_counter())
        self._ever = np.zeros(self.world, bool)  # any authenticated packet from it, ever
        self._t_first: float | None = None  # when the first phase started
        self._booked = np.full((3, self.world), -1, np.int64)  # last marker round booked
        self.rejected = np.zeros(len(REASONS), np.int64)
        self._lock = threading.Lock()
        self._cond: threading.Condition | _NativeCond = threading.Condition(self._lock)
        self._rows_cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._eng = None
        self._silenced_at = np.zeros(self.world)
        if self.engine == "native":
            self._start_native()
        else:
            self.transport.on_error = self._wake
            self.transport.start(self._on_batch)
        ex.barrier()  # every socket is bound and draining before anyone sends


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

    def reduce_scatter(self, flat: np.ndarray, avg_out: np.ndarray | None = None
                       ) -> tuple[np.ndarray, PhaseStats]:
        """Phase 1 of the current round: returns this rank's shard, averaged per chunk over the
        contributions that arrived (its own always) -- written into ``avg_out`` when given
        (it may be ``flat``'s own shard: everything of ``flat`` is sent by then)."""
        flat = np.ascontiguousarray(flat, dtype=np.float32)
        t0 = time.perf_counter()
        st = self._rounds[self.round % ROUNDS_OPEN]
        own = flat[self._lo: self._hi]
        st.acc.add_own(own)  # (a reference: averaged in at the end, not summed now)
        hint = int(self.deadline.proposals.get(self.rank, self.deadline.current()) * 1e6)
        b = self.layout.bounds
        plan = []
        counts = {}
        # native: the rows are filled and sealed as they are sent (receivers start earlier)
        lazy = self._eng is not None
        fill: dict[int, np.ndarray] = {}
        for k in range(1, self.world):  # start at the next rank: owners see spread-out load
            d = (self.rank + k) % self.world
            rows, lengths = self._rows(PHASE_GRAD, d, flat[b[d]: b[d + 1]], hint, seal=not lazy)
            if lazy:
                fill[id(rows)] = flat[b[d]: b[d + 1]]
            plan.append((rows, lengths, d))
            counts[d] = len(lengths)
        acc = self._accumulators([(r, d, d) for r, _, d in plan]) if lazy else {}
        sent, want = self._send_copies(plan, self._gpol, fill, acc)
        # parity after all the data: a receiver decodes a stripe once k of its packets are in
        par_plan: list[tuple[np.ndarray, np.ndarray, int]] = []
        npar: dict[int, int] = {}
        for k in range(1, self.world):
            d = (self.rank + k) % self.world
            pp, cnt = self._parity(PHASE_GRAD, d, flat[b[d]: b[d + 1]], [d], hint,
                                   acc.get(id(self._rows_cache[(PHASE_GRAD, d)][0])))
            par_plan += pp
            npar.update(cnt)
        sent += self._send(par_plan)
        sent += self._send_markers(PHASE_GRAD, counts, hint, want, npar)
        out = self._wait(PHASE_GRAD, t0)
        out.sent, out.copies = sent, max(want.values(), default=1)
        out.parity, out.recovered = sum(npar.values()), int(st.recovered[PHASE_GRAD])
        if self._eng is None:
            return st.acc.average(out=avg_out), out
        # native: the same average in one pass in C (the phase is closed: nothing writes the
        # sum now), without the GIL
        if avg_out is None:
            avg_out = np.empty(own.size, np.float32)
        self._eng.average(self.round % ROUNDS_OPEN, self.round, own, avg_out)
        return avg_out, out

    def broadcast(self, shard_values: np.ndarray, out: np.ndarray,
                  stale: np.ndarray | None = None, want_mask: bool = True,
                  direct: bool = False, bound: bool = False
                  ) -> tuple[np.ndarray | None, PhaseStats]:
        """Phase 2: send this rank's shard values to all; write the owners' chunks that arrived
        into ``out`` (the full vector; this rank's own shard is always written; where nothing
        arrived ``out`` keeps its values, or takes ``stale``'s when given). Returns a
        per-element mask of what was written (None unless ``want_mask``: one byte per element
        to fill) and the phase statistics.

        ``direct`` (used by the native engine only, and only without ``stale``): the owners'
        chunks are placed in ``out`` by the receive thread as they arrive, instead of into the
        round's buffer and copied over after the phase (one pass over the vector less). The
        result is the same; the difference is when ``out`` changes: during the phase, so a
        call that raises may leave some owners' chunks in ``out``. ``bound``: the caller has
        bound ``out`` already (``_bind_values``) and unbinds it."""
        t0 = time.perf_counter()
        shard_values = np.ascontiguousarray(shard_values, dtype=np.float32)
        slot = self.round % ROUNDS_OPEN
        # native, no stale values to put first: the owners' chunks land in ``out`` itself as
        # they arrive (no copy-out after the phase); this rank's reduce-scatter is sent by
        # now, so nothing reads the other shards of ``out`` until the call returns
        mine = not bound and direct and stale is None and self._bind_values(out)
        direct = bound or mine
        try:
            hint = int(self.deadline.proposals.get(self.rank, self.deadline.current()) * 1e6)
            lazy = self._eng is not None  # (as in reduce_scatter)
            rows, lengths = self._rows(PHASE_VALUE, self.rank, shard_values, hint,
                                       seal=not lazy)
            peers = [(self.rank + k) % self.world for k in range(1, self.world)]
            acc = self._accumulators([(rows, self.rank, peers[0])]) if lazy and peers else {}
            sent, want = self._send_copies([(rows, lengths, d) for d in peers], self._vpol,
                                           {id(rows): shard_values} if lazy else None, acc)
            par_plan, npar = self._parity(PHASE_VALUE, self.rank, shard_values, peers, hint,
                                          acc.get(id(rows)))
            sent += self._send(par_plan)
            sent += self._send_markers(PHASE_VALUE, {d: len(lengths) for d in peers}, hint,
                                       want, npar)
            ps = self._wait(PHASE_VALUE, t0)
        finally:
            if mine:  # the phase is closed (or failed): nothing more lands in out
                self._unbind_values()
        ps.sent, ps.copies = sent, max(want.values(), default=1)
        st = self._rounds[slot]
        ps.parity, ps.recovered = sum(npar.values()), int(st.recovered[PHASE_VALUE])
        return self._landed(st, shard_values, out, stale, want_mask, direct), ps

    def _landed(self, st: RoundState, shard_values: np.ndarray, out: np.ndarray,
                stale: np.ndarray | None, want_mask: bool = True, direct: bool = False
                ) -> np.ndarray | None:
        """Write the owners' chunks that arrived into ``out`` (``stale``'s values elsewhere, when
        given) and this rank's shard (unless it is already there: ``reduce_scatter`` averaged
        into it); returns the per-element mask of what arrived (None unless ``want_mask``). A
        shard that arrived whole -- the common case -- is one copy, not a masked one; with
        ``direct`` (the engine placed them in ``out`` itself) the owners' chunks are not
        copied at all."""
        mask = np.empty(self.layout.numel, bool) if want_mask else None
        b = self.layout.bounds
        for s in range(self.world):
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
                m = self.layout.expand(s, st.vseen[s])
                if mask is not None:
                    mask[lo:hi] = m
                if direct:
                    continue
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
        Chunks whose broadcast was lost keep ``out``'s previous values (``flat``'s if None).
        With ``out`` the owners' chunks land in it as they arrive (``broadcast(direct=True)``);
        if the call raises, ``out`` holds a part of the result."""
        self.begin_round()
        if out is None:  # chunks that do not arrive keep flat's values
            avg, p1 = self.reduce_scatter(flat)
            out = np.empty(self.layout.numel, np.float32)
            _, p2 = self.broadcast(avg, out, stale=np.asarray(flat, np.float32),
                                   want_mask=False)
        else:  # the average goes straight into out's own shard (no buffer, no copy)
            # native: out is bound from the round's start, so that owners' values arriving
            # before this rank's broadcast also land there (not copied over at a later binding)
            bound = self._bind_values(out)
            try:
                avg, p1 = self.reduce_scatter(flat, avg_out=out[self._lo: self._hi])
                _, p2 = self.broadcast(avg, out, want_mask=False, direct=True, bound=bound)
            finally:
                if bound:
                    self._unbind_values()
        return out, [p1, p2]

    def _bind_values(self, out: np.ndarray) -> bool:
        """Native engine: the current round's broadcast values land in ``out`` (a writable
        C-contiguous float32 vector of every element) from now on, as they arrive; the chunks
        already in the round's buffer are copied over now. False (nothing bound) with the
        Python engine or another ``out``. Safe from the round's start even when ``out`` is the
        vector being reduce-scattered: an owner broadcasts its shard only after it closed its
        reduce-scatter phase -- with all of this rank's packets for it in (or rebuilt from its
        parity), which are handed to the kernel before anything that follows them, or once it
        stopped waiting for this rank (deadline, silence), when whatever this rank still sends
        it is rejected as late -- so no value
        lands in a shard this rank still reads for a packet that counts; its own shard is never
        written."""
        if (self._eng is None or out.dtype != np.float32 or not out.flags.c_contiguous
                or not out.flags.writeable or out.size != self.layout.numel):
            return False
        with self._cond:
            self._eng.values_into(self.round % ROUNDS_OPEN, self.round, out)
        return True

    def _unbind_values(self) -> None:
        """End ``_bind_values``'s binding: nothing more lands in ``out``."""
        with self._cond:
            self._eng.values_into(self.round % ROUNDS_OPEN, self.round, None)

    def worst_loss_in(self) -> float:
        """The highest loss rate measured on this rank's incoming links (0 if none yet)."""
        est = [self.loss_in.loss(s) for s in range(self.world) if s != self.rank]
        return max((x for x in est if x is not None), default=0.0)

    def bad_packets(self) -> int:
        """Rejected packets except late ones (authentic, merely after their phase ended --
        already counted as lost by the phase, or spare copies)."""
        return int(self.rejected.sum() - self.rejected[R["late"]] - self.rejected[R["spare"]])

    def rejected_counts(self) -> dict[str, int]:
        return {REASONS[i]: int(v) for i, v in enumerate(self.rejected) if i and v}

    def interrupt(self, why: str) -> None:
        """From any thread: the phase this rank waits in (or its next one) raises
        ``Interrupted`` -- the job knows a peer is gone (its membership changed), so waiting
        for the peer's packets up to a deadline cap would only delay the regroup. Sticky:
        the collective is not used again."""
        self.interrupted = why
        self._wake()

    def close(self) -> None:
        if self._eng is not None:
            self._eng.stop()  # before the socket closes: the engine reads its descriptor
        self.transport.close()



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
