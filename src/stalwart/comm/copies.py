"""Forward error protection sized to the measured loss: how many copies of each packet to send.

Mechanism: no retransmission (the paper's transport never waits for a lost packet), but every
data packet of a phase may be sent ``c`` times, so a chunk is missed only when all copies are:
``p**c`` for independent loss ``p``. Missed PARAMETER chunks are what costs accuracy (a replica
computes its next gradient at a stale point; measured on the tiny preset at 10% loss: 10% of
parameter chunks missed moved the final validation loss by +2.9%), while copies cost bandwidth
on every phase. A fixed ``c`` is wrong at both ends -- wasted bandwidth on a clean network, too
little protection on a bad one -- so each rank sizes ``c`` per destination from that link's
measured loss: the smallest ``c`` with ``p**c <= target``.

Measuring ``p`` without acknowledgements: every end-of-phase marker says how many data packets
the sender sent this receiver in that phase and how many copies of each, so the receiver counts
the datagrams that arrived (every copy, on time or late) against the datagrams it was owed,
over an exponentially weighted window of about 10,000 datagrams: that is the raw
loss rate on the link sender -> receiver, measured on thousands of datagrams per window. (The
first version counted only the 4 marker copies per phase: ~120 samples per window, so at 1%
loss it saw no loss a third of the time, dropped to 1 copy, and a 1%-loss run lost 0.6% of its
chunks.) The receiver reports the rate back in the ``fb`` field of the markers it sends to
that sender (``wire.py``), so each sender learns the loss on its own outgoing links.
Arrivals are counted per phase (round and phase of the packet) and booked with THAT phase's
marker. The first version booked whatever had arrived since the sender's previous marker: when
all copies of a marker were lost -- the copies go back to back, so one burst of 4 packets takes
them all (on the testbed at 4 of every 40 packets: 38 of 840 markers, not p**4) -- the next
marker booked two phases of arrivals against one phase of debt, ~300 datagrams too many, and
since a window's loss is clamped at 0 that hid ~300 datagrams of real loss: a link losing 10%
in bursts of 32 datagrams read 0.05% for the rest of the run, got 2 parity packets per stripe
and lost 32 chunks to each later burst. Now a phase whose marker never arrives is simply not
sampled (its arrivals are forgotten with it).

The count is capped (3 by default, ``LossyCollective(max_copies=...)``; ``attach``: 5, with a
target of 2e-5 -- ``ddp.py`` says why) because copies are load:
FEC that sizes itself from loss must not be able to feed on the loss it causes (more copies ->
receivers' threads fall behind -> more measured loss -> more copies).

And it has a floor (``min_copies``; ``attach(copies="auto")`` uses 2). The first version of
this estimator under-read a real 1% loss as 0.0-0.3% -- copies that arrived after their round
had ended were counted while their markers were not booked -- so links dropped to 1 copy and a
1%-loss run lost 0.75% of its chunks. That is fixed (markers are booked whether in time or not;
at 1% the estimate now reads 1.2-1.5%), but ``attach`` keeps the floor of 2: every benchmark of
this code was measured with it. Lowering it to 1 saves a clean network its second copy.

Guarantees: ``copies_for`` is monotone in ``p`` and always within [1, max_copies]; until a
link has been measured the sender uses the ``initial`` count; a forged ``fb`` (it is inside
the authenticated header, so only a job member can send one) can only change how much
protection that link gets, never what a packet carries.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Hashable

import numpy as np

DECAY = 0.97  # per DECAY_DATAGRAMS datagrams owed: a window of ~10,000 datagrams
DECAY_DATAGRAMS = 300.0
MIN_OWED = 64.0  # datagrams owed before an estimate is trusted
PHASES_PENDING = 16  # phases per peer whose arrivals wait for their marker (2 x 4 open rounds x 2)
REPORTS_KEPT = 16  # feedback reports (markers) per peer whose maximum sizes erasure parity
# lost datagrams in a link's window below which the link reports itself clean (fb = 0: the
# clean-link parity of ``fec.floor`` only). With the window's decay a single lost datagram
# keeps the link reporting loss for the next ~6,800 datagrams owed (0.5 = 0.97 ** (6800 / 300)),
# then REPORTS_KEPT more reports keep its sized parity on at the sender: independent loss at a
# rate >= ~1/6,800 never reads clean
CLEAN_LOST = 0.5
# datagrams a window must hold before "none lost" reads as clean: at a true loss rate q a
# window of n datagrams shows none with probability (1-q)^n -- 0.7% at q = 1e-3, e^-50 at 1%
# -- whereas a small window proves nothing (64 datagrams at 1% loss show none half the time:
# the tiny GPT's 1%-loss runs lost their parity that way, val loss 0.17% off instead of ~0)
CLEAN_MIN_OWED = 5000.0


def copies_for(p: float, target: float, max_copies: int) -> int:
    """Smallest c in [1, max_copies] with p**c <= target (max_copies if none is enough)."""
    if not p > 0:
        return 1
    if p >= 1:
        return max_copies
    # a small tolerance so that p = 0.1, target = 1e-3 gives exactly 3
    c = math.ceil(math.log(target) / math.log(p) - 1e-9)
    return int(min(max(c, 1), max_copies))


class LossEstimator:
    """Per-peer raw loss rate of incoming datagrams: arrived vs announced, per phase."""

    def __init__(self, world: int) -> None:
        self.got = np.zeros(world)
        self.owed = np.zeros(world)
        # per sender: datagrams arrived per phase key (round, phase) whose marker is not booked
        # yet, and the keys booked recently (a straggler of those counts at once)
        self._pending: list[dict[Hashable, float]] = [{} for _ in range(world)]
        self._booked: list[collections.OrderedDict[Hashable, None]] = [
            collections.OrderedDict() for _ in range(world)]

    def arrived(self, sender: int, key: Hashable = None, n: int = 1) -> None:
        """``n`` data datagrams (any copy, on time or late) from ``sender`` arrived, of the
        phase ``key`` (e.g. (round, phase); None: one phase at a time, in order)."""
        if key is not None and key in self._booked[sender]:
            self.got[sender] += n  # after its marker: the debt is already in the window
            return
        pend = self._pending[sender]
        pend[key] = pend.get(key, 0.0) + n
        while len(pend) > PHASES_PENDING:  # phases whose marker was lost: never booked
            del pend[next(iter(pend))]

    def owe(self, sender: int, datagrams: int, key: Hashable = None) -> None:
        """`sender`'s end marker of phase ``key`` announced this many datagrams (chunks x
        copies + parity) for us: that phase's arrivals and its debt enter the window together.
        """
        # the window is a number of DATAGRAMS (~DECAY_DATAGRAMS / (1 - DECAY) = 10,000), not
        # of phases: how sure the estimate is depends on how much was counted, and a small
        # model's phases carry few datagrams
        f = DECAY ** (datagrams / DECAY_DATAGRAMS)
        got = self._pending[sender].pop(key, 0.0)
        self.got[sender] = self.got[sender] * f + got
        self.owed[sender] = self.owed[sender] * f + datagrams
        if key is not None:
            booked = self._booked[sender]
            booked[key] = None
            while len(booked) > PHASES_PENDING:
                booked.popitem(last=False)

    def loss(self, sender: int) -> float | None:
        """Loss rate from `sender`, an upper estimate: (lost + 2 sqrt(lost) + 1) / owed, about
        two standard deviations above the count plus one pseudo-loss (None until enough
        datagrams were owed). The point estimate read 0 often enough at 1% loss (a window
        holds ~30 expected losses) to drop links to 1 copy for 300 of 800 rank-steps; the
        upper estimate keeps 2 there and still reads ~1/owed (1 copy) on a clean network."""
        owed = self.owed[sender]
        if owed < MIN_OWED:
            return None
        lost = max(owed - self.got[sender], 0.0)
        return float(min((lost + 2.0 * math.sqrt(lost) + 1.0) / owed, 1.0))


    def report(self, sender: int) -> float | None:
        """What this rank feeds back to ``sender`` in its markers: 0.0 while a window of at
        least ``CLEAN_MIN_OWED`` datagrams holds no lost one (under ``CLEAN_LOST``: the link
        is clean, the sender sends it only ``fec.floor``'s parity, one packet per stripe of a
        run's width), else the upper estimate ``loss()`` (None until enough was owed).
        Reporting the upper estimate on a clean link, as before, made every sender protect it
        with a plan for ~1e-4 and encode it in a pass of its own: 0.22-0.24 ns of CPU per
        payload byte, 11% of a loss-free all-reduce (docs/comm.md, "Where the CPU goes")."""
        owed = self.owed[sender]
        if owed < MIN_OWED:
            return None
        if owed >= CLEAN_MIN_OWED and owed - self.got[sender] < CLEAN_LOST:
            return 0.0
        return self.loss(sender)


class CopyPolicy:
    """Copies to send per destination: fixed, or sized from the receivers' feedback."""

    def __init__(self, world: int, initial: int, target: float | None,
                 max_copies: int = 3, min_copies: int = 1) -> None:
        self.initial = max(1, int(initial))
        self.target = target  # None: always `initial` (fixed protection)
        self.max_copies = max(self.initial, int(max_copies))
        self.min_copies = min(max(1, int(min_copies)), self.max_copies)
        self.reported: list[float | None] = [None] * world  # loss on our link to each peer
        # the last REPORTS_KEPT reports per peer: parity is sized from their maximum, because
        # loss comes in bursts and one window's count under-reads a bursty link (seen on the
        # testbed: a link read 0.5% between two bursts of 32 datagrams, got 2 parity packets
        # per stripe, and the next burst took 4 from each)
        self.history: list[collections.deque[float]] = [
            collections.deque(maxlen=REPORTS_KEPT) for _ in range(world)]

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    def feedback(self, peer: int, rate: float) -> None:
        """`peer` told us the loss rate it measures on packets from us."""
        if 0.0 <= rate <= 1.0:
            self.reported[peer] = rate
            self.history[peer].append(rate)

    def recent_max(self, peer: int) -> float | None:
        """The highest loss rate ``peer`` reported in its last ``REPORTS_KEPT`` markers."""
        h = self.history[peer]
        return max(h) if h else None

    def copies(self, dest: int) -> int:
        if self.target is None:
            return self.initial
        p = self.reported[dest]
        if p is None:
            return self.initial
        return max(self.min_copies, copies_for(p, self.target, self.max_copies))
