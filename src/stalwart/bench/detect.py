"""``stalwart bench detect``: straggler detection scored against the testbed's real faults,
with NVIDIA's straggler detector measured in the same runs.

What it measures, in one invocation:
- scenario runs on the netns testbed (4 hosts, gloo over a bridge; ``detect_scenarios``):
  clean runs (20 in full mode: the built-in GPT, three user scripts, a variable-step-time
  script, a noisy neighbour), faults applied mid-run on the GPT (compute 1.3x/2x on every
  rank, slow link, slow pair, contention, a fault that starts and ends), faults present from
  step 0 (born slow: compute 2x/1.3x, slow link, slow pair), user scripts run with
  ``stalwart run --script`` with compute faults mid-run and from the start, and five runs
  under ``--comm lossy`` at 5% loss (scored apart as ``lossy_*``) -- each scored against the
  ground-truth ``fault_applied`` / ``fault_removed`` events the testbed wrote
  (``detect_score``);
- the same reliable GPT runs scored for the hand-written baseline (stalwart.detect.baseline)
  over each rank's compute time in metrics.jsonl (what a user would threshold);
- NVIDIA's detector (nvidia-resiliency-ext, ``bench.peers.nvrx``) attached to every reliable
  run when it is installed: section "fwd" (DDP's forward, what its documentation recommends)
  and "step" (the whole iteration), a report every 5 s; its reports are scored like stalwart's
  decisions on the wall clock (``nvrx_*`` figures on the "fwd" section; "step" in the
  details). Without the package those figures are null and one line says so;
  ``--install-peers`` installs it first (pip, the pinned version, without touching torch);
- tracking overhead: one 4-rank local job alternating steps with the monitor on and off
  (``detect_overhead``), and the monitor's CPU time per step on rank 0.

Figures by family: ``detection_rate`` / ``localization_accuracy`` / ``median_latency_iters``
on the mid-run GPT faults (as before); ``detection_rate_born``; ``detection_rate_scripts``
(with the 2x faults it missed in the details); ``false_positives`` over every clean run;
``median_latency_s`` over every reliable faulty run (seconds from the fault, or the first
iteration if later, to the decision).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stalwart.bench import BenchResult, Steps
from stalwart.bench.detect_overhead import abba, begin_step, end_step  # noqa: F401
from stalwart.bench.detect_scenarios import (  # noqa: F401  (the suite's public names)
    BATCH,
    START,
    STEPS,
    Scenario,
    run_config,
    scenarios,
)
from stalwart.bench.detect_score import (  # noqa: F401
    Clock,
    Truth,
    ground_truth,
    localised,
    match,
    replay_heldout,
    score,
    severe_missed,
)
from stalwart.bench.peers import nvrx_reports
from stalwart.bench.peers.nvrx import ENV as NVRX_ENV
from stalwart.bench.peers.nvrx import VERSION as NVRX_VERSION
from stalwart.events import SlowdownUnexplained, StragglerDetected, StragglerRecovered

# a busy loop for the noisy neighbour; it leaves when the bench (argv[1]) is gone
_BUSY = ("import os, sys\np=int(sys.argv[1])\nwhile os.getppid()==p:\n"
         "    for _ in range(100000): pass\n")

# NVIDIA's detector's decisions, scored per variant: (sections, threshold; None = as it
# flagged, 0.75). "nvrx_fwd" gives the nvrx_* figures; the others are in the details.
NVRX_VARIANTS: dict[str, tuple[tuple[str, ...], float | None]] = {
    "nvrx_fwd": (("fwd",), None), "nvrx_step": (("step",), None),
    "nvrx_fwd_0.5": (("fwd",), 0.5)}


# ---- running ---------------------------------------------------------------------------------
def run_scenario(sc: Scenario, workdir: Path, tag: str, peer: bool = False) -> tuple[Any, int]:
    """One scenario run; ``peer``: NVIDIA's detector rides along (reliable runs only)."""
    from stalwart.launch import launch
    from stalwart.rundir import RunData

    cfg = run_config(sc, workdir, tag)
    module = "stalwart.bench.peers.nvrx" if peer and sc.workload == "gpt" else \
        "stalwart.train.worker"
    busy = [subprocess.Popen([sys.executable, "-S", "-c", _BUSY, str(os.getpid())])
            for _ in range(sc.noisy)]
    old = os.environ.get(NVRX_ENV)
    if peer:
        os.environ[NVRX_ENV] = "1"  # the ranks inherit it: the scripts' opt-in
    try:
        rc = launch(cfg, module=module, show_progress=False, on_line=lambda _s: None)
    finally:
        if old is None:
            os.environ.pop(NVRX_ENV, None)
        for p in busy:
            p.kill()
            p.wait()
    return RunData.load(cfg.run_dir), rc


