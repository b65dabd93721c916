"""An S4 decision's event names the emulated host, as the finding and the testbed do: with
``--ranks-per-host 2`` slots 2 and 3 are host 1 (testbed.node), so leaving them is
``exclude_host`` of ``host1`` -- it read ``host2`` (the slot) while the finding said host 1."""

from __future__ import annotations

from pathlib import Path

from stalwart.mitigate.decisions import EXCLUDE, Decision
from stalwart.mitigate.rebalance import Rebalancer
from stalwart.rundir import RunData


def _excluded_target(tmp_path: Path, ranks_per_host: int) -> tuple[str, list[int]]:
    reb = Rebalancer(None, micro_batches=12, rank=0, world=6, run_dir=tmp_path,
                     ranks_per_host=ranks_per_host)
    # the policy's S4 of slot 2 and its host-mate, slot 3 (counts are 1-based slots)
    reb._log_decision(40, Decision(EXCLUDE, 1, 40, counts=[4], target=2, predicted_gain=0.5))
    ev = RunData.load(tmp_path).events_of("mitigation_applied")
    assert len(ev) == 1 and ev[0]["strategy"] == "exclude_host"
    return ev[0]["target"], ev[0]["plan"]


def test_two_ranks_per_host_name_the_host(tmp_path: Path) -> None:
    assert _excluded_target(tmp_path, 2) == ("host1", [0, 1, 4, 5])


def test_one_rank_per_host_names_the_slot_as_before(tmp_path: Path) -> None:
    assert _excluded_target(tmp_path, 1) == ("host2", [0, 1, 4, 5])
