"""End to end: one born-slow scenario of `stalwart bench detect` as the suite runs it (netns
testbed, 4 hosts, a 2x compute fault on rank 2 from step 0, the MLP user script through
`stalwart run --script --detect`), with NVIDIA's detector beside the monitor when it is
installed: the run's ground truth, both detectors' decisions and their scores."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.bench.detect_scenarios import Scenario


@pytest.mark.slow
@pytest.mark.root
def test_a_born_slow_rank_in_a_user_script_is_scored_for_both_detectors(
        tmp_path: Path) -> None:
    import stalwart.bench.detect as bench
    from stalwart.bench.peers import nvrx_reports

    try:
        import nvidia_resiliency_ext.straggler  # noqa: F401

        peer = True
    except ImportError:
        peer = False
    sc = Scenario("mlp-born-r2-x2", ("compute:rank=2,factor=2",), workload="mlp")
    data, rc = bench.run_scenario(sc, tmp_path, "e2e", peer=peer)
    assert rc == 0, f"run failed, see {data.path}/logs"
    truths = bench.ground_truth(data.events)
    assert [(t.kind, t.applied, t.rank) for t in truths] == [("compute", 0, 2)]
    last, clock = bench._clock(data)
    assert last > 100 and clock.first is not None  # the monitor counted the iterations
    found = data.events_of("straggler_detected", "slowdown_unexplained")
    ours = bench.score([(sc, found, truths, last, clock)])
    assert ours["faults"] == 1
    assert ours["detection_rate"] == 1.0 and ours["localization_accuracy"] == 1.0, ours["rows"]
    if peer:
        reports = nvrx_reports.load(data.path)
        assert reports, "NVIDIA's detector wrote no report"
        cost = nvrx_reports.cost(data.path)
        assert cost is not None and cost["iterations"] > 0
        theirs = bench.score([(sc, nvrx_reports.decisions(reports), truths, last, clock)],
                             by_time=True)
        assert theirs["faults"] == 1  # scored; whether it finds the rank is the benchmark's
