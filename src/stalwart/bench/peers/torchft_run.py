"""torchft beside stalwart in ``stalwart bench mitigate``: its runs and figures.

The runs: torchft's replica groups (``torchft_worker.py``, one rank each, N = 4) started by
stalwart's own launcher on the same netns testbed, each host at its fair CPU share, with the
bench's faults -- replica 3 killed at 30% of the run (the ``failstop`` scenario), replica 2's
host slowed 2x by a CPU quota (the ``compute2x`` scenario's window). ``launch(...,
keep_going=True)``: a dead replica is logged (``rank_lost``) and the others go on, as torchft
expects. The Lighthouse runs on host 0 (replica 0 starts it), which no fault touches.

- ``failstop_ddp``: torchft as its documentation sets it up (its DistributedDataParallel);
  whether a survivor crashed when its peer was killed (``torchft_ddp_crashed``) and the error;
  it crashes when the kill lands inside a gradient all-reduce, not when it lands between two
  steps (then no collective fails): the details say which (``ddp_kill_hit_a_collective``);
- ``failstop``: the working form, gradients averaged by ``Manager.allreduce``:
  ``torchft_failstop_resume_s`` from the kill (the testbed's ``fault_applied``) to the end of
  the first step every member of its quorum committed after it; ``torchft_failstop_samples_lost``
  = per data step (the position of torchft's data loaders, which advance on every attempted
  step) the global batch minus the samples of committed updates, summed -- the dropped
  attempt's whole batch and the lost replica's shard of every later step; torchft keeps the
  number of steps, not the global batch; ``torchft_val_loss_rel_change``: its final
  validation loss against stalwart's healthy run (the same model, data and updates: with no
  fault torchft's run gives the same loss to the last digit, checked by hand and in
  tests/bench/test_torchft_peer.py);
- ``slow`` (DDP, no crash there) and ``healthy`` (DDP, no fault):
  ``torchft_slow_tokens_per_s_ratio`` = stalwart's tokens/s over the slow window of the
  mitigated compute 2x run / torchft's over the same steps; ``torchft_healthy_tokens_per_s_ratio``
  the same without the fault (what the ratio is when nothing is slow). Tokens/s over a window
  = tokens of its (committed) steps / wall time from its first step's start to its last step's
  end, less evaluations inside it.

Without torchft (``pip install 'stalwart[peers]'``, or ``bench mitigate --install-peers``)
nothing runs: ``available()`` says why,
and the figures are null. The figure functions are pure (run-directory data in, numbers
out).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stalwart.events import Eval, FaultApplied, RankLost

TORCHFT_VERSION = "0.2.0"
N_REPLICAS = 4
FIGURES = ("torchft_failstop_resume_s", "torchft_failstop_samples_lost",
           "torchft_val_loss_rel_change", "torchft_slow_tokens_per_s_ratio",
           "torchft_ddp_crashed", "torchft_failstop_steps_dropped",
           "torchft_healthy_tokens_per_s_ratio")
RUNS = ("failstop_ddp", "failstop", "slow", "healthy")
_EXC_RE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt))\b:?\s*(.*)$")
_WHERE_RE = re.compile(r'^File "([^"]+)", line (\d+), in (\S+)')


def available() -> str | None:
    """None when torchft can be imported here, else the one line that says why not."""
    if importlib.util.find_spec("torchft") is None:
        return ("torchft is not installed (pip install 'stalwart[peers]'): "
                "the torchft figures are null")
    return None


def install() -> int:
    """pip-install the pinned torchft and what it imports, never a torch: ``--no-deps`` for
    torchft itself (its ``torch>=2.7`` must not be resolved against an index), then its
    OpenTelemetry dependencies. The pip exit status."""
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    rc = subprocess.call([*pip, "--no-deps", f"torchft=={TORCHFT_VERSION}"])
    if rc == 0:
        rc = subprocess.call([*pip, "opentelemetry-api", "opentelemetry-sdk",
                              "opentelemetry-exporter-otlp-proto-http"])
    importlib.invalidate_caches()
    return rc


def ready(peers: bool, install_first: bool, suite: str) -> str | None:
    """None when torchft runs beside us in bench ``suite``, else why not (said once, its
    figures null). ``install_first`` (``--install-peers``): pip-install it when missing."""
    if not peers:
        return "--no-peers: torchft not run, its figures are null"
    if install_first and available() is not None:
        print(f"bench {suite}: installing torchft=={TORCHFT_VERSION} (pip, no torch change)",
              flush=True)
        install()
    return available()


def null_figures() -> dict[str, float | None]:
    return dict.fromkeys(FIGURES)


# ---- runs ---------------------------------------------------------------------------------
def plan(failstop: Any, slow: Any) -> dict[str, tuple[list[str], int, str]]:
    """Run name -> (faults, steps, mode) from the bench's ``failstop`` and ``compute2x``
    scenarios (their faults and lengths)."""
    return {"failstop_ddp": (list(failstop.faults), failstop.steps, "ddp"),
            "failstop": (list(failstop.faults), failstop.steps, "allreduce"),
            "slow": (list(slow.faults), slow.steps, "ddp"),
            "healthy": ([], slow.steps, "ddp")}


def run_one(name: str, faults: list[str], steps: int, mode: str, workdir: Path, tag: str,
            micro_size: int) -> Any:
    from stalwart.config import RunConfig
    from stalwart.launch import launch
    from stalwart.rundir import RunData

    cfg = RunConfig(nproc=N_REPLICAS, testbed="netns", faults=faults, steps=steps,
                    micro_batch_size=micro_size, mitigate="off", detect=False, cpu_cap="fair",
                    out=str(workdir), name=f"{tag}-torchft-{name}",
                    global_batch=8 * N_REPLICAS)  # the tiny preset's batch, as stalwart's runs
    t0 = time.monotonic()
    print(f"bench mitigate: {cfg.job.name} ({steps} steps, torchft {mode}) ...", file=sys.stderr,
          flush=True)
    rc = launch(cfg, module="stalwart.bench.peers.torchft_worker", args=["--mode", mode],
                show_progress=False, on_line=lambda _s: None, keep_going=True)
    print(f"bench mitigate: {cfg.job.name} done in {time.monotonic() - t0:.0f} s (exit {rc})",
          file=sys.stderr, flush=True)
    data = RunData.load(cfg.run_dir)
    data.rc = rc  # type: ignore[attr-defined]
    return data


def measure(failstop: Any, slow: Any, workdir: Path, tag: str, micro_size: int,
            steps: Any = None) -> dict[str, Any]:
    """torchft's four runs, one after the other; name -> RunData."""
    out = {}
    for name, (faults, n, mode) in plan(failstop, slow).items():
        if steps is not None:
            steps.start(f"torchft {name} ({mode})")
        out[name] = run_one(name, faults, n, mode, workdir, tag, micro_size)
    return out