def measure_overhead(workdir: Path, tag: str, steps: int) -> dict[str, Any]:
    from stalwart.config import RunConfig
    from stalwart.launch import launch

    cfg = RunConfig(nproc=4, testbed="local", steps=steps, batch_size=BATCH,
                    out=str(workdir), name=f"{tag}-overhead")
    rc = launch(cfg, module="stalwart.bench.detect_overhead",
                args=["--overhead-steps", str(steps)], show_progress=False,
                on_line=lambda _s: None)
    path = cfg.run_dir / "overhead.json"
    if rc != 0 or not path.exists():
        return {"error": f"overhead run failed (exit {rc}), see {cfg.run_dir}/logs"}
    return json.loads(path.read_text())


def nvrx_ready(want: bool, install: bool, say: Callable[[str], None] = print) -> bool:
    """Whether NVIDIA's detector rides along; one line says why not, or how it runs."""
    from importlib import metadata

    def version() -> str | None:
        try:
            return metadata.version("nvidia-resiliency-ext")
        except metadata.PackageNotFoundError:
            return None

    if not want:
        say("nvrx: skipped (--no-peers): its figures are null")
        return False
    if version() is None and install:
        say(f"nvrx: installing nvidia-resiliency-ext=={NVRX_VERSION} (pip, no torch change)")
        install_nvrx()
    v = version()
    if v is None:
        say("nvrx: nvidia-resiliency-ext is not installed: its figures are null (install it "
            "with `stalwart bench detect --install-peers` or `pip install 'stalwart[peers]'`)")
        return False
    say(f"nvrx: nvidia-resiliency-ext {v} in the same runs (sections 'fwd' = DDP forward, as "
        "its documentation recommends, and 'step' = the whole iteration; a report every 5 s, "
        "threshold 0.75); CPU-only harness: its CUPTI manager is a stub and "
        "torch.cuda.synchronize / current_device are made harmless inside its modules")
    return True


def install_nvrx() -> int:
    """pip-install the pinned package and its small dependencies, never a torch: ``--no-deps``
    for the package itself (its ``torch>=2.3`` must not be resolved against an index), then
    what its straggler module imports. (pynvml, the deprecated shim it also lists, is left
    out: installed, it warns on every ``import torch``.)"""
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    rc = subprocess.call([*pip, "--no-deps", f"nvidia-resiliency-ext=={NVRX_VERSION}"])
    if rc == 0:
        rc = subprocess.call([*pip, "nvidia-ml-py>=12.570.86", "psutil>=6.0.0", "pyyaml",
                              "defusedxml", "packaging"])
    return rc


def _clock(data: Any) -> tuple[int, Clock]:
    """(last step, wall span of the iterations): stalwart's metrics or, for a user script,
    the monitor's iterations."""
    from stalwart.rundir import ITERATIONS, read_jsonl

    rows = list(data.metrics) + read_jsonl(data.path / ITERATIONS)
    last = max((int(m["step"]) for m in rows), default=0)
    times = [float(m["time"]) for m in rows if isinstance(m.get("time"), (int, float))]
    return last, Clock(min(times) if times else None, max(times) if times else None)


