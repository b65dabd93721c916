"""Forward error protection sized to the measured loss: how many copies of each packet to send.

Mechanism: no retransmission (the paper's transport never waits for a lost packet), but every
data packet of a phase may be sent ``c`` times, so a chunk is missed only when all copies are:
``p**c`` for independent loss ``p``. Missed PARAMETER chunks are what costs accuracy (a replica
computes its next gradient at a stale point; measured on the tiny preset at 10% loss: 10% of
parameter chunks missed moved the final validation loss by +2.9%), while copies cost bandwidth
on every phase. A fixed ``c`` is wrong at both ends -- wasted bandwidth on a clean network, too
little protection on a bad one -- so each rank sizes ``c`` per destination from that link's
measured loss: the smallest ``c`` with ``p**c <= target``.

Measuring ``p`` without acknowledgements: every end-of-phase marker is sent ``MARKER_COPIES``
times, a known number, so a receiver counts the marker copies that arrived per sender against
the copies it was owed (an exponentially weighted window of about ``1 / (1 - DECAY)`` phases):
that is the raw loss rate on the link sender -> receiver, whatever copy count the sender used
for its data. The receiver reports it back in the ``fb`` field of the markers it sends to that
sender (``wire.py``), so each sender learns the loss on its own outgoing links.

The count is capped (3 by default, ``LossyCollective(max_copies=...)``) because copies are load:
FEC that sizes itself from loss must not be able to feed on the loss it causes (more copies ->
receivers' threads fall behind -> more measured loss -> more copies).

Guarantees: ``copies_for`` is monotone in ``p`` and always within [1, max_copies]; until a
link has been measured the sender uses the ``initial`` count; a forged ``fb`` (it is inside
the authenticated header, so only a job member can send one) can only change how much
protection that link gets, never what a packet carries.
"""

from __future__ import annotations

import math

import numpy as np

DECAY = 0.97  # per phase: the loss estimate covers roughly the last 30 phases
MIN_OWED = 16.0  # marker copies owed before an estimate is trusted


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
    """Per-peer raw loss rate of incoming packets, from counted marker copies."""

    def __init__(self, world: int, marker_copies: int) -> None:
        self.marker_copies = marker_copies
        self.got = np.zeros(world)
        self.owed = np.zeros(world)
        self._owing: list[int] = []  # senders of the last closed phase, not booked yet

    def heard_marker(self, sender: int) -> None:
        """One authenticated marker copy from `sender` arrived (on time or late)."""
        self.got[sender] += 1.0

    def phase_closed(self, senders: list[int]) -> None:
        """A phase ended in which each of `senders` owed us ``marker_copies`` copies.

        They are booked one phase later: a phase usually closes as soon as its data is in,
        before the markers that follow the data have arrived (booking them at once read as
        ~10% loss on a clean network in a 6-step job)."""
        self.owed[self._owing] += self.marker_copies
        self._owing = list(senders)
        # both decay together, after the copies were added: the ratio is not biased
        self.got *= DECAY
        self.owed *= DECAY

    def loss(self, sender: int) -> float | None:
        """Estimated loss rate from `sender` (None until enough copies were owed)."""
        if self.owed[sender] < MIN_OWED:
            return None
        return float(min(max(1.0 - self.got[sender] / self.owed[sender], 0.0), 1.0))


class CopyPolicy:
    """Copies to send per destination: fixed, or sized from the receivers' feedback."""

    def __init__(self, world: int, initial: int, target: float | None,
                 max_copies: int = 3) -> None:
        self.initial = max(1, int(initial))
        self.target = target  # None: always `initial` (fixed protection)
        self.max_copies = max(self.initial, int(max_copies))
        self.reported: list[float | None] = [None] * world  # loss on our link to each peer

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    def feedback(self, peer: int, ppm: int) -> None:
        """`peer` told us the loss rate it measures on packets from us (parts per million)."""
        if 0 <= ppm <= 1_000_000:
            self.reported[peer] = ppm / 1e6

    def copies(self, dest: int) -> int:
        if self.target is None:
            return self.initial
        p = self.reported[dest]
        if p is None:
            return self.initial
        return copies_for(p, self.target, self.max_copies)
