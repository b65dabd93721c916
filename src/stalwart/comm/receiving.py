"""The receive side of the lossy collective: the Python engine's handler and the native one's
binding.

Mechanism: every datagram is checked (``wire.Wire.check``: format, tag, sender, round, range,
finite values) and then placed into its round's buffers (``rounds.RoundState``): a gradient
chunk is added to the owner's sum (``aggregate``), a value chunk written where it belongs, a
parity packet kept for the stripe's decoder (``fec``), an end marker's announced count booked
for the phase's end rule and for the loss estimate (``copies.LossEstimator``), which counts
authenticated arrivals per (round, phase).

Two engines, one set of rules. The Python engine (``Receiver.on_batch`` and the methods after
it) is the reference: the transport's thread hands it each batch, the common case is placed per
batch with numpy, everything else per datagram. The native engine (``native``,
``_native/engine.c``) runs the same rules in C on its own thread without the GIL, into the same
numpy arrays; ``Receiver.sync`` applies, once per phase step, what it gathered that lives in Python
objects (deadline proposals, loss feedback, silent peers that spoke). The comm test suite runs
with each engine.

Guarantees: a datagram changes a round's buffers only after every check passed, and each chunk
is counted at most once per round (a copy or a replay is a "spare" or a "duplicate"); every
rejected datagram is counted by reason, never raised. Handler failures (Python engine) are
counted; past ``MAX_HANDLER_ERRORS`` the next phase raises ``ReceiveFailed``.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from stalwart.comm import fec, native
from stalwart.comm.copies import CopyPolicy, LossEstimator
from stalwart.comm.deadline import AdaptiveDeadline
from stalwart.comm.layout import Layout
from stalwart.comm.liveness import Liveness
from stalwart.comm.rounds import ROUNDS_OPEN, FecRx, RoundRing, RoundState
from stalwart.comm.transport import UdpTransport, _ip_u32
from stalwart.comm.wire import (
    FB_SCALE,
    FB_UNKNOWN,
    FLAG_END,
    FLAG_PARITY,
    HEADER,
    HEADER_BYTES,
    PHASE_GRAD,
    PHASE_NORM,
    PHASE_VALUE,
    TAG_BYTES,
    R,
    Wire,
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
MAX_ANNOUNCED_COPIES = 16  # a marker's copy count is believed up to this (sanity bound)
# receive-handler failures (each one loses a batch of up to 64 datagrams) past which the job
# stops: a handler bug repeats on every batch, so this is reached within milliseconds, while
# letting it pass would silently turn a code bug into "packet loss" for the rest of the run
MAX_HANDLER_ERRORS = 10


class ReceiveFailed(RuntimeError):
    """The receiving thread's handler failed more than ``MAX_HANDLER_ERRORS`` times."""