def _say_outcome(sc: Scenario, found: list[dict], truths: list[Truth], clock: Clock,
                 nvrx: list[dict] | None) -> None:
    """One progress line per run: each detector's first decision since the fault (or the
    first iteration, if later), and how many it took before."""
    t0 = max([t.t_applied for t in truths if t.t_applied] + [clock.first or 0.0]) \
        if truths else None

    def first(ds: list[dict]) -> str:
        ds = sorted((d for d in ds if d.get("event") == StragglerDetected.name),
                    key=lambda d: d.get("time") or 0.0)
        if t0 is None:
            return f"{len(ds)} decisions" if ds else "nothing"
        after = [d for d in ds if (d.get("time") or 0.0) >= t0]
        before = f" ({len(ds) - len(after)} before the fault)" if len(after) < len(ds) else ""
        if not after:
            return "nothing" + before
        d = after[0]
        who = d.get("link") if d.get("kind") == "link" and d.get("link") else d.get("ranks")
        return f"{d.get('kind')} {who} +{d['time'] - t0:.1f}s{before}"

    peer = "" if nvrx is None else f"; nvrx: {first(nvrx)}"
    print(f"[bench detect]   {sc.name}: stalwart: {first(found)}{peer}", flush=True)


def _collect(todo: list[Scenario], workdir: Path, tag: str, peer: bool,
             steps: Steps) -> tuple[dict[str, list], list[Scenario], dict[str, Any]]:
    """Run every scenario; per detector the scored runs, the failed runs, per-run extras."""
    from stalwart.detect.baseline import threshold_detector

    runs: dict[str, list] = {"ours": [], "base": [], **{k: [] for k in NVRX_VARIANTS}}
    failed: list[Scenario] = []
    extra: dict[str, Any] = {"hiccups": {}, "nvrx_cost": {}}
    for sc in todo:
        steps.start(sc.name)
        with_peer = peer and sc.comm == "reliable"
        data, rc = run_scenario(sc, workdir, tag, peer=with_peer)
        if rc == 130:
            raise KeyboardInterrupt
        if rc != 0:
            failed.append(sc)
            print(f"[bench detect]   {sc.name}: run failed (exit {rc}), see {data.path}/logs",
                  flush=True)
            continue
        truths = ground_truth(data.events)
        last, clock = _clock(data)
        found = data.events_of(StragglerDetected, StragglerRecovered, SlowdownUnexplained)
        runs["ours"].append((sc, found, truths, last, clock))
        stats_path = data.path / "detect_stats.json"
        if stats_path.exists():
            extra["hiccups"][sc.name] = json.loads(stats_path.read_text()).get("hiccups")
        if sc.workload == "gpt" and sc.family in ("clean", "mid"):
            # what a user would threshold: each rank's own compute time
            runs["base"].append((sc, threshold_detector(data.step_table("compute_time")),
                                 truths, last, clock))
        # the detector rode along: no report file means it never reported (no decision)
        reports = (nvrx_reports.load(data.path) or []) if with_peer else None
        if reports is not None:
            for key, (sections, threshold) in NVRX_VARIANTS.items():
                runs[key].append((sc, nvrx_reports.decisions(reports, sections,
                                                             threshold=threshold),
                                  truths, last, clock))
            extra["nvrx_cost"][sc.name] = nvrx_reports.cost(data.path)
        _say_outcome(sc, found, truths, clock,
                     runs["nvrx_fwd"][-1][1] if reports is not None else None)
    return runs, failed, extra


def _pick(runs: list, pred: Callable[[Scenario], bool]) -> list:
    return [r for r in runs if pred(r[0])]


def _family(*names: str) -> Callable[[Scenario], bool]:
    return lambda sc: sc.family in names


def _scored(runs: list, failed: list[Scenario], by_time: bool = False) -> dict[str, Any]:
    """Each figure's subset of runs, scored: clean+mid (the suite's historical figures and
    every clean run), born, scripts, every reliable faulty run (latency in seconds)."""
    parts: dict[str, Callable[[Scenario], bool]] = {
        "main": _family("clean", "mid"), "born": _family("born"),
        "scripts": lambda sc: sc.in_scripts, "faulty": _family("mid", "born", "script"),
        "group": _family("group")}
    out = {k: score(_pick(runs, f), [sc for sc in failed if f(sc)], by_time=by_time)
           for k, f in parts.items()}
    out["severe_missed"] = severe_missed(_pick(runs, parts["scripts"]), by_time=by_time) + [
        sc.name for sc in failed if sc.in_scripts and sc.severe]
    return out


