"""``stalwart bench detect``: straggler detection scored against the testbed's real faults.

What it measures, in one invocation:
- scenario runs of ``stalwart run`` on the netns testbed (4 hosts, gloo over a bridge) --
  clean runs (10 in full mode); compute stragglers (cgroup CPU quota) at factor 1.3 and 2
  on every rank; a slow host link (tc tbf); a slow pair of hosts (tc htb); CPU contention
  (busy processes in the rank's cgroup); a fault that starts and ends -- each scored against
  the ground-truth ``fault_applied`` / ``fault_removed`` events the testbed wrote;
- five more under ``--comm lossy`` at 5% packet loss on every host (two clean, two compute
  stragglers, one slow host link), scored apart as ``lossy_*`` (the monitor exchanges
  every 8 steps there);
- the same reliable runs scored for the hand-written baseline (stalwart.detect.baseline)
  over each rank's compute time in metrics.jsonl (what a user would threshold: the step
  time is the same on every rank of a synchronous job);
- tracking overhead: one 4-rank job (local) alternating steps with the monitor enabled and disabled
  (ABBA order), overhead = geometric mean of the paired steps' ratios - 1, with its 95%
  interval (an "on" step followed by an "off" one waits for its exchange to complete, so
  no monitor work runs on into an "off" step), plus the time spent inside ``monitor.step``
  as a fraction of step time and its CPU time (``monitor_step_cpu_us_median``: rank 0's
  thread CPU time inside ``monitor.step`` on monitored steps -- change detection, the
  exchange of rows -- in microseconds).

Scoring: a fault is detected by the first ``straggler_detected`` decided while the fault was
active (from the step it was applied to 5 steps after it was removed); latency = decision
step - applied step; the onset error (located onset - applied step) is in the details.
Localisation is right when the kind matches (compute/contention -> "compute",
link/pairlink -> "link") and the rank is exactly the faulty rank (compute), the faulty host
is the named rank or an end of the named link (link), or the named link is the faulty pair
(pairlink). False positives count detections and ``slowdown_unexplained`` events in clean
runs (a clean run must log neither; ``unexplained_on_clean`` is the second part alone) and
every clean run that failed; a failed faulty run counts its faults as missed. Detections
decided before a fault was applied are reported in the details, and the
details carry each run's ``hiccups`` (unexplained slowdowns that did not last, counted by
the monitor in ``detect_stats.json`` instead of logged).

The overhead worker is this module's ``main`` (``python -m stalwart.bench.detect --config
CFG --overhead-steps N``), started by the launcher like any rank.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalwart.bench import BenchResult, Steps

if TYPE_CHECKING:  # the worker imports torch and the monitor only when it runs
    from stalwart.detect import Monitor

STEPS = 70
START = 30
BATCH = 32  # per-rank micro-batch: ~0.2 s steps with 4 ranks on 2 cores


@dataclass(frozen=True)
class Scenario:
    name: str
    faults: tuple[str, ...] = ()
    seed: int = 0
    steps: int = STEPS
    comm: str = "reliable"

    @property
    def stragglers(self) -> int:
        """Faults the detector must find (packet loss is the lossy scenarios' weather)."""
        return sum(1 for f in self.faults if not f.startswith("loss:"))


LOSS = "loss:host=all,p=0.05"


def scenarios(quick: bool) -> list[Scenario]:
    s = START
    if quick:
        return [
            Scenario("clean-0"),
            Scenario("compute-r3-x2", (f"compute:rank=3,factor=2,start={s}",)),
            Scenario("link-h1", (f"link:host=1,rate=30mbit,start={s}",)),
            Scenario("compute-r1-x2-transient", (f"compute:rank=1,factor=2,start={s},end=50",),
                     steps=75),
            Scenario("lossy-compute-r2-x2", (LOSS, f"compute:rank=2,factor=2,start={s}"),
                     comm="lossy"),
        ]
    # silence on clean runs is a figure of its own: 10 of them, different seeds
    out = [Scenario(f"clean-{i}", seed=i) for i in range(10)]
    for f in (1.3, 2):
        for r in range(4):
            out.append(Scenario(f"compute-r{r}-x{f}", (f"compute:rank={r},factor={f},start={s}",),
                                seed=r))
    out += [
        Scenario("link-h1", (f"link:host=1,rate=30mbit,start={s}",)),
        Scenario("link-h2", (f"link:host=2,rate=30mbit,start={s}",), seed=1),
        Scenario("pairlink-1-2", (f"pairlink:hosts=1-2,rate=20mbit,start={s}",)),
        Scenario("pairlink-0-3", (f"pairlink:hosts=0-3,rate=20mbit,start={s}",), seed=1),
        Scenario("contention-r2-p2", (f"contention:rank=2,procs=2,start={s}",)),
        Scenario("contention-r0-p1", (f"contention:rank=0,procs=1,start={s}",), seed=1),
        Scenario("compute-r1-x2-transient", (f"compute:rank=1,factor=2,start={s},end=50",),
                 steps=75),
    ]
    # under --comm lossy at 5% loss (scored apart: the monitor exchanges every 8 steps there)
    out += [
        Scenario("lossy-clean-0", (LOSS,), comm="lossy"),
        Scenario("lossy-clean-1", (LOSS,), seed=1, comm="lossy"),
        Scenario("lossy-compute-r2-x2", (LOSS, f"compute:rank=2,factor=2,start={s}"),
                 comm="lossy"),
        Scenario("lossy-compute-r0-x2", (LOSS, f"compute:rank=0,factor=2,start={s}"), seed=1,
                 comm="lossy"),
        Scenario("lossy-link-h1", (LOSS, f"link:host=1,rate=30mbit,start={s}"), comm="lossy"),
    ]
    return out


# ---- scoring ----------------------------------------------------------------------------------
@dataclass
class Truth:
    kind: str
    applied: int
    removed: int | None
    rank: int | None
    hosts: list[int]


def ground_truth(events: list[dict[str, Any]]) -> list[Truth]:
    out: list[Truth] = []
    for e in events:
        if e.get("kind") == "loss":
            continue  # the lossy scenarios' weather, not a straggler
        if e.get("event") == "fault_applied":
            out.append(Truth(e["kind"], int(e["step"]), None, e.get("rank"),
                             list(e.get("hosts", []))))
        elif e.get("event") == "fault_removed" and not e.get("at_close"):
            for t in out:
                if t.kind == e["kind"] and t.removed is None:
                    t.removed = int(e["step"])
    return out


def localised(d: dict[str, Any], t: Truth) -> bool:
    ranks, link = list(d.get("ranks") or []), list(d.get("link") or [])
    if t.kind in ("compute", "contention"):
        return d.get("kind") == "compute" and ranks == [t.rank]
    if t.kind == "link":
        return d.get("kind") == "link" and (ranks == t.hosts or t.hosts[0] in link)
    if t.kind == "pairlink":
        return d.get("kind") == "link" and sorted(link) == sorted(t.hosts)
    return False


def match(dets: list[dict[str, Any]], t: Truth, last_step: int) -> dict[str, Any] | None:
    end = (t.removed if t.removed is not None else last_step) + 5
    for d in dets:
        if d.get("event") == "straggler_detected" and t.applied <= d["step"] <= end:
            return d
    return None


def score(runs: list[tuple[Scenario, list[dict], list[Truth], int]],
          failed: list[Scenario] | None = None) -> dict[str, Any]:
    """runs: (scenario, detections, truths, last step) -> figures for one detector.

    A scenario run that failed counts against the detector: a clean one as a false
    positive (a crashed run is not silence), a faulty one's faults as missed.
    """
    fp = early = detected = right = faults = unexplained = 0
    lat: list[int] = []
    onset_err: list[int] = []
    rows: list[dict[str, Any]] = []
    for sc in failed or []:
        if sc.stragglers:
            faults += sc.stragglers
        else:
            fp += 1
        rows.append({"scenario": sc.name, "failed": True})
    for sc, dets, truths, last in runs:
        found = [d for d in dets if d.get("event") == "straggler_detected"]
        if not sc.stragglers:
            # a clean run must log neither a straggler nor an unexplained slowdown
            n_unexp = sum(d.get("event") == "slowdown_unexplained" for d in dets)
            fp += len(found) + n_unexp
            unexplained += n_unexp
            rows.append({"scenario": sc.name, "detections": len(found),
                         "unexplained_slowdowns": n_unexp})
            continue
        for t in truths:
            faults += 1
            d = match(found, t, last)
            early += sum(1 for x in found if x["step"] < t.applied)
            row: dict[str, Any] = {"scenario": sc.name, "applied": t.applied}
            if d is not None:
                detected += 1
                lat.append(d["step"] - t.applied)
                onset_err.append(d["onset_step"] - t.applied)
                ok = localised(d, t)
                right += ok
                row.update(step=d["step"], onset=d["onset_step"], kind=d.get("kind"),
                           ranks=d.get("ranks"), link=d.get("link"), right=ok)
            else:
                row["missed"] = True
            rows.append(row)
    return {"false_positives": fp, "early_detections": early, "faults": faults,
            "clean_unexplained_slowdowns": unexplained,
            "detected": detected,
            "detection_rate": detected / faults if faults else None,
            "localization_accuracy": right / detected if detected else None,
            "median_latency_iters": statistics.median(lat) if lat else None,
            "latencies": lat, "onset_errors": onset_err, "rows": rows}


# ---- running ---------------------------------------------------------------------------------
def run_scenario(sc: Scenario, workdir: Path, tag: str) -> tuple[Any, int]:
    from stalwart.config import RunConfig
    from stalwart.launch import launch
    from stalwart.rundir import RunData

    cfg = RunConfig(nproc=4, testbed="netns", faults=list(sc.faults), steps=sc.steps,
                    seed=sc.seed, batch_size=BATCH, comm=sc.comm, out=str(workdir),
                    name=f"{tag}-{sc.name}")
    rc = launch(cfg, show_progress=False, on_line=lambda _s: None)
    return RunData.load(cfg.run_dir), rc


def measure_overhead(workdir: Path, tag: str, steps: int) -> dict[str, Any]:
    from stalwart.config import RunConfig
    from stalwart.launch import launch

    cfg = RunConfig(nproc=4, testbed="local", steps=steps, batch_size=BATCH,
                    out=str(workdir), name=f"{tag}-overhead")
    rc = launch(cfg, module="stalwart.bench.detect",
                args=["--overhead-steps", str(steps)], show_progress=False,
                on_line=lambda _s: None)
    path = cfg.run_dir / "overhead.json"
    if rc != 0 or not path.exists():
        return {"error": f"overhead run failed (exit {rc}), see {cfg.run_dir}/logs"}
    return json.loads(path.read_text())


def run(quick: bool, workdir: Path) -> BenchResult:
    from stalwart.detect.baseline import threshold_detector

    workdir = Path(workdir)
    tag = time.strftime("detect-%Y%m%d-%H%M%S")
    ours: list[tuple[Scenario, list[dict], list[Truth], int]] = []
    lossy: list[tuple[Scenario, list[dict], list[Truth], int]] = []
    base: list[tuple[Scenario, list[dict], list[Truth], int]] = []
    failed: list[Scenario] = []
    hiccups: dict[str, int | None] = {}
    todo = scenarios(quick)
    steps = Steps("detect", len(todo) + 1)
    for sc in todo:
        steps.start(sc.name)
        data, rc = run_scenario(sc, workdir, tag)
        if rc == 130:
            raise KeyboardInterrupt
        if rc != 0:
            failed.append(sc)
            continue
        truths = ground_truth(data.events)
        last = max((m["step"] for m in data.metrics), default=0)
        found = data.events_of("straggler_detected", "straggler_recovered",
                               "slowdown_unexplained")
        (lossy if sc.comm == "lossy" else ours).append((sc, found, truths, last))
        stats_path = data.path / "detect_stats.json"
        if stats_path.exists():
            hiccups[sc.name] = json.loads(stats_path.read_text()).get("hiccups")
        if sc.comm == "reliable":
            # what a user would threshold: each rank's own compute time (the step time is
            # the same on every rank of a synchronous job)
            base.append((sc, threshold_detector(data.step_table("compute_time")), truths,
                         last))
    steps.start("overhead (monitor on/off)")
    ov = measure_overhead(workdir, tag, 160 if quick else 600)
    s = score(ours, [f for f in failed if f.comm == "reliable"])
    b = score(base, [f for f in failed if f.comm == "reliable"])
    lo = score(lossy, [f for f in failed if f.comm == "lossy"])
    recoveries = [
        {"scenario": sc.name, "removed": t.removed,
         "recovered_step": next((d["step"] for d in dets if d.get("event") ==
                                 "straggler_recovered" and t.removed is not None
                                 and d["step"] >= t.removed - 3), None)}
        for sc, dets, truths, _ in ours for t in truths if t.removed is not None]
    figures = {
        "false_positives": s["false_positives"],
        "detection_rate": s["detection_rate"],
        "localization_accuracy": s["localization_accuracy"],
        "median_latency_iters": s["median_latency_iters"],
        "unexplained_on_clean": s["clean_unexplained_slowdowns"],
        "tracking_overhead": ov.get("overhead"),
        "monitor_step_cpu_us_median": ov.get("monitor_step_cpu_us_median"),
        "lossy_detection_rate": lo["detection_rate"],
        "lossy_false_positives": lo["false_positives"],
        "lossy_localization_accuracy": lo["localization_accuracy"],
        "baseline_false_positives": b["false_positives"],
        "baseline_detection_rate": b["detection_rate"],
        "baseline_localization_accuracy": b["localization_accuracy"],
    }
    targets = {"false_positives": "<= 0", "detection_rate": ">= 0.95",
               "localization_accuracy": ">= 0.95", "median_latency_iters": "<= 4",
               "unexplained_on_clean": "<= 0", "tracking_overhead": "<= 0.005",
               "lossy_detection_rate": ">= 0.9", "lossy_false_positives": "<= 0"}
    details = {"scenario_runs": len(ours) + len(lossy),
               "failed_runs": [f.name for f in failed], "ours": s, "lossy": lo,
               "baseline": b, "recoveries": recoveries, "overhead": ov, "hiccups": hiccups,
               "workdir": str(workdir),
               "steps": STEPS, "fault_start": START, "batch_size": BATCH}
    cmd = "stalwart bench detect" + (" --quick" if quick else "")
    return BenchResult("detect", figures, targets, details, cmd)


# ---- the overhead worker (one rank) ---------------------------------------------------------
def _paired(xs: list[tuple[bool, float]]) -> tuple[float, float]:
    """Mean log(on/off) over consecutive (on, off) / (off, on) pairs, and its 95% half-width."""
    logs = []
    for i in range(0, len(xs) - 1, 2):
        (a_on, a), (_, b) = xs[i], xs[i + 1]
        if a > 0 and b > 0:
            logs.append(math.log(a / b) if a_on else math.log(b / a))
    mean = statistics.fmean(logs)
    return mean, 1.96 * statistics.stdev(logs) / math.sqrt(len(logs))


ABBA = (True, False, False, True)  # monitor on/off per step: a linear drift cancels in 4 steps


def abba(step: int, warm: int) -> tuple[bool, bool]:
    """(monitor on at ``step``, drain its exchanges at the end of it): on through warm-up,
    then ABBA; an "on" step followed by an "off" one drains, so the exchange it issued is
    complete before the off step begins and its cost stays with the on step."""
    on = step < warm or ABBA[(step - warm) % 4]
    nxt = step + 1 < warm or ABBA[(step + 1 - warm) % 4]
    return on, on and not nxt


def begin_step(mon: Monitor, step: int, warm: int) -> bool:
    """Switch the monitor on or off for ``step`` as the schedule says (every rank at the
    same step); returns whether it is on."""
    on = abba(step, warm)[0]
    mon.enabled = on
    return on


def end_step(mon: Monitor, step: int, warm: int, metrics: dict[str, float]) -> None:
    """The monitor's part of the end of ``step``: its step hint, then, where the schedule
    says (``abba``), a drain -- the next step runs with the monitor off, and the exchange
    this step issued must not run on into it: its cost belongs to this "on" step."""
    mon.step(step, metrics)
    if abba(step, warm)[1]:
        mon.drain()


def overhead_worker(cfg_path: Path, steps: int, check_every: int | None = None) -> int:
    """DDP training with the Monitor on and off on alternating steps (ABBA), same process.

    Every rank switches at the same step. Steps pair up as (on, off), (off, on), ...; the
    overhead is the geometric mean of the pairs' ratios - 1, with a 95% interval. The time
    spent inside ``monitor.step`` (detector, decision broadcast) is reported separately.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from stalwart.config import RunConfig
    from stalwart.detect import Monitor
    from stalwart.train.data import load_corpus, train_batch
    from stalwart.train.model import GPT, PRESETS

    cfg = RunConfig.load(cfg_path)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    run_dir = Path(os.environ["STALWART_RUN_DIR"])
    # the exchange period stalwart's worker uses for reliable communication (None: the
    # monitor batches exchanges, src/stalwart/train/worker.py): the figure is the cost of
    # what `stalwart run` does
    mon = Monitor(run_dir=None, rank=rank, world=world, check_every=check_every)
    torch.manual_seed(cfg.seed)
    mcfg = PRESETS[cfg.preset]["model"]
    model = DDP(GPT(mcfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    corpus = load_corpus(cfg.data, cfg.max_data_bytes)
    bs = cfg.resolved_batch_size()
    warm = 12
    dts: list[tuple[bool, float]] = []
    cpus: list[tuple[bool, float]] = []
    in_step: list[float] = []
    in_step_cpu: list[float] = []
    for step in range(warm + steps):
        on = begin_step(mon, step, warm)
        x, y = train_batch(corpus, bs, mcfg.block_size, cfg.seed, step, rank, 0)
        t0 = time.perf_counter()
        c0 = time.process_time()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        m0 = time.thread_time()
        # as stalwart's worker does: the loop reports its compute and communication split
        # (so the tracker keeps no records; their split does not matter here)
        end_step(mon, step, warm, {"step_time": t1 - t0, "compute_time": t1 - t0,
                                   "comm_time": 0.0})
        m1 = time.thread_time()
        t2 = time.perf_counter()
        c2 = time.process_time()
        if step >= warm:
            dts.append((on, t2 - t0))
            cpus.append((on, c2 - c0))
            if on:
                in_step.append(t2 - t1)
                in_step_cpu.append(m1 - m0)
    mon.close()
    if rank == 0:
        mean, half = _paired(dts)
        cmean, chalf = _paired(cpus)
        on_times = [d for o, d in dts if o]
        out = {"overhead": math.exp(mean) - 1.0, "pairs": len(dts) // 2,
               "ci95": [math.exp(mean - half) - 1, math.exp(mean + half) - 1],
               # the same pairing on this process's CPU time (all its threads): what the
               # monitor adds in work, much less disturbed by other jobs on the machine
               "cpu_overhead": math.exp(cmean) - 1.0,
               "cpu_ci95": [math.exp(cmean - chalf) - 1, math.exp(cmean + chalf) - 1],
               "median_step_on": statistics.median(on_times),
               "median_step_off": statistics.median([d for o, d in dts if not o]),
               "monitor_step_s_median": statistics.median(in_step),
               "monitor_step_s_quantiles": [round(q, 6) for q in
                                            statistics.quantiles(in_step, n=10)],
               "monitor_step_fraction": sum(in_step) / sum(on_times),
               "monitor_step_cpu_us_median": round(1e6 * statistics.median(in_step_cpu), 1),
               "monitor_step_cpu_us_quantiles": [round(1e6 * q, 1) for q in
                                                 statistics.quantiles(in_step_cpu, n=10)],
               "monitor": mon.stats(), "check_every_arg": check_every, "nproc": world}
        (run_dir / "overhead.json").write_text(json.dumps(out, indent=2) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stalwart.bench.detect")
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--overhead-steps", type=int, default=200)
    ap.add_argument("--check-every", type=int, default=0,
                    help="the monitor's exchange period; 0 (default, what `stalwart run` "
                         "does for reliable comm): chosen by the monitor")
    a = ap.parse_args(argv)
    return overhead_worker(a.config, a.overhead_steps, a.check_every or None)


if __name__ == "__main__":
    sys.exit(main())
