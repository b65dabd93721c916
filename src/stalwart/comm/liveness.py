"""Which peers of the lossy collective are alive, silent or lost.

Mechanism: every authenticated datagram from a peer (any round, any phase) stamps its last
heard time; a phase that hit its deadline marks silent each peer of which nothing arrived in
that phase and nothing at all for a deadline cap, and is not waited for again until any
authenticated packet from it arrives. A peer silent for ``give_up_s`` (counted from the first
phase, or from its last packet) raises ``PeerLost``: training on without its shard's updates,
or alone, would be a silent failure.

Guarantees: a dead peer costs its peers at most one deadline cap of waiting per phase until it
is marked, then none; ``check`` raises within one phase of ``give_up_s`` being reached. The
``heard`` and ``ever`` arrays are written in place by the native engine too (it holds pointers
to them). Cost: two arrays of ``world`` entries; ``check`` is O(silent peers).
"""

from __future__ import annotations

import time

import numpy as np

from stalwart.comm.transport import UdpTransport

# a peer silent this long (seconds from the first phase, or from its last packet) stops the job:
# long enough for a restart of a neighbour's eval or checkpoint under loss (seconds), short
# enough that a dead rank or a blocked path is reported within the first minute
GIVE_UP_S = 60.0


class PeerLost(RuntimeError):
    """A peer sent nothing for ``give_up_s``: dead, or its packets cannot reach this rank."""


class Liveness:
    """Per peer: when it was last heard, whether ever, and whether it is silent (not waited
    for). Written under the collective's lock: an authenticated packet from a peer stamps
    ``heard`` and ``ever`` and takes it out of ``silent`` (the receiver does so in its hot
    path, per group of datagrams; the native engine stamps the arrays, and
    ``unsilence_spoken`` applies them)."""

    def __init__(self, world: int, rank: int, transport: UdpTransport,
                 give_up_s: float = GIVE_UP_S) -> None:
        self.rank, self.transport = rank, transport
        self.give_up_s = float(give_up_s)
        # perf_counter of each peer's latest packet (start: now, so a peer that never speaks
        # is given up on after one cap like any other)
        self.heard = np.full(world, time.perf_counter())
        self.ever = np.zeros(world, bool)  # any authenticated packet from it, ever
        self.silent: set[int] = set()
        self.silenced_at = np.zeros(world)
        self.t_first: float | None = None  # when the first phase started

    def unsilence_spoken(self) -> None:
        """Native engine: peers marked silent that spoke since (it stamps ``heard``)."""
        for s in [s for s in self.silent if self.heard[s] > self.silenced_at[s]]:
            self.silent.discard(s)

    def phase_started(self, t0: float) -> None:
        if self.t_first is None:
            self.t_first = t0

    def silence(self, s: int, quiet_after: float) -> None:
        """After a phase that hit its deadline with nothing from ``s``: mark it silent when
        nothing authenticated of any round came from it for ``quiet_after`` seconds (a peer
        merely stalled, or a round out of step, is not dead: giving up on it after one short
        deadline let the others run rounds ahead, beyond the rounds it buffers)."""
        now = time.perf_counter()
        if now - self.heard[s] >= quiet_after:
            self.silent.add(s)
            self.silenced_at[s] = time.perf_counter()

    def check(self) -> None:
        """Raise ``PeerLost`` for a peer silent for ``give_up_s``. A silent peer costs no wait
        once marked, so without this bound a dead owner's shard would freeze for the rest of
        the run (or, with every peer silent, each phase would wait a deadline forever) and a
        rank that never hears anyone -- a bind address its peers cannot reach -- would train
        on its own gradient."""
        assert self.t_first is not None
        now = time.perf_counter()
        for s in sorted(self.silent):
            quiet = now - max(self.heard[s], self.t_first)
            if quiet < self.give_up_s:
                continue
            me = f"{self.transport.addr[0]}:{self.transport.addr[1]}"
            if not self.ever[s]:
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