def _nvrx_cost(costs: dict[str, Any]) -> dict[str, Any]:
    recs = [c for c in costs.values() if c]
    if not recs:
        return {}
    return {"step_cpu_us_median": round(statistics.median(
                c["step_cpu_us_median"] for c in recs), 1),
            "step_cpu_us_mean": round(statistics.median(c["step_cpu_us_mean"] for c in recs), 1),
            "report_ms_median": round(statistics.median(
                [x for c in recs for x in c.get("report_ms", [])] or [0.0]), 2),
            "reports": sum(c.get("reports", 0) for c in recs), "runs": len(recs)}


def group_rate(g: dict[str, Any]) -> float | None:
    """A host of 2 ranks slowed alike, found and named whole (both ranks, one finding): the
    share of those faults (each of the two ranks' faults counts; truth.py ``together``)."""
    rows = [r for r in g["rows"] if "applied" in r or r.get("failed")]
    if not rows:
        return None
    return round(sum(1 for r in rows if r.get("right")) / len(rows), 3)


def _figures(s: dict[str, Any], b: dict[str, Any], lo: dict[str, Any], ov: dict[str, Any],
             nv: dict[str, Any] | None, nv_cost: dict[str, Any],
             rh: dict[str, Any] | None = None) -> dict[str, Any]:
    m = s["main"]
    cpu = ov.get("monitor_step_cpu_us_median")
    return {
        # the replayed held-out corpus (bench.detect_score.replay_heldout): share of runs right
        "replay_score_heldout": rh["right_fraction"] if rh else None,
        "replay_heldout_detection_rate": rh["detection_rate"] if rh else None,
        "replay_heldout_false_positives": rh["false_positives"] if rh else None,
        "false_positives": m["false_positives"],
        "detection_rate": m["detection_rate"],
        "localization_accuracy": m["localization_accuracy"],
        "median_latency_iters": m["median_latency_iters"],
        "median_latency_s": s["faulty"]["median_latency_s"],
        "detection_rate_born": s["born"]["detection_rate"],
        "localization_accuracy_born": s["born"]["localization_accuracy"],
        "detection_rate_scripts": s["scripts"]["detection_rate"],
        "scripts_2x_missed": len(s["severe_missed"]),
        "unexplained_on_clean": m["clean_unexplained_slowdowns"],
        "tracking_overhead": ov.get("overhead"),
        # rank 0, median, the analysis thread's CPU amortised in (detect_overhead.py)
        "monitor_step_cpu_us": cpu,
        "monitor_step_cpu_us_median": cpu,
        "monitor_step_cpu_us_training_thread": ov.get("monitor_step_cpu_us_training_thread"),
        "monitor_analysis_cpu_us_per_step": ov.get("monitor_analysis_cpu_us_per_step"),
        # its 95% interval's ends (figures are scalars)
        "tracking_overhead_ci95_low": (ov.get("ci95") or [None, None])[0],
        "tracking_overhead_ci95_high": (ov.get("ci95") or [None, None])[1],
        "lossy_detection_rate": lo["detection_rate"],
        "lossy_false_positives": lo["false_positives"],
        "lossy_localization_accuracy": lo["localization_accuracy"],
        "baseline_false_positives": b["false_positives"],
        "baseline_detection_rate": b["detection_rate"],
        "baseline_localization_accuracy": b["localization_accuracy"],
        "group_detection_rate": group_rate(s["group"]),
        "nvrx_detection_rate_born": nv["born"]["detection_rate"] if nv else None,
        "nvrx_detection_rate_scripts": nv["scripts"]["detection_rate"] if nv else None,
        "nvrx_false_positives": nv["main"]["false_positives"] if nv else None,
        "nvrx_median_latency_s": nv["faulty"]["median_latency_s"] if nv else None,
        "nvrx_step_cpu_us": nv_cost.get("step_cpu_us_median") if nv else None,
        # its decisions name ranks only: a link fault is never localised
        "nvrx_localization_accuracy": nv["faulty"]["localization_accuracy"] if nv else None,
    }


TARGETS = {"false_positives": "<= 0", "detection_rate": ">= 0.95",
           "localization_accuracy": ">= 0.95", "median_latency_iters": "<= 4",
           "detection_rate_born": ">= 0.95", "detection_rate_scripts": ">= 0.95",
           "scripts_2x_missed": "<= 0", "unexplained_on_clean": "<= 0",
           "tracking_overhead": "<= 0.005", "monitor_step_cpu_us": "<= 60",
           "lossy_detection_rate": ">= 0.9", "lossy_false_positives": "<= 0",
           "replay_score_heldout": ">= 0.95", "group_detection_rate": ">= 0.95"}
