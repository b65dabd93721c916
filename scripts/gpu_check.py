"""The prepared device check (issue 27): every capability on CUDA, in one command, <= 8 min.

Stages (each bounded by a timeout; a failed stage is recorded and the next one runs):
  probe     what the machine has: GPUs, torch, network namespaces / tc, CUDA MPS
  mps       (only when named) start the CUDA MPS daemon for the later stages, so that ranks
            sharing the GPU run their kernels at once; stopped again if a CUDA program fails
  tests     the GPU-marked tests (tests/gpu) and the device-plan tests
  runs      a short 2-rank ``stalwart run --device cuda`` per capability (data parallel with the
            detector, lossy transport, tensor parallel with strand interleaving, mitigation,
            a resume from a checkpoint) and the same runs with ``--device cpu`` (in the
            background, on the host's cores): final validation losses side by side
  overhead  the detector's cost on CUDA: the same job with --detect and --no-detect, ABBA
  bench     ``stalwart bench overlap --device cuda --quick``

Writes OUT/gpu_check.json (every figure, updated after each stage), OUT/bench_overlap.json,
OUT/pytest.log and OUT/runs.tar.gz (the run directories' events, metrics, logs).
Usage: python scripts/gpu_check.py OUT [stage ...]   (default: every stage but mps)
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("probe", "mps", "tests", "runs", "overhead", "bench")
DEFAULT_STAGES = ("probe", "tests", "runs", "overhead", "bench")  # mps only when asked
RUN = [sys.executable, "-m", "stalwart.cli", "run", "--no-progress"]
SHORT = ["--nproc", "2", "--steps", "40", "--eval-every", "20", "--eval-batches", "4",
         "--ckpt-every", "20", "--seed", "0"]
CAPABILITIES = {
    "ddp_detect": ["--detect"],
    "lossy": ["--comm", "lossy"],
    "overlap_si": ["--tp", "2", "--overlap", "si"],
    "mitigate": ["--mitigate", "auto"],
}
VAL_TOLERANCE = 1e-3  # issue 27: each capability's CUDA run ends at the CPU run's loss
# the device under test; GPU_CHECK_DEVICE=cpu dry-runs this script's plumbing on a CPU machine
DEV = os.environ.get("GPU_CHECK_DEVICE", "cuda")


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(cmd: list[str], timeout: float, log: Path | None = None, **kw: Any) -> tuple[int, str]:
    """Run a command; (exit code, its last 2,000 characters). 124 on timeout."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kw)
        out, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
            else (e.stdout or "")
        rc = 124
    if log is not None:
        log.write_text(out)
    return rc, out[-2000:]


def probe() -> dict[str, Any]:
    import torch

    res: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
                           "gpus": torch.cuda.device_count(), "python": sys.version.split()[0],
                           "cpus": os.cpu_count()}
    if res["cuda"]:
        res["gpu_name"] = torch.cuda.get_device_name(0)
    res["nvidia_smi"] = sh(["nvidia-smi", "-L"], 20)[1].strip() if shutil.which(
        "nvidia-smi") else None
    ok = shutil.which("ip") is not None and sh(["ip", "netns", "add", "stwprobe0"], 10)[0] == 0
    if ok:
        sh(["ip", "netns", "del", "stwprobe0"], 10)
    res["netns"] = ok
    res["tc"] = shutil.which("tc") is not None
    res["nft"] = shutil.which("nft") is not None
    res["mps_control"] = shutil.which("nvidia-cuda-mps-control") is not None
    res["testbed"] = ("netns available (not used: the checks run on loopback)" if ok else
                      "no network namespaces here: loopback without shaping")
    return res


def mps() -> dict[str, Any]:
    """Start CUDA MPS (pipe and log folders under /tmp) and check that a CUDA program runs."""
    if shutil.which("nvidia-cuda-mps-control") is None:
        return {"started": False, "why": "nvidia-cuda-mps-control not found"}
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps-pipe",
           "CUDA_MPS_LOG_DIRECTORY": "/tmp/mps-log"}
    for d in ("/tmp/mps-pipe", "/tmp/mps-log"):
        os.makedirs(d, exist_ok=True)
    rc, tail = sh(["nvidia-cuda-mps-control", "-d"], 20, env=env)
    if rc != 0:
        return {"started": False, "why": tail[-300:]}
    os.environ.update(CUDA_MPS_PIPE_DIRECTORY="/tmp/mps-pipe",
                      CUDA_MPS_LOG_DIRECTORY="/tmp/mps-log")
    rc, tail = sh([sys.executable, "-c", "import torch; print((torch.ones(4, device='cuda')"
                   " * 2).sum().item())"], 60)
    if rc != 0 or "8.0" not in tail:
        sh(["bash", "-c", "echo quit | nvidia-cuda-mps-control"], 20)
        for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
            os.environ.pop(k, None)
        return {"started": False, "why": f"a CUDA program failed under MPS: {tail[-300:]}"}
    return {"started": True}


