"""The membership generations on the launch's store (the launcher's pipe and a rank's
connection to one real store process), the kill fault's grammar and the socket shutdown that
wakes a rank blocked in a collective (no ranks: quick)."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stalwart.config import ConfigError, RunConfig
from stalwart.elastic.launcher import LauncherStore
from stalwart.elastic.ranklink import RankLink
from stalwart.events import RankLost
from stalwart.launch import free_port
from stalwart.mitigate import membership
from stalwart.mitigate.membership import Announcer, failstop_ok, in_place_ok
from stalwart.rundir import EventLog, RunData
from stalwart.testbed import parse_fault

JOB = "job"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LauncherStore]:
    """One store process in launcher mode (its stdin takes the launcher's operations)."""
    st = LauncherStore([], "127.0.0.1", free_port(), JOB, tmp_path_factory.mktemp("store"),
                       commands=True)
    yield st
    st.close()


def _rank_view(st: LauncherStore, ann: Announcer) -> RankLink:
    """A rank's connection to launch ``ann``'s records."""
    port = int(st.env["STALWART_STORE"].rpartition(":")[2])
    return RankLink("127.0.0.1", port, JOB, ann.token)


def test_kill_fault_parses_a_step_or_seconds_and_stays_on() -> None:
    f = parse_fault("kill:rank=3,at=60", 4, "netns")
    assert (f.kind, f.rank, f.start, f.end, f.target) == ("kill", 3, 60, None, "rank3")
    assert not f.active_at(59) and f.active_at(60) and f.active_at(10**6)
    g = parse_fault("kill:rank=0,at=2.5s", 2, "local")
    assert g.start_s == 2.5 and not g.active_at(100, 2.4) and g.active_at(0, 2.5)
    assert g.event_fields()["rank"] == 0


@pytest.mark.parametrize("spec,needle", [
    ("kill:rank=4,at=3", "rank=4 out of range"),
    ("kill:rank=1", "missing at="),
    ("kill:rank=1,at=-2", "at=-2"),
    ("kill:rank=1,at=x", "at='x'"),
    ("kill:rank=1,at=5,end=9", "unknown parameter 'end'"),
])
def test_kill_fault_errors_name_the_bad_value(spec: str, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_fault(spec, 4, "local")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_generations_drop_the_lost_and_renumber_the_rest(store: Any) -> None:
    ann = Announcer(store.pipe, JOB, [0, 2, 3, 5])
    rank = _rank_view(store, ann)
    g0 = rank.first()  # written before the store may serve: a rank waits for it
    assert g0 == ann.current and g0.gen == 0 and g0.world == 4
    g1 = ann.lose([2], step=7)
    assert rank.newest(g0) == g1 and rank.generation(1) == g1
    assert (g1.gen, g1.alive, g1.hosts, g1.lost) == (1, (0, 1, 3), (0, 2, 5), (2,))
    assert [g1.rank_of(s) for s in range(4)] == [0, 1, None, 2]
    g2 = ann.lose([0], step=9)
    assert (g2.alive, g2.rank_of(3)) == ((1, 3), 1)
    assert rank.newest(g0) == g2
    # a new launch (a relaunch, a resumed run) has a new token: its ranks never read the
    # older launch's generations
    again = Announcer(store.pipe, JOB, [0, 1])
    fresh = _rank_view(store, again)
    assert again.token != ann.token and fresh.newest(fresh.first()).gen == 0
    assert fresh.generation(1) is None and rank.newest(g0) == g2


def test_generations_only_grow_whoever_writes_first(store: Any) -> None:
    """Rank 0's planned change and the launcher's lost rank race for the same generation
    number: the first writer wins, and the other's change is built on it (the launcher's)
    or dropped (rank 0's: the step loop regroups to the launcher's generation)."""
    ann = Announcer(store.pipe, JOB, [0, 1, 2, 3])
    rank0 = _rank_view(store, ann)
    g0 = rank0.first()
    planned = membership.with_hosts(g0, [0, 2, 1, 3], 10)  # S3, by rank 0
    assert rank0.propose(planned) == planned
    g2 = ann.lose([3], step=11)  # built on rank 0's generation 1, not on generation 0
    assert (g2.gen, g2.alive, g2.hosts) == (2, (0, 2, 1), (0, 2, 1))
    late = membership.with_hosts(planned, [0, 2], 12)  # rank 0 had not seen g2
    assert late.gen == 2 and rank0.propose(late) == g2  # the launcher's stays
    assert rank0.newest(g0) == g2 and ann.newest() == g2


def test_auto_jobs_regroup_in_place_and_survive_a_death() -> None:
    assert in_place_ok(RunConfig(nproc=4, mitigate="auto"))
    assert not in_place_ok(RunConfig(nproc=4, mitigate="off"))
    assert in_place_ok(RunConfig(nproc=4, mitigate="auto", tp=2))
    # lossy jobs too: the owners' optimizer state is re-sharded between the live ranks
    assert in_place_ok(RunConfig(nproc=4, mitigate="auto", comm="lossy"))
    assert failstop_ok(RunConfig(nproc=4, mitigate="auto", comm="lossy"))
    assert not in_place_ok(RunConfig(nproc=4, mitigate="rebalance", comm="lossy"))
    assert failstop_ok(RunConfig(nproc=4, mitigate="auto"))
    assert failstop_ok(RunConfig(nproc=4, mitigate="auto", tp=2))
    assert not failstop_ok(RunConfig(nproc=4, mitigate="off", tp=2))


def test_a_dead_rank_takes_its_tensor_parallel_group_out_with_it(store: Any) -> None:
    ann = Announcer(store.pipe, JOB, [0, 1, 2, 3, 4, 5])
    # TP groups of 2 are runs of consecutive ranks: (0, 1), (2, 3), (4, 5)
    assert membership.survivors(ann.current, [3], tp=2) == ([0, 1, 4, 5], [2])
    assert membership.survivors(ann.current, [3], tp=1) == ([0, 1, 2, 4, 5], [])
    assert membership.survivors(ann.current, [0, 5], tp=3) == ([], [1, 2, 3, 4])
    g1 = ann.lose([3], step=4, tp=2)
    assert (g1.alive, g1.hosts, g1.lost) == ((0, 1, 4, 5), (0, 1, 4, 5), (3,))
    # the groups of the next generation are taken in its own order: (0, 1), (4, 5)
    assert membership.survivors(g1, [4], tp=2) == ([0, 1], [5])


def test_shutdown_wakes_a_blocked_reader_and_spares_kept_ports() -> None:
    from stalwart.mitigate.regroup import shutdown_tcp

    server = socket.create_server(("127.0.0.1", 0))
    kept_server = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(server.getsockname())
    b, _ = server.accept()
    kept = socket.create_connection(kept_server.getsockname())
    kept_peer, _ = kept_server.accept()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(a.recv(10)))
    reader.start()  # blocked: nothing is ever sent on a-b
    n = shutdown_tcp({kept_server.getsockname()[1]})
    reader.join(timeout=10)
    assert not reader.is_alive() and got == [b""]  # woken with end-of-stream
    assert n >= 2  # both ends of a-b live in this process
    kept.sendall(b"x")  # the kept connection still works, and so does the listener
    assert kept_peer.recv(1) == b"x"
    extra = socket.create_connection(kept_server.getsockname())
    for s in (a, b, kept, kept_peer, extra, server, kept_server):
        s.close()


def test_a_host_left_out_is_taken_back_by_its_own_launch_rank(store: Any) -> None:
    """S3 moves ranks between hosts, S4 leaves a host out; taking the host back finds its
    launch rank (processes stay on their hosts) and says who joined; the rank started again
    says it is ready in a record the launcher reads."""
    a = Announcer(store.pipe, JOB, [0, 1, 2, 3])
    g0 = a.current
    g1 = membership.with_hosts(g0, [0, 2, 1, 3], 10)  # S3: ranks in another order
    g2 = membership.with_hosts(g1, [0, 2, 3], 20)  # S4: host 1 out
    assert g2.alive == (0, 2, 3) and g2.lost == (1,) and g2.home == (0, 1, 2, 3)
    g3 = membership.with_hosts(g2, [0, 1, 2, 3], 40)  # host 1 back
    assert g3.alive == (0, 1, 2, 3) and g3.rank_of(1) == 1 and g3.planned
    assert membership.joined(g2, g3) == [1] and membership.joined(g1, g2) == []
    assert membership.Generation.from_json(g3.to_json()) == g3
    assert membership.Generation.from_dict(json.loads(g3.to_json())).home == g3.home
    with pytest.raises(ValueError, match="hosts"):
        membership.with_hosts(g2, [0, 5], 41)  # never a host of the launch
    joiner = _rank_view(store, a)
    assert a.link.ready(1) is None
    joiner.ready(1)
    got = a.link.ready(1)
    assert got is not None and (got.slot, got.pid) == (1, os.getpid())
    a.link.clear_ready(1)  # the next try's start says it anew
    assert a.link.ready(1) is None


def test_a_live_restore_travels_as_a_marker_every_rank_reads_the_same_way() -> None:
    from stalwart.mitigate.decisions import RESTORE, Decision
    from stalwart.mitigate.rebalance import Rebalancer

    r = object.__new__(Rebalancer)
    r.hosts = [0, 2, 3]
    live = Decision(RESTORE, 3, 50, [1, 3, 4], 1, 0.25, "")
    assert r.planned_hosts(live) == [0, 1, 2, 3]
    restart = Decision(RESTORE, 3, 50, [0, 0, 0], 1, 0.25, "")  # no marker: a restart
    assert r.planned_hosts(restart) is None


def test_a_take_back_request_reaches_rank_0_once_as_a_live_restore(store: Any) -> None:
    """The launcher's probe asks (a ``TakeBack`` record); rank 0's plan reads it at its next
    exchange, removes it, and decides a live restore that every rank can turn into the same
    host map."""
    from stalwart.mitigate.decisions import RESTORE
    from stalwart.mitigate.policy import Policy
    from stalwart.mitigate.probe import HostProbe
    from stalwart.mitigate.rebalance import Rebalancer

    ann = Announcer(store.pipe, JOB, [0, 1, 2, 3])
    rank0 = _rank_view(store, ann)
    r = object.__new__(Rebalancer)
    r.hosts, r.in_place, r.link = [0, 2, 3], True, rank0
    r.policy = Policy(3, 12)
    assert r._control(50) is None  # nothing asked
    probe = HostProbe(object(), 1, [0, 2, 3], ann.link)
    probe.stop()
    probe.request("host 1 healthy for 2 probes", groups=3)
    dec = r._control(50)
    assert dec is not None and (dec.kind, dec.target, dec.start_step) == (RESTORE, 1, 50)
    assert dec.reason == "host 1 healthy for 2 probes" and dec.predicted_gain == 0.25
    assert r.planned_hosts(dec) == [0, 1, 2, 3]  # live: its rank is waiting to join
    assert r._control(52) is None  # read once
    probe.close()


def test_a_rank_says_why_it_exits_and_the_launcher_reads_it(store: Any) -> None:
    """A rank that exits 0 early writes why first (left, fell back with its saved state, left
    for a restart with the host map); one that finished writes nothing; a rank started again
    does not inherit its earlier process's record."""
    from stalwart.elastic.runlink import FALLBACK, LEFT, RESTART, ExitRecord
    from stalwart.mitigate.fallback import Saved

    ann = Announcer(store.pipe, JOB, [0, 1, 2])
    rank = _rank_view(store, ann)
    saved = Saved(1, 6, 0, "cannot build the groups", False, 12.5, False)
    recs = [ExitRecord(0, RESTART, 30, "host 2 slow", (0, 1), "exclude", 0.2, 0.05),
            ExitRecord(1, FALLBACK, 6, "cannot build the groups", saved=saved),
            ExitRecord(2, LEFT, 40)]
    assert [ann.link.exit_of(s) for s in range(3)] == [None, None, None]  # finished
    for rec in recs:
        rank.exiting(rec)
    got = [ann.link.exit_of(s) for s in range(3)]
    assert got == recs and got[1] is not None and got[1].saved == saved
    assert ExitRecord.from_json(recs[0].to_json()).hosts == (0, 1)
    ann.link.clear_exit(2)  # launch rank 2 is started again to rejoin
    assert ann.link.exit_of(2) is None
    # the next launch never reads these
    assert Announcer(store.pipe, JOB, [0, 1, 2]).link.exit_of(1) is None


def test_a_rank_lost_after_rank_0_changed_the_membership_is_found_in_the_newest(
        store: Any, tmp_path: Path) -> None:
    """The launcher's own view can be behind rank 0's planned generations (a host taken
    back live): a rank that joined that way and then dies is looked up in the newest
    generation, and the next one leaves it out."""
    from stalwart.rankexits import lose_ranks

    class Proc:
        def poll(self) -> int | None:
            return None

    ann = Announcer(store.pipe, JOB, [0, 1, 2, 3])
    g1 = ann.lose([1], step=5)  # launch rank 1 lost; the launcher's view is g1
    rank0 = _rank_view(store, ann)
    back = membership.with_hosts(g1, [0, 1, 2, 3], 30)  # rank 0 takes host 1 back live
    assert rank0.propose(back) == back and ann.current == g1
    events = EventLog(tmp_path)  # the run directory's own log, read back below
    procs: dict[int, Any] = {0: Proc(), 2: Proc(), 3: Proc()}  # 1 died (already dropped)
    assert lose_ranks([(1, -9)], {**procs, 1: Proc()}, ann, tmp_path, events,  # type: ignore
                      lambda _: None, 40)
    events.close()
    lost = RunData.load(tmp_path).events_of(RankLost)
    assert len(lost) == 1 and lost[0]["host"] == 1
    g3 = ann.current
    assert (g3.gen, g3.alive, g3.lost) == (3, (0, 2, 3), (1,))