# ---- figures from run directories ---------------------------------------------------------
def kill_time(d: Any, kind: str = "kill") -> tuple[float, int] | None:
    """(time, rank or host) of the testbed's first fault of ``kind`` (kill, hang, cut)."""
    kills = [e for e in d.events_of(FaultApplied) if e.get("kind") == kind]
    if not kills:
        return None
    e = kills[0]
    return float(e["time"]), int(e["rank"] if e.get("rank") is not None else e["hosts"][0])


def committed_done(metrics: list[dict[str, Any]]) -> dict[int, float]:
    """Step -> when its last member wrote its committed line, for the steps every member of
    the quorum committed (``world`` members)."""
    by: dict[int, list[dict[str, Any]]] = {}
    for m in metrics:
        if m.get("committed", True):
            by.setdefault(int(m["step"]), []).append(m)
    return {s: max(float(x["time"]) for x in ms) for s, ms in by.items()
            if len(ms) >= int(ms[0]["world"])}


def resume_s(d: Any, kind: str = "kill") -> float | None:
    """From the fault to the end of the first step every member of its quorum committed."""
    k = kill_time(d, kind)
    if k is None:
        return None
    after = [t for t in committed_done(d.metrics).values() if t > k[0]]
    return min(after) - k[0] if after else None


def samples_lost(metrics: list[dict[str, Any]], global_batch: int) -> float | None:
    """Per data step up to the last one any replica read: the global batch minus the samples
    of committed lines, summed."""
    if not metrics:
        return None
    last = max(int(m.get("data_step", m["step"])) for m in metrics)
    got = [0] * (last + 1)
    for m in metrics:
        if m.get("committed", True):
            got[int(m.get("data_step", m["step"]))] += int(m["samples"])
    return float(sum(max(global_batch - g, 0) for g in got))


def steps_dropped(metrics: list[dict[str, Any]]) -> float | None:
    """Attempted steps that no replica committed (data steps read and thrown away)."""
    if not metrics:
        return None
    tried = {int(m.get("data_step", m["step"])) for m in metrics}
    kept = {int(m.get("data_step", m["step"])) for m in metrics if m.get("committed", True)}
    return float(len(tried - kept))


