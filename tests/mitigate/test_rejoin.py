"""Taking a host back live (issue 25): a host left out for its slow link (S4, in place) is
probed; when healthy again its launch rank is started again, joins in place at an agreed
step with the current parameters and optimizer state from a peer, and every later step is
trained by all four ranks on the whole global batch. Root only (netns, tbf)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from stalwart.rundir import RunData
from tests.helpers import stalwart

pytestmark = [pytest.mark.root, pytest.mark.slow]


def test_an_excluded_host_rejoins_live_when_healthy(tmp_path: Path) -> None:
    # long enough for the probe's two healthy rounds (6 s apart) and a cold start of the
    # joining rank on a loaded machine (~25 s measured with three other jobs running)
    r = stalwart("run", "--testbed", "netns", "--nproc", "4", "--mitigate", "auto",
                 "--fault", "link:host=1,rate=10mbit,start=15,end=40", "--steps", "900",
                 "--eval-every", "10000", "--ckpt-every", "10000", "--no-progress",
                 "--out", str(tmp_path), "--name", "rj", timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    d = RunData.load(tmp_path / "rj")
    left = d.events_of("rank_left")
    assert [e["host"] for e in left] == [1]
    back = [e for e in d.events_of("regroup") if e.get("joined")]
    assert len(back) == 1 and back[0]["joined"] == [1] and back[0]["world"] == 4, \
        d.events_of("regroup", "rank_rejoining", "rank_ready", "rejoin_failed")
    applied = [e for e in d.events_of("mitigation_applied") if e["strategy"] == "restore_host"]
    assert applied and applied[0]["plan"] == [0, 1, 2, 3]
    assert not d.events_of("restart")  # in place: no process of the job restarted
    step = back[0]["step"]
    by: dict[tuple[int, int], list[int]] = defaultdict(list)
    for m in d.metrics:
        by[(m["step"], m["world"])].append(m["samples"])
    gb = int(d.config["global_batch"])
    assert all(sum(v) == gb for (s, w), v in by.items() if len(v) == w)
    assert {m["world"] for m in d.metrics if m["step"] >= step} == {4}
    assert {m["host"] for m in d.metrics if m["step"] >= step} == {0, 1, 2, 3}
