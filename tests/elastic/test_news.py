"""How fast a member hears of a membership change (elastic/rank.py): a generation another member
writes is adopted at once (the store wakes the generation waiter), not at the watcher's next
round; a joiner proposes its own admission as soon as it is registered. The watchers here run
one round every 30 s -- the first at once -- so anything quicker than that came from the
waiter or the first round. Real store, sockets and threads."""

from __future__ import annotations

import time
from collections.abc import Callable

from stalwart.elastic import protocol as P
from stalwart.elastic.rank import Runtime
from stalwart.elastic.store import Keys, client, serve

SLOW_ROUND_S = 30.0


def member(port: int, node: str) -> Runtime:
    return Runtime("127.0.0.1", port, "t/", node, 0, "127.0.0.1", min_world=1,
                   heartbeat_s=SLOW_ROUND_S, dead_after_s=3 * SLOW_ROUND_S)


def within(cond: Callable[[], bool], seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_a_generation_written_elsewhere_is_adopted_at_once_and_close_ends_the_wait() -> None:
    srv = serve("127.0.0.1", 0)
    rt = member(srv.port, "a")
    try:
        assert within(lambda: rt.newest is not None and rt.newest.gen == 0, 5.0)
        rt.wake.clear()
        other = Keys(client("127.0.0.1", srv.port, "t/"), "store")
        other.propose(P.Generation(1, (rt.me.id,), (), "written elsewhere"))
        assert within(lambda: rt.newest is not None and rt.newest.gen == 1, 2.0)
        assert rt.wake.is_set() and rt.newest.why == "written elsewhere"
    finally:
        t0 = time.monotonic()
        rt.close()
    assert time.monotonic() - t0 < 3.0 and not rt._waiter.is_alive()


def test_a_joiner_is_admitted_as_soon_as_it_registers() -> None:
    srv = serve("127.0.0.1", 0)
    a = member(srv.port, "a")
    b = None
    try:
        assert within(lambda: a.newest is not None and a.newest.gen == 0, 5.0)
        b = member(srv.port, "b")
        both = (a.me.id, b.me.id)
        assert within(lambda: all(r.newest is not None and r.newest.members == both
                                  for r in (a, b)), 2.0), (a.newest, b.newest)
        assert a.newest is not None and a.newest.gen == 1
        assert a.newest.why == f"joined {b.me.id}"
    finally:
        for r in (b, a):
            if r is not None:
                r.close()
