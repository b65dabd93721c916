"""After a regroup every rank agrees on the work at the agreed step boundary (its evaluation
and checkpoint). A member lost during the evaluation's all-reduce can leave it completed on
some survivors and failed on others; deciding from each rank's own record put one survivor in
the evaluation's all-reduce and another in the next step's gradient all-reduce (gloo:
``op.preamble.length <= op.nbytes. 120576 vs 8``). Real processes and gloo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from stalwart.mitigate.regroup import agree_boundary
from tests.helpers import spawn_ranks

pytestmark = pytest.mark.slow

# per rank: (its record of the boundary at step 7, joining)
CASES: dict[str, list[tuple[set, bool]]] = {
    "one rank evaluated": [({("eval", 7), ("ckpt", 5)}, False), ({("ckpt", 5)}, False),
                           (set(), True)],
    "all evaluated, a joiner": [({("eval", 7)}, False), ({("eval", 7)}, False), (set(), True)],
}


def _rank(rank: int, world: int, store: str, out: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        out.put((rank, {name: agree_boundary(7, *case[rank]) for name, case in CASES.items()}))
    finally:
        dist.destroy_process_group()


def test_the_ranks_agree_on_the_boundarys_evaluation_and_checkpoint(tmp_path: Path) -> None:
    # the timeout only keeps a hung rank from hanging the test: 3 spawned torch imports
    # took over 60 s at load average ~30
    got = spawn_ranks(_rank, 3, str(tmp_path / "store"), timeout=300)
    # redone by all when one rank lacks it; a joiner leaves it to the others
    assert got[0]["one rank evaluated"] == {("ckpt", 5)}
    assert got[1]["one rank evaluated"] == {("ckpt", 5)}
    assert got[2]["one rank evaluated"] == set()
    assert all(got[r]["all evaluated, a joiner"] == {("eval", 7)} for r in range(3))
