"""S3 in a tensor-parallel job, in place (issue 25): 4 ranks as 2 x 2 (TP x DP) on netns hosts,
the TP pair of hosts 0-1 on a 10 mbit link. The ranks regroup in place -- new TP and DP groups
on a fresh store, the shards following the new TP indices -- onto a placement where hosts 0
and 1 are no TP pair: no restart, no process started, the same global batch every step, and
the slow pair then carries (almost) nothing, measured by the testbed's byte counters. Root
only (netns, tbf)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from stalwart.rundir import RunData
from tests.helpers import stalwart

pytestmark = [pytest.mark.root, pytest.mark.slow]


def test_a_slow_tp_pair_is_remapped_in_place(tmp_path: Path) -> None:
    steps = 60
    r = stalwart("run", "--testbed", "netns", "--nproc", "4", "--tp", "2", "--mitigate", "auto",
                 "--no-progress", "--eval-every", "1000", "--ckpt-every", "1000",
                 "--steps", str(steps), "--out", str(tmp_path), "--name", "tp",
                 "--fault", "pairlink:hosts=0-1,rate=10mbit,start=15", timeout=900)
    assert r.returncode == 0, r.stderr + r.stdout
    d = RunData.load(tmp_path / "tp")
    remap = [e for e in d.events_of("mitigation_applied") if e["strategy"] == "remap"]
    assert remap, d.events_of("mitigation_applied", "straggler_detected")
    hosts = remap[0]["plan"]
    assert sorted(hosts) == [0, 1, 2, 3]
    assert hosts.index(0) // 2 != hosts.index(1) // 2  # hosts 0 and 1 are no TP pair now
    # in place: no restart, no resume, no rank left or lost, no fallback
    assert not d.events_of("restart", "resumed", "rank_left", "rank_lost", "regroup_failed")
    regroup = d.events_of("regroup")
    assert len(regroup) == 1 and regroup[0]["planned"] and regroup[0]["hosts"] == hosts
    assert regroup[0]["step"] == remap[0]["step"] and regroup[0]["world"] == 4
    assert len(regroup[0]["state_from"]) == 2  # one source per TP index
    back = regroup[0]["step"]
    # every step once per rank; each DP group's micro-batches add up to the global batch
    by: dict[int, list[dict]] = defaultdict(list)
    for m in d.metrics:
        by[m["step"]].append(m)
    assert sorted(by) == list(range(steps))
    for s, lines in by.items():
        assert sorted(m["rank"] for m in lines) == [0, 1, 2, 3], s
        assert sum(m["micro_batches"] for m in lines if m["rank"] % 2 == 0) == 16, s
        want = hosts if s >= back else [0, 1, 2, 3]
        assert [m["host"] for m in sorted(lines, key=lambda m: m["rank"])] == want, s
    traffic = d.events_of("testbed_traffic")
    assert len(traffic) == 2 and traffic[1]["hosts"] == hosts
    before, after = (t["bytes_per_step"].get("0-1", 0) for t in traffic)
    assert after < 0.1 * before, traffic
