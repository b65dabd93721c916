"""Calibration: the model's step time against the testbed's measured step time.

Protocol (every number from a recorded ``stalwart run --testbed netns`` directory; ``record``
makes them, ``CASES`` lists them):
- while a run runs, ``RateSampler`` reads every rank's threads' scheduler counters
  (``/proc/<tid>/schedstat``: seconds on a CPU, seconds runnable but waiting -- for a run-queue
  slot or for the rank's CFS quota, which the testbed sets for every rank with ``--cpu-cap
  fair``) every ``SAMPLE_S`` and writes them to the run directory (``RATES``);
- each run is summarised (``summarise``): ranks, ranks per host, micro-batches per rank,
  gradient bytes (4 x the preset's parameters), its faults, and the median iteration time (the
  slowest rank's step) over its healthy window (steps 10 .. the fault's start - 1) and over
  its fault window (the fault's start + 3 .. its end), the healthy window's median compute per
  rank, and each rank's *delivered rate* in each window: CPU seconds / (CPU + waiting)
  seconds of its main thread (forward, backward, optimizer; all its threads' rate is kept as
  ``*_rate_all``), the part of a CPU the machine gave the rank while it had work;
- the model is fitted on a healthy window only: seconds per micro-batch = median compute /
  micro-batches, and the rest of the measured median step (what the model's compute, with
  the measured noise, leaves) is the all-reduce's CPU work (``model.Job.comm_cpu_s``: gloo's
  reductions and copies, pipelined with the wire time, so a link-bound step pays the wire);
- load between windows is normalised by the delivered rate, not by wall time: compute in a
  predicted window = the fitted window's x the fitted window's median rate / the predicted
  window's (over the ranks no CPU fault targets), the all-reduce's CPU work likewise with the
  slowest rank's rate (``_comm_norm``: the ring's steps go in lock-step). Within a run this
  is the load that moved between its healthy and its fault window; across runs it is also
  the testbed's CPU cap (cores / ranks each), measured rather than assumed. A compute or
  contention fault's rank gets its own measured rate ratio as its factor (a quota of
  share / 2 reads 1.7-2.1x when the machine's other load holds the healthy ranks under their
  share);
- then it predicts, without further fitting: each fault window from the same run's healthy
  window (a host link or a ring pair at R bit/s -> the ring all-reduce's bottleneck at R,
  with 4.6% of TCP/IP headers at MTU 1500), and every other run's healthy window of the same
  preset from the preset's 4-rank healthy run (``BASE``), with that run's ranks and ranks per
  host.
What the rate does not see: a rank blocked in a collective is not runnable, so a window's
rate is weighted to the rank's CPU-bound phases; memory bandwidth and caches shared with the
other load are not in it (a CPU second of a loaded machine can do less work).
``sim_step_error`` is the largest |predicted / measured - 1| over the predictions (the fits
themselves are listed, not counted). ``predict_all(..., rates=False, pipelined=False)`` is
the protocol before (wall time only, the cap's share assumed, the nominal fault factor, the
non-compute cost added to the wire time).

The summaries of the runs recorded for docs/BENCHMARKS.md are kept in
``data/calibration.json``; ``python -m stalwart.simulate.calibrate record OUT`` re-records
them (root: netns testbed, cgroups; ~20 min on a 2-core machine at load 10-25) and
``python -m stalwart.simulate.calibrate summarise RUN_DIR...`` re-summarises (writes
``data/calibration.json``); ``stalwart simulate --calibrate DIR...`` uses run directories.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from stalwart.rundir import RunData
from stalwart.simulate.engine import Engine, Settings
from stalwart.simulate.faults import Fault
from stalwart.simulate.model import Job, Link
from stalwart.simulate.noise import Noise

DATA = Path(__file__).with_name("data") / "calibration.json"
RATES = "cpu_rates.jsonl"  # RateSampler's lines in a run directory
WARM = 10
SETTLE = 3  # steps after a fault's start before its window (the kernel state, the queues)
HEADERS = 1514 / 1448  # wire bytes per TCP payload byte at MTU 1500
VETH_BPS = 7e9  # an unshaped testbed pair (BENCHMARKS testbed: ~7 Gbit/s)
CORES = 2
STEPS = 300  # simulated steps per prediction
SAMPLE_S = 0.2  # a tiny-preset healthy window is ~2 s: ~10 samples
CPU_KINDS = ("compute", "contention")

_COMMON = ["--testbed", "netns", "--cpu-cap", "fair", "--micro-batches", "4", "--no-progress"]
_TINY = ["--preset", "tiny", "--steps", "80", "--batch-size", "2"]
_SMALL = ["--preset", "small", "--steps", "40", "--batch-size", "4"]
CASES: list[tuple[str, list[str]]] = [  # name, ``stalwart run`` arguments after _COMMON
    ("tiny4-healthy", [*_TINY, "--nproc", "4"]),
    ("tiny4-compute", [*_TINY, "--nproc", "4", "--fault", "compute:rank=2,factor=2,start=30"]),
    ("tiny4-link", [*_TINY, "--nproc", "4", "--fault", "link:host=2,rate=10mbit,start=30"]),
    ("tiny4-contention", [*_TINY, "--nproc", "4",
                          "--fault", "contention:rank=1,procs=2,start=30"]),
    ("tiny4-pairlink", [*_TINY, "--nproc", "4",
                        "--fault", "pairlink:hosts=1-2,rate=10mbit,start=30"]),
    ("tiny8-healthy", [*_TINY, "--nproc", "8"]),
    ("tiny8-compute", [*_TINY, "--nproc", "8", "--fault", "compute:rank=5,factor=2,start=30"]),
    ("tiny4x2-healthy", [*_TINY, "--nproc", "4", "--ranks-per-host", "2"]),
    ("tiny4x2-link", [*_TINY, "--nproc", "4", "--ranks-per-host", "2",
                      "--fault", "link:host=1,rate=10mbit,start=30"]),
    ("tiny6x2-link", [*_TINY, "--nproc", "6", "--ranks-per-host", "2",
                      "--fault", "link:host=1,rate=10mbit,start=30"]),
    ("tiny6x2-compute", [*_TINY, "--nproc", "6", "--ranks-per-host", "2",
                         "--fault", "compute:rank=3,factor=2,start=30"]),
    ("small4-healthy", [*_SMALL, "--nproc", "4"]),
    ("small4-compute", [*_SMALL, "--nproc", "4", "--fault", "compute:rank=2,factor=2,start=15"]),
    ("small4-link", [*_SMALL, "--nproc", "4", "--fault", "link:host=2,rate=20mbit,start=15"]),
]
BASE = {"tiny": "tiny4-healthy", "small": "small4-healthy"}  # the fits across runs


# -- recording -------------------------------------------------------------------------------
def _schedstat(tid: int) -> tuple[int, int] | None:
    try:
        with open(f"/proc/{tid}/schedstat") as f:
            on, wait = f.read().split()[:2]
        return int(on), int(wait)
    except (OSError, ValueError):
        return None


def _is_busy(tid: int, cache: dict[int, bool]) -> bool:
    """A contention fault's busy process (testbed/cpu.py): in the rank's group, not the rank."""
    if tid not in cache:
        try:
            cache[tid] = b"getppid" in Path(f"/proc/{tid}/cmdline").read_bytes()
        except OSError:
            cache[tid] = True
    return cache[tid]


def _is_main(tid: int, cache: dict[int, bool]) -> bool:
    """A process's main thread (its Tgid is its tid): the rank's training loop -- forward,
    backward and optimizer run there (torch at one intra-op thread per rank)."""
    if tid not in cache:
        try:
            status = Path(f"/proc/{tid}/status").read_text()
            tgid = next(x.split()[1] for x in status.splitlines() if x.startswith("Tgid:"))
            cache[tid] = int(tgid) == tid
        except (OSError, StopIteration, ValueError):
            cache[tid] = False
    return cache[tid]


class RateSampler(threading.Thread):
    """Samples the ranks of the testbed owned by process ``owner`` every ``SAMPLE_S``: per rank
    (its CPU group ``stw-<owner>-<k>-r<rank>``, the busy processes of a contention fault left
    out), the on-CPU and waiting seconds its threads gained since the last sample (threads seen
    in both samples only). Writes one JSON line per rank and sample to ``path``: ``t`` (epoch
    s), ``rank``, ``cpu_s``, ``wait_s``. Cost: one small read per rank thread per sample."""

    def __init__(self, owner: int, path: Path, root: Path = Path("/sys/fs/cgroup/cpu")) -> None:
        super().__init__(daemon=True)
        self.owner, self.path, self.root = owner, path, root
        self.stop = threading.Event()

    def _groups(self) -> dict[int, Path]:
        out = {}
        for g in self.root.glob(f"stw-{self.owner}-*-r*"):
            tasks = g / "tasks" if (g / "tasks").exists() else g / "cgroup.threads"
            out[int(g.name.rsplit("-r", 1)[1])] = tasks
        return out

    def run(self) -> None:
        last: dict[int, tuple[int, int]] = {}
        busy: dict[int, bool] = {}
        main: dict[int, bool] = {}
        with open(self.path, "a") as out:
            while not self.stop.wait(SAMPLE_S):
                now, t = {}, time.time()
                for rank, tasks in self._groups().items():
                    try:
                        tids = [int(x) for x in tasks.read_text().split()]
                    except OSError:
                        continue
                    acc = {"cpu_s": 0, "wait_s": 0, "main_cpu_s": 0, "main_wait_s": 0}
                    for tid in tids:
                        if _is_busy(tid, busy):
                            continue
                        s = _schedstat(tid)
                        if s is None:
                            continue
                        now[tid] = s
                        if tid in last:
                            d = (s[0] - last[tid][0], s[1] - last[tid][1])
                            acc["cpu_s"] += d[0]
                            acc["wait_s"] += d[1]
                            if _is_main(tid, main):
                                acc["main_cpu_s"] += d[0]
                                acc["main_wait_s"] += d[1]
                    out.write(json.dumps({"t": round(t, 3), "rank": rank,
                                          **{k: v / 1e9 for k, v in acc.items()}}) + "\n")
                    out.flush()
                last = now


def record(out: Path, names: list[str] | None = None) -> list[Path]:
    """Runs the ``CASES`` (or those named) one after another under ``out``, each with a
    ``RateSampler``; returns their run directories."""
    dirs = []
    for name, args in CASES:
        if names and name not in names:
            continue
        cmd = [sys.executable, "-m", "stalwart.cli", "run", *_COMMON, *args,
               "--out", str(out), "--name", name]
        print(" ".join(["stalwart", *cmd[3:]]), flush=True)
        t0 = time.time()
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        (out / name).mkdir(parents=True, exist_ok=True)
        rates = out / name / RATES
        rates.unlink(missing_ok=True)
        sampler = RateSampler(p.pid, rates)
        sampler.start()
        rc = p.wait()
        sampler.stop.set()
        sampler.join()
        print(f"  rc {rc}, {time.time() - t0:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)
        dirs.append(out / name)
    return dirs


# -- summaries -------------------------------------------------------------------------------
def _params(preset: str) -> int:
    from stalwart.train.model import GPT, PRESETS

    return sum(p.numel() for p in GPT(PRESETS[preset]["model"]).parameters())


def _target(f: dict[str, Any]) -> int:
    """The fault's rank (compute, contention), host (link) or first host (pairlink)."""
    body = str(f["spec"]).split(":", 1)[1]
    kv = dict(x.split("=", 1) for x in body.split(","))
    return int((kv.get("rank") or kv.get("host") or kv["hosts"]).split("-")[0])


