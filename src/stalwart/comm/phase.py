"""When a phase ends: the wait of one phase of the lossy collective, as a state machine.

Mechanism: OptiReduce's bounded-time phases (NSDI '25) as used by "Distributed Training under
Packet Loss", with the liveness rules this project needed on lossy testbeds. A phase ends at the
first of: every expected packet arrived (COMPLETE); every live sender's end marker arrived,
plus a short grace (ENDED); the agreed adaptive deadline (``deadline.AdaptiveDeadline``), or,
while a live peer has not started the round at all, the deadline cap (DEADLINE), both counted
from the end of this rank's own send. Nothing is ever retransmitted, so a phase lasts at most
its own send plus one cap whatever the network does.

``PhaseClock`` is the pure part -- states WAITING, LATE, GRACE and the three final ones, fed
observations (all done, all ended, someone late) and the time, answering when to look again --
so its rules can be read and tested without sockets. ``Phases._wait`` observes the round's
counters under the receive lock, feeds the clock, sleeps until the clock's wake time or until
the receiver signals a change, and afterwards marks silent peers and raises ``PeerLost`` for
one silent for ``give_up_s``.

Guarantees: the clock's wake time never exceeds ``start + cap`` while a peer is late, nor
``base + deadline`` otherwise (``base`` starts at ``start`` and moves to the moment a late peer
starts); ``start`` is when this rank's own packets were handed to the kernel (``sent``; ``t0``
when not given), so a phase lasts at most its own send plus one cap; a phase that waited for a
late peer is not used as a deadline sample (it measured the peer's lateness, not the network).
The deadline runs from the end of the own send, not from ``t0``: on a CPU-starved machine a
rank's send took 2.6-7.5 s of a 5 s cap, and a rank whose send outlasted the deadline gave up
at its first look on every chunk still in flight from peers that were as slow (measured: the
4 ranks of the bench's 10%-loss all-reduce held to 0.05 CPU in all, 641 of 45,216 chunks lost
at 11 deadlines, 9,894 of their packets arriving authentic but late).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from stalwart.comm.rounds import ROUNDS_OPEN, PhaseStats
from stalwart.comm.wire import PHASE_GRAD, PHASE_NORM

# a peer silent this long (seconds from the first phase, or from its last packet) stops the job:
# long enough for a restart of a neighbour's eval or checkpoint under loss (seconds), short
# enough that a dead rank or a blocked path is reported within the first minute
GIVE_UP_S = 60.0


class PeerLost(RuntimeError):
    """A peer sent nothing for ``give_up_s``: dead, or its packets cannot reach this rank."""


class Interrupted(RuntimeError):
    """The collective was interrupted (``LossyCollective.interrupt``: the job's membership
    changed, a peer is known to be gone): the phase in progress stops waiting."""


WAITING, LATE, GRACE = "waiting", "late", "grace"  # running states
COMPLETE, ENDED, DEADLINE = "complete", "ended", "deadline"  # final states


@dataclass
class PhaseClock:
    """The end rule of one phase started at ``t0`` with deadline ``limit`` and cap ``cap``."""

    t0: float
    limit: float
    cap: float
    grace: Callable[[float], float]  # grace after the last marker, from the time elapsed
    sent: float | None = None  # when this rank's own sending was done (None: at t0)
    state: str = WAITING
    base: float = 0.0  # when the phase's deadline started to run (a late peer moves it)
    start: float = 0.0  # when the waiting started: max(t0, sent)
    grace_from: float | None = None  # when every live sender had ended
    waited_late: bool = False  # waited past the deadline for a peer that had not started

    def __post_init__(self) -> None:
        self.start = self.t0 if self.sent is None else max(self.t0, self.sent)
        self.base = self.start

    @property
    def deadline_hit(self) -> bool:
        return self.state == DEADLINE

    def step(self, now: float, all_done: bool, all_ended: bool, late: bool) -> float | None:
        """Advance on an observation at ``now``; returns when to look again, or None when
        the phase is over (``state`` says how)."""
        if all_done:
            self.state = COMPLETE
            return None
        if all_ended and self.grace_from is None:
            self.grace_from = now
        if self.state == LATE and not late:
            self.base = now  # the late peer has started: its deadline runs from here
        self.state = LATE if late else GRACE if self.grace_from is not None else WAITING
        # a live peer of which nothing of this ROUND has arrived has not started it (loss
        # never takes all of a phase's packets and its 4 marker copies): it is late -- held
        # by its own gloo traffic, eval or checkpoint, where TCP waits out retransmission
        # timeouts under loss -- so wait for it up to the cap, and once it has started, give
        # it the phase's deadline from then on. Ending at the adaptive deadline instead left
        # the early ranks a phase ahead with nothing of it (seen at 10% loss: a rank entered
        # a step 0.6-4.8 s before the others, got 0 of 519 packets, and the run ended 2.2%
        # off); counting that deadline from the phase's start cut off a late peer's packets
        # as soon as its first ones arrived (116 chunks lost).
        wake = self.start + self.cap if late else self.base + self.limit
        self.waited_late |= late and now >= self.start + self.limit
        if self.grace_from is not None:
            wake = min(wake, self.grace_from + self.grace(self.grace_from - self.base))
        if now >= wake:
            self.state = DEADLINE if (now >= self.base + self.limit or late) else ENDED
            return None
        return wake


class WaitAccount:
    """Where one phase's wait went, from the observations of ``Phases._wait``: when each peer
    was first seen to have started the round and to have completed or ended the phase. The
    times are those of this rank's wake-ups (the native engine wakes it when a peer starts,
    completes or sends a marker), so they include its own scheduling delay."""

    def __init__(self, t0: float, sent: float | None = None) -> None:
        self.t0 = t0
        self.sent = t0 if sent is None else sent  # when this rank's own sending was done
        self.started: dict[int, float] = {}
        self.ended: dict[int, float] = {}

    def observe(self, now: float, started: Iterable[int], ended: Iterable[int]) -> None:
        for s in started:
            self.started.setdefault(s, now)
        for s in ended:
            self.ended.setdefault(s, now)

    def fill(self, out: PhaseStats) -> None:
        """``t_sent``, ``t_started`` (every peer seen started), ``t_ended`` (every peer
        complete or its marker in: the phase's end minus the grace or deadline wait) and
        ``last``."""
        out.t_sent = self.sent - self.t0
        out.t_started = max(self.started.values(), default=self.t0) - self.t0
        out.t_ended = (max(self.ended.values()) - self.t0) if self.ended else out.elapsed
        out.last = max(self.ended, key=self.ended.__getitem__) if self.ended else -1


class Phases:
    """The phase half of ``LossyCollective`` (a mixin: it works on the collective's state)."""

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
        sent = time.perf_counter()  # this rank's packets, parity and markers are sent
        clock = PhaseClock(t0, self.deadline.current(), self.deadline.cap, self.deadline.grace,
                           sent=sent)
        out = PhaseStats()
        if self._t_first is None:
            self._t_first = t0
        account = WaitAccount(t0, sent)
        with self._cond:
            while True:
                self._check_handler()
                if self.interrupted is not None:
                    raise Interrupted(f"stalwart.comm: rank {self.rank}: {self.interrupted}")
                self._sync()
                now = time.perf_counter()
                live = [s for s in exp if s not in self.silent]
                if not live:
                    # every peer silent: it is THIS rank that is out of step (ahead after the
                    # others lost a deadline to it, or cut off); finishing at once would let it
                    # train alone, rounds ahead, with every packet rejected as out of round.
                    # Wait for them instead: their packets of this round un-silence them.
                    live = list(exp)
                all_done = all(st.got[phase, s] >= exp[s] for s in live)
                all_ended = all(st.got[phase, s] >= exp[s] or st.marker[phase, s] >= 0
                                for s in live)
                # evidence of having started is per round, not per phase: a peer whose
                # gradients arrived but whose one-float norm was lost (all copies) is not
                # late, and waiting a cap for it stalled everyone 5 s
                late = any(not st.got[:, s].any() and (st.marker[:, s] < 0).all()
                           for s in live)
                account.observe(now, (s for s in live if st.got[:, s].any()
                                      or (st.marker[:, s] >= 0).any()),
                                (s for s in live if st.got[phase, s] >= exp[s]
                                 or st.marker[phase, s] >= 0))
                wake = clock.step(now, all_done, all_ended, late)
                if wake is None:
                    break
                if self._eng is not None:  # wake only when something read above changes
                    self._eng.watch(self.round, phase,
                                    [exp.get(s, -1) for s in range(self.world)],
                                    [s in self.silent for s in range(self.world)])
                self._cond.wait(timeout=wake - now)
            st.closed[phase] = True
            if self._eng is not None:
                self._eng.close_phase(self.round % ROUNDS_OPEN, phase)
            out.deadline_hit = clock.deadline_hit
            out.elapsed = time.perf_counter() - t0
            out.end = clock.state
            account.fill(out)
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
        if adapt and not clock.waited_late and (not out.deadline_hit or completion > 0):
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
