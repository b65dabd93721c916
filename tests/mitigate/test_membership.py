"""The membership record, the kill fault's grammar and the socket shutdown that wakes a rank
blocked in a collective (no processes of stalwart's: quick)."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from stalwart.config import ConfigError, RunConfig
from stalwart.mitigate import membership
from stalwart.mitigate.membership import Announcer, failstop_ok, in_place_ok
from stalwart.testbed import parse_fault


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


def test_generations_drop_the_lost_and_renumber_the_rest(tmp_path: Path) -> None:
    ann = Announcer(tmp_path, [0, 2, 3, 5])
    g0 = membership.read(tmp_path)
    assert g0 is not None and g0.gen == 0 and g0.world == 4
    g1 = ann.lose([2], step=7)
    assert membership.read(tmp_path) == g1
    assert (g1.gen, g1.alive, g1.hosts, g1.lost) == (1, (0, 1, 3), (0, 2, 5), (2,))
    assert [g1.rank_of(s) for s in range(4)] == [0, 1, None, 2]
    g2 = ann.lose([0], step=9)
    assert (g2.alive, g2.rank_of(3)) == ((1, 3), 1)
    # every generation rebuilds on a store of its own, and a new launch never reuses one
    assert membership.store_path(tmp_path, g1) != membership.store_path(tmp_path, g2)
    again = Announcer(tmp_path, [0, 1])
    assert again.current.token != g0.token and membership.read(tmp_path).gen == 0


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


def test_a_dead_rank_takes_its_tensor_parallel_group_out_with_it(tmp_path: Path) -> None:
    ann = Announcer(tmp_path, [0, 1, 2, 3, 4, 5])
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


def test_a_host_left_out_is_taken_back_by_its_own_launch_rank(tmp_path: Path) -> None:
    """S3 moves ranks between hosts, S4 leaves a host out; taking the host back finds its
    launch rank (processes stay on their hosts) and says who joined."""
    a = Announcer(tmp_path, [0, 1, 2, 3])
    g0 = a.current
    g1 = membership.with_hosts(g0, [0, 2, 1, 3], 10)  # S3: ranks in another order
    g2 = membership.with_hosts(g1, [0, 2, 3], 20)  # S4: host 1 out
    assert g2.alive == (0, 2, 3) and g2.lost == (1,) and g2.home == (0, 1, 2, 3)
    g3 = membership.with_hosts(g2, [0, 1, 2, 3], 40)  # host 1 back
    assert g3.alive == (0, 1, 2, 3) and g3.rank_of(1) == 1 and g3.planned
    assert membership.joined(g2, g3) == [1] and membership.joined(g1, g2) == []
    assert membership.Generation.from_dict(__import__("json").loads(g3.to_json())) == g3
    with pytest.raises(ValueError, match="hosts"):
        membership.with_hosts(g2, [0, 5], 41)  # never a host of the launch
    ready = membership.ready_path(tmp_path, g2.token, 1)
    assert ready.parent == tmp_path / membership.STORE_DIR and str(1) in ready.name


def test_a_live_restore_travels_as_a_marker_every_rank_reads_the_same_way() -> None:
    from stalwart.mitigate.decisions import RESTORE, Decision
    from stalwart.mitigate.rebalance import Rebalancer

    r = object.__new__(Rebalancer)
    r.hosts = [0, 2, 3]
    live = Decision(RESTORE, 3, 50, [1, 3, 4], 1, 0.25, "")
    assert r.planned_hosts(live) == [0, 1, 2, 3]
    restart = Decision(RESTORE, 3, 50, [0, 0, 0], 1, 0.25, "")  # no marker: a restart
    assert r.planned_hosts(restart) is None