def _span(run: RunData, lo: int, hi: int) -> tuple[float, float]:
    """Epoch seconds from the start of step ``lo`` to the end of step ``hi - 1`` (any rank)."""
    rows = [m for m in run.metrics if lo <= m["step"] < hi and "time" in m]
    return (min(m["time"] - m["step_time"] for m in rows), max(m["time"] for m in rows))


def _rates(lines: list[dict[str, Any]], t0: float, t1: float, key: str = "main_"
           ) -> dict[str, float]:
    """Per rank: CPU / (CPU + waiting) seconds over the samples ending in (t0, t1], of its
    main threads (``key`` "main_") or of all its threads ("")."""
    cpu: dict[int, float] = {}
    tot: dict[int, float] = {}
    for x in lines:
        if t0 < x["t"] <= t1:
            c, w = x[f"{key}cpu_s"], x[f"{key}wait_s"]
            cpu[x["rank"]] = cpu.get(x["rank"], 0.0) + c
            tot[x["rank"]] = tot.get(x["rank"], 0.0) + c + w
    return {str(r): round(cpu[r] / tot[r], 4) for r in sorted(cpu) if tot[r] > 0}


def summarise(run_dir: Path) -> dict[str, Any]:
    run = RunData.load(run_dir)
    cfg = run.config
    steps, it = run.iteration_times()
    st, it = np.asarray(steps), np.asarray(it)
    faults = []
    for e in run.events_of("fault_applied"):
        faults.append({"spec": e.get("spec"), "kind": e.get("kind"),
                       "target": e.get("target"), "magnitude": e.get("magnitude"),
                       "start": int(e.get("step", 0)),
                       "end": e.get("end") if isinstance(e.get("end"), int) else None})
    start = min((f["start"] for f in faults), default=int(st.max()) + 1)
    end = min((f["end"] for f in faults if f["end"] is not None), default=int(st.max()) + 1)
    ct = run.step_table("compute_time")
    healthy = (st >= WARM) & (st < start)
    comp = [float(np.median(list(ct[s].values()))) for s in st[healthy] if s in ct]
    out: dict[str, Any] = {
        "name": Path(run_dir).name, "ranks": int(cfg.get("nproc", 4)),
        "ranks_per_host": int(cfg.get("ranks_per_host", 1)),
        "preset": cfg.get("preset", "tiny"), "micro_batches": int(cfg.get("micro_batches", 1)),
        "grad_bytes": 4 * _params(cfg.get("preset", "tiny")), "faults": faults,
        "healthy_step_s": float(np.median(it[healthy])),
        "healthy_compute_s": float(np.median(comp)), "healthy_steps": int(healthy.sum())}
    rates_path = Path(run_dir) / RATES
    lines = [json.loads(x) for x in rates_path.read_text().splitlines() if x.strip()] \
        if rates_path.exists() else []
    if lines:  # the model reads the main threads' rates; all threads' are kept to compare
        out["healthy_rate"] = _rates(lines, *_span(run, WARM, start))
        out["healthy_rate_all"] = _rates(lines, *_span(run, WARM, start), key="")
    if faults:
        w = (st >= start + SETTLE) & (st < end)
        out["fault_step_s"] = float(np.median(it[w]))
        out["fault_steps"] = int(w.sum())
        if lines:
            span = _span(run, start + SETTLE, int(st[w].max()) + 1)
            out["fault_rate"] = _rates(lines, *span)
            out["fault_rate_all"] = _rates(lines, *span, key="")
    return out


