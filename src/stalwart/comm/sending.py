"""The send side of the lossy collective: sealed packets, erasure-code parity, end markers.

Mechanism: a phase's values are cut into chunks, one packet each (``wire``: header, payload,
GMAC tag), sealed in place in rows that are reused every round; each destination gets its
packets (``copies`` times with repetition), then its Reed-Solomon parity (``fec``, sized from
the loss that destination reports in its markers), then ``MARKER_COPIES`` copies of the phase's
end marker (how many data and parity packets were sent, the sender's deadline proposal, the
loss it measures on that peer's packets). Destinations are interleaved run by run (a run:
``gso_segments`` consecutive rows sent as one message, segmented by the kernel), so no receiver
gets a long burst. Nothing is ever retransmitted.

Cost per phase: one pass over the values to tag them -- native engine, one copy of a packet
per destination: payloads of 4 KB or more (MTU 9000) straight from the values to the kernel
(iovecs), smaller ones (MTU 1500: 3 iovecs per datagram cost the kernel more than a copy) copied
into the rows and tagged there while in cache, GIL released; with repetition, or the Python
engine, the values are first copied into the rows -- the parity's
multiply-adds (m per data byte; native engine: done while each packet is sealed, on its payload
in cache, no pass of its own), and one ``sendmmsg`` per 32 messages.

Parity rule: every link gets ``fec.plan``'s parity for the loss it reports, and a link that
reports none (clean) gets ``fec.floor``'s: one parity packet per stripe, stripes interleaved at
least as many ways as a sent run is long, so the first loss event after a clean period -- one
run dropped whole, or scattered datagrams in distinct stripes -- is rebuilt, not lost; two
events on one link within one phase (at 0.1% loss in runs of 32: ~0.4% of 2,960-datagram
phases) lose the packets of the stripes they share. Protection sized from the loss comes back
at the sender's next phase to that link after the receiver's first report of loss.
"""

from __future__ import annotations

import numpy as np

from stalwart.comm import fec
from stalwart.comm.copies import CopyPolicy, LossEstimator
from stalwart.comm.deadline import AdaptiveDeadline
from stalwart.comm.layout import Layout
from stalwart.comm.rounds import RoundRing
from stalwart.comm.transport import UdpTransport
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
    Wire,
)

# an end marker is lost only if all copies are: p**4 (0.01% at 10% independent loss; the copies
# go back to back, so a burst of 4 packets takes them all: 38 of 840 on the testbed's bursts)
MARKER_COPIES = 4
# a norm is the whole phase (one float per owner), and a lost one holds its receiver a full
# deadline while the others go on to the broadcast without it: 1e-8 at 10% loss
NORM_COPIES = 8
# reports a link's parity waits for before it trusts them: the first windows hold a few hundred
# datagrams, and between two bursts of loss they read nearly 0 (seen on the testbed: a link
# that lost 10% in bursts of 32 datagrams read 0.25% after its first phase)
FEC_MIN_REPORTS = 4


