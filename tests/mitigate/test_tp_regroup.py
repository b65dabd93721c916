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


STEPS = 60


def _run(out: Path, name: str, env: dict[str, str] | None = None) -> RunData:
    r = stalwart("run", "--testbed", "netns", "--nproc", "4", "--tp", "2", "--mitigate", "auto",
                 "--no-progress", "--eval-every", "1000", "--ckpt-every", "1000",
                 "--steps", str(STEPS), "--out", str(out), "--name", name,
                 "--fault", "pairlink:hosts=0-1,rate=10mbit,start=15", timeout=900, env=env)
    assert r.returncode == 0, r.stderr + r.stdout
    return RunData.load(out / name)


@pytest.fixture(scope="module")
def in_place(tmp_path_factory: pytest.TempPathFactory) -> RunData:
    return _run(tmp_path_factory.mktemp("tp"), "tp")


def test_a_slow_tp_pair_is_remapped_in_place(in_place: RunData) -> None:
    steps, d = STEPS, in_place
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


def test_a_failed_tp_regroup_falls_back_to_a_relaunch_on_the_new_map(
        in_place: RunData, tmp_path: Path) -> None:
    """The same run with launch rank 0 refusing the new groups (the STALWART_TEST_REGROUP_FAIL
    hook): the ranks save their shards, the launcher relaunches the 4 ranks on the re-mapped
    hosts from one saved file per TP index, and training ends where the in-place run ends."""
    from stalwart.mitigate.fallback import TEST_FAIL_ENV

    d = _run(tmp_path, "fb", env={TEST_FAIL_ENV: "0"})
    remap = [e for e in d.events_of("mitigation_applied") if e["strategy"] == "remap"]
    assert remap, d.events_of("mitigation_applied", "straggler_detected")
    failed = d.events_of("regroup_failed")
    assert len(failed) == 1 and failed[0]["fallback"] == "restart", failed
    assert failed[0]["hosts"] == remap[0]["plan"] and failed[0]["failed"] == [0]
    assert not d.events_of("regroup")
    restart = d.events_of("restart")
    assert len(restart) == 1 and restart[0]["hosts"] == remap[0]["plan"]
    back = failed[0]["resume_step"]
    assert d.events_of("resumed")[-1]["step"] == back
    after = [m for m in d.metrics if m["step"] >= back]
    assert len(after) == 4 * (STEPS - back)  # each step once per rank
    assert {m["host"] for m in after if m["rank"] == 1} == {remap[0]["plan"][1]}
    va, vb = in_place.final_val_loss(), d.final_val_loss()
    assert va is not None and vb is not None and abs(va - vb) / va <= 1e-6, (va, vb)