# -- the model against the summaries ---------------------------------------------------------
def _job(s: dict[str, Any], ranks: int, c: float, fixed: float, per_host: int = 1,
         pipelined: bool = True, grad: bool = True) -> Job:
    """The run as the model's job; the fitted non-compute cost ``fixed`` is the all-reduce's
    CPU work (``Job.comm_cpu_s``, under its wire time) when ``pipelined``, else a fixed cost
    added to it (the protocol before)."""
    mb = s["micro_batches"]
    return Job(dp=ranks, micro=mb * ranks, mb_compute_s=c,
               grad_bytes=s["grad_bytes"] * HEADERS if grad else 0.0,
               fixed_s=0.0 if pipelined else fixed, comm_cpu_s=fixed if pipelined else 0.0,
               gpus_per_host=per_host, inter=Link(0.0, VETH_BPS / 8))


def _cpu_targets(s: dict[str, Any]) -> set[int]:
    return {_target(f) for f in s["faults"] if f["kind"] in CPU_KINDS}


def _median_rate(rates: dict[str, float], skip: set[int]) -> float:
    return float(np.median([v for r, v in rates.items() if int(r) not in skip]))


def _faults(s: dict[str, Any], ranks: int, achieved: dict[int, float] | None = None
            ) -> list[Fault]:
    """The run's faults as the simulator's; a CPU fault's factor is ``achieved[rank]`` when
    given (its measured rate ratio), else nominal (compute F -> x F; contention K -> x (K+1),
    the rank's share of its CPU cap)."""
    out = []
    for f in s["faults"]:
        kind, mag, t = f["kind"], float(f["magnitude"] or 1.0), _target(f)
        if kind in CPU_KINDS:
            nominal = mag if kind == "compute" else mag + 1.0
            out.append(Fault("compute", t, (achieved or {}).get(t, nominal), 0.0))
        elif kind in ("link", "pairlink"):
            out.append(Fault("link", t % ranks, VETH_BPS / mag, 0.0))
    return out


