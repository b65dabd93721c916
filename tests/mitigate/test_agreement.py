"""The plan's agreement over the rank-0 control channel (agreement.py on rowlink.py): real
gloo ranks in spawned processes, real sockets. Every rank must install rank 0's decision at
the same step, rank 0 must decide from every rank's measurements, and a peer that exits must
make the next read fail at once instead of hanging the job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stalwart.mitigate.agreement import REBALANCE, Decision, PlanChannel
from tests.helpers import spawn_ranks

pytestmark = pytest.mark.slow

EVERY = 2
STEPS = 12


def _rank(rank: int, world: int, store: str, scenario: str, out: Any) -> None:
    import torch.distributed as dist

    from stalwart.rowlink import RowLinkError

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    ch = PlanChannel(world, world, row_len=3, every=EVERY)
    seen: list[tuple[int, Any]] = []
    try:
        for step in range(STEPS):
            if scenario == "exit" and rank == 2 and step == 5:
                ch.close()
                out.put((rank, "left"))
                return
            if not ch.due(step):
                continue
            rows, dec = ch.receive()
            if dec is not None:
                seen.append((step, (dec.kind, dec.version, dec.start_step, dec.counts,
                                    dec.target, dec.predicted_gain)))
            if rows is not None:
                seen.append((step, [r[0] for r in rows]))
            out_dec = None
            if rank == 0 and step == 3:  # decided from the exchange read at step 3
                out_dec = Decision(REBALANCE, 1, ch.start_for(step), [5, 5, 6], target=2,
                                   predicted_gain=0.125)
            ch.send([10.0 * rank + step, 0.5, float(step)], out_dec)
        ch.close()
        out.put((rank, seen))
    except RowLinkError as e:
        out.put((rank, f"RowLinkError: {e}"))


def test_every_rank_installs_rank_0s_decision_at_the_same_step(tmp_path: Path) -> None:
    res = spawn_ranks(_rank, 3, str(tmp_path / "store"), "rows")
    decided = (REBALANCE, 1, 3 + EVERY + 1, [5, 5, 6], 2, 0.125)
    for r in range(3):
        got = dict(s for s in res[r] if isinstance(s[1], tuple))
        assert got == {5: decided}, (r, res[r])
    # rank 0 reads every rank's row of the previous exchange; the others read rank 0's
    rows0 = [v for s, v in res[0] if isinstance(v, list)]
    assert rows0[0] == [1.0, 11.0, 21.0]  # sent at step 1, read at step 3
    for r in (1, 2):
        assert [v for s, v in res[r] if isinstance(v, list)][0] == [1.0]


def test_a_peer_that_exits_fails_rank_0s_next_read(tmp_path: Path) -> None:
    res = spawn_ranks(_rank, 3, str(tmp_path / "store"), "exit", timeout=60)
    assert res[2] == "left"
    assert isinstance(res[0], str) and "rank 2 closed the plan's row link" in res[0], res[0]


def test_one_process_reads_back_its_own_decision() -> None:
    ch = PlanChannel(1, 1, row_len=3, every=EVERY)
    assert ch.receive() == (None, None)
    ch.send([1.0, 2.0, 3.0], Decision(REBALANCE, 4, 9, [7], 0, 0.5))
    rows, dec = ch.receive()
    assert rows == [[1.0, 2.0, 3.0]]
    assert dec is not None and (dec.kind, dec.version, dec.start_step, dec.counts,
                                dec.target, dec.predicted_gain) == (REBALANCE, 4, 9, [7], 0, 0.5)
    ch.send([0.0, 0.0, 0.0], None)
    assert ch.receive()[1] is None
