"""``stalwart bench overlap``: how much TP communication strand interleaving hides.

Mechanism measured: DHelix strand interleaving (arXiv 2411.15871) -- with split backward
(weight-gradient GEMMs deferred into collective waits) and optionally chunked collectives --
against sequential execution and against intra-micro-batch overlap (each column-parallel
backward overlapping its own input-gradient all-reduce with its weight-gradient GEMM -- what
a user would write).

Procedure (all on the netns testbed: one emulated host per rank, links shaped by tc tbf):
1. calibration runs: sequential schedule only, links at a reference rate R0; measure the
   communication time T_comm (in-flight time of the collectives) and the computation time
   T_compute (step time minus time blocked on collectives); set R1 = R0 * T_comm / T_compute
   (bandwidth-bound transfers take time ~ 1/rate), measure again at R1 and set
   R2 = R1 * T_comm / T_compute -- so that communication ~= computation; the ratio measured in
   the main run is reported as ``comm_to_compute``;
2. main run at R2: one model, three executors (sequential "off", intra-micro-batch "async",
   strand interleaving "si"), repetitions in rotating order with a barrier before each step
   (``stalwart.bench.overlap_worker``). Figures are medians over repetitions of per-repetition
   ratios, so slow drifts of the shared machine cancel.

Figures: si_comm_hidden = (T_seq - T_si) / T_comm; baseline_comm_hidden likewise for "async";
si_speedup = T_seq / T_si; si_vs_bound = T_si / max(T_compute, T_comm); si_extra_memory = peak
saved activations interleaved / sequential - 1 (autograd's saved tensors, see
overlap/memory.py, including what the deferred weight-gradient queue holds);
plan_model_error = |predicted - measured| / measured interleaved step time, predicted by the
profile's step model (``plan.simulate_step``), measured as the median over repetitions. Full
mode repeats the main run with TP=4 (``*_tp4`` figures).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from stalwart.bench import BenchResult, Steps

TARGETS = {
    "si_comm_hidden": ">= 0.8",
    "si_speedup": ">= 1.4",
    "si_vs_bound": "<= 1.15",
    "si_extra_memory": "<= 0.10",
    "plan_model_error": "<= 0.1",
}
# issue 27's targets on one H200 (two ranks share it over gloo)
CUDA_TARGETS = {"si_comm_hidden": ">= 0.7", "si_speedup": ">= 1.3"}
# how the interleaved executor runs (split backward, chunked collectives): see overlap/wgrad.py
# and TPComm.start_matmul; the worker passes them to Interleaved(schedule="si")
SI_OPTIONS = ["--defer-wgrad=1", "--wgrad-memory=0.1", "--chunks=1", "--serial-comm=0"]
# timed in the same rotation, for what each mechanism adds: strand interleaving alone
VARIANTS = ["--variant=si_plain=0,0,1,0"]
# on CUDA: the step shape whose width E is calibrated (a multiple of 64 within the bounds)
# (E ~ 3.5k: comm ~= compute for two ranks sharing one H200 over gloo, from its first
# calibration there; batch 2 keeps a step near 0.2 s: at batch 8 the quick run outlasted the
# device check's 3 minutes)
CUDA_SHAPE = {"n_layer": 2, "n_head": 8, "n_embd": 3584, "block": 256, "batch": 2}
MIN_EMBD, MAX_EMBD = 256, 6144
R0_MBIT = 200.0
MIN_MBIT, MAX_MBIT = 10.0, 2000.0
# model and step shape: big enough per byte that the rate needed for comm ~= compute stays
# low (the network path costs CPU too, and this machine has two cores)
SHAPE = {"n_layer": 2, "n_head": 8, "n_embd": 768, "block": 64, "batch": 2}


def _why_not_netns() -> str | None:
    if os.geteuid() != 0:
        return "needs root for the netns testbed (network namespaces, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs {tool} for the netns testbed"
    return None


def _launch(workdir: Path, name: str, nproc: int, rate_mbit: float | None, args: list[str],
            shape: dict[str, int] | None = None, device: str = "cpu") -> list[dict[str, Any]]:
    """One job of the overlap worker: on the netns testbed with every link shaped to
    ``rate_mbit`` (CPU), or on this machine's loopback (``rate_mbit`` None: CUDA)."""
    from stalwart.config import RunConfig
    from stalwart.launch import launch

    if rate_mbit is None:
        cfg = RunConfig(nproc=nproc, tp=nproc, out=str(workdir), name=name, detect=False,
                        device=device)
    else:
        rate = f"{int(round(rate_mbit))}mbit"
        cfg = RunConfig(nproc=nproc, tp=nproc, testbed="netns", out=str(workdir), name=name,
                        faults=[f"link:host={h},rate={rate}" for h in range(nproc)],
                        detect=False)
    shutil.rmtree(workdir / name, ignore_errors=True)
    flat = [f"--{k.replace('_', '-')}={v}" for k, v in (shape or SHAPE).items()]
    flat.append(f"--device={device}")
    rc = launch(cfg, module="stalwart.bench.overlap_worker", args=[*flat, *args],
                show_progress=False, on_line=lambda s: None)
    if rc != 0:
        logs = workdir / name / "logs"
        raise RuntimeError(f"overlap bench run {name} failed (exit {rc}); see {logs}")
    return [json.loads((workdir / name / f"bench-rank-{r}.json").read_text())
            for r in range(nproc)]