def _median_step(job: Job, faults: list[Fault], noise: Noise, seed: int) -> float:
    eng = Engine(job, faults, noise, Settings(policy="none", seed=seed))
    out = eng.run(STEPS, "calibrate")  # STEPS < engine.TIMELINE: every step is kept
    return float(np.median([s for _, s in out.timeline]))


def fit(s: dict[str, Any], noise: Noise, seed: int = 0, pipelined: bool = True
        ) -> tuple[float, float]:
    """(seconds per micro-batch, seconds of the step outside compute) from a run's healthy
    window: all of it when ``pipelined`` (the healthy wire time is under the CPU work), else
    what the model's all-reduce leaves."""
    c = s["healthy_compute_s"] / s["micro_batches"]
    job = _job(s, s["ranks"], c, 0.0, s.get("ranks_per_host", 1), pipelined=False,
               grad=not pipelined)
    return c, max(0.0, s["healthy_step_s"] - _median_step(job, [], noise, seed))


def _comm_norm(ref: dict[str, float], target: dict[str, float]) -> float:
    """The all-reduce's CPU work from one window to another: the ring's 2 (d - 1) steps go
    in lock-step, each as fast as its slowest rank's share of the reductions, so the work
    scales with the slowest rank's rate (min over ranks), not the median."""
    return min(ref.values()) / min(target.values())


