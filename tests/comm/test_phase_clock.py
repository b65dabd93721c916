"""The end rule of a phase (``phase.PhaseClock``), driven by observations: pure, no sockets."""

from __future__ import annotations

from stalwart.comm.phase import COMPLETE, DEADLINE, ENDED, GRACE, LATE, WAITING, PhaseClock


def clock(limit: float = 1.0, cap: float = 5.0) -> PhaseClock:
    return PhaseClock(t0=0.0, limit=limit, cap=cap, grace=lambda elapsed: 0.05 * elapsed)


def test_every_packet_in_ends_the_phase_at_once() -> None:
    c = clock()
    assert c.step(0.1, all_done=False, all_ended=False, late=False) == 1.0
    assert c.state == WAITING
    assert c.step(0.2, all_done=True, all_ended=True, late=False) is None
    assert c.state == COMPLETE and not c.deadline_hit


def test_all_markers_in_ends_after_a_grace_not_the_deadline() -> None:
    c = clock()
    wake = c.step(0.4, all_done=False, all_ended=True, late=False)
    assert c.state == GRACE and wake == 0.4 + 0.05 * 0.4
    assert c.step(wake, all_done=False, all_ended=True, late=False) is None
    assert c.state == ENDED and not c.deadline_hit


def test_the_deadline_ends_a_phase_with_packets_missing() -> None:
    c = clock(limit=1.0)
    assert c.step(0.5, all_done=False, all_ended=False, late=False) == 1.0
    assert c.step(1.0, all_done=False, all_ended=False, late=False) is None
    assert c.state == DEADLINE and c.deadline_hit and not c.waited_late


def test_a_late_peer_is_waited_for_up_to_the_cap_then_given_a_whole_deadline() -> None:
    c = clock(limit=1.0, cap=5.0)
    assert c.step(0.5, all_done=False, all_ended=False, late=True) == 5.0  # the cap
    assert c.state == LATE
    assert c.step(2.0, all_done=False, all_ended=False, late=True) == 5.0
    assert c.waited_late  # past the deadline for a late peer: not a deadline sample
    # its first packet at 3.0: from then on its deadline runs
    assert c.step(3.0, all_done=False, all_ended=False, late=False) == 4.0
    assert c.step(4.0, all_done=False, all_ended=False, late=False) is None
    assert c.deadline_hit


def test_a_peer_that_never_starts_costs_one_cap() -> None:
    c = clock(limit=1.0, cap=5.0)
    assert c.step(0.0, all_done=False, all_ended=False, late=True) == 5.0
    assert c.step(5.0, all_done=False, all_ended=False, late=True) is None
    assert c.deadline_hit


def test_the_deadline_runs_from_the_end_of_the_own_send() -> None:
    """A rank whose own send outlasted the deadline (a CPU-starved machine: 2.6-7.5 s sends
    against a 5 s cap, measured) still gives its peers' packets a whole deadline, and a late
    peer the cap, from then on; before, it gave up on every chunk in flight at its first look."""
    c = PhaseClock(t0=0.0, limit=1.0, cap=5.0, grace=lambda e: 0.05 * e, sent=1.5)
    assert c.step(1.5, all_done=False, all_ended=False, late=False) == 2.5
    assert c.state == WAITING and not c.deadline_hit
    assert c.step(2.5, all_done=False, all_ended=False, late=False) is None
    assert c.deadline_hit  # one deadline after the send, not more
    late = PhaseClock(t0=0.0, limit=1.0, cap=5.0, grace=lambda e: 0.05 * e, sent=6.0)
    assert late.step(6.0, all_done=False, all_ended=False, late=True) == 11.0
    assert late.step(11.0, all_done=False, all_ended=False, late=True) is None
    assert late.deadline_hit  # a peer that never starts costs the own send plus one cap
    # a send within the deadline changes nothing but where the deadline is counted from
    quick = PhaseClock(t0=0.0, limit=1.0, cap=5.0, grace=lambda e: 0.05 * e, sent=0.2)
    assert quick.step(0.5, all_done=True, all_ended=True, late=False) is None
    assert quick.state == COMPLETE


def test_the_wait_account_names_the_last_peer_and_the_split() -> None:
    from stalwart.comm.phase import WaitAccount
    from stalwart.comm.rounds import PhaseStats

    acc = WaitAccount(t0=10.0, sent=10.05)
    acc.observe(10.1, started=[1], ended=[])
    acc.observe(10.3, started=[1, 2], ended=[1])
    acc.observe(10.9, started=[1, 2], ended=[1, 2])  # peer 2 ends last; re-seen 1 keeps 10.3
    out = PhaseStats(elapsed=1.0)
    acc.fill(out)
    assert (round(out.t_sent, 6), round(out.t_started, 6), round(out.t_ended, 6), out.last) == (
        0.05, 0.3, 0.9, 2)
    empty = PhaseStats(elapsed=2.0)
    WaitAccount(t0=0.0).fill(empty)  # nobody seen: the whole phase was the wait
    assert (empty.t_started, empty.t_ended, empty.last) == (0.0, 2.0, -1)
