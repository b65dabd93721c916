"""Calibration: the model's step time against the testbed's measured step time.

Protocol (every number from a recorded ``stalwart run --testbed netns`` directory):
- each run is summarised (``summarise``): ranks, micro-batches per rank, gradient bytes (4 x
  the preset's parameters), its faults, and the median iteration time (the slowest rank's
  step) over its healthy window (steps 10 .. the fault's start - 1) and over its fault window
  (the fault's start + 3 .. its end), plus the healthy window's median compute per rank;
- the model is fitted on a healthy window only: seconds per micro-batch = median compute /
  micro-batches, and the fixed per-step cost = the measured median minus what the model
  (with the measured noise, no fault) gives without it;
- then it predicts, without further fitting: each fault window from the same run's healthy
  window (compute F -> the rank's compute x F; contention K -> x (K+1), the rank's share
  of its CPU cap; a host link or a ring pair at R bit/s -> the ring all-reduce's bottleneck
  at R, with 4.6% of TCP/IP headers at MTU 1500), and the 8-rank healthy windows from the
  4-rank healthy run: compute per micro-batch and the fixed cost x 2, because the testbed
  holds each host at cores/ranks CPUs and on a CPU every per-step cost (gloo's reductions
  and copies, the optimizer, Python) runs on that share.
``sim_step_error`` is the largest |predicted / measured - 1| over the predictions (the fits
themselves are listed, not counted). Noise: the machine is shared, so identical healthy
windows measured 0.074-0.098 s from run to run (tiny preset, 4 ranks); a prediction can be
no better than that.

The summaries of the runs recorded for docs/BENCHMARKS.md are kept in
``data/calibration.json``; ``--calibrate DIR...`` re-summarises run directories.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from stalwart.rundir import RunData
from stalwart.simulate.engine import Engine, Settings
from stalwart.simulate.faults import Fault
from stalwart.simulate.model import Job, Link
from stalwart.simulate.noise import Noise

DATA = Path(__file__).with_name("data") / "calibration.json"
WARM = 10
SETTLE = 3  # steps after a fault's start before its window (the kernel state, the queues)
HEADERS = 1514 / 1448  # wire bytes per TCP payload byte at MTU 1500
VETH_BPS = 7e9  # an unshaped testbed pair (BENCHMARKS testbed: ~7 Gbit/s)
CORES = 2
STEPS = 300  # simulated steps per prediction


def _params(preset: str) -> int:
    from stalwart.train.model import GPT, PRESETS

    return sum(p.numel() for p in GPT(PRESETS[preset]["model"]).parameters())


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
        "preset": cfg.get("preset", "tiny"), "micro_batches": int(cfg.get("micro_batches", 1)),
        "grad_bytes": 4 * _params(cfg.get("preset", "tiny")), "faults": faults,
        "healthy_step_s": float(np.median(it[healthy])),
        "healthy_compute_s": float(np.median(comp)), "healthy_steps": int(healthy.sum())}
    if faults:
        w = (st >= start + SETTLE) & (st < end)
        out["fault_step_s"] = float(np.median(it[w]))
        out["fault_steps"] = int(w.sum())
    return out


def _job(s: dict[str, Any], ranks: int, c: float, fixed: float) -> Job:
    mb = s["micro_batches"]
    return Job(dp=ranks, micro=mb * ranks, mb_compute_s=c, grad_bytes=s["grad_bytes"] * HEADERS,
               fixed_s=fixed, gpus_per_host=1, inter=Link(0.0, VETH_BPS / 8))


def _faults(s: dict[str, Any], ranks: int) -> list[Fault]:
    out = []
    for f in s["faults"]:
        kind, target, mag = f["kind"], str(f["target"] or ""), float(f["magnitude"] or 1.0)
        if kind == "compute":
            out.append(Fault("compute", int(target.removeprefix("rank")), mag, 0.0))
        elif kind == "contention":
            out.append(Fault("compute", int(target.removeprefix("rank")), mag + 1.0, 0.0))
        elif kind in ("link", "pairlink"):
            host = int(str(f["spec"]).split("=")[1].split(",")[0].split("-")[0])
            out.append(Fault("link", host % ranks, VETH_BPS / mag, 0.0))
    return out


def _median_step(job: Job, faults: list[Fault], noise: Noise, seed: int) -> float:
    eng = Engine(job, faults, noise, Settings(policy="none", seed=seed))
    out = eng.run(STEPS, "calibrate")  # STEPS < engine.TIMELINE: every step is kept
    return float(np.median([s for _, s in out.timeline]))


def fit(s: dict[str, Any], noise: Noise, seed: int = 0) -> tuple[float, float]:
    """(seconds per micro-batch, fixed seconds per step) from a run's healthy window."""
    c = s["healthy_compute_s"] / s["micro_batches"]
    base = _median_step(_job(s, s["ranks"], c, 0.0), [], noise, seed)
    return c, max(0.0, s["healthy_step_s"] - base)


def predict_all(summaries: list[dict[str, Any]], noise: Noise, seed: int = 0
                ) -> list[dict[str, Any]]:
    """One row per case (module docstring): fitted or predicted, measured, error."""
    by = {s["name"]: s for s in summaries}
    rows = []
    for s in summaries:
        c, fixed = fit(s, noise, seed)
        if not s["faults"]:
            rows.append({"case": f"{s['name']} (healthy)", "kind": "fit", "ranks": s["ranks"],
                         "measured_s": round(s["healthy_step_s"], 4),
                         "predicted_s": round(s["healthy_step_s"], 4), "error": 0.0})
            continue
        pred = _median_step(_job(s, s["ranks"], c, fixed), _faults(s, s["ranks"]), noise, seed)
        rows.append(_row(f"{s['name']} (fault window)", s["ranks"], s["fault_step_s"], pred))
    # across sizes: a 4-rank healthy fit predicts the 8-rank runs' healthy windows
    for s8 in summaries:
        if s8["ranks"] != 8:
            continue
        base = by.get(f"{s8['preset']}4-healthy")
        if base is None:
            continue
        c, fixed = fit(base, noise, seed)
        share = max(1.0, s8["ranks"] / CORES) / max(1.0, base["ranks"] / CORES)
        pred = _median_step(_job(base, 8, c * share, fixed * share), [], noise, seed)
        rows.append(_row(f"{s8['name']} (healthy, from {base['name']})", 8,
                         s8["healthy_step_s"], pred))
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