def _fault_row(s: dict[str, Any], noise: Noise, seed: int, rates: bool,
               pipelined: bool = True, slowest: bool = True) -> dict[str, Any]:
    c, fixed = fit(s, noise, seed, pipelined)
    achieved = None
    norm = comm = 1.0
    if rates:
        skip = _cpu_targets(s)
        h, f = s["healthy_rate"], s["fault_rate"]
        norm = _median_rate(h, skip) / _median_rate(f, skip)
        comm = _comm_norm(h, f) if slowest else norm
        achieved = {t: h[str(t)] / f[str(t)] / norm for t in skip}
    job = _job(s, s["ranks"], c * norm, fixed * comm, s.get("ranks_per_host", 1), pipelined)
    pred = _median_step(job, _faults(s, s["ranks"], achieved), noise, seed)
    row = _row(f"{s['name']} (fault window)", s["ranks"], s["fault_step_s"], pred)
    row["load_norm"] = round(norm, 4)
    row["comm_norm"] = round(comm, 4)
    if achieved:
        row["achieved"] = {str(k): round(v, 3) for k, v in achieved.items()}
    return row


def predict_all(summaries: list[dict[str, Any]], noise: Noise, seed: int = 0,
                rates: bool | None = None, pipelined: bool = True, slowest: bool = True
                ) -> list[dict[str, Any]]:
    """One row per case (module docstring): fitted or predicted, measured, error.
    ``rates``: normalise load by the delivered rates (None: when every summary has them --
    run directories recorded without ``RateSampler`` get the protocol before the rates);
    ``pipelined``: the fitted non-compute cost is the all-reduce's CPU work under its wire
    time (``model.Job.comm_cpu_s``), else added to it (the protocol before); ``slowest``:
    that cost follows the slowest rank's rate (``_comm_norm``), else the median's."""
    if rates is None:
        rates = has_rates(summaries)
    by = {s["name"]: s for s in summaries}
    rows = []
    for s in summaries:
        if not s["faults"]:
            if s["name"] in BASE.values() or not rates:
                rows.append({"case": f"{s['name']} (healthy)", "kind": "fit",
                             "ranks": s["ranks"], "measured_s": round(s["healthy_step_s"], 4),
                             "predicted_s": round(s["healthy_step_s"], 4), "error": 0.0})
            continue
        rows.append(_fault_row(s, noise, seed, rates, pipelined, slowest))
    # across runs: the preset's 4-rank healthy fit predicts the other runs' healthy windows
    for s in summaries:
        base = by.get(BASE.get(s["preset"], ""))
        if base is None or s is base:
            continue
        if not rates and s["ranks"] != 8:
            continue  # the protocol before the rates predicted the 8-rank runs only
        c, fixed = fit(base, noise, seed, pipelined)
        if rates:
            norm = _median_rate(base["healthy_rate"], set()) / _median_rate(s["healthy_rate"],
                                                                          set())
            comm = _comm_norm(base["healthy_rate"], s["healthy_rate"]) if slowest else norm
        else:
            norm = comm = max(1.0, s["ranks"] / CORES) / max(1.0, base["ranks"] / CORES)
        job = _job(base, s["ranks"], c * norm, fixed * comm, s.get("ranks_per_host", 1),
                   pipelined)
        pred = _median_step(job, [], noise, seed)
        row = _row(f"{s['name']} (healthy, from {base['name']})", s["ranks"],
                   s["healthy_step_s"], pred)
        row["load_norm"] = round(norm, 4)
        row["comm_norm"] = round(comm, 4)
        rows.append(row)
    return rows