class Receiver:
    """The receive side of one rank: places what arrives into the round ring's buffers.

    Owns the rejection counters (by reason), the booking of end markers, and the Python
    engine's handler (``on_batch``, run on the transport's thread); with the native engine
    ``sync`` applies what the engine gathered. Guarantees: the module's. Cost: per batch, one
    check (``wire.check``) and numpy placement per (round, phase, sender); per unusual
    datagram, Python work under the lock.
    """

    def __init__(self, wire: Wire, layout: Layout, ring: RoundRing, live: Liveness,
                 loss_in: LossEstimator, policies: tuple[CopyPolicy, CopyPolicy],
                 deadline: AdaptiveDeadline, transport: UdpTransport, may_copy: bool,
                 rejected: np.ndarray) -> None:
        self.wire, self.layout, self.ring, self.live = wire, layout, ring, live
        self.loss_in, self.policies, self.deadline = loss_in, policies, deadline
        self.transport, self.may_copy = transport, may_copy
        self.rank, self.world, self.chunk = wire.me, layout.world, layout.chunk
        self.rejected = rejected  # per reason (``wire.REASONS``); the native engine adds too
        self.booked = np.full((3, self.world), -1, np.int64)  # last marker round booked
        # (a plain lock, not re-entrant: nothing here takes it twice)
        self.cond: threading.Condition | NativeCond = threading.Condition(threading.Lock())
        self.eng = None

    def attach(self, eng) -> None:
        """The native engine receives from now on; the lock is its lock."""
        self.eng = eng
        self.cond = NativeCond(eng)

    def _feedback(self, s: int, rate: float) -> None:
        for pol in self.policies:
            pol.feedback(s, rate)

    def sync(self) -> None:
        """Apply what the native engine gathered since the last call (under the lock): deadline
        proposals and loss feedback from markers, and peers marked silent that spoke since.
        (The Python engine does all of this as each packet is handled.)"""
        if self.eng is None:
            return
        hints, fb = self.eng.drain()
        for s, secs in hints:
            self.deadline.hear(s, secs)
        for s, rate in fb:
            self._feedback(s, rate)
        self.live.unsilence_spoken()

    # ---- receiving thread -----------------------------------------------------------------
    def bind_values(self, out: np.ndarray) -> bool:
        """Native engine: the current round's broadcast values land in ``out`` (a writable
        C-contiguous float32 vector of every element) from now on, as they arrive; the chunks
        already in the round's buffer are copied over now. False (nothing bound) with the
        Python engine or another ``out``. Safe from the round's start even when ``out`` is the
        vector being reduce-scattered: an owner broadcasts its shard only after it closed its
        reduce-scatter phase -- with all of this rank's packets for it in (or rebuilt from its
        parity), which are handed to the kernel before anything that follows them, or once it
        stopped waiting for this rank (deadline, silence), when whatever this rank still sends
        it is rejected as late -- so no value lands in a shard this rank still reads for a
        packet that counts; its own shard is never written."""
        if (self.eng is None or out.dtype != np.float32 or not out.flags.c_contiguous
                or not out.flags.writeable or out.size != self.layout.numel):
            return False
        with self.cond:
            self.eng.values_into(self.ring.slot, self.ring.round, out)
        return True

    def unbind_values(self) -> None:
        """End ``bind_values``'s binding: nothing more lands in ``out``."""
        with self.cond:
            self.eng.values_into(self.ring.slot, self.ring.round, None)

    def check_handler(self) -> None:
        n = self.transport.handler_errors
        if n > MAX_HANDLER_ERRORS:
            raise ReceiveFailed(
                f"stalwart.comm: rank {self.rank}'s receive handler failed {n} times (bound "
                f"{MAX_HANDLER_ERRORS}); last: {self.transport.last_error!r}")

    def on_batch(self, rows: np.ndarray, sizes: np.ndarray, src_ok: np.ndarray) -> None:
        hdr, reasons = self.wire.check(rows, sizes, src_ok, max(self.ring.round, 0), self._placed)
        with self.cond:
            done = self._place_batch(rows, hdr, reasons)
        if done.any():
            keep = ~done
            rows, hdr, reasons = rows[keep], hdr[keep], reasons[keep]
            if not len(reasons):
                with self.cond:
                    self.cond.notify_all()
                return
        self._on_rest(rows, hdr, reasons)

    def _place_batch(  # noqa: PLR0915 (the reference engine's per-batch rules, one pass)
            self, rows: np.ndarray, hdr: np.ndarray, reasons: np.ndarray) -> np.ndarray:
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
        heard, ever, silent = self.live.heard, self.live.ever, self.live.silent
        lay = self.layout
        for grp in np.split(order, bounds_k):
            r, p, s = int(rnd[grp[0]]), int(ph[grp[0]]), int(snd[grp[0]])
            st = self.ring.states[r % ROUNDS_OPEN]
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
                    acc.add_chunks(c_new, pay)  # (whole chunks: length == C)
                    if acc.contrib is not None:
                        acc.contrib[s].reshape(-1, C)[c_new] = pay
                    st.gtag[s, c_new] = tags
                else:
                    lo = lay.bounds[s]
                    nfull = lay.shard_len(s) // C
                    st.vals[lo: lo + nfull * C].reshape(nfull, C)[c_new] = pay
                    st.vtag[self.ring.chunk_base[s] + c_new] = tags
                st.got[p, s] += c_new.size
                rx = st.fec.get((p, s))
                if rx is not None:
                    stripes = c_new % rx.geo.S
                    np.add.at(rx.have, stripes, 1)
                    for i in np.unique(stripes).tolist():
                        self._maybe_decode(st, p, s, rx, i)
            if dup and not self.may_copy:
                self.rejected[R["duplicate"]] += dup
            # all of them authenticated data datagrams from s: alive, and arrived
            heard[s] = now  # (``Liveness.spoke``, inline: once per group of datagrams)
            ever[s] = True
            silent.discard(s)
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
        heard, ever, silent = self.live.heard, self.live.ever, self.live.silent
        with self.cond:
            for i, why in enumerate(why_l):
                s = snd_l[i]
                # authenticated: its tag was checked (wire.check tag-checks an ended round's
                # data packets too), so the sender is alive, whatever the round
                if why not in _UNAUTHENTICATED and s < self.world:
                    heard[s] = now  # of any round: alive (``Liveness.spoke``, inline)
                    ever[s] = True
                    if s in silent:
                        silent.discard(s)  # it speaks again: wait for it again
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
                        if rnd_l[i] > self.booked[ph_l[i], s]:
                            self.booked[ph_l[i], s] = rnd_l[i]
                            self.loss_in.owe(
                                s, off_l[i] * min(max(cp_l[i], 1), MAX_ANNOUNCED_COPIES)
                                + len_l[i], (rnd_l[i], ph_l[i]))
                            # the feedback too: once per marker, not per copy (the recent
                            # reports' maximum sizes the parity)
                            if fb_l[i] != FB_UNKNOWN:
                                rate = fb_l[i] / FB_SCALE
                                self._feedback(s, rate)
                if why == 0:
                    why = self._place(rows[i], rnd_l[i], ph_l[i], s, fl_l[i], off_l[i],
                                      len_l[i], hint_l[i], C, bounds)
                # (also after _place: wire.check ran outside the lock, and the round may have
                # ended between it and here -- the packet is then as late as one it tagged old)
                if why == _OLD and rnd_l[i] == self.ring.round - 1:
                    # the round that just ended: a late packet or a spare copy -- except its
                    # end markers, deliberate copies counted in no loss (as in a closed phase)
                    why = 0 if fl_l[i] & FLAG_END else _LATE
                if why:
                    self.rejected[why] += 1
            self.cond.notify_all()

    def _same_tag(self, row: np.ndarray, rnd: int, ph: int, s: int, off: int, n: int) -> bool:
        """Whether a spare copy carries the tag of the copy placed for its chunk this round
        (so it is a copy of an authenticated packet). Called under the lock."""
        st = self.ring.states[rnd % ROUNDS_OPEN]
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
            ref = st.vtag[self.ring.chunk_base[s] + c]
        at = HEADER_BYTES + 4 * n
        return bool(np.array_equal(row[at: at + TAG_BYTES], ref))

    def _placed(self, hdr: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """Which datagrams ``idx`` name a data chunk this rank already placed (read without the
        lock: "seen" only goes from False to True within a round, and a packet misjudged
        during a round change is of an old round, rejected anyway)."""
        out = np.zeros(idx.size, bool)
        if not self.may_copy:
            return out  # no deliberate copies: keep counting replays as duplicates
        h = hdr[idx]
        C, me, world = self.chunk, self.rank, self.world
        for j, (rnd, ph, fl, s, off) in enumerate(zip(
                h["round"].tolist(), h["phase"].tolist(), h["flags"].tolist(),
                h["sender"].tolist(), h["offset"].tolist(), strict=True)):
            st = self.ring.states[rnd % ROUNDS_OPEN]
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
        st = self.ring.states[rnd % ROUNDS_OPEN]
        if st.rnd != rnd:
            return R["old_round"] if rnd < self.ring.round else R["future_round"]
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
                return 0 if self.may_copy else R["duplicate"]
            st.gtag[s, off // C] = row[HEADER_BYTES + 4 * n: HEADER_BYTES + 4 * n + TAG_BYTES]
            self._fec_data_arrived(st, ph, s, off // C)
        else:
            seen = st.vseen[s]
            c = off // C
            if seen[c]:  # an identical copy of values already written: ignore, never harmful
                return 0 if self.may_copy else R["duplicate"]
            seen[c] = True
            lo = bounds[s] + off
            st.vals[lo: lo + n] = pay
            st.vtag[self.ring.chunk_base[s] + c] = row[HEADER_BYTES + 4 * n:
                                                   HEADER_BYTES + 4 * n + TAG_BYTES]
            self._fec_data_arrived(st, ph, s, c)
        st.got[ph, s] += 1
        return 0

    # ---- erasure decoding (receiving thread, under the lock) ------------------------------
    def _seen(self, st: RoundState, ph: int, s: int) -> np.ndarray:
        return st.acc.seen[s] if ph == PHASE_GRAD else st.vseen[s]

    def _place_parity(self, st: RoundState, ph: int, s: int, q: int, S: int, m: int,
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
            rx = FecRx(geo, np.empty((m * S, self.chunk), np.float32),
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

    def _fec_data_arrived(self, st: RoundState, ph: int, s: int, c: int) -> None:
        rx = st.fec.get((ph, s))
        if rx is not None:
            i = c % rx.geo.S
            rx.have[i] += 1
            self._maybe_decode(st, ph, s, rx, i)

    def _maybe_decode(  # noqa: PLR0915 (one stripe's decode, in order)
            self, st: RoundState, ph: int, s: int, rx: FecRx, i: int) -> None:
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



class NativeCond:
    """The native engine's mutex and condition variable, used like ``threading.Condition``."""

    def __init__(self, eng) -> None:
        self._eng = eng

    def __enter__(self) -> NativeCond:
        self._eng.lock()
        return self

    def __exit__(self, *exc: object) -> None:
        self._eng.unlock()

    def wait(self, timeout: float) -> bool:
        return self._eng.wait(timeout)

    def notify_all(self) -> None:
        self._eng.notify()



def start_native(rx: Receiver, ring: RoundRing, live: Liveness) -> object:
    """Start the native engine: it receives instead of the transport's thread, into ``ring``'s
    round buffers and the receiver's, liveness's and loss estimator's counters (it holds
    pointers to those arrays), and seals every packet (it owns the nonce counter). The ring
    and the receiver are attached to it; returns the engine."""
    mod = native.module()
    t, wire, lay = rx.transport, rx.wire, rx.layout
    eng = mod.Engine(fd=t.sock.fileno(), key=wire.job_key, job=wire.job, world=lay.world,
                     me=rx.rank, shard_lens=lay.shard_lens, chunk=lay.chunk, slot=t.slot,
                     rounds_open=ROUNDS_OPEN, may_copy=rx.may_copy, batch=t.batch,
                     rx_segments=t.rx_segments)
    eng.set_peers([_ip_u32(h) for h, _ in t.peers], [p for _, p in t.peers])
    for i, st in enumerate(ring.states):
        eng.bind_round(i, st.acc.sum, st.acc.count, st.acc.seen, st.acc.contrib, st.vals,
                       st.vseen, st.norm, st.got, st.marker, st.gtag, st.vtag, st.recovered)
        eng.reset_round(i, st.rnd)
    eng.bind_shared(live.heard, live.ever, rx.rejected, rx.loss_in.got, rx.loss_in.owed)
    wire.sealer = eng.seal
    ring.attach(eng)
    rx.attach(eng)
    eng.start()
    return eng
