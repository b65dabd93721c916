"""When a phase ends: the wait of one phase of the lossy collective, as a state machine.

Mechanism: OptiReduce's bounded-time phases (NSDI '25) as used by "Distributed Training under
Packet Loss", with the liveness rules this project needed on lossy testbeds. A phase ends at the
first of: every expected packet arrived (COMPLETE); every live sender's end marker arrived,
plus a short grace (ENDED); the agreed adaptive deadline (``deadline.AdaptiveDeadline``), or,
while a live peer has not started the round at all, the deadline cap (DEADLINE), both counted
from the end of this rank's own send. Nothing is ever retransmitted, so a phase lasts at most
its own send plus one cap whatever the network does.

``PhaseClock`` is the pure part -- an explicit ``PhaseState``: WAITING, LATE, GRACE and the
three final ones, fed observations (all done, all ended, someone late) and the time, answering
when to look again -- so its rules can be read and tested without sockets. ``PhaseWait.wait``
observes the round's counters under the receive lock, feeds the clock, sleeps until the clock's
wake time or until the receiver signals a change, and afterwards marks silent peers and raises
``PeerLost`` for one silent for ``give_up_s`` (``liveness``).

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

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

from stalwart.comm.deadline import AdaptiveDeadline
from stalwart.comm.layout import Layout
from stalwart.comm.liveness import GIVE_UP_S, Liveness, PeerLost  # noqa: F401 (re-exported)
from stalwart.comm.receiving import Receiver
from stalwart.comm.rounds import PhaseStats, RoundRing
from stalwart.comm.wire import PHASE_GRAD, PHASE_NORM


class Interrupted(RuntimeError):
    """The collective was interrupted (``LossyCollective.interrupt``: the job's membership
    changed, a peer is known to be gone): the phase in progress stops waiting."""


class PhaseState(StrEnum):
    """Where one phase's wait stands (a string: ``PhaseStats.end`` and the bench's rows)."""

    WAITING = "waiting"  # running: peers still sending, no marker from every live one yet
    LATE = "late"  # running: a live peer has not started the round (wait up to the cap)
    GRACE = "grace"  # running: every live sender's marker is in, a short grace left
    COMPLETE = "complete"  # final: every expected packet arrived
    ENDED = "ended"  # final: the grace after the markers ran out
    DEADLINE = "deadline"  # final: the deadline (or, for a late peer, the cap) ran out


WAITING, LATE, GRACE = PhaseState.WAITING, PhaseState.LATE, PhaseState.GRACE
COMPLETE, ENDED, DEADLINE = PhaseState.COMPLETE, PhaseState.ENDED, PhaseState.DEADLINE


@dataclass
class PhaseClock:
    """The end rule of one phase started at ``t0`` with deadline ``limit`` and cap ``cap``."""

    t0: float
    limit: float
    cap: float
    grace: Callable[[float], float]  # grace after the last marker, from the time elapsed
    sent: float | None = None  # when this rank's own sending was done (None: at t0)
    state: PhaseState = WAITING
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
    """Where one phase's wait went, from the observations of ``PhaseWait.wait``: when each peer
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




class PhaseWait:
    """The wait that ends each phase of this rank (the end rule: ``PhaseClock``).

    Guarantees: ``wait`` returns when the phase's clock reaches a final state, with the round's
    phase closed (later packets of it are late) and, after a deadline, the peers that sent
    nothing for a cap marked silent; it raises ``Interrupted`` once ``interrupt`` was called,
    ``receiving.ReceiveFailed`` past the handler's error bound, ``PeerLost`` for a peer silent
    for ``give_up_s``. A phase lasts at most this rank's own send plus one deadline cap.
    Cost: one look at the round's counters (O(world)) per wake-up; the native engine wakes
    this thread only when something it looks at changes.
    """

    def __init__(self, layout: Layout, rank: int, ring: RoundRing, receiver: Receiver,
                 live: Liveness, deadline: AdaptiveDeadline,
                 cond: threading.Condition, eng=None) -> None:
        self.layout, self.rank, self.ring, self.receiver = layout, rank, ring, receiver
        self.live, self.deadline, self.cond, self.eng = live, deadline, cond, eng
        self.interrupted: str | None = None  # why: every wait for packets raises Interrupted

    def interrupt(self, why: str) -> None:
        """From any thread: the wait in progress (or the next one) raises ``Interrupted``.
        Sticky."""
        self.interrupted = why
        self.wake()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()  # a waiting phase re-checks the handler's failures

    def expected(self, phase: int) -> dict[int, int]:
        """Packets expected from each peer in ``phase`` of a round."""
        world, lay = self.layout.world, self.layout
        if phase == PHASE_NORM:
            return {s: 1 for s in range(world) if s != self.rank}
        if phase == PHASE_GRAD:
            n = lay.n_chunks(self.rank)
            return {s: n for s in range(world) if s != self.rank}
        return {s: lay.n_chunks(s) for s in range(world) if s != self.rank}

    def wait(self, phase: int, t0: float, adapt: bool = True) -> PhaseStats:
        """Wait for the current round's ``phase`` (started at ``t0``; this rank's packets are
        sent by now) to end; returns its statistics (``sent`` and the protection counts are
        the caller's to fill). ``adapt``: the phase is a sample for the adaptive deadline."""
        st, rnd, eng, silent = self.ring.current, self.ring.round, self.eng, self.live.silent
        exp = self.expected(phase)
        total = sum(exp.values())
        sent = time.perf_counter()  # this rank's packets, parity and markers are sent
        clock = PhaseClock(t0, self.deadline.current(), self.deadline.cap, self.deadline.grace,
                           sent=sent)
        out = PhaseStats()
        self.live.phase_started(t0)
        account = WaitAccount(t0, sent)
        with self.cond:
            while True:
                self.receiver.check_handler()
                if self.interrupted is not None:
                    raise Interrupted(f"stalwart.comm: rank {self.rank}: {self.interrupted}")
                self.receiver.sync()
                now = time.perf_counter()
                live = [s for s in exp if s not in silent]
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
                if eng is not None:  # wake only when something read above changes
                    eng.watch(rnd, phase, [exp.get(s, -1) for s in range(self.layout.world)],
                              [s in silent for s in range(self.layout.world)])
                self.cond.wait(timeout=wake - now)
            st.closed[phase] = True
            if eng is not None:
                eng.close_phase(self.ring.slot, phase)
            out.deadline_hit = clock.deadline_hit
            out.elapsed = time.perf_counter() - t0
            out.end = clock.state.value
            account.fill(out)
            recv = int(st.got[phase].sum())
            out.recv = recv
            out.lost = total - recv
            if out.deadline_hit:
                for s in exp:
                    # silent = nothing authenticated from it, of ANY round, for a whole
                    # deadline cap (``Liveness.silence``). A peer that is merely stalled (a TCP
                    # retransmission in the job's eval or checkpoint traffic holds a rank
                    # 0.2-1 s under loss) or a round out of step is not dead: two pairs of
                    # ranks that gave up on each other after one short deadline never met
                    # again. A dead peer costs at most one cap of deadlines, then is not
                    # waited for.
                    if st.got[phase, s] == 0 and st.marker[phase, s] < 0:
                        self.live.silence(s, self.deadline.cap)
                out.silent = sorted(silent)
        completion = recv / total if total else 1.0
        # (a wait for a late peer measures its lateness, not the network: not a sample)
        if adapt and not clock.waited_late and (not out.deadline_hit or completion > 0):
            self.deadline.observe(self.rank, out.elapsed, completion)
        self.live.check()
        return out
