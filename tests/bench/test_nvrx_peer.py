"""NVIDIA's straggler detector beside stalwart's in `stalwart bench detect`: its reports as
decisions, the bench without the package, and the CPU-only harness (when it is installed)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from stalwart.bench.detect_scenarios import Scenario
from stalwart.bench.detect_score import Clock, ground_truth, score
from stalwart.bench.peers import nvrx_reports


def _report(t: float, fwd_rel: list[int], step_rel: list[int] | None = None,
            fwd_ind: list[int] | None = None) -> dict:
    return {"time": t, "iteration": int(t), "report_ms": 3.0,
            "flagged": {"relative": {"fwd": fwd_rel, **({"step": step_rel} if step_rel else {})},
                        "individual": {"fwd": fwd_ind or []}}}


def test_a_rank_entering_the_flagged_set_is_one_decision() -> None:
    reps = [_report(10, []), _report(15, [2]), _report(20, [2]), _report(25, [2, 3]),
            _report(30, []), _report(35, [2])]
    ds = nvrx_reports.decisions(reps)
    assert [(d["time"], d["ranks"]) for d in ds] == [(15.0, [2]), (25.0, [3]), (35.0, [2])]
    assert all(d["event"] == "straggler_detected" and d["kind"] == "compute" for d in ds)


def test_sections_and_score_kinds_are_chosen() -> None:
    reps = [_report(10, [], step_rel=[1]), _report(15, [], fwd_ind=[0])]
    assert [d["ranks"] for d in nvrx_reports.decisions(reps)] == [[0]]  # fwd, any kind
    assert [d["ranks"] for d in nvrx_reports.decisions(reps, ("step",))] == [[1]]
    assert nvrx_reports.decisions(reps, kinds=("relative",)) == []


def test_reports_are_read_from_the_run_directory(tmp_path: Path) -> None:
    assert nvrx_reports.load(tmp_path) is None  # the detector did not run there
    lines = [json.dumps(_report(10, [2])), "{cut short", json.dumps(_report(15, [2]))]
    (tmp_path / nvrx_reports.REPORTS).write_text("\n".join(lines) + "\n")
    assert [r["time"] for r in nvrx_reports.load(tmp_path)] == [10, 15]
    assert nvrx_reports.cost(tmp_path) is None
    (tmp_path / nvrx_reports.COST).write_text(json.dumps({"step_cpu_us_median": 70.0}))
    assert nvrx_reports.cost(tmp_path) == {"step_cpu_us_median": 70.0}


def test_its_decisions_are_scored_like_ours_on_the_wall_clock() -> None:
    born = Scenario("born-compute-r2-x2", ("compute:rank=2,factor=2",))
    truths = ground_truth([{"event": "fault_applied", "step": 0, "time": 100.0,
                            "kind": "compute", "rank": 2}])
    ds = nvrx_reports.decisions([_report(121.0, [2]), _report(126.0, [2])])
    s = score([(born, ds, truths, 0, Clock(first=115.0, last=150.0))], by_time=True)
    assert s["detection_rate"] == 1.0 and s["localization_accuracy"] == 1.0
    assert s["median_latency_s"] == 6.0
    clean = Scenario("cnn-clean-0", workload="cnn")
    s = score([(clean, nvrx_reports.decisions([_report(120.0, [0, 1, 3])]), [], 0, Clock())],
              by_time=True)
    assert s["false_positives"] == 1  # one report naming three ranks: one decision


def test_the_bench_runs_without_the_package(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path, capsys) -> None:
    import stalwart.bench.detect as bench
    from stalwart.rundir import RunData

    real = metadata.version

    def version(name: str) -> str:
        if name == "nvidia-resiliency-ext":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
    peers_seen = []

    def fake_run(sc: Scenario, workdir: Path, tag: str, peer: bool = False):
        peers_seen.append(peer)
        return RunData(tmp_path, {}, [], []), 0

    monkeypatch.setattr(bench, "scenarios", lambda quick: [Scenario("clean-0")])
    monkeypatch.setattr(bench, "run_scenario", fake_run)
    monkeypatch.setattr(bench, "measure_overhead", lambda workdir, tag, steps: {})
    res = bench.run(quick=True, workdir=tmp_path)
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("nvrx:")]
    assert len(lines) == 1 and "not installed" in lines[0] and "null" in lines[0]
    assert peers_seen == [False]
    for name in ("nvrx_detection_rate_born", "nvrx_detection_rate_scripts",
                 "nvrx_false_positives", "nvrx_median_latency_s", "nvrx_step_cpu_us",
                 "nvrx_localization_accuracy"):
        assert name in res.figures and res.figures[name] is None
    assert res.figures["false_positives"] == 0  # the rest still ran and was scored


def test_no_peers_skips_it_in_one_line(capsys) -> None:
    from stalwart.bench.detect import nvrx_ready

    assert nvrx_ready(False, False) is False
    assert capsys.readouterr().out.count("nvrx:") == 1


_HARNESS = """
import json, sys, time
from pathlib import Path
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from stalwart.bench.peers.nvrx import Harness, make_cpu_safe
run_dir = Path(sys.argv[1])
h = Harness(run_dir, rank=0, report_s=0.05)
h.install()  # patches, Detector.initialize (CUPTI stub), the sections, the step hook
import torch.distributed as dist
import os
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
model = DDP(nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(40):
    model(torch.randn(4, 8)).sum().backward()
    opt.step(); opt.zero_grad()
    time.sleep(0.005)
h.write_cost()
dist.destroy_process_group()
"""


def test_the_cpu_harness_reports_on_a_machine_without_cuda(tmp_path: Path) -> None:
    pytest.importorskip("nvidia_resiliency_ext.straggler")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-c", _HARNESS, str(tmp_path), str(port)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    reps = nvrx_reports.load(tmp_path)
    assert reps, "no report written"
    assert {"fwd", "step"} <= set(reps[-1]["relative"])  # both sections scored
    cost = nvrx_reports.cost(tmp_path)
    assert cost is not None and cost["iterations"] == 40 and cost["step_cpu_us_median"] > 0


def test_reports_can_be_rethresholded_from_their_scores() -> None:
    rep = {"time": 1.0, "relative": {"fwd": {"0": 0.6, "1": 1.0, "2": 0.4}},
           "individual": {"fwd": {"0": 1.0, "1": 1.0, "2": 1.0}},
           "flagged": {"relative": {"fwd": [0, 2]}, "individual": {}}}
    assert nvrx_reports.flagged(rep) == {0, 2}
    assert nvrx_reports.flagged(rep, threshold=0.5) == {2}