def _row(case: str, ranks: int, measured: float, pred: float) -> dict[str, Any]:
    return {"case": case, "kind": "prediction", "ranks": ranks,
            "measured_s": round(measured, 4), "predicted_s": round(pred, 4),
            "error": round(pred / measured - 1.0, 4)}


def step_error(rows: list[dict[str, Any]]) -> float:
    errs = [abs(r["error"]) for r in rows if r["kind"] == "prediction"]
    return round(max(errs), 4) if errs else float("nan")


def load(path: Path = DATA) -> list[dict[str, Any]]:
    return json.loads(Path(path).read_text())


def has_rates(summaries: list[dict[str, Any]]) -> bool:
    return all("healthy_rate" in s and ("fault_rate" in s or not s["faults"])
               for s in summaries)


def main(argv: list[str]) -> int:
    """``record OUT [NAME...]`` | ``summarise RUN_DIR...`` (writes ``DATA``) | ``table [FILE]``.
    """
    if argv[:1] == ["record"] and len(argv) >= 2:
        record(Path(argv[1]), argv[2:])
    elif argv[:1] == ["summarise"] and len(argv) >= 2:
        sums = [summarise(Path(d)) for d in argv[1:]]
        DATA.write_text(json.dumps(sums, indent=1) + "\n")
    elif argv[:1] == ["table"]:  # [FILE]: this protocol, then the one before (wall time)
        sums = load(Path(argv[1])) if len(argv) > 1 else load()
        variants: list[dict[str, bool]] = [{}, {"slowest": False},
                                           {"slowest": False, "pipelined": False},
                                           {"rates": False, "pipelined": False}]
        for kw in variants:
            rows = predict_all(sums, Noise.load(), **kw)
            name = {"rates": has_rates(sums), "pipelined": True, "slowest": True, **kw}
            print(f"{name}: sim_step_error {step_error(rows)}")
            for r in rows:
                print(f"  {r['case']:<50} {r['kind']:<10} {r['measured_s']:>8.4f} "
                      f"{r['predicted_s']:>8.4f} {r['error']:+.3f} {r.get('load_norm', '')} "
                      f"{r.get('comm_norm', '')} {r.get('achieved', '')}")
    else:
        print(main.__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
