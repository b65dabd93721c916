"""A tensor-parallel collective that will never complete (its peer left for a regroup) must
give up once the membership watcher says a member is lost, not wait out gloo's timeout
(overlap/comm.py ``TPComm.interrupt``). Real gloo ranks in spawned processes."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import spawn_ranks

pytestmark = pytest.mark.slow


def _rank(rank: int, world: int, store: str, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from stalwart.overlap.comm import TPComm

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    if rank == 1:  # the peer that never takes part (it is regrouping elsewhere)
        time.sleep(4.0)
        out.put((rank, "away"))
        return
    comm = TPComm(dist.group.WORLD)
    comm.interruptible = True
    threading.Timer(0.5, comm.interrupt, args=("a member was lost",)).start()
    t0 = time.monotonic()
    try:
        comm.finish(comm.start(torch.ones(8)))
        first, waited = "completed", time.monotonic() - t0
    except RuntimeError as e:
        first, waited = str(e), time.monotonic() - t0
    try:  # and nothing more is issued until the next rebind
        comm.start(torch.ones(8))
        second = "issued"
    except RuntimeError as e:
        second = str(e)
    out.put((rank, (first, round(waited, 2), second)))


def test_an_abandoned_tensor_parallel_collective_gives_up_when_interrupted(
        tmp_path: Path) -> None:
    got = spawn_ranks(_rank, 2, str(tmp_path / "store"), timeout=60)
    assert got[1] == "away"
    first, waited, second = got[0]
    assert "abandoned: a member was lost" in first, got
    assert waited < 3.0, got  # the interrupt, not gloo's timeout (30 min)
    assert "not issued: a member was lost" in second, got