def window_tokens_per_s(d: Any, lo: int, hi: int) -> float | None:
    """Tokens of the (committed) steps lo..hi-1 over the wall time from the first one's start
    to the last one's end, less the evaluations logged inside (works for stalwart's runs and
    torchft's: a line without ``committed`` counts)."""
    latest: dict[tuple[int, int], dict[str, Any]] = {}  # a step redone after a regroup
    for m in d.metrics:
        if lo <= int(m["step"]) < hi and m.get("committed", True):
            latest[(int(m["step"]), int(m["rank"]))] = m
    rows = list(latest.values())
    first = [m for m in rows if int(m["step"]) == lo]
    last = [m for m in rows if int(m["step"]) == hi - 1]
    if not first or not last:
        return None
    t0 = min(float(m["time"]) - float(m["step_time"]) for m in first)
    t1 = max(float(m["time"]) for m in last)
    evals = sum(float(e.get("eval_time", 0.0)) for e in d.events_of(Eval)
                if t0 < float(e["time"]) < t1)
    span = t1 - t0 - evals
    return sum(int(m["tokens"]) for m in rows) / span if span > 0 else None


def crash(d: Any) -> tuple[bool, str]:
    """Whether a replica other than the killed one died, and its error (from its log)."""
    k = kill_time(d)
    killed = k[1] if k else None
    lost = [e for e in d.events_of(RankLost) if e.get("rank") != killed]
    if not lost:
        return False, ""
    r = int(lost[0]["rank"])
    return True, error_line(Path(d.path) / "logs" / f"rank-{r}.log") or str(
        lost[0].get("error", ""))


def error_line(log: Path) -> str:
    """The last exception of a rank's log with where it was raised: ``AssertionError at
    torchft/ddp.py:76 in _comm_hook``; empty when the log has none."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    return last_exception(lines)


def last_exception(lines: list[str]) -> str:
    for i in range(len(lines) - 1, -1, -1):
        m = _EXC_RE.match(lines[i])
        if not m:
            continue
        where = ""
        for j in range(i - 1, max(i - 8, -1), -1):
            w = _WHERE_RE.match(lines[j])
            if w:
                path = "/".join(Path(w.group(1)).parts[-2:])
                where = f" at {path}:{w.group(2)} in {w.group(3)}"
                break
        text = f"{m.group(1)}{': ' + m.group(2) if m.group(2) else ''}"
        return (text[:200] + where).strip()
    return ""


def val_change(a: Any, b: Any) -> float | None:
    va, vb = a.final_val_loss(), b.final_val_loss()
    return abs(va - vb) / vb if va is not None and vb else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def figures(runs: dict[str, Any], healthy: Any, ours_slow: Any,
            window: tuple[int, int]) -> tuple[dict[str, float | None], dict[str, Any]]:
    """The torchft figures beside stalwart's, and the details (per-run facts, the crash)."""
    fs, ddp = runs["failstop"], runs["failstop_ddp"]
    crashed, error = crash(ddp)
    lo, hi = window
    tps = {"stalwart_slow": window_tokens_per_s(ours_slow, lo, hi),
           "torchft_slow": window_tokens_per_s(runs["slow"], lo, hi),
           "stalwart_healthy": window_tokens_per_s(healthy, lo, hi),
           "torchft_healthy": window_tokens_per_s(runs["healthy"], lo, hi)}
    gb = int(fs.config.get("global_batch") or 8 * N_REPLICAS)
    figs: dict[str, float | None] = {
        "torchft_failstop_resume_s": resume_s(fs),
        "torchft_failstop_samples_lost": samples_lost(fs.metrics, gb),
        "torchft_val_loss_rel_change": val_change(fs, healthy),
        "torchft_slow_tokens_per_s_ratio": ratio(tps["stalwart_slow"], tps["torchft_slow"]),
        "torchft_ddp_crashed": 1.0 if crashed else 0.0,
        "torchft_failstop_steps_dropped": steps_dropped(fs.metrics),
        "torchft_healthy_tokens_per_s_ratio": ratio(tps["stalwart_healthy"],
                                                    tps["torchft_healthy"]),
    }
    # a kill between two steps fails no collective (the survivors wait out the heartbeat
    # timeout in the quorum): such a run cannot show the crash
    hit = crashed or bool(steps_dropped(ddp.metrics))
    details = {"ddp_error": error, "ddp_resume_s": None if crashed else resume_s(ddp),
               "ddp_kill_hit_a_collective": hit,
               "window": list(window),
               "tokens_per_s": {k: None if v is None else round(v, 1) for k, v in tps.items()},
               "runs": {k: {"path": str(d.path), "rc": getattr(d, "rc", None),
                            "final_val_loss": d.final_val_loss(),
                            "lost": [{k2: e.get(k2) for k2 in ("rank", "exit_code", "error")}
                                     for e in d.events_of(RankLost)]}
                        for k, d in runs.items()}}
    return figs, details