def tests(out: Path) -> dict[str, Any]:
    rc, tail = sh([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   "tests/gpu", "tests/test_devices.py", "-ra"], 240, out / "pytest.log")
    last = [ln for ln in tail.splitlines() if ln.strip()][-1:] or [""]
    return {"rc": rc, "summary": last[0]}


def _final_val(run_dir: Path) -> float | None:
    val = None
    try:
        for line in (run_dir / "events.jsonl").read_text().splitlines():
            ev = json.loads(line)
            if ev.get("event") == "eval":
                val = ev["val_loss"]
    except OSError:
        return None
    return val


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    try:
        lines = (run_dir / "events.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [e for e in map(json.loads, lines) if e.get("event") == kind]


def runs(work: Path, only: list[str] | None = None) -> dict[str, Any]:
    """The CPU references start first, in the background; the CUDA runs one after another.
    ``only``: these capabilities, without the resume check (a rerun of what failed)."""
    caps = {k: v for k, v in CAPABILITIES.items() if not only or k in only}
    cpu_procs = {}
    for name, extra in caps.items():
        cmd = [*RUN, *SHORT, *extra, "--device", "cpu", "--out", str(work),
               "--name", f"{name}-cpu"]
        log = open(work / f"{name}-cpu.out", "w")  # noqa: SIM115
        cpu_procs[name] = (subprocess.Popen(cmd, cwd=ROOT, stdout=log,
                                            stderr=subprocess.STDOUT), log)
    res: dict[str, Any] = {}
    for name, extra in caps.items():
        t0 = time.perf_counter()
        rc, tail = sh([*RUN, *SHORT, *extra, "--device", DEV, "--out", str(work),
                       "--name", f"{name}-cuda"], 150)
        res[name] = {"cuda_rc": rc, "cuda_s": round(time.perf_counter() - t0, 1),
                     "cuda_val": _final_val(work / f"{name}-cuda")}
        if rc != 0:
            res[name]["cuda_tail"] = tail[-600:]
        say(f"runs: {name} cuda rc={rc} val={res[name]['cuda_val']}")
    if not only:  # halt at 20, continue to 40 on the GPU (checkpoints load onto the device)
        rc1, t1 = sh([*RUN, *SHORT, "--device", DEV, "--out", str(work), "--name",
                      "resume-cuda", "--halt-at", "20"], 120)
        rc2, t2 = sh([*RUN, *SHORT, "--device", DEV, "--out", str(work), "--name",
                      "resume-cuda", "--resume"], 120)
        res["resume"] = {"cuda_rc": max(rc1, rc2), "cuda_val": _final_val(work / "resume-cuda"),
                         "uninterrupted_val": res["ddp_detect"]["cuda_val"]}
        if max(rc1, rc2):
            res["resume"]["cuda_tail"] = (t1 + t2)[-600:]
    for name, (p, log) in cpu_procs.items():
        try:
            p.wait(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
        log.close()
        res[name]["cpu_rc"] = p.returncode
        res[name]["cpu_val"] = _final_val(work / f"{name}-cpu")
    for name, r in res.items():
        ref = r.get("cpu_val") if name != "resume" else r.get("uninterrupted_val")
        if r.get("cuda_val") is not None and ref is not None:
            r["val_diff"] = abs(r["cuda_val"] - ref)
            r["within_1e-3"] = r["val_diff"] <= VAL_TOLERANCE
    for name in [n for n in ("ddp_detect", "mitigate") if n in caps]:
        run_dir = work / f"{name}-cuda"
        res[name]["devices_event"] = (_events(run_dir, "devices") or [{}])[0].get("plan")
        res[name]["detections"] = len(_events(run_dir, "straggler_detected"))
        res[name]["mitigations"] = len(_events(run_dir, "mitigation_applied"))
    return res


def _median_step(run_dir: Path, key: str = "step_time", skip: int = 10) -> float | None:
    by_step: dict[int, list[float]] = {}
    try:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            m = json.loads(line)
            by_step.setdefault(m["step"], []).append(m[key])
    except (OSError, KeyError):
        return None
    steps = sorted(by_step)[skip:-1]  # warm-up out; the last step holds eval and checkpoint
    return statistics.median(max(by_step[s]) for s in steps) if steps else None


def overhead(work: Path) -> dict[str, Any]:
    """Step time with the detector on / off, same job, ABBA order (drifts cancel)."""
    base = [*RUN, "--nproc", "2", "--steps", "90", "--preset", "small", "--device", DEV,
            "--eval-every", "1000", "--ckpt-every", "1000", "--eval-batches", "1",
            "--out", str(work)]
    times: dict[str, list[float]] = {"on": [], "off": []}
    compute: dict[str, list[float]] = {"on": [], "off": []}
    for k, mode in enumerate(("on", "off", "off", "on")):
        name = f"overhead-{mode}-{k}"
        rc, tail = sh([*base, "--detect" if mode == "on" else "--no-detect", "--name", name],
                      100)
        if rc != 0:
            return {"rc": rc, "tail": tail[-600:]}
        t = _median_step(work / name)
        c = _median_step(work / name, "compute_time")
        if t is not None:
            times[mode].append(t)
        if c is not None:
            compute[mode].append(c)
        say(f"overhead: {name} median step {t}")
    on, off = statistics.mean(times["on"]), statistics.mean(times["off"])
    return {"step_on_s": on, "step_off_s": off, "detect_overhead": on / off - 1.0,
            "pairs": times, "compute_time_s": compute, "preset": "small", "steps": 90,
            "target": "<= 0.005"}


def bench(out: Path, work: Path) -> dict[str, Any]:
    rc, tail = sh([sys.executable, "-m", "stalwart.cli", "bench", "overlap", "--device",
                   DEV, "--quick", "--json", str(out / "bench_overlap.json"), "--workdir",
                   str(work / "bench")], 330, out / "bench_overlap.log")
    res: dict[str, Any] = {"rc": rc}
    try:
        data = json.loads((out / "bench_overlap.json").read_text())
        res["figures"] = data.get("figures", data)
    except (OSError, json.JSONDecodeError):
        res["tail"] = tail[-800:]
    return res


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    out = Path(argv[0]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    chosen = argv[1:] or list(DEFAULT_STAGES)  # "runs:NAME,NAME" reruns some capabilities only
    bad = [s for s in chosen if s.split(":")[0] not in STAGES]
    if bad:
        print(f"gpu_check: unknown stage {bad[0]!r} (choose from {', '.join(STAGES)})",
              file=sys.stderr)
        return 2
    work = Path("/tmp/stalwart-gpu-check")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "stages": {}}
    path = out / "gpu_check.json"
    t_all = time.perf_counter()
    for stage in chosen:
        say(f"stage {stage} ...")
        t0 = time.perf_counter()
        try:
            if stage == "probe":
                r = probe()
            elif stage == "mps":
                r = mps()
            elif stage == "tests":
                r = tests(out)
            elif stage.startswith("runs"):
                r = runs(work, stage.partition(":")[2].split(",") if ":" in stage else None)
            elif stage == "overhead":
                r = overhead(work)
            else:
                r = bench(out, work)
        except Exception as e:  # a broken stage must not cost the others
            r = {"error": f"{type(e).__name__}: {e}"}
        r["stage_s"] = round(time.perf_counter() - t0, 1)
        report["stages"][stage] = r
        report["total_s"] = round(time.perf_counter() - t_all, 1)
        path.write_text(json.dumps(report, indent=2, default=str))
        say(f"stage {stage} done in {r['stage_s']} s: "
            f"{json.dumps(r, default=str)[:400]}")
    with tarfile.open(out / "runs.tar.gz", "w:gz") as tar:
        for f in sorted(work.rglob("*")):
            if f.is_file() and (f.suffix in (".jsonl", ".log", ".out", ".json")):
                tar.add(f, arcname=str(f.relative_to(work)))
    say(f"done in {report['total_s']} s -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