def _med(ranks: list[dict[str, Any]], sched: str, key: str) -> float:
    """Mean over ranks of the per-rank median."""
    return statistics.mean(statistics.median(s[key] for s in r["steps"][sched]) for r in ranks)


def _paired(ranks: list[dict[str, Any]], fn) -> float:
    """Median over repetitions of fn(rep) where fn sees each schedule's rank-mean values."""
    reps = len(ranks[0]["steps"]["off"])

    def at(sched: str, key: str, k: int) -> float:
        return statistics.mean(r["steps"][sched][k][key] for r in ranks)

    return statistics.median(fn(lambda s, key, k=k: at(s, key, k)) for k in range(reps))


def figures(ranks: list[dict[str, Any]], suffix: str = "") -> tuple[dict[str, float], dict]:
    def hidden(sched: str):
        return lambda at: (at("off", "wall") - at(sched, "wall")) / at("off", "comm_time")

    fig = {
        f"si_comm_hidden{suffix}": _paired(ranks, hidden("si")),
        f"baseline_comm_hidden{suffix}": _paired(ranks, hidden("async")),
        f"si_speedup{suffix}": _paired(ranks, lambda at: at("off", "wall") / at("si", "wall")),
        f"si_vs_bound{suffix}": _paired(ranks, lambda at: at("si", "wall") / max(
            at("off", "compute_time"), at("off", "comm_time"))),
        f"si_extra_memory{suffix}": max(
            max(s["act_peak_bytes"] for s in r["steps"]["si"])
            / max(s["act_peak_bytes"] for s in r["steps"]["off"]) for r in ranks) - 1.0,
    }
    plan = ranks[0]["plan"]
    measured_si = statistics.median(
        statistics.mean(r["steps"]["si"][k]["wall"] for r in ranks)
        for k in range(len(ranks[0]["steps"]["si"])))
    predicted_si = plan.get("predicted_step_time") if plan is not None else None
    fig[f"plan_model_error{suffix}"] = (abs(predicted_si - measured_si) / measured_si
                                        if predicted_si else None)
    detail = {
        sched: {k: _med(ranks, sched, k) for k in
                ("wall", "compute_time", "comm_time", "comm_hidden", "comm_exposed",
                 "act_peak_bytes", "wgrad_filled", "wgrad_flushed")
                if k in ranks[0]["steps"][sched][0]}
        for sched in ("off", "async", "si")
    }
    for name in ranks[0]["steps"]:  # interleaved variants timed in the same rotation
        if name in ("off", "async", "si"):
            continue
        detail[name] = {k: _med(ranks, name, k) for k in detail["si"]
                        if k in ranks[0]["steps"][name][0]}
        detail[f"speedup_{name}"] = _paired(
            ranks, lambda at, n=name: at("off", "wall") / at(n, "wall"))
        detail[f"si_gain_over_{name}"] = _paired(
            ranks, lambda at, n=name: at(n, "wall") / at("si", "wall"))
        variant = (ranks[0].get("variants") or {}).get(name) or {}
        detail[f"predicted_step_time_{name}"] = variant.get("predicted_step_time")
    detail["comm_to_compute"] = detail["off"]["comm_time"] / detail["off"]["compute_time"]
    # the least-disturbed repetition of each schedule (interference only adds time)
    best = {s: min(statistics.mean(r["steps"][s][k]["wall"] for r in ranks)
                   for k in range(len(ranks[0]["steps"][s]))) for s in ("off", "async", "si")}
    detail["min_wall"] = best
    detail["min_wall_speedup"] = best["off"] / best["si"]
    detail["plan"] = ranks[0]["plan"]
    detail["profile_time_s"] = ranks[0]["profile_time"]
    detail["bytes_allreduced_per_step"] = ranks[0]["steps"]["off"][0]["bytes"]
    detail["reps"] = ranks[0]["reps"]
    detail["micro_batches"] = ranks[0]["micro_batches"]
    detail["si_options"] = ranks[0].get("si_options")
    if plan is not None:
        # the profile's model of one step (plan.simulate_step: F(0) alone, the whole-step
        # stream plan, one link shared by both strands, the deferred weight-gradient pool)
        detail["predicted_step_time"] = predicted_si
        detail["measured_step_time"] = measured_si
        detail["measured_speedup"] = detail["off"]["wall"] / detail["si"]["wall"]
    return fig, detail


