"""Wire format of the loss-tolerant transport: header, authentication tag, batch parser.

Mechanism: the packet of "Distributed Training under Packet Loss" (Weintraub et al., 2025) and
OptiReduce (NSDI '25) -- a fixed-size chunk of one shard, tagged with (job, round, phase, shard,
offset, sender) so that every datagram is self-describing and can be placed without any
per-connection state -- plus a 16-byte authentication tag over header and payload.

The tag is GMAC: AES-256-GCM (pyca ``cryptography``, i.e. OpenSSL) with the whole packet as
associated data and nothing encrypted. The key is derived from the per-job secret and the job
id (keyed BLAKE2b, once). Why not HMAC/keyed BLAKE2b per packet: on these machines BLAKE2b
costs 7.2 us per 9 KB packet against 0.8-1.2 us for GMAC on AES-NI + carry-less multiply, and
the tag was 40% of the all-reduce's time. GMAC is only secure while no nonce repeats under one
key; the nonce is (sender u16, 0 u16, seq u64) and ``seq`` is a per-``Wire`` counter that
every sealed packet takes the next value of (the deliberate copies of one packet are the same
sealed bytes, so they share it harmlessly). Keys differ per job, so two jobs never share one.

Layout (little-endian)::

    magic u16 | phase u8 | flags u8 | job u32 | round u32 | sender u16 | shard u16 |
    offset u32 | length u32 | hint u32 | fb u16 | copies u16 | seq u64 |
    payload: length x float32 | tag: 16 bytes

``offset``/``length`` count float32 elements inside the shard. A ``PHASE_NORM`` packet carries
one float (the owner's squared norm of its averaged gradient shard) at offset 0. A packet with
``FLAG_END`` set is an end-of-phase marker: no payload, ``offset`` = how many data packets the
sender sent to this receiver in that phase (so the receiver can count its losses exactly) and
``hint`` = the sender's deadline proposal in microseconds (how ranks agree on deadlines
without a reliable channel), ``copies`` = how many times the sender sent each of those data
packets (so the receiver knows how many datagrams it was owed), and ``fb`` = the packet loss
rate the sender measures on what it receives FROM this receiver, in units of 1e-4
(``FB_UNKNOWN`` before it has measured): the feedback that sizes the receiver's forward error
protection towards the sender (``copies.py``, ``fec.py``), and ``length`` = how many parity
packets the sender sent this receiver in that phase. Data packets carry ``fb`` =
``FB_UNKNOWN`` and ``copies`` = 0. A packet with ``FLAG_PARITY`` set is a Reed-Solomon parity
packet of the phase's erasure code (``fec.py``): ``fb`` = the number of stripes S, ``copies`` =
parity packets per stripe m, ``offset`` = its index q (stripe q % S, parity row q // S) and a
whole chunk of parity bytes as payload (arbitrary bits: not checked for finite floats; what it
rebuilds is, in ``collective``).

Guarantee of ``Wire.check``: it never raises and never writes anywhere but its own result
arrays. Every packet it accepts has a valid tag under this job's key, comes from a known peer
(claimed sender id and source address both match), belongs to the current round or one of
the next ``rounds_open - 1`` and a known phase, covers exactly one chunk of the right shard,
and carries only finite floats (a parity packet: names a valid code -- k + m <= 256, at most 2x
the data in parity -- and an index inside it).
Everything else is rejected with a reason code that the caller counts. One kind of packet is
rejected before its tag is computed, because accepting or refusing it can change nothing: a
data packet naming a chunk already placed ("spare"; a forged one is dropped just the same). Its
caller may count a spare as an arrival only if its tag equals the tag of the copy it placed
(``collective``): copies of a packet are the same sealed bytes. A data packet of a round that
has ended ("old_round") is tag-checked like any other, because the loss estimate counts it as
an arrived copy: an unauthenticated one could otherwise hide real loss. (These are rare: a copy
is old only when it arrives after the receiver's whole next step has begun.)
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = 0x5357  # "WS"
HEADER = np.dtype([
    ("magic", "<u2"), ("phase", "u1"), ("flags", "u1"), ("job", "<u4"), ("round", "<u4"),
    ("sender", "<u2"), ("shard", "<u2"), ("offset", "<u4"), ("length", "<u4"), ("hint", "<u4"),
    ("fb", "<u2"), ("copies", "<u2"), ("seq", "<u8"),
])
HEADER_BYTES = HEADER.itemsize  # 40
FB_UNKNOWN = 0xFFFF
FB_SCALE = 10_000  # fb units per 1.0 of loss rate
TAG_BYTES = 16
OVERHEAD = HEADER_BYTES + TAG_BYTES  # 56
IP_UDP_BYTES = 28  # IPv4 header (20) + UDP header (8)

PHASE_GRAD = 0  # contributions to a shard, sent to its owner (reduce-scatter)
PHASE_VALUE = 1  # an owner's values of its shard, sent to everyone (broadcast)
PHASE_NORM = 2  # an owner's squared norm of its averaged shard (global gradient clipping)
PHASES = (PHASE_GRAD, PHASE_VALUE, PHASE_NORM)
FLAG_END = 1
FLAG_PARITY = 2  # a parity packet of the phase's erasure code (``fec.py``)
MAX_BLOCKS = 256  # data + parity packets of one stripe (GF(2^8))

# reject reasons (index into REASONS); 0 = accepted
OK = 0
REASONS = ("ok", "malformed", "bad_tag", "unknown_sender", "old_round", "future_round",
           "bad_range", "nonfinite", "duplicate", "late", "spare")
# "spare": names a chunk that is already placed (a deliberate extra copy, or a replay): dropped
# before its tag is even computed -- it could not change anything, so it costs no hashing
R = {name: i for i, name in enumerate(REASONS)}


def max_floats_for_mtu(mtu: int) -> int:
    """Largest float32 payload per packet that fits one IP datagram of this MTU unfragmented."""
    n = (mtu - IP_UDP_BYTES - OVERHEAD) // 4
    if n < 1:
        raise ValueError(f"MTU {mtu} too small for a {OVERHEAD}-byte header")
    return n


def _nonces(hdr: np.ndarray) -> np.ndarray:
    """The GCM nonce of each header: sender u16 | 0 u16 | seq u64 (n, 12) uint8, contiguous."""
    out = np.zeros((hdr.size, 12), np.uint8)
    out[:, 0:2] = hdr["sender"].astype("<u2").reshape(-1, 1).view(np.uint8)
    out[:, 4:12] = hdr["seq"].astype("<u8").reshape(-1, 1).view(np.uint8)
    return out


class Wire:
    """Seals and checks packets of one job, seen from rank ``me`` of ``world``.

    ``shard_lens[s]`` is the number of floats of shard s and ``chunk`` the floats per packet; a
    data packet must cover exactly ``[offset, offset + min(chunk, shard_len - offset))`` with
    ``offset`` a multiple of ``chunk``.
    """

    def __init__(self, key: bytes, job: int, world: int, me: int,
                 shard_lens: list[int], chunk: int, rounds_open: int = 2) -> None:
        if len(key) < 16:
            raise ValueError("key must have at least 16 bytes")
        self.key = key
        self.job = int(job) & 0xFFFFFFFF
        self.world = world
        self.me = me
        self.shard_lens = np.asarray(shard_lens, dtype=np.int64)
        self.chunk = int(chunk)
        self.rounds_open = int(rounds_open)  # current round + this many - 1 ahead accepted
        job_key = hashlib.blake2b(self.job.to_bytes(4, "little"), key=key[:64], digest_size=32,
                                  person=b"stalwart-gmac").digest()
        self.job_key = job_key
        self._aead = AESGCM(job_key)
        self._seq = 0  # the next nonce sequence number this Wire seals with (never reused)
        # seal_rows' replacement when the native engine seals (it owns the sequence counter:
        # one counter per key, whoever seals, or a nonce could repeat)
        self.sealer: Callable[[np.ndarray, np.ndarray], None] | None = None

    # ---- sending --------------------------------------------------------------------------
    def tag(self, nonce: memoryview | bytes, data: memoryview | bytes) -> bytes:
        """GMAC of ``data`` under this job's key: AES-GCM of nothing, ``data`` authenticated."""
        return self._aead.encrypt(nonce, b"", data)

    def _take_seq(self, n: int) -> int:
        first = self._seq
        self._seq += n
        return first

    def seal_rows(self, rows: np.ndarray, lengths: np.ndarray,
                  values: np.ndarray | None = None) -> None:
        """Give each row the next sequence numbers and write its tag in place: row = header |
        payload(length) | tag.

        ``rows`` is a C-contiguous (n, slot) uint8 array whose headers are filled, and its
        payloads too unless ``values`` (float32, the payloads back to back) is given.
        """
        n_rows = rows.shape[0]
        if n_rows == 0:
            return
        if self.sealer is not None:
            self.sealer(rows, np.ascontiguousarray(lengths, np.int64),
                        *(() if values is None else (np.ascontiguousarray(values, "<f4"),)))
            return
        if values is not None:
            ends = np.cumsum(lengths)
            for i, (a, b) in enumerate(zip((ends - lengths).tolist(), ends.tolist(),
                                           strict=True)):
                rows[i, HEADER_BYTES: HEADER_BYTES + 4 * (b - a)] = values[a:b].view(np.uint8)
        hdr = rows[:, :HEADER_BYTES].view(HEADER).reshape(n_rows)
        hdr["seq"] = self._take_seq(n_rows) + np.arange(n_rows, dtype=np.uint64)
        nonces = _nonces(hdr)
        nv = memoryview(nonces).cast("B")
        mv = memoryview(rows).cast("B")
        slot = rows.shape[1]
        tag = self._aead.encrypt
        for i, n in enumerate((HEADER_BYTES + 4 * lengths).tolist()):
            base = i * slot
            mv[base + n: base + n + TAG_BYTES] = tag(nv[12 * i: 12 * i + 12], b"",
                                                     mv[base: base + n])

    def packet(self, phase: int, rnd: int, shard: int, offset: int, payload: np.ndarray,
               flags: int = 0, hint: int = 0, sender: int | None = None,
               fb: int = FB_UNKNOWN, copies: int = 0, length: int | None = None) -> bytes:
        """One sealed packet as bytes (for tests, markers and tools; the hot path uses rows).
        ``length`` overrides the header's length field (a marker's parity count)."""
        payload = np.ascontiguousarray(payload, dtype="<f4")
        hdr = np.zeros(1, HEADER)
        hdr[0] = (MAGIC, phase, flags, self.job, rnd & 0xFFFFFFFF,
                  self.me if sender is None else sender, shard, offset,
                  payload.size if length is None else length, hint,
                  fb, copies, 0)
        row = np.zeros((1, OVERHEAD + 4 * payload.size), np.uint8)
        row[0, :HEADER_BYTES] = hdr.view(np.uint8)
        row[0, HEADER_BYTES: HEADER_BYTES + 4 * payload.size] = payload.view(np.uint8)
        # the tag covers header + payload; a marker's ``length`` is not its payload size
        self.seal_rows(row, np.array([payload.size], np.int64))
        return row.tobytes()

    # ---- receiving ------------------------------------------------------------------------
    def check(self, rows: np.ndarray, sizes: np.ndarray, src_ok: np.ndarray,  # noqa: PLR0915
              cur_round: int, placed: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
        """Check n received datagrams; returns (headers (n,) HEADER, reasons (n,) uint8).

        ``rows``: (n, slot) uint8 with datagram i in ``rows[i, :sizes[i]]``; ``src_ok[i, s]``
        says whether datagram i's source address is sender s's registered address. Reason 0
        means accepted. Never raises, never writes into ``rows``. ``placed(hdr, idx)`` (optional)
        says which of the well-formed datagrams ``idx`` name a chunk that is already placed;
        those are dropped as "spare" without computing their tag.
        """
        n = rows.shape[0]
        reasons = np.zeros(n, np.uint8)
        hdr = np.zeros(n, HEADER)
        if n == 0:
            return hdr, reasons
        slot = rows.shape[1]
        sizes = np.asarray(sizes, dtype=np.int64)
        if slot >= HEADER_BYTES:
            hdr = np.ascontiguousarray(rows[:, :HEADER_BYTES]).view(HEADER).reshape(n)
        length = hdr["length"].astype(np.int64)
        bad = (sizes < OVERHEAD) | (sizes > slot) | (hdr["magic"] != MAGIC)
        # a marker has no payload (its ``length`` counts the parity packets it announces: it
        # may exceed a slot, and rejecting such markers as malformed cut MTU 1500 links off
        # their loss feedback, leaving their parity at the initial 20%)
        is_end = hdr["flags"] == FLAG_END
        bad |= (hdr["job"] != self.job) | ((length > slot) & ~is_end)
        bad |= sizes != np.where(is_end, OVERHEAD, OVERHEAD + 4 * length)
        reasons[bad] = R["malformed"]
        if placed is not None:
            idx = np.flatnonzero(reasons == 0)
            if idx.size:
                reasons[idx[placed(hdr, idx)]] = R["spare"]
        cur = int(cur_round) & 0xFFFFFFFF
        # the tag: per packet, only for well-formed ones (rejects garbage before hashing it)
        mv = memoryview(np.ascontiguousarray(rows)).cast("B")
        nv = memoryview(_nonces(hdr)).cast("B")
        tag = self._aead.encrypt
        for i in np.flatnonzero(reasons == 0).tolist():
            end = i * slot + int(sizes[i]) - TAG_BYTES
            if not hmac.compare_digest(tag(nv[12 * i: 12 * i + 12], b"", mv[i * slot: end]),
                                       mv[end: end + TAG_BYTES]):
                reasons[i] = R["bad_tag"]
        live = reasons == 0
        sender = hdr["sender"].astype(np.int64)
        known = (sender < self.world) & (sender != self.me)
        if src_ok is not None and n and known.any():
            src_ok = np.asarray(src_ok, dtype=bool).reshape(n, -1)
            idx = np.clip(sender, 0, src_ok.shape[1] - 1)
            known &= src_ok[np.arange(n), idx]
        reasons[live & ~known] = R["unknown_sender"]
        live = reasons == 0
        rnd = hdr["round"].astype(np.int64)
        reasons[live & (rnd < cur)] = R["old_round"]
        reasons[live & (rnd > cur + self.rounds_open - 1)] = R["future_round"]
        live = reasons == 0
        # semantic range: phase, flags, shard, offset/length == exactly one chunk of that shard
        phase = hdr["phase"].astype(np.int64)
        flags = hdr["flags"].astype(np.int64)
        shard = hdr["shard"].astype(np.int64)
        offset = hdr["offset"].astype(np.int64)
        want_shard = np.where(phase == PHASE_GRAD, self.me, sender)
        ok = (phase <= PHASE_NORM) & (shard == want_shard)
        ok &= (flags == 0) | (flags == FLAG_END) | (flags == FLAG_PARITY)
        slen = self.shard_lens[np.clip(shard, 0, self.world - 1)]
        nch = -(-slen // self.chunk)
        is_end = flags == FLAG_END
        is_par = flags == FLAG_PARITY
        data_ok = (offset % self.chunk == 0) & (offset < slen)
        data_ok &= length == np.minimum(self.chunk, slen - offset)
        data_ok = np.where(phase == PHASE_NORM, (offset == 0) & (length == 1), data_ok)
        # parity: fb = stripes S, copies = parity rows m, offset = parity packet index; the
        # geometry must be a valid code (k + m <= 256, at most 2x the data in parity)
        n_s = hdr["fb"].astype(np.int64)
        m_p = hdr["copies"].astype(np.int64)
        k_p = -(-nch // np.maximum(n_s, 1))
        par_ok = (phase != PHASE_NORM) & (n_s >= 1) & (n_s <= nch) & (m_p >= 1)
        par_ok &= (k_p + m_p <= MAX_BLOCKS) & (m_p * n_s <= 2 * nch + n_s)
        par_ok &= (offset < m_p * n_s) & (length == self.chunk)
        end_ok = (phase != PHASE_NORM) & (length <= 2 * nch + MAX_BLOCKS)
        ok &= np.where(is_end, end_ok, np.where(is_par, par_ok, data_ok))
        reasons[live & ~ok] = R["bad_range"]
        live = reasons == 0
        # payload must be finite (a NaN from a broken or hostile peer would poison the average);
        # parity is arbitrary bytes: what it rebuilds is checked instead (``collective``)
        check = live & ~is_end & ~is_par
        if check.any():
            idx = np.flatnonzero(check)
            width = (slot - HEADER_BYTES) // 4
            pay = rows[idx, HEADER_BYTES: HEADER_BYTES + 4 * width].view("<f4")
            beyond = np.arange(width)[None, :] >= length[idx, None]  # not part of the payload
            finite = (np.isfinite(pay) | beyond).all(axis=1)
            reasons[idx[~finite]] = R["nonfinite"]
        return hdr, reasons

    def check_one(self, data: bytes, src: int | None, cur_round: int,
                  slot: int | None = None) -> tuple[np.void, int]:
        """Check one datagram (bytes) whose source address is peer ``src`` (None = unknown)."""
        slot = max(slot or 0, len(data), 1)
        rows = np.zeros((1, slot), np.uint8)
        rows[0, :len(data)] = np.frombuffer(data, np.uint8)
        src_ok = np.zeros((1, self.world), bool)
        if src is not None and 0 <= src < self.world:
            src_ok[0, src] = True
        hdr, reasons = self.check(rows, np.array([len(data)]), src_ok, cur_round)
        return hdr[0], int(reasons[0])
