"""Loss-tolerant reduce-scatter and owner broadcast over the UDP transport.

The collective wires parts that own their state: ``rounds.RoundRing`` (the open rounds'
buffers and the round number), ``receiving.Receiver`` (checks and places what arrives: the
Python engine, or the native data plane, ``native``), ``sending.Sender`` (a phase's packets,
parity and markers), ``phase.PhaseWait`` (when a phase ends: ``PhaseClock``'s explicit states),
``liveness.Liveness`` (which peers are silent or lost) and ``exchange`` (setup). It owns only
the public calls: each phase is "send, wait, read the round's buffers".

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

Setup (``exchange``) goes through torch.distributed once; rounds advance in lockstep (every
rank calls ``begin_round()`` once per step: ``rounds.RoundRing``); a dead peer costs at most a
deadline cap of waiting, and one silent for ``give_up_s`` raises ``PeerLost``
(``liveness``).
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np

from stalwart.comm import native
from stalwart.comm.copies import CopyPolicy, LossEstimator
from stalwart.comm.deadline import AdaptiveDeadline
from stalwart.comm.exchange import DistExchange, check_addresses  # noqa: F401 (re-exported)
from stalwart.comm.layout import Layout
from stalwart.comm.liveness import GIVE_UP_S, Liveness, PeerLost  # noqa: F401 (re-exported)
from stalwart.comm.phase import Interrupted, PhaseWait  # noqa: F401 (re-exported)
from stalwart.comm.receiving import (  # noqa: F401 (re-exported)
    MAX_HANDLER_ERRORS,
    ReceiveFailed,
    Receiver,
    start_native,
)
from stalwart.comm.rounds import ROUNDS_OPEN, PhaseStats, RoundRing
from stalwart.comm.sending import FEC_MIN_REPORTS, MARKER_COPIES, NORM_COPIES, Sender  # noqa: F401
from stalwart.comm.transport import UdpTransport, default_host, default_mtu
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

# protection of a link not measured yet (the first step): parity sized for this loss rate.
# Early training is the most sensitive to lost chunks (docs/comm.md), and the benchmark's
# worst case is 20% loss
FEC_INITIAL_LOSS = 0.2
FEC_MODES = ("copies", "rs", "none")


class LossyCollective:
    """Reduce-scatter + broadcast of a flat float32 vector of ``numel`` elements over UDP.

    Protection: ``fec_mode`` "rs" (Reed-Solomon parity per link, sized for ``fec_target``
    from the loss the link reports, ``fec_initial_loss`` until then), "copies" (every chunk
    sent ``value_copies`` / ``grad_copies`` times; with ``copies_target`` those are where
    each link starts and it then gets the fewest copies, ``min_copies`` .. ``max_copies``,
    that bring its measured loss to the target: ``copies.CopyPolicy``) or "none". A missed
    parameter chunk makes a replica compute its next gradient at a stale point, while copies
    and parity cost only bandwidth.

    Guarantees: every phase returns within this rank's own send plus one deadline cap, with
    what arrived (unbiased per-chunk averages; missing broadcast chunks keep their stale
    values) or raises (``PeerLost``, ``Interrupted``, ``ReceiveFailed``); nothing is
    retransmitted. Cost: ``ROUNDS_OPEN`` round buffers (``rounds``), one socket and one
    receive thread (the transport's, or the native engine's), per phase one pass to seal
    the values and one wait.
    """

    def __init__(self, numel: int, *, group=None, host: str | None = None,
                 mtu: int | None = None, deadline: AdaptiveDeadline | None = None,
                 pace_bytes_per_s: float = 0.0, key: bytes | None = None,
                 world: int | None = None, rank: int | None = None,
                 exchange=None, value_copies: int = 1, grad_copies: int = 1,
                 copies_target: float | None = None, max_copies: int = 3,
                 min_copies: int = 1, give_up_s: float = GIVE_UP_S, fec_mode: str = "copies",
                 fec_target: float = 2e-5,
                 fec_initial_loss: float = FEC_INITIAL_LOSS, engine: str | None = None) -> None:
        if fec_mode not in FEC_MODES:
            raise ValueError(f"unknown fec mode {fec_mode!r} ({', '.join(FEC_MODES)})")
        if fec_mode != "copies":
            value_copies, grad_copies, copies_target = 1, 1, None
        vc, gc = max(1, int(value_copies)), max(1, int(grad_copies))
        may_copy = copies_target is not None or vc > 1 or gc > 1
        ex = exchange or DistExchange(group)
        if world is None:
            world, rank = DistExchange(group).world_rank()
        self.world, self.rank = int(world), int(rank)
        # (without the extension rank 0 says so in one line; the others stay quiet)
        self.engine = native.engine_name(engine, warn=self.rank == 0)
        policies = (CopyPolicy(self.world, vc, copies_target, max_copies, min_copies),
                    CopyPolicy(self.world, gc, copies_target, max_copies, min_copies))
        self.loss_in = LossEstimator(self.world)
        self.chunk = max_floats_for_mtu(mtu or default_mtu())
        self.layout = lay = Layout(int(numel), self.world, self.chunk)
        self.slot = OVERHEAD + 4 * self.chunk
        # secret + job id from rank 0; addresses from everyone
        secret, job = ex.broadcast_from_0((key if key is not None else os.urandom(32),
                                           int.from_bytes(os.urandom(4), "little")))
        self.transport = t = UdpTransport(host or default_host(), self.slot,
                                          pace_bytes_per_s=pace_bytes_per_s)
        peers = ex.all_gather((t.addr, socket.gethostname()))
        addrs = [(str(a[0]), int(a[1])) for a, _ in peers]
        try:
            check_addresses(addrs, [str(h) for _, h in peers])
        except RuntimeError:
            t.close()
            raise
        t.set_peers(addrs)
        self.wire = Wire(secret, job, self.world, self.rank, lay.shard_lens, self.chunk,
                         rounds_open=ROUNDS_OPEN)
        self.deadline = deadline or AdaptiveDeadline()
        self.ring = RoundRing(lay, self.rank, keep=fec_mode == "rs")
        self.live = Liveness(self.world, self.rank, t, give_up_s)
        self.receiver = Receiver(self.wire, lay, self.ring, self.live, self.loss_in, policies,
                                 self.deadline, t, may_copy,
                                 np.zeros(len(REASONS), np.int64))
        self._eng = start_native(self.receiver, self.ring, self.live) \
            if self.engine == "native" else None
        self.sender = Sender(self.wire, lay, self.ring, t, policies, self.loss_in,
                             self.deadline, fec_mode, fec_target, fec_initial_loss, self._eng)
        self.waiter = PhaseWait(lay, self.rank, self.ring, self.receiver, self.live,
                                self.deadline, self.receiver.cond, self._eng)
        self._lo, self._hi = lay.bounds[self.rank], lay.bounds[self.rank + 1]
        if self._eng is None:
            t.on_error = self.waiter.wake
            t.start(self._on_batch)
        ex.barrier()  # every socket is bound and draining before anyone sends

    def _on_batch(self, rows: np.ndarray, sizes: np.ndarray, src_ok: np.ndarray) -> None:
        """The Python engine's receive hook (the transport's thread): the receiver's."""
        self.receiver.on_batch(rows, sizes, src_ok)

    @property
    def round(self) -> int:
        return self.ring.round

    @property
    def silent(self) -> set[int]:
        return self.live.silent

    @property
    def rejected(self) -> np.ndarray:
        return self.receiver.rejected

    def begin_round(self) -> int:
        with self.receiver.cond:
            r = self.ring.begin()
            self.receiver.sync()
        return r

    def reduce_scatter(self, flat: np.ndarray, avg_out: np.ndarray | None = None
                       ) -> tuple[np.ndarray, PhaseStats]:
        """Phase 1 of the current round: returns this rank's shard, averaged per chunk over the
        contributions that arrived (its own always) -- written into ``avg_out`` when given
        (it may be ``flat``'s own shard: everything of ``flat`` is sent by then)."""
        flat = np.ascontiguousarray(flat, dtype=np.float32)
        t0 = time.perf_counter()
        st = self.ring.current
        own = flat[self._lo: self._hi]
        st.acc.add_own(own)  # (a reference: averaged in at the end, not summed now)
        sent, want, npar = self.sender.send_grad(flat)
        out = self._closed(PHASE_GRAD, t0, sent, want, npar)
        if self._eng is None:
            return st.acc.average(out=avg_out), out
        # native: the same average in one pass in C (the phase is closed: nothing writes the
        # sum now), without the GIL
        if avg_out is None:
            avg_out = np.empty(own.size, np.float32)
        self._eng.average(self.ring.slot, self.ring.round, own, avg_out)
        return avg_out, out

    def _closed(self, phase: int, t0: float, sent: int, want: dict[int, int],
                npar: dict[int, int]) -> PhaseStats:
        """Wait for ``phase`` to end; its statistics with what this rank sent."""
        ps = self.waiter.wait(phase, t0)
        ps.sent, ps.copies = sent, max(want.values(), default=1)
        ps.parity, ps.recovered = sum(npar.values()), int(self.ring.current.recovered[phase])
        return ps

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
        bound ``out`` already (``Receiver.bind_values``) and unbinds it."""
        t0 = time.perf_counter()
        shard_values = np.ascontiguousarray(shard_values, dtype=np.float32)
        # native, no stale values to put first: the owners' chunks land in ``out`` itself as
        # they arrive (no copy-out after the phase); this rank's reduce-scatter is sent by
        # now, so nothing reads the other shards of ``out`` until the call returns
        mine = not bound and direct and stale is None and self.receiver.bind_values(out)
        try:
            sent, want, npar = self.sender.send_values(shard_values)
            ps = self._closed(PHASE_VALUE, t0, sent, want, npar)
        finally:
            if mine:  # the phase is closed (or failed): nothing more lands in out
                self.receiver.unbind_values()
        return self.ring.landed(self.ring.current, shard_values, out, stale, want_mask,
                                bound or mine), ps

    def global_norm_sq(self, own_sq: float) -> tuple[float, PhaseStats]:
        """Sum over owners of their averaged shards' squared norms (for global clipping).

        Every owner sends its value to every rank (``NORM_COPIES`` copies). A value still
        missing at the deadline is estimated from the others' mean per element times that
        shard's size.
        """
        t0 = time.perf_counter()
        sent = self.sender.send_norm(own_sq)
        ps = self.waiter.wait(PHASE_NORM, t0, adapt=False)
        ps.sent = sent
        return self.ring.norm_total(own_sq), ps

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
            bound = self.receiver.bind_values(out)
            try:
                avg, p1 = self.reduce_scatter(flat, avg_out=out[self._lo: self._hi])
                _, p2 = self.broadcast(avg, out, want_mask=False, direct=True, bound=bound)
            finally:
                if bound:
                    self.receiver.unbind_values()
        return out, [p1, p2]

    def worst_loss_in(self) -> float:
        """The highest loss rate measured on this rank's incoming links (0 if none yet)."""
        est = [self.loss_in.loss(s) for s in range(self.world) if s != self.rank]
        return max((x for x in est if x is not None), default=0.0)

    def bad_packets(self) -> int:
        """Rejected packets except late ones (authentic, merely after their phase ended --
        already counted as lost by the phase, or spare copies)."""
        rej = self.receiver.rejected
        return int(rej.sum() - rej[R["late"]] - rej[R["spare"]])

    def rejected_counts(self) -> dict[str, int]:
        return {REASONS[i]: int(v) for i, v in enumerate(self.receiver.rejected) if i and v}

    def interrupt(self, why: str) -> None:
        """From any thread: the phase this rank waits in (or its next one) raises
        ``Interrupted`` -- the job knows a peer is gone (its membership changed), so waiting
        for the peer's packets up to a deadline cap would only delay the regroup. Sticky:
        the collective is not used again."""
        self.waiter.interrupt(why)

    def close(self) -> None:
        if self._eng is not None:
            self._eng.stop()  # before the socket closes: the engine reads its descriptor
        self.transport.close()