# families ``--only`` runs by themselves (their figures alone)
ONLY = ("group",)


def _run_only(families: list[str], quick: bool, workdir: Path, tag: str) -> BenchResult:
    """``--only group``: those runs alone and their one figure (nothing else is measured,
    so nothing else is reported)."""
    todo = [sc for sc in scenarios(quick) if sc.family in families]
    steps = Steps("detect", len(todo))
    runs, failed, _ = _collect(todo, workdir, tag, False, steps)
    g = score(runs["ours"], failed)
    cmd = "stalwart bench detect --only " + " ".join(families) + (" --quick" if quick else "")
    return BenchResult("detect", {"group_detection_rate": group_rate(g)},
                       {"group_detection_rate": TARGETS["group_detection_rate"]},
                       {"only": families, "group": g, "workdir": str(workdir)}, cmd)


def run(quick: bool, workdir: Path, peers: bool = True, install_peers: bool = False,
        only: list[str] | None = None) -> BenchResult:
    workdir = Path(workdir)
    tag = time.strftime("detect-%Y%m%d-%H%M%S")
    if only:
        return _run_only(list(only), quick, workdir, tag)
    peer = nvrx_ready(peers, install_peers)
    todo = scenarios(quick)
    steps = Steps("detect", len(todo) + 1)
    runs, failed, extra = _collect(todo, workdir, tag, peer, steps)
    steps.start("overhead (monitor on/off)")
    ov = measure_overhead(workdir, tag, 160 if quick else 600)
    reliable = [f for f in failed if f.comm == "reliable"]
    s = _scored(runs["ours"], reliable)
    b = score(runs["base"], [f for f in reliable if f.workload == "gpt" and
                             f.family in ("clean", "mid")])
    lossy_runs = [r for r in runs["ours"] if r[0].comm == "lossy"]
    lo = score(lossy_runs, [f for f in failed if f.comm == "lossy"])
    nv_all = {k: _scored(runs[k], reliable, by_time=True) for k in NVRX_VARIANTS} \
        if peer else {}
    nv = nv_all.get("nvrx_fwd")
    nv_cost = _nvrx_cost(extra["nvrx_cost"])
    recoveries = [
        {"scenario": sc.name, "removed": t.removed,
         "recovered_step": next((d["step"] for d in dets if d.get("event") ==
                                 StragglerRecovered.name and t.removed is not None
                                 and d["step"] >= t.removed - 3), None)}
        for sc, dets, truths, *_ in runs["ours"] for t in truths if t.removed is not None]
    details = {"scenario_runs": len(runs["ours"]), "failed_runs": [f.name for f in failed],
               "ours": s["main"], "born": s["born"], "scripts": s["scripts"],
               "faulty": s["faulty"], "scripts_2x_missed": s["severe_missed"],
               "group": s["group"],
               "lossy": lo, "baseline": b, "recoveries": recoveries, "overhead": ov,
               "hiccups": extra["hiccups"],
               "clean_runs": sum(1 for sc in todo if sc.family == "clean"),
               "nvrx": None if nv is None else {
                   "section_fwd": nv, "section_step": nv_all["nvrx_step"],
                   "section_fwd_threshold_0.5": nv_all["nvrx_fwd_0.5"], "cost": nv_cost,
                   "per_run_cost": extra["nvrx_cost"],
                   "sections": {"fwd": "DistributedDataParallel.forward (recommended by the "
                                       "package's documentation)",
                                "step": "one optimizer step to the next (forward, backward "
                                        "with its all-reduce, optimizer)"},
                   "harness": "CUPTI manager stubbed; torch.cuda.synchronize and "
                              "current_device made harmless inside nvrx's modules (CPU)"},
               "workdir": str(workdir), "steps": STEPS, "fault_start": START,
               "batch_size": BATCH}
    rh = replay_heldout()
    details["replay_heldout"] = rh
    cmd = "stalwart bench detect" + (" --quick" if quick else "")
    return BenchResult("detect", _figures(s, b, lo, ov, nv, nv_cost, rh), dict(TARGETS),
                       details, cmd)