def _calibrate(workdir: Path, nproc: int, micro: int) -> tuple[float, dict[str, Any]]:
    """Two rounds: R1 = R0 * comm/compute at R0, then R2 = R1 * comm/compute at R1.

    The second round corrects what does not scale with 1/rate (latency, CPU-bound parts of
    the network path), which matters most with more hosts than cores.
    """
    rate = R0_MBIT
    rounds = []
    for k in range(2):
        ranks = _launch(workdir, f"overlap-calibrate-tp{nproc}-{k}", nproc, rate,
                        ["--schedules=off", "--reps=2", f"--micro-batches={micro}"])
        comm = _med(ranks, "off", "comm_time")
        compute = _med(ranks, "off", "compute_time")
        rounds.append({"rate_mbit": rate, "comm_s": comm, "compute_s": compute})
        rate = min(max(rate * comm / compute, MIN_MBIT), MAX_MBIT)
    return rate, {"rounds": rounds, "rate_mbit": rate}


def _calibrate_width(workdir: Path, nproc: int, micro: int, device: str, rounds: int = 2
                     ) -> tuple[dict[str, int], dict[str, Any]]:
    """CUDA: the link is this machine's loopback, which nothing shapes; what moves the
    balance is the model's width E -- a collective carries B*T*E values, a layer computes
    ~24*B*T*E^2/TP -- so compute/comm grows as E. Rounds: E1 = E0 * comm/compute at E0, then
    E2 from E1 likewise (rounded to a multiple of 64, within bounds)."""
    shape = dict(CUDA_SHAPE)
    done = []
    for k in range(rounds):
        ranks = _launch(workdir, f"overlap-calibrate-tp{nproc}-{k}", nproc, None,
                        ["--schedules=off", "--reps=2", f"--micro-batches={micro}"],
                        shape, device)
        comm = _med(ranks, "off", "comm_time")
        compute = _med(ranks, "off", "compute_time")
        done.append({"n_embd": shape["n_embd"], "comm_s": comm, "compute_s": compute})
        width = shape["n_embd"] * comm / max(compute, 1e-9)
        shape["n_embd"] = int(min(max(round(width / 64) * 64, MIN_EMBD), MAX_EMBD))
    return shape, {"rounds": done, "n_embd": shape["n_embd"]}


def _resolve_device(device: str) -> str:
    """"cpu" or "cuda" for this bench (ConfigError when CUDA is asked for and absent)."""
    from stalwart.config import ConfigError
    from stalwart.devices import DeviceError, plan_devices, visible_gpus

    try:
        plan = plan_devices(device, 2, visible_gpus() if device != "cpu" else 0)
    except DeviceError as e:
        raise ConfigError(str(e)) from None
    return plan.kind


