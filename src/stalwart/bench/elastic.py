"""``stalwart bench elastic``: a node of a plain DDP user script killed and started again, hung,
or cut off -- under stalwart's elastic API, torchrun's elastic restart and torchft, side by
side in one invocation.

The workload: examples/elastic_ddp.py's training (an MLP on generated data, global batch 64,
AdamW), on 4 emulated nodes of 2 ranks (netns hosts as root, local processes otherwise),
each node running its own launcher (elastic_arms.py says how each arm is set up). Faults on
the last node, once the job has done ``fault_at`` steps: a kill (every process of the node;
started again ``back_after_s`` later, the run goes to its end), a hang (its ranks
SIGSTOPped) and a cut link (nftables drops its packets both ways; root only -- without root
the suite runs kill and hang and says so). The user script through the API under ``stalwart
run --script`` (4 ranks on 4 hosts, rank 3 killed by the launcher's ``kill`` fault) and its
healthy run complete the set.

Figures (elastic_figures.py defines each; the arms' prefixes: none = stalwart's API under
torchrun, ``torchrun_elastic_``, ``torchft_``):

- ``torchrun_failstop_resume_s``: kill -> the survivors' first step in their new membership;
  ``torchrun_elastic_resume_s`` (its first redone step after the restart),
  ``torchft_failstop_resume_s`` (the first step its new quorum committed);
- ``*_samples_lost`` (computed and not kept, plus what kept steps lack of the global batch)
  and ``*_workers_restarted`` (survivors' worker processes started after the kill);
- ``torchrun_rejoin_s``: the node started again -> the first step done at the full world
  (its ranks' first step in the job), beside torchft's and torchrun elastic's;
- ``hang_detect_s`` / ``cut_detect_s``: SIGSTOP / cut -> the survivors' first step without
  the node (None: not within ``cap_s``);
- ``script_failstop_resume_s``, ``script_samples_lost``, ``script_val_loss_rel_change`` (the
  final validation loss against the healthy run of the same script); the torchrun arms'
  ``*_val_loss_rel_change`` of their kill runs against the same healthy run (the same
  training: the same global batch, split and weighting, so the same loss up to the order of
  float sums -- ``healthy_val_losses`` in the details shows it for the full run);
  ``script_val_loss_rounding``: a healthy run of the script at world 3 against the one at
  world 4 -- the same samples at every step, so the order of fp32 sums alone, amplified over
  the run by AdamW: the floor under ``script_val_loss_rel_change``;
- ``time_to_samples_s`` per arm: wall time from the first step's end to the step at which
  N samples are trained in the kill run, N = what every arm trained (the smallest total);
  ``time_to_samples_ratio`` = ours / the best peer's.

What the figures do not show: the machine has 2 cores for 8 ranks (absolute times are
contention-bound; compare arms within one run); a node's start (imports, rendezvous) is
inside every rejoin figure alike.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stalwart.bench import BenchResult, Steps
from stalwart.bench import elastic_arms as ea
from stalwart.bench import elastic_figures as ef
from stalwart.bench.peers import torchft_run
from stalwart.rundir import EVENTS, read_jsonl

PREFIX = {"stalwart": "", "torchrun_elastic": "torchrun_elastic_", "torchft": "torchft_"}
TARGETS = {
    "torchrun_failstop_resume_s": "<= 1.0", "torchrun_failstop_samples_lost": "<= 0",
    "torchrun_workers_restarted": "<= 0", "torchrun_rejoin_s": "<= 2.0",
    "script_failstop_resume_s": "<= 1.0", "script_samples_lost": "<= 0",
    "script_val_loss_rel_change": "<= 0.001", "hang_detect_s": "<= 5",
    "time_to_samples_ratio": "<= 0.8",
}


def plan(quick: bool) -> ea.Plan:
    """The runs' size: long enough that a node started again ``back_after_s`` after the kill
    is back while the others still train -- a node's start (torchrun, 2 workers importing
    torch) took 50-60 s on the 2 cores at load ~35, when 400 steps took 60 s."""
    if quick:
        return ea.Plan(steps=1000, compute_ms=100.0, fault_at=100, back_after_s=2.0,
                       cap_s=40.0, run_timeout_s=600.0)
    return ea.Plan(steps=2000, compute_ms=100.0, fault_at=200, back_after_s=10.0,
                   cap_s=90.0, run_timeout_s=1200.0)


def figure_names() -> list[str]:
    names = ["torchrun_failstop_resume_s", "torchrun_elastic_resume_s",
             "torchft_failstop_resume_s", "torchrun_failstop_samples_lost",
             "torchrun_elastic_samples_lost", "torchft_failstop_samples_lost",
             "torchrun_workers_restarted", "torchrun_elastic_workers_restarted",
             "torchft_workers_restarted", "torchrun_rejoin_s", "torchrun_elastic_rejoin_s",
             "torchft_rejoin_s", "script_failstop_resume_s", "script_samples_lost",
             "script_val_loss_rel_change", "script_val_loss_rounding",
             "torchrun_val_loss_rel_change",
             "torchrun_elastic_val_loss_rel_change", "torchft_val_loss_rel_change",
             "hang_detect_s", "torchrun_elastic_hang_detect_s", "torchft_hang_detect_s",
             "cut_detect_s", "torchrun_elastic_cut_detect_s", "torchft_cut_detect_s",
             "time_to_samples_s", "torchrun_elastic_time_to_samples_s",
             "torchft_time_to_samples_s", "time_to_samples_ratio"]
    return names


def arm_figures(arm: str, eps: dict[str, ea.Episode], p: ea.Plan, healthy_val: float | None
                ) -> dict[str, float | None]:
    """One arm's figures from its episodes (``kill``, ``hang``, ``cut``; missing ones
    give None)."""
    pre = PREFIX[arm]
    victim = p.nodes - 1
    out: dict[str, float | None] = {}
    k = eps.get("kill")
    kr = k.records if k else []
    resume = ef.resume_s(kr, k.t_fault) if k and k.t_fault else None
    lost = ef.samples_lost(kr, p.batch) if k and k.t_fault else None
    restarted = ef.workers_restarted(k.seen, k.t_fault, victim) if k and k.t_fault else None
    rejoin = ef.rejoin_s(kr, k.t_back, p.ranks) if k and k.t_back else None
    val = ef.rel_change(ef.final_val_loss(kr), healthy_val) if k and k.finished else None
    if arm == "stalwart":
        out["torchrun_failstop_resume_s"] = resume
        out["torchrun_failstop_samples_lost"] = _f(lost)
        out["torchrun_workers_restarted"] = _f(restarted)
        out["torchrun_rejoin_s"] = rejoin
        out["torchrun_val_loss_rel_change"] = val
    else:
        out[f"{pre}{'failstop_' if arm == 'torchft' else ''}resume_s"] = resume
        out[f"{pre}{'failstop_' if arm == 'torchft' else ''}samples_lost"] = _f(lost)
        out[f"{pre}workers_restarted"] = _f(restarted)
        out[f"{pre}rejoin_s"] = rejoin
        out[f"{pre}val_loss_rel_change"] = val
    for fault in ("hang", "cut"):
        e = eps.get(fault)
        out[f"{pre}{fault}_detect_s"] = ef.resume_s(e.records, e.t_fault) \
            if e is not None and e.t_fault else None
    return out


def _f(x: int | None) -> float | None:
    return None if x is None else float(x)


def time_figures(kills: dict[str, ea.Episode]) -> tuple[dict[str, float | None], int | None]:
    """``*time_to_samples_s`` per arm and the ratio, at N = what every finished kill run
    trained."""
    done = {a: e for a, e in kills.items() if e.finished and e.t_fault}
    n = ef.common_samples([e.records for e in done.values()])
    out: dict[str, float | None] = {}
    for arm in PREFIX:
        e = done.get(arm)
        out[f"{PREFIX[arm]}time_to_samples_s"] = \
            ef.time_to_samples_s(e.records, n) if e is not None and n else None
    peers = [v for k, v in out.items() if k != "time_to_samples_s" and v is not None]
    out["time_to_samples_ratio"] = ef.ratio(out["time_to_samples_s"], min(peers)) \
        if peers else None
    return out, n


# ---- the user script under ``stalwart run --script`` ------------------------------------------
def script_run(name: str, p: ea.Plan, workdir: Path, netns: bool, kill_at: int | None,
               nproc: int = 4) -> tuple[list[dict[str, Any]], float | None, int]:
    """examples/elastic_ddp.py on ``nproc`` ranks under ``stalwart run --script``, with the
    launcher's own fault ``kill:rank=3,at=KILL_AT`` when given (``--detect``: the step counter
    is the elastic job's steps, which it writes to iterations.jsonl): its records, the time
    the launcher sent the kill (its ``fault_applied`` event), the exit status."""
    rec = workdir / f"{name}-records"
    fault = ["--detect", "--fault", f"kill:rank=3,at={kill_at}"] if kill_at is not None else []
    cmd = [sys.executable, "-m", "stalwart.cli", "run", "--script",
           str(ea.EXAMPLES / "elastic_ddp.py"), "--nproc", str(nproc),
           "--testbed", "netns" if netns else "local", "--out", str(workdir), "--name", name,
           "--no-progress", *fault, "--", "--steps", str(p.steps), "--batch", str(p.batch),
           "--compute-ms", str(p.compute_ms / 2), "--out", str(rec)]
    with open(workdir / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=p.run_timeout_s + ea.START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.terminate()
            rc = proc.wait(timeout=60)
    kills = [e for e in read_jsonl(workdir / name / EVENTS)
             if e.get("event") == "fault_applied" and e.get("kind") == "kill"]
    return ea.read_records(rec), (float(kills[0]["time"]) if kills else None), rc


# ---- the suite ------------------------------------------------------------------------------
def run(quick: bool, workdir: Path, peers: bool = True,
        install_peers: bool = False) -> BenchResult:
    p = plan(quick)
    netns = os.geteuid() == 0 and shutil.which("ip") is not None
    cut = netns and shutil.which("nft") is not None
    faults = ["kill", "hang"] + (["cut"] if cut else [])
    notes: list[str] = []
    if not cut:
        notes.append("no cut-link runs: they need root and nftables (the netns testbed); "
                     "kill and hang only")
    skip = torchft_run.ready(peers, install_peers, "elastic")
    if skip is not None:
        print(f"bench elastic: {skip}", flush=True)
        notes.append(skip)
    arms = [a for a in ea.ARMS if not (a == "torchft" and skip is not None)]
    missing = {a: f"{s} is missing" for a, s in (("stalwart", ea.Stalwart.script),
                                                 ("torchrun_elastic",
                                                  ea.TorchrunElastic.script))
               if not Path(s).is_file()}
    for a, why in missing.items():
        notes.append(f"{a}: {why}; its figures are null")
    arms = [a for a in arms if a not in missing]
    st = Steps("elastic", 3 * ("stalwart" not in missing) + len(arms) * len(faults))
    details: dict[str, Any] = {"plan": vars(p) | {"ranks": p.ranks}, "netns": netns,
                               "notes": notes, "runs": {}}

    # the user script under stalwart run --script: healthy, then rank 3 killed
    healthy_val: float | None = None
    figs: dict[str, float | None] = dict.fromkeys(figure_names())
    if "stalwart" not in missing:
        st.start("script healthy (stalwart run --script)")
        h_recs, _, h_rc = script_run("script-healthy", p, workdir, netns, None)
        healthy_val = ef.final_val_loss(h_recs)
        st.start("script kill (stalwart run --script)")
        t_kill = p.fault_at // 2
        s_recs, s_t, s_rc = script_run("script-kill", p, workdir, netns, t_kill)
        figs["script_failstop_resume_s"] = ef.resume_s(s_recs, s_t) if s_t else None
        # (samples lost only where the survivors went on: a job that stopped lost the rest)
        figs["script_samples_lost"] = _f(ef.samples_lost(s_recs, p.batch)) \
            if figs["script_failstop_resume_s"] is not None else None
        figs["script_val_loss_rel_change"] = ef.rel_change(ef.final_val_loss(s_recs),
                                                           healthy_val)
        if s_t is not None and figs["script_failstop_resume_s"] is None:
            notes.append(f"script kill: the survivors did not go on after rank 3 was killed "
                         f"(stalwart run --script exited {s_rc}; log {workdir}/script-kill.log)")
        # the same training at world 3 from the start: what the order of fp32 sums alone
        # moves the final loss by (the kill run trains at world 3 after step t_kill)
        st.start("script healthy at world 3 (the rounding floor)")
        h3_recs, _, h3_rc = script_run("script-healthy-3", p, workdir, netns, None, nproc=3)
        figs["script_val_loss_rounding"] = ef.rel_change(ef.final_val_loss(h3_recs),
                                                         healthy_val)
        details["runs"]["script"] = {"healthy_rc": h_rc, "kill_rc": s_rc, "kill_at": t_kill,
                                     "healthy_val_loss": healthy_val,
                                     "kill_val_loss": ef.final_val_loss(s_recs),
                                     "healthy3_rc": h3_rc,
                                     "healthy3_val_loss": ef.final_val_loss(h3_recs)}
    # the arms, fault by fault
    eps: dict[str, dict[str, ea.Episode]] = {a: {} for a in arms}
    for fault in faults:
        for a in arms:
            st.start(f"{a} {fault}")
            arm = ea.make_arm(a, p, netns)
            t0 = time.monotonic()
            e = ea.run_episode(arm, fault, workdir)
            eps[a][fault] = e
            details["runs"][f"{a}-{fault}"] = e.summary() | {
                "wall_s": round(time.monotonic() - t0, 1),
                "rejoin_split": ef.rejoin_split(e.records, e.t_back, p.ranks)
                if e.t_back else None}
            for n in e.notes:
                print(f"bench elastic: {a} {fault}: {n}", flush=True)
    for a in arms:
        figs.update(arm_figures(a, eps[a], p, healthy_val))
    tf, n = time_figures({a: e["kill"] for a, e in eps.items() if "kill" in e})
    figs.update(tf)
    details["time_to_samples_n"] = n
    return BenchResult("elastic", figs, targets=dict(TARGETS), details=details)
