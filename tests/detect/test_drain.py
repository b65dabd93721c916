"""``Monitor.drain`` in the detect benchmark's overhead loop, with real monitors on a real
two-rank gloo job: where the ABBA schedule turns the monitor off, the "on" step before it
must not end until the exchange it issued is complete -- on the socket row link and on the
gloo all-gather it falls back to."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import spawn_ranks

WARM = 1  # steps 0-1 on, 2-3 off, 4-5 on: the schedule drains at the end of steps 1 and 5
STEPS = 7
DELAY = 1.0  # rank 1 issues its row this late on the steps that drain


def _rank(rank: int, world: int, store: str, out: Any) -> None:
    import torch.distributed as dist

    from stalwart.bench.detect import abba, begin_step, end_step
    from stalwart.detect import Monitor
    from stalwart.detect.exchange import Exchange
    from stalwart.rowlink import GlooRows

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    res: dict[str, Any] = {}
    for link in ("sockets", "gloo"):
        # one exchange per step, each read at the next check (as the benchmark's reliable runs)
        mon = Monitor(rank=rank, world=world, check_every=1)
        if link == "gloo":
            assert mon.exchange is not None
            mon.exchange.rows.close()
            mon.exchange.rows = GlooRows(rank, world, Exchange.width(1), mon.group())
        issued: dict[int, float] = {}
        ended: dict[int, float] = {}
        for step in range(STEPS):
            begin_step(mon, step, WARM)
            if rank == 1 and abba(step, WARM)[1]:
                time.sleep(DELAY)  # rank 0 is long at its end of this step
            issued[step] = time.time()
            end_step(mon, step, WARM, {"step_time": 0.01, "compute_time": 0.01,
                                       "comm_time": 0.0})
            ended[step] = time.time()
        res[link] = {"issued": issued, "ended": ended, "exchanges": mon.exchange.exchanges}
        mon.close()
    out.put((rank, res))
    dist.destroy_process_group()


@pytest.mark.slow
def test_an_on_step_that_an_off_step_follows_ends_only_when_its_exchange_is_complete(
        tmp_path: Path) -> None:
    from stalwart.bench.detect import abba

    res = spawn_ranks(_rank, 2, str(tmp_path / "store"), timeout=120)
    drains = [s for s in range(STEPS) if abba(s, WARM)[1]]
    assert drains == [1, 5]
    ons = sum(abba(s, WARM)[0] for s in range(STEPS))
    for link in ("sockets", "gloo"):
        r0, r1 = res[0][link], res[1][link]
        for s in drains:
            # rank 0 got to the end of step s ~DELAY before rank 1 issued its row; without
            # a real wait it would have left the step (and started the "off" one) at once
            assert r0["ended"][s] >= r1["issued"][s], (link, s)
            assert r0["ended"][s] - r0["issued"][s] > DELAY / 2, (link, s)
        # drained exchanges stay queued and are read at their checks: one per "on" step
        assert r0["exchanges"] == r1["exchanges"] == ons, link