class Sender:
    """The send side of one rank: each phase's packets, parity and end markers.

    Owns the reusable packet rows (one set per (phase, shard), headers written once) and the
    protection settings (copies per link from ``policies``, Reed-Solomon parity per link from
    the loss it reports). Guarantees: the module's; every packet it sends is sealed with the
    job's key (by the native engine, which owns the nonce counter, when attached). Cost: the
    module's.
    """

    def __init__(self, wire: Wire, layout: Layout, ring: RoundRing, transport: UdpTransport,
                 policies: tuple[CopyPolicy, CopyPolicy], loss_in: LossEstimator,
                 deadline: AdaptiveDeadline, fec_mode: str, fec_target: float,
                 fec_initial_loss: float, eng=None) -> None:
        self.wire, self.layout, self.ring, self.transport = wire, layout, ring, transport
        self.vpol, self.gpol = policies  # broadcast values, contributions to the owners
        self.loss_in, self.deadline, self.eng = loss_in, deadline, eng
        self.rank, self.chunk, self.slot = wire.me, layout.chunk, transport.slot
        # "rs": systematic Reed-Solomon parity per stripe of each phase (fec.py), sized per
        # link from its measured loss for ``fec_target``; "copies": repetition; "none":
        # neither (the bare algorithm)
        self.fec_mode, self.fec_target = fec_mode, float(fec_target)
        self.fec_initial_loss = float(fec_initial_loss)
        self.rows_cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def _hint(self) -> int:
        """This rank's deadline proposal in microseconds (carried by every packet)."""
        return int(self.deadline.proposals.get(self.rank, self.deadline.current()) * 1e6)

    def send_grad(self, flat: np.ndarray) -> tuple[int, dict[int, int], dict[int, int]]:
        """Phase 1: shard d of ``flat`` to its owner d, for every peer d (the next rank first:
        owners see spread-out load), then the parity, then the markers. Returns (datagrams
        sent, copies per destination, parity packets per destination)."""
        hint, b, world = self._hint(), self.layout.bounds, self.layout.world
        plan = []
        counts = {}
        # native: the rows are filled and sealed as they are sent (receivers start earlier)
        lazy = self.eng is not None
        fill: dict[int, np.ndarray] = {}
        for k in range(1, world):
            d = (self.rank + k) % world
            rows, lengths = self._rows(PHASE_GRAD, d, flat[b[d]: b[d + 1]], hint, seal=not lazy)
            if lazy:
                fill[id(rows)] = flat[b[d]: b[d + 1]]
            plan.append((rows, lengths, d))
            counts[d] = len(lengths)
        acc = self._accumulators([(r, d, d) for r, _, d in plan]) if lazy else {}
        sent, want = self._send_copies(plan, self.gpol, fill, acc)
        # parity after all the data: a receiver decodes a stripe once k of its packets are in
        par_plan: list[tuple[np.ndarray, np.ndarray, int]] = []
        npar: dict[int, int] = {}
        for k in range(1, world):
            d = (self.rank + k) % world
            pp, cnt = self._parity(PHASE_GRAD, d, flat[b[d]: b[d + 1]], [d], hint,
                                   acc.get(id(self.rows_cache[(PHASE_GRAD, d)][0])))
            par_plan += pp
            npar.update(cnt)
        sent += self._send(par_plan)
        sent += self._send_markers(PHASE_GRAD, counts, hint, want, npar)
        return sent, want, npar

    def send_values(self, shard_values: np.ndarray
                    ) -> tuple[int, dict[int, int], dict[int, int]]:
        """Phase 2: this rank's shard values to every peer, then parity, then markers.
        Returns (datagrams sent, copies per destination, parity packets per destination)."""
        hint, world = self._hint(), self.layout.world
        lazy = self.eng is not None  # (as in send_grad)
        rows, lengths = self._rows(PHASE_VALUE, self.rank, shard_values, hint, seal=not lazy)
        peers = [(self.rank + k) % world for k in range(1, world)]
        acc = self._accumulators([(rows, self.rank, peers[0])]) if lazy and peers else {}
        sent, want = self._send_copies([(rows, lengths, d) for d in peers], self.vpol,
                                       {id(rows): shard_values} if lazy else None, acc)
        par_plan, npar = self._parity(PHASE_VALUE, self.rank, shard_values, peers, hint,
                                      acc.get(id(rows)))
        sent += self._send(par_plan)
        sent += self._send_markers(PHASE_VALUE, {d: len(lengths) for d in peers}, hint,
                                   want, npar)
        return sent, want, npar

    def send_norm(self, own_sq: float) -> int:
        """This rank's squared shard norm to every peer, ``NORM_COPIES`` copies each (a
        one-float packet is cheap to repeat). Returns datagrams sent."""
        pkt = self.wire.packet(PHASE_NORM, self.ring.round, self.rank, 0,
                               np.array([own_sq], np.float32))
        peers = [d for d in range(self.layout.world) if d != self.rank]
        rows = np.zeros((len(peers) * NORM_COPIES, len(pkt)), np.uint8)
        rows[:] = np.frombuffer(pkt, np.uint8)
        return self.transport.send(rows, np.full(len(rows), len(pkt)),
                                   np.array(peers * NORM_COPIES))

    def _rows(self, phase: int, shard: int, values: np.ndarray,
              hint_us: int, seal: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Sealed packets carrying ``values`` (shard ``shard``'s elements) for this round;
        with ``seal`` False (native engine) only their headers: ``_send`` fills and seals
        them run by run as it sends them."""
        lay = self.layout
        nc = lay.n_chunks(shard)
        key = (phase, shard)
        if key not in self.rows_cache:
            # the rows are reused every round: their headers are written whole once, and only
            # the fields that change (round, hint; the sealer writes seq) per call
            rows = np.zeros((nc, self.slot), np.uint8)
            lengths = lay.chunk_lengths(shard)
            h = np.zeros(nc, HEADER)
            h["magic"], h["phase"], h["job"] = MAGIC, phase, self.wire.job
            h["sender"], h["shard"], h["fb"] = self.rank, shard, FB_UNKNOWN
            h["offset"], h["length"] = lay.chunk_offsets(shard), lengths
            rows[:, :HEADER_BYTES] = h.view(np.uint8).reshape(nc, HEADER_BYTES)
            self.rows_cache[key] = (rows, lengths,
                                     rows[:, :HEADER_BYTES].view(HEADER).reshape(nc))
        rows, lengths, hv = self.rows_cache[key]
        if nc == 0:
            return rows, lengths
        hv["round"] = self.ring.round & 0xFFFFFFFF
        hv["hint"] = hint_us
        if not seal:
            return rows, lengths
        if self.eng is not None:  # copy and tag row by row, in one pass (native)
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

    def link_loss(self, dest: int) -> float:
        """The loss rate that ``dest`` reports on our packets to it (the upper estimate of
        ``copies.LossEstimator``, fed back in its markers; the highest of its recent reports,
        since loss is bursty); ``fec_initial_loss`` until then."""
        if len(self.gpol.history[dest]) < FEC_MIN_REPORTS:
            return self.fec_initial_loss
        p = self.gpol.recent_max(dest)
        return self.fec_initial_loss if p is None else p

    def _geometry(self, shard: int, dest: int) -> fec.Stripes | None:
        """The stripes of the parity that ``dest`` gets for shard ``shard`` (None: none, or
        not erasure coding): sized from that link's loss (``fec.plan``), and never less than
        ``fec.floor`` -- one parity packet per stripe, stripes interleaved at least as many
        ways as a sent run is long -- on a link that reads clean."""
        if self.fec_mode != "rs":
            return None
        n = self.layout.n_chunks(shard)
        run = self._run(n)
        geo = fec.plan(n, self.link_loss(dest), self.fec_target, run)
        return geo if geo is not None else fec.floor(n, run)

    def _accumulators(self, entries: list[tuple[np.ndarray, int, int]]) -> dict[int, list]:
        """Parity accumulators for the native send (``Engine.send`` fills them while it seals
        each packet, with the payload in cache: no pass of its own over the values), one per
        (rows, shard, first destination) in ``entries``: {id(rows): [acc, geometry, used]};
        ``used`` turns True when a send filled it. Empty without the native engine."""
        out: dict[int, list] = {}
        if self.eng is None or self.transport.pace:
            return out
        for rows, shard, d in entries:
            geo = self._geometry(shard, d)
            if geo is not None and id(rows) not in out:
                out[id(rows)] = [np.zeros((geo.parity, self.chunk), np.float32), geo, False]
        return out

    def _parity(self, phase: int, shard: int, values: np.ndarray, dests: list[int],
                hint_us: int, fused: list | None = None
                ) -> tuple[list[tuple[np.ndarray, np.ndarray, int]], dict[int, int]]:
        """Parity packets of ``values`` (shard ``shard``'s elements) for each destination
        (``_geometry``); destinations with the same geometry share the packets (their headers
        do not name the receiver). ``fused``: an accumulator of ``_accumulators``, used when the
        send filled it and its geometry is the destination's. Returns (send plan, parity
        packets per dest)."""
        plan: list[tuple[np.ndarray, np.ndarray, int]] = []
        counts = {d: 0 for d in dests}
        if self.fec_mode != "rs":
            return plan, counts
        made: dict[fec.Stripes, tuple[np.ndarray, np.ndarray]] = {}
        for d in dests:
            geo = self._geometry(shard, d)
            if geo is None:
                continue
            if geo not in made:
                par = fused[0] if fused is not None and fused[2] and fused[1] == geo else None
                made[geo] = self._parity_rows(phase, shard, values, geo, hint_us, par)
            rows, lengths = made[geo]
            plan.append((rows, lengths, d))
            counts[d] = len(lengths)
        return plan, counts

    def _parity_rows(self, phase: int, shard: int, values: np.ndarray, geo: fec.Stripes,
                     hint_us: int, par: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
        if par is None:
            par = fec.encode(values, self.chunk, geo)
        q = par.shape[0]
        rows = np.zeros((q, self.slot), np.uint8)
        lengths = np.full(q, self.chunk, np.int64)
        h = np.zeros(q, HEADER)
        h["magic"], h["phase"], h["flags"] = MAGIC, phase, FLAG_PARITY
        h["job"], h["round"] = self.wire.job, self.ring.round
        h["sender"], h["shard"] = self.rank, shard
        h["offset"], h["length"], h["hint"] = np.arange(q), self.chunk, hint_us
        h["fb"], h["copies"] = geo.S, geo.m
        rows[:, :HEADER_BYTES] = h.view(np.uint8).reshape(q, HEADER_BYTES)
        rows[:, HEADER_BYTES: HEADER_BYTES + 4 * self.chunk] = par.view(np.uint8)
        self.wire.seal_rows(rows, lengths)
        return rows, lengths

    def _run(self, n: int) -> int:
        """Datagrams per sent run (one message, segmented by the kernel) in a phase of ``n``
        packets per peer: ``gso_segments`` (8), or longer runs -- up to ``gso_long`` -- when
        the phase has at least 64 runs per peer, so that its stripes can still interleave at
        least as many ways as a run is long (a run dropped whole then costs a stripe one
        packet; ``fec.plan`` is given the same run length and counts in runs otherwise)."""
        return max(self.transport.gso_segments, min(self.transport.gso_long, n // 64))

    def _send(self, plan: list[tuple[np.ndarray, np.ndarray, int]],
              fill: dict[int, np.ndarray] | None = None, direct: bool = False,
              acc: dict[int, list] | None = None) -> int:
        """Send each (rows, lengths, dest), destinations interleaved so that no receiver gets a
        long burst; the rows are sent in place (no copy). With segmentation offload, runs of
        ``gso_segments`` consecutive rows to one destination go as one message (every row but
        a shard's last is exactly one slot, so a run is one contiguous buffer).

        ``fill`` (native engine): rows (by ``id``) whose payloads are still to be copied from
        these values and sealed -- done run by run as they are sent, the first time they are.
        ``direct`` (native engine, rows that are not sent again): payloads of 4 KB or more go
        from those values straight to the kernel (iovecs), never copied into the rows
        (smaller ones are copied: ``DIRECT_MIN_PAYLOAD`` in the engine says why).
        ``acc`` (native engine, with ``fill``): parity accumulators (``_accumulators``) that the
        entry sealing those rows fills; each one filled is marked used.
        """
        plan = [p for p in plan if len(p[1])]
        if not plan:
            return 0
        g = self._run(max(len(p[1]) for p in plan))
        if self.eng is not None and not self.transport.pace:
            fill = dict(fill or {})
            entries = []
            for rows, lengths, d in plan:
                lens = np.ascontiguousarray(lengths, np.int64)
                a = (acc or {}).get(id(rows))
                seals = id(rows) in fill and (
                    len(entries) == 0 or all(e[0] is not rows for e in entries))
                par = None
                if a is not None and seals and not a[2]:
                    par = (a[0], a[1].S, a[1].m)
                    a[2] = True
                if direct and id(rows) in fill:  # every entry sends from the values,
                    entries.append((rows, lens, fill[id(rows)], d, seals, par))  # first seals
                else:
                    entries.append((rows, lens, fill.pop(id(rows), None), d, True, par))
            sent, nbytes, errors = self.eng.send(entries, g, direct)
            self.transport.bytes_sent += nbytes
            self.transport.send_errors += errors
            return sent
        if fill:
            for rows, lengths, _ in plan:
                if id(rows) in fill:
                    self.wire.seal_rows(rows, lengths, fill.pop(id(rows)))
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
                     policy: CopyPolicy, fill: dict[int, np.ndarray] | None = None,
                     acc: dict[int, list] | None = None) -> tuple[int, dict[int, int]]:
        """Send the plan, each destination's packets as many times as its policy says (all
        first copies, then all second copies, ...: copies of one packet are spread in time,
        so a burst of loss rarely takes all of them). Returns (sent, copies per destination)."""
        want = {d: policy.copies(d) for _, _, d in plan}
        sent = 0
        rounds = max(want.values(), default=1)
        for k in range(rounds):  # rows sent again are filled, not sent from the values
            sent += self._send([p for p in plan if want[p[2]] > k], fill if k == 0 else None,
                               direct=rounds == 1, acc=acc if k == 0 else None)
        return sent, want

    def _send_markers(self, phase: int, counts: dict[int, int], hint_us: int,
                      copies: dict[int, int], parity: dict[int, int] | None = None) -> int:
        """Send ``MARKER_COPIES`` copies of each destination's end marker (copy-major: every
        destination's first copy, then every second one). The markers are made as one header
        array and sealed in one call; with the native engine they go out through its send
        (no per-call ctypes structures)."""
        if not counts:
            return 0
        dests = list(counts)
        n = len(dests)
        h = np.zeros(n, HEADER)
        h["magic"], h["phase"], h["flags"], h["job"] = MAGIC, phase, FLAG_END, self.wire.job
        h["round"], h["sender"], h["hint"] = self.ring.round & 0xFFFFFFFF, self.rank, hint_us
        h["shard"] = dests if phase == PHASE_GRAD else self.rank
        h["offset"] = [counts[d] for d in dests]
        h["length"] = [(parity or {}).get(d, 0) for d in dests]
        h["copies"] = [copies.get(d, 1) for d in dests]
        fb = []
        for d in dests:
            est = self.loss_in.report(d)  # what we measure on d's packets, fed back to d
            fb.append(FB_UNKNOWN if est is None else int(round(est * FB_SCALE)))
        h["fb"] = fb
        rows = np.zeros((n, self.slot), np.uint8)
        rows[:, :HEADER_BYTES] = h.view(np.uint8).reshape(n, HEADER_BYTES)
        empty = np.zeros(n, np.int64)  # no payload: the tag follows the header
        self.wire.seal_rows(rows, empty)
        if self.eng is not None and not self.transport.pace:
            one = np.zeros(1, np.int64)
            plan = [(rows[j: j + 1], one, None, d)
                    for _ in range(MARKER_COPIES) for j, d in enumerate(dests)]
            sent, nbytes, errors = self.eng.send(plan, 1, False)
            self.transport.bytes_sent += nbytes
            self.transport.send_errors += errors
            return sent
        reps = np.tile(np.arange(n), MARKER_COPIES)
        return self.transport.send(np.ascontiguousarray(rows[reps]),
                                   np.full(reps.size, OVERHEAD, np.int64),
                                   np.array(dests, np.int64)[reps])
