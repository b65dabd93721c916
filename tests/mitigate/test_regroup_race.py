"""A member that dies in the middle of a regroup (a rank started to rejoin, killed as the
generation taking it back was announced) breaks the others' new connections before the
launcher has announced the generation without it. The survivors must wait for that word and
regroup again, not count the broken regroup a failure of their own (which would checkpoint
and relaunch the job). Real processes, gloo and the rank side of regroup.py; the test plays
the launcher, late on purpose."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import torch

from stalwart.elastic.launcher import LauncherStore
from stalwart.elastic.ranklink import RankLink
from stalwart.launch import free_port
from stalwart.mitigate import membership
from stalwart.mitigate.regroup import Regrouper, agree_state
from stalwart.train.inplace import regroup_until_done

LAUNCHER_LATE_S = 1.0  # the launcher's word comes this long after the death


class _Member:
    """The part of a rank that ``regroup_until_done`` drives: groups, then the agreed state."""

    def __init__(self, port: int, token: str, slot: int, dies: bool) -> None:
        self.regrouper = Regrouper(RankLink("127.0.0.1", port, "job", token), slot)
        self.dies = dies
        self.model = torch.nn.Linear(4, 4)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def regroup(self, applied: int, why: str) -> int:
        self.regrouper.regroup("gloo", timeout_s=30)
        if self.dies:
            os._exit(3)  # in the new groups, gone before the first collective
        return agree_state(self.model, self.opt, applied)[0]


def _rank(port: int, token: str, slot: int, dies: bool, ready: Any, out: Any) -> None:
    os.environ["STALWART_HOST_ADDR"] = "127.0.0.1"
    m = _Member(port, token, slot, dies)
    ready.put(slot)  # watching generation 0: the next one announced wakes it
    try:
        done = regroup_until_done(m, 10 + slot, "planned")  # type: ignore[arg-type]
        out.put((slot, "ok", m.regrouper.current.gen, torch.distributed.get_world_size(),
                 done))
    except Exception as e:  # noqa: BLE001 -- reported to the test
        out.put((slot, "failed", type(e).__name__, str(e)[:200], 0))
    finally:
        m.regrouper.close()


def test_survivors_of_a_member_lost_mid_regroup_regroup_again_without_it(
        tmp_path: Path) -> None:
    port = free_port()
    store = LauncherStore([], "127.0.0.1", port, "job", tmp_path, commands=True)
    members = membership.Announcer(store.pipe, "job", [0, 1, 2])
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(port, members.token, s, s == 2, ready, out))
             for s in range(3)]
    for p in procs:
        p.start()
    try:
        assert sorted(ready.get(timeout=60) for _ in procs) == [0, 1, 2]
        # every member regroups at a planned generation (as for a host taken back), which
        # rank 0 writes ...
        members.link.propose_generation(membership.with_hosts(members.current, [0, 1, 2], 5))
        procs[2].join(timeout=60)
        assert procs[2].exitcode == 3
        # ... member 2 dies in it; the launcher says so, late
        time.sleep(LAUNCHER_LATE_S)
        g = members.lose([2], 5)
        got = sorted(out.get(timeout=60) for _ in range(2))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        store.close()
    # both survivors are in the generation without member 2, with the most advanced state
    assert got == [(0, "ok", g.gen, 2, 11), (1, "ok", g.gen, 2, 11)], got