def run(quick: bool, workdir: Path, device: str = "cpu") -> BenchResult:
    """``device`` "cpu" (default): the netns testbed with shaped links; "cuda" (or "auto"
    with a GPU visible): ranks on this machine's GPUs over its loopback, the model's width
    calibrated instead of the link rate."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    reps, micro = (5, 8) if quick else (7, 12)
    command = "stalwart bench overlap" + (" --quick" if quick else "")
    if _resolve_device(device) == "cuda":
        return _run_loopback(workdir, reps, micro, command, "cuda", rounds=1 if quick else 2)
    why = _why_not_netns()
    if why is not None:
        return BenchResult("overlap", {k: None for k in TARGETS}, dict(TARGETS),
                           {"skipped": why}, command)
    t0 = time.perf_counter()
    # other processes share the two cores; the load says how much (ratios stay meaningful,
    # absolute times do not)
    details: dict[str, Any] = {"shape": SHAPE, "loadavg_start": os.getloadavg()}
    figs: dict[str, float] = {}
    targets = dict(TARGETS)
    sizes = (2,) if quick else (2, 4)
    st = Steps("overlap", 2 * len(sizes))
    for nproc in sizes:
        suffix = "" if nproc == 2 else f"_tp{nproc}"
        st.start(f"TP={nproc}: calibrating the link rate")
        rate, cal = _calibrate(workdir, nproc, micro=4)
        st.start(f"TP={nproc}: sequential, async and interleaved schedules, {reps} reps")
        ranks = _launch(workdir, f"overlap-main-tp{nproc}", nproc, rate,
                        [f"--reps={reps}", f"--micro-batches={micro}", "--profile-reps=5",
                         *SI_OPTIONS, *VARIANTS])
        f, d = figures(ranks, suffix)
        # what the shaped link can carry back to back: a ring all-reduce sends 2(n-1)/n of
        # the tensor per rank; tbf's burst credit (1 ms of traffic since 2026-12-04, 10 ms
        # before) makes isolated transfers -- the sequential schedule's -- a little faster
        # than this, a saturated link never
        sent = d["bytes_allreduced_per_step"] * 2 * (nproc - 1) / nproc
        d["link_rate_mbit"] = round(rate)
        d["link_sustained_s"] = sent * 8 / (round(rate) * 1e6)
        d["si_vs_link_bound"] = d["si"]["wall"] / max(d["off"]["compute_time"],
                                                      d["link_sustained_s"])
        figs.update(f)
        details[f"tp{nproc}"] = {"calibration": cal, **d}
        if suffix:
            targets.update({k + suffix: v for k, v in TARGETS.items()})
    details["bench_time_s"] = time.perf_counter() - t0
    details["loadavg_end"] = os.getloadavg()
    return BenchResult("overlap", figs, targets, details, command)


def _run_loopback(workdir: Path, reps: int, micro: int, command: str, device: str,
                  rounds: int = 2) -> BenchResult:
    """TP=2 on this machine's loopback (its GPUs for "cuda"): the three schedules at comm ~=
    compute, the model's width calibrated."""
    from stalwart.devices import plan_devices, visible_gpus

    t0 = time.perf_counter()
    nproc = 2
    plan = plan_devices(device, nproc, visible_gpus() if device != "cpu" else 0)
    details: dict[str, Any] = {"device": device, "devices": plan.describe(),
                               "loadavg_start": os.getloadavg()}
    shape, cal = _calibrate_width(workdir, nproc, 4, device, rounds)
    ranks = _launch(workdir, f"overlap-main-tp{nproc}", nproc, None,
                    [f"--reps={reps}", f"--micro-batches={micro}", "--profile-reps=5",
                     *SI_OPTIONS, *VARIANTS], shape, device)
    figs, d = figures(ranks)
    details["tp2"] = {"calibration": cal, "shape": shape, **d}
    details["bench_time_s"] = time.perf_counter() - t0
    details["loadavg_end"] = os.getloadavg()
    return BenchResult("overlap", figs, {**TARGETS, **CUDA_TARGETS}, details,
                       f"{command} --device {device}")
