"""``stalwart simulate``: every scale's scenarios, the decision-cost sweep, the calibration,
one run directory.

Writes ``OUT/NAME/``: ``config.json`` (the options), ``events.jsonl`` (every scenario's
faults, detections, mitigations, each line tagged with ``scenario`` and ``job_ranks``),
``figures.json`` (also to ``--json FILE``), ``cost.json``, ``calibration.json``, PNG plots and
``report.html``. Progress goes to stderr about once a second: scenario i of n, its steps,
elapsed time and an estimate of the rest (from the steps still to simulate at the current
rate). Cost: see engine.py; the sweep and the calibration add about a minute.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stalwart.events import FaultDrawn
from stalwart.mitigate import planner
from stalwart.rundir import EventLog, atomic_write_text
from stalwart.simulate import calibrate, cost, report
from stalwart.simulate.engine import Settings
from stalwart.simulate.faults import Fault, parse
from stalwart.simulate.noise import Noise
from stalwart.simulate.scenarios import POLICIES, ScaleResult, run_scale, scale_job, scale_tag


@dataclass
class Options:
    ranks: list[int] = field(default_factory=lambda: [10000])
    hours: float = 24.0
    policies: tuple[str, ...] = POLICIES
    tp: int = 8
    pp: int = 5
    gpus_per_host: int = 8
    noise_scale: float = 0.25
    restart_s: float = 12.0
    validation_s: float = 1.0
    seed: int = 0
    faults: list[str] = field(default_factory=list)  # scripted; none: FALCON-drawn
    events: int = 0  # > 0: exactly this many FALCON-drawn fail-slows within ``hours``
    cost_ranks: list[int] = field(default_factory=list)  # decision-cost sweep (empty: none)
    cost_steps: int = 150
    cost_before: bool = True
    calibrate_dirs: list[str] = field(default_factory=list)
    out: str = "runs"
    name: str | None = None
    json: str | None = None
    progress: bool = True


class _Progress:
    def __init__(self, total_steps: int, enabled: bool) -> None:
        self.total, self.done_before, self.enabled = total_steps, 0, enabled
        self.t0 = time.perf_counter()
        self.i, self.n = 0, 0
        self._cur = 0

    def scenario(self, i: int, n: int) -> None:
        self.i, self.n = i, n

    def __call__(self, name: str, done: int, total: int) -> None:
        if done >= total:
            self.done_before += total
            self._cur = 0
        else:
            self._cur = done
        if not self.enabled:
            return
        el = time.perf_counter() - self.t0
        done_all = self.done_before + self._cur
        eta = el / done_all * (self.total - done_all) if done_all else float("nan")
        what = f"scenario {self.i}/{self.n} " if self.n else ""
        print(f"\rsimulate: {what}{name}: step {min(done, total)}/{total}"
              f"  elapsed {el:6.0f} s  estimate {eta:6.0f} s left   ", end="",
              file=sys.stderr, flush=True)
        if done >= total:
            print(file=sys.stderr)


def _scripted(opts: Options, job: Any, step_s: float) -> list[Fault] | None:
    if not opts.faults:
        return None
    return [parse(s, job.ranks, job.hosts, step_s) for s in opts.faults]


def simulate(opts: Options, command: str = "stalwart simulate") -> tuple[Path, dict[str, Any]]:
    wall0, cpu0 = time.perf_counter(), time.process_time()
    noise = Noise.load(scale=opts.noise_scale)
    settings = Settings(restart_s=opts.restart_s, validation_s=opts.validation_s,
                        seed=opts.seed)
    jobs = [scale_job(n, opts.tp, opts.pp, opts.gpus_per_host) for n in opts.ranks]
    name = opts.name or time.strftime("sim-%Y%m%d-%H%M%S")
    run_dir = Path(opts.out) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.json", json.dumps(asdict(opts), indent=1))
    # rough total for the estimate: (healthy + policies) x steps, steps ~ hours / 8 s
    per = int(opts.hours * 3600 / 8.0)
    prog = _Progress(len(jobs) * (len(opts.policies) + 1) * per, opts.progress)
    figures: dict[str, Any] = {}
    results: list[ScaleResult] = []
    n_scen = len(jobs) * (len(opts.policies) + 1)
    with EventLog(run_dir) as events:
        for j_i, job in enumerate(jobs):
            state: dict[str, Any] = {"k": j_i * (len(opts.policies) + 1), "last": None}

            def rep(nm: str, d: int, t: int, st: dict[str, Any] = state,
                    tag: str = scale_tag(job.ranks)) -> None:
                if nm != st["last"]:  # a new scenario
                    st["k"] += 1
                    st["last"] = nm
                    prog.scenario(st["k"], n_scen)
                    prog.total = max(prog.total, prog.done_before + (n_scen - st["k"] + 1) * t)
                prog(f"{tag} {nm}", d, t)

            scripted = _scripted(opts, job, 8.0)
            res = run_scale(job, opts.hours, noise, settings, opts.policies, scripted, rep,
                            opts.events)
            results.append(res)
            figures.update(res.figures)
            for f in res.faults:
                events.emit(FaultDrawn(job_ranks=job.ranks, **f.as_event()))
            for sname, out in res.outcomes.items():
                for e in out.events:
                    events.relay(e, scenario=sname, job_ranks=job.ranks)
    # the scenarios of every scale (the sweep and the calibration below not included): wall
    # seconds, and this process's CPU seconds -- what a loaded machine does not inflate
    figures["sim_wall_s"] = round(time.perf_counter() - wall0, 1)
    figures["sim_cpu_s"] = round(time.process_time() - cpu0, 1)
    largest = scale_tag(max(opts.ranks))
    if f"decision_us_per_rank_step_{largest}" in figures:
        figures["decision_us_per_rank_step"] = figures[f"decision_us_per_rank_step_{largest}"]
    figures["planner_ms_10k_groups"] = round(planner.time_plan_ms(10000, 160000), 3)
    cost_rows = _cost_sweep(opts, noise, settings, figures, run_dir)
    summaries = [calibrate.summarise(Path(d)) for d in opts.calibrate_dirs] \
        if opts.calibrate_dirs else calibrate.load()
    calib = calibrate.predict_all(summaries, Noise.load(), opts.seed)
    figures["sim_step_error"] = calibrate.step_error(calib)
    errs = sorted(abs(r["error"]) for r in calib if r["kind"] == "prediction")
    figures["sim_step_error_median"] = round(errs[len(errs) // 2], 4) if errs else None
    atomic_write_text(run_dir / "calibration.json", json.dumps(calib, indent=1))
    plots = _plots(run_dir, results, cost_rows)
    atomic_write_text(run_dir / "figures.json", json.dumps(figures, indent=1))
    if opts.json:
        atomic_write_text(Path(opts.json), json.dumps(figures, indent=1))
    report.write_page(run_dir, figures, calib, plots, command)
    return run_dir, figures


def _cost_sweep(opts: Options, noise: Noise, settings: Settings, figures: dict[str, Any],
                run_dir: Path) -> list[dict[str, Any]]:
    """The decision-cost sweep (cost.py), before and after, into ``figures`` and cost.json."""
    if not opts.cost_ranks:
        return []

    def job_for(n: int) -> Any:
        return scale_job(n, opts.tp, opts.pp, opts.gpus_per_host)
    crep = _Progress(len(opts.cost_ranks) * opts.cost_steps * (2 if opts.cost_before else 1),
                     opts.progress)
    rows = cost.measure(job_for, opts.cost_ranks, opts.cost_steps, noise, settings, False,
                        crep)
    if opts.cost_before:
        rows += cost.measure(job_for, opts.cost_ranks, opts.cost_steps, noise, settings, True,
                             crep)
    for r in rows:
        tag = f"{r['variant']}_{{}}_{scale_tag(r['ranks'])}"
        figures["cost_" + tag.format("ms_median")] = r["ms_median"]
        figures["cost_" + tag.format("ms_max")] = r["ms_max"]
        figures["cost_" + tag.format("pauses_per_1000")] = r["pauses_per_1000_steps"]
    atomic_write_text(run_dir / "cost.json", json.dumps(rows, indent=1))
    return rows


def _plots(run_dir: Path, results: list[ScaleResult], cost_rows: list[dict[str, Any]]
           ) -> list[tuple[str, Path]]:
    out = []
    jct = {scale_tag(r.job.ranks): {n: o.jct_s / 3600 for n, o in r.outcomes.items()}
           for r in results}
    p = report.plot_jct(jct, run_dir / "jct.png")
    if p:
        out.append(("Job completion time per policy", p))
    for r in results:
        tag = scale_tag(r.job.ranks)
        p = report.plot_timeline({n: o.timeline for n, o in r.outcomes.items()},
                                 [f.as_event() for f in r.faults],
                                 f"step time at {r.job.ranks} ranks", run_dir /
                                 f"timeline_{tag}.png")
        if p:
            out.append((f"Step time at {r.job.ranks} ranks", p))
    p = report.plot_cost(cost_rows, run_dir / "decision_cost.png")
    if p:
        out.append(("Rank 0's decision cost and validation pauses against ranks", p))
    return out
