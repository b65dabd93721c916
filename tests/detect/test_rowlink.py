"""The monitor's row link over real sockets between real gloo ranks (rowlink.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import spawn_ranks


def _rank(rank: int, world: int, store: str, scenario: str, out: Any) -> None:
    import torch.distributed as dist

    from stalwart.rowlink import RowLinkError, StarRows

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    if scenario == "nolisten":  # rank 0 cannot bind this (TEST-NET) address
        try:
            StarRows(rank, world, 3, dist.group.WORLD, "192.0.2.1", timeout=20.0)
            out.put((rank, "set up"))
        except OSError as e:
            out.put((rank, f"OSError: {e}"))
        return
    link = StarRows(rank, world, 3, dist.group.WORLD, "127.0.0.1", timeout=20.0)
    if scenario == "rows":
        got = []
        for seq in range(5):
            link.issue(seq, [float(rank), float(seq), 7.0])
        for seq in range(5):
            got.append(link.read(seq))
        out.put((rank, got))
    elif scenario == "silent":  # rank 2 stays but sends nothing: rank 0's read times out
        link.set_timeout(1.0)
        if rank == 2:
            time.sleep(4.0)
            out.put((rank, "quiet"))
        else:
            link.issue(0, [float(rank), 0.0, 0.0])
            t0 = time.monotonic()
            try:
                link.read(0) if rank == 0 else None
                out.put((rank, "read"))
            except RowLinkError as e:
                out.put((rank, f"error after {time.monotonic() - t0:.1f}s: {e}"))
    else:  # rank 2 exits without a word; rank 0's read of its row must fail, not hang
        if rank == 2:
            link.close()
            out.put((rank, "left"))
            return
        link.issue(0, [float(rank), 0.0, 0.0])
        t0 = time.monotonic()
        try:
            link.read(0) if rank == 0 else None
            out.put((rank, "read"))
        except RowLinkError as e:
            out.put((rank, f"error after {time.monotonic() - t0:.1f}s: {e}"))
    link.close()


def _run(tmp_path: Path, scenario: str, world: int = 3) -> dict[int, object]:
    return spawn_ranks(_rank, world, str(tmp_path / "store"), scenario)


@pytest.mark.slow
def test_rank_0_reads_every_row_and_the_others_read_rank_0s(tmp_path: Path) -> None:
    res = _run(tmp_path, "rows")
    assert res[0] == [[[float(r), float(s), 7.0] for r in range(3)] for s in range(5)]
    for r in (1, 2):
        assert res[r] == [[[0.0, float(s), 7.0]] for s in range(5)]


@pytest.mark.slow
def test_a_peer_that_exits_makes_the_read_fail_at_once(tmp_path: Path) -> None:
    res = _run(tmp_path, "exit")
    assert res[2] == "left"
    assert isinstance(res[0], str) and "rank 2 closed" in res[0]
    assert float(res[0].split("after ")[1].split("s")[0]) < 10  # not the 20 s timeout


@pytest.mark.slow
def test_a_silent_peer_makes_the_read_fail_after_the_timeout(tmp_path: Path) -> None:
    res = _run(tmp_path, "silent")
    assert res[2] == "quiet"
    assert isinstance(res[0], str) and "no monitor row from rank 2 within 1.0 s" in res[0]
    assert 0.9 <= float(res[0].split("after ")[1].split("s")[0]) < 3.5


@pytest.mark.slow
def test_a_rank_0_that_cannot_listen_fails_setup_on_every_rank_without_a_hang(
        tmp_path: Path) -> None:
    res = _run(tmp_path, "nolisten")
    assert set(res) == {0, 1, 2}
    assert all(isinstance(v, str) and v.startswith("OSError") for v in res.values()), res
    assert "cannot listen" in str(res[1])
