"""`stalwart bench lossy`: the loss-tolerant transport against gloo on 4 testbed hosts.

What it measures (all with real random loss from nftables on the hosts' input path):
- all-reduce of 16 MiB, ours vs gloo, interleaved iteration by iteration in the same processes,
  at 0%, 0.1%, 1% and 5% loss, ours with the protection training uses (Reed-Solomon parity
  sized for a residual chunk loss of 2e-5, ``attach``'s default); an iteration's time is the
  slowest rank's; CPU seconds per all-reduce (all threads of all ranks, ``process_time``) for
  both at 0%. At 10% loss ours alone (gloo takes seconds per all-reduce there): UDP bytes sent
  per payload byte and the fraction of chunks still lost after decoding. MTU 9000 and 1500.
  The engine (``STALWART_ENGINE``: native data plane or the Python reference) is recorded.
- full training runs through ``stalwart.launch`` (4 ranks, tiny GPT, same seed and steps):
  reliable (gloo) vs lossy (``--comm lossy``) at 0/1/5/10/20% loss: final validation loss and
  job throughput (tokens/s; in full runs the throughput configurations run twice, interleaved,
  and are averaged, because the shared machine's load drifts between runs); and lossy with
  the protection off (``comm.fec`` "none") at 1/5/10%, so that the accuracy figures also
  measure unbiased averaging and bounded drift, not only the parity.
- replica drift at 10% UDP loss, exactly (a lossless gloo probe after every step), with the
  parameter broadcast and with the naive gradient broadcast, both unprotected; constant
  learning rate so a decaying schedule cannot make drift look bounded.
Figure names are those of issues 4, 12 and 23; ``_mtu1500`` variants are the same at MTU 1500.
``--only profile``: the per-stage CPU account alone; ``--only tail``: the all-reduce at 0.1, 1
and 5% alone, with where its slow iterations waited (``tail_account``). The timed operations
are lined up by a barrier the loss cannot delay (``lossy_worker.FileBarrier``).
Progress (stage, MTU, loss level, elapsed) goes to stderr while it runs.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from stalwart.bench import BenchResult, Steps

NUMEL = 4 * 1024 * 1024  # 16 MiB of float32
TARGETS = {
    "allreduce_median_ratio_loss0": "<= 1.0",
    "allreduce_median_ratio_loss0.1": "<= 1.0",
    "allreduce_p99_ratio_loss0.1": "<= 0.5",
    "allreduce_p99_ratio_loss1": "<= 0.5",
    "allreduce_median_ratio_loss5": "<= 0.1",
    "allreduce_cpu_ratio_loss0": "<= 1.0",
    "wire_bytes_ratio_loss10": "<= 1.5",
    "residual_chunk_loss_loss10": "<= 2e-5",
    "val_loss_rel_change_loss1": "<= 0.002",
    "val_loss_rel_change_loss10": "<= 0.005",
    "val_loss_rel_change_loss20": "<= 0.005",
    "drift_growth_loss10": "<= 1.5",
    "naive_drift_growth_loss10": "> 1.5",
    "tokens_per_s_ratio_loss5": ">= 5",
    "tokens_per_s_kept_loss5": ">= 0.95",
}
TARGETS_MTU1500 = {"allreduce_median_ratio_loss0": "<= 1.2"}
RESIDUAL_TARGET = 2e-5  # attach's default (ddp.AUTO_TARGET)


def _p(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


class Progress:
    """One line per stage on stderr: what runs, at which MTU, and the time since the start."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self, what: str) -> None:
        print(f"[bench lossy {time.monotonic() - self.t0:6.0f} s] {what}", file=sys.stderr,
              flush=True)


PHASE_NAMES = ("reduce-scatter", "broadcast")


def how_ended(end: str, recovered: int) -> str:
    """How a phase's last missing chunks came: ``data`` (every packet arrived), ``parity``
    (complete, some chunks rebuilt from parity), ``markers`` (every sender's end marker in and
    the grace over with chunks still missing: no parity could rebuild them), ``deadline``.
    Nothing is ever retransmitted, so there is no fifth way."""
    if end == "complete":
        return "parity" if recovered > 0 else "data"
    return "markers" if end == "ended" else end


def tail_account(ours: list[float], waits: list[list[list]],
                 starts: list[list[float]] | None = None) -> dict:
    """Where the slow all-reduces' time went (issue 37 item 3). For the iterations at or above
    the 90th percentile of ``ours`` (slowest rank), the slowest rank's phases split into its
    own send (its packets, parity and markers handed to the kernel), skew (then until every
    peer had started the round), transfer (until every peer had completed or sent its end
    marker) and the end wait (grace, decode or deadline after that); with how each phase
    ended (``how_ended``), how long it waited after its own send (``after_send_s``) and which
    peer came last. ``waits``: per rank, per iteration, per phase [end, t_started, t_ended,
    elapsed, last, lost, recovered, t_sent(, parity)]; ``starts``: per rank, per iteration,
    the start time on the machine's one monotonic clock (``start_skew_s``: the last rank's
    start minus the first's). The times are the waiting thread's wake-ups: on a loaded
    machine its own scheduling delay is in them. ``ends`` counts how every phase of every
    rank and iteration ended, not only the slow ones."""
    if not ours or not waits or not all(waits):
        return {}
    cut = float(np.percentile(ours, 90))
    rows = []
    skews = ([float(max(s[it] for s in starts) - min(s[it] for s in starts))
              for it in range(len(ours))] if starts and all(starts) else [])
    for it, t in enumerate(ours):
        if t < cut:
            continue
        r = int(np.argmax([sum(ph[3] for ph in w[it]) for w in waits]))  # the slowest rank
        for k, ph in enumerate(waits[r][it][:2]):
            end, ts, te, el, last, lost, rec = ph[:7]
            sent = ph[7] if len(ph) > 7 else 0.0
            rows.append({"iter": it, "rank": r, "phase": PHASE_NAMES[k], "end": end,
                         "how": how_ended(end, rec),
                         "start_skew_s": skews[it] if skews else None,
                         "own_send_s": sent, "skew_s": max(ts - sent, 0.0),
                         "transfer_s": max(te - max(ts, sent), 0.0),
                         "end_wait_s": max(el - te, 0.0), "after_send_s": max(el - sent, 0.0),
                         "elapsed_s": el, "last": last, "lost": lost, "recovered": rec,
                         "parity": ph[8] if len(ph) > 8 else None, "total_s": t})
    keys = ("own_send_s", "skew_s", "transfer_s", "end_wait_s")
    share = {k: float(sum(x[k] for x in rows) / max(sum(x["elapsed_s"] for x in rows), 1e-12))
             for k in keys}
    ends: dict[str, int] = {}
    for w in waits:
        for it in range(len(ours)):
            for ph in w[it][:2]:
                h = how_ended(ph[0], ph[6])
                ends[h] = ends.get(h, 0) + 1
    after = [max(ph[3] - (ph[7] if len(ph) > 7 else 0.0), 0.0)
             for w in waits for it in range(len(ours)) for ph in w[it][:2]]
    return {"cut_s": cut, "iterations": rows, "share": share, "ends": ends,
            "after_send_median_s": _p(after, 50), "after_send_max_s": float(max(after)),
            "start_skew_s": skews}


def tail_markdown(ar: dict, mtu: int) -> str:
    """One row per slow iteration's phase (``tail_account``) at each loss level of ``ar``
    (``bench_allreduce``'s result), with the level's times and how its phases ended."""
    lines = [f"MTU {mtu}: the iterations at or above each level's 90th percentile (slowest "
             "rank's phases; ms)", "",
             "| loss | iter | total | start skew | phase | own send | wait for start | "
             "transfer | end wait | after send | last chunks | lost / rebuilt / parity |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ms = 1e3
    for k, v in ar.items():
        if k in ("rejected", "engine") or not v.get("tail"):
            continue
        for x in v["tail"]["iterations"]:
            sk = "" if x["start_skew_s"] is None else f"{x['start_skew_s'] * ms:.1f}"
            lines.append(
                f"| {float(k):.1%} | {x['iter']} | {x['total_s'] * ms:.0f} | {sk} | "
                f"{x['phase']} | {x['own_send_s'] * ms:.1f} | {x['skew_s'] * ms:.1f} | "
                f"{x['transfer_s'] * ms:.1f} | {x['end_wait_s'] * ms:.1f} | "
                f"{x['after_send_s'] * ms:.1f} | {x['how']} | {x['lost']} / {x['recovered']}"
                f" / {x['parity']} |")
    lines += ["", "| loss | ours median / p99 | gloo median / p99 | p99 ratio | phases ended by "
              "| after own send, median / max | start skew, max |", "|---|---|---|---|---|---|---|"]
    for k, v in ar.items():
        if k in ("rejected", "engine") or not v.get("tail"):
            continue
        t = v["tail"]
        g = (f"{_p(v['gloo'], 50) * ms:.0f} / {_p(v['gloo'], 99) * ms:.0f}" if v["gloo"]
             else "")
        ratio = f"{_p(v['ours'], 99) / _p(v['gloo'], 99):.2f}" if v["gloo"] else ""
        ends = ", ".join(f"{a} {b}" for a, b in sorted(t["ends"].items()))
        sk = f"{max(t['start_skew_s']) * ms:.1f}" if t["start_skew_s"] else ""
        lines.append(f"| {float(k):.1%} | {_p(v['ours'], 50) * ms:.0f} / "
                     f"{_p(v['ours'], 99) * ms:.0f} | {g} | {ratio} | {ends} | "
                     f"{t['after_send_median_s'] * ms:.1f} / {t['after_send_max_s'] * ms:.1f} "
                     f"| {sk} |")
    return "\n".join(lines)


def bench_allreduce(mtu: int, iters: dict[float, int], workdir: Path,
                    gloo_levels: list[float], progress: Progress | None = None) -> dict:
    """Per loss level: per-iteration times (slowest rank), ours and gloo; chunks lost after
    decoding and wire bytes per payload byte (summed / averaged over ranks)."""
    from stalwart.bench.lossy_net import run_on_hosts
    from stalwart.testbed import Hosts

    levels = sorted(iters)
    with Hosts(4, mtu=mtu) as h:
        args = {"numel": NUMEL, "levels": levels, "iters": [iters[p] for p in levels],
                "warmup": 3, "netns": [h.ns(i) for i in range(4)], "gloo_levels": gloo_levels,
                "fec": "rs", "fec_target": RESIDUAL_TARGET}
        out_dir = workdir / f"allreduce-mtu{mtu}"
        recs = run_on_hosts(h, "stalwart.bench.lossy_worker", ["allreduce", json.dumps(args)],
                            out_dir, timeout=1800,
                            progress=(lambda line: progress(f"all-reduce MTU {mtu}: {line}"))
                            if progress else None)
    out: dict = {}
    for p in levels:
        k = str(p)
        lv = [r["levels"][k] for r in recs]
        ours = np.max([v["ours"] for v in lv], axis=0).tolist()
        gloo = np.max([v["gloo"] for v in lv], axis=0).tolist() if lv[0]["gloo"] else []
        lost = int(sum(sum(v["lost"]) for v in lv))
        chunks = int(sum(sum(v["chunks"]) for v in lv))
        out[k] = {"ours": ours, "gloo": gloo, "lost": lost, "chunks": chunks,
                  "lost_frac": lost / max(chunks, 1),
                  "recovered": int(sum(sum(v["recovered"]) for v in lv)),
                  "wire": float(np.mean([np.mean(v["wire"]) for v in lv])),
                  "deadline_hits": int(np.sum([v["deadline_hits"] for v in lv])),
                  # CPU seconds per all-reduce, all ranks together (iteration by iteration)
                  "cpu": np.sum([v["cpu"] for v in lv], axis=0).tolist(),
                  "gloo_cpu": (np.sum([v["gloo_cpu"] for v in lv], axis=0).tolist()
                               if lv[0].get("gloo_cpu") else []),
                  "tail": tail_account(ours, [v.get("waits", []) for v in lv],
                                       [v.get("starts", []) for v in lv]),
                  "gloo_start_skew": ([float(max(g) - min(g)) for g in zip(
                      *[v["gloo_starts"] for v in lv], strict=True)]
                      if lv[0].get("gloo_starts") else [])}
    out["rejected"] = [r["rejected"] for r in recs]
    out["engine"] = recs[0].get("engine")
    return out


def bench_profile(mtu: int, iters: int, workdir: Path) -> dict | None:
    """CPU ns per payload byte per stage, ours and gloo, loss-free (``lossy_profile``); None
    (with the reason in the progress line) when ``perf`` cannot sample here."""
    from stalwart.bench import lossy_profile
    from stalwart.bench.lossy_net import run_on_hosts
    from stalwart.testbed import Hosts

    why = lossy_profile.available()
    if why is not None:
        return {"unavailable": why}
    with Hosts(4, mtu=mtu) as h:
        args = {"numel": NUMEL, "iters": iters, "warmup": 3, "fec": "rs",
                "fec_target": RESIDUAL_TARGET}
        recs = run_on_hosts(h, "stalwart.bench.lossy_worker", ["profile", json.dumps(args)],
                            workdir / f"profile-mtu{mtu}", timeout=1200)
    tab = lossy_profile.table(recs)
    tab["markdown"] = lossy_profile.markdown(tab, f"MTU {mtu}, 16 MiB, 4 ranks, no loss, "
                                                  f"{iters} all-reduces per rank")
    tab["engine"] = recs[0]["engine"]
    return tab


def profile_figures(tab: dict | None, sfx: str) -> dict[str, float | None]:
    """``cpu_ns_per_byte`` (ours, all stages), gloo's, and one figure per stage of each."""
    if tab is None or "unavailable" in tab:
        return {f"cpu_ns_per_byte{sfx}": None, f"cpu_ns_per_byte_gloo{sfx}": None}
    figs: dict[str, float | None] = {
        f"cpu_ns_per_byte{sfx}": tab["ours"]["all"]["total"],
        f"cpu_ns_per_byte_gloo{sfx}": tab["gloo"]["all"]["total"]}
    for system in ("ours", "gloo"):
        for stage, v in tab[system]["all"].items():
            if stage != "total" and not stage.startswith("("):
                key = stage.replace(": ", "_").replace(", ", "_").replace(" + ", "_")
                figs[f"cpu_ns_per_byte_{system}_{key.replace(' ', '_')}{sfx}"] = v
    return figs


ONLY = ("profile", "tail")
TAIL_LEVELS = (0.001, 0.01, 0.05)  # the levels of the tail figures (p99 at 0.1 / 1%, median 5%)


def bench_drift(steps: int, workdir: Path) -> dict:
    from stalwart.bench.lossy_net import run_on_hosts, set_udp_loss
    from stalwart.testbed import Hosts

    res = {}
    with Hosts(4, mtu=9000) as h:
        for i in range(4):
            set_udp_loss(h.ns(i), 0.10)
        for mode in ("params", "naive"):
            args = {"mode": mode, "steps": steps, "lr": 3e-3, "seed": 0, "preset": "tiny"}
            recs = run_on_hosts(h, "stalwart.bench.lossy_worker", ["drift", json.dumps(args)],
                                workdir / f"drift-{mode}", timeout=1200)
            res[mode] = {"drift": recs[0]["drift"],
                         "lost_frac": float(np.mean([r["lost_frac"] for r in recs]))}
    return res


def growth(drift: list[float]) -> float:
    """max drift over the last quarter of steps / max over the second quarter."""
    n = len(drift)
    q2 = drift[n // 4: n // 2]
    q4 = drift[3 * n // 4:]
    return max(q4) / max(max(q2), 1e-12)


def bench_training(mtu: int, steps: int, workdir: Path, repeat: bool,
                   progress: Progress | None = None) -> dict:
    from stalwart.config import RunConfig
    from stalwart.launch import launch
    from stalwart.rundir import RunData

    # (comm, loss, protection): "rs" = attach's default, "none" = no protection (comm.fec)
    runs = [("reliable", 0.0, ""), ("lossy", 0.0, "rs"), ("reliable", 0.05, ""),
            ("lossy", 0.05, "rs"), ("lossy", 0.01, "rs"), ("lossy", 0.10, "rs"),
            ("lossy", 0.20, "rs"), ("lossy", 0.01, "none"), ("lossy", 0.05, "none"),
            ("lossy", 0.10, "none")]
    first = len(runs)
    if repeat:  # the machine's load drifts: throughput configs again, interleaved
        runs += [("reliable", 0.05, ""), ("lossy", 0.05, "rs"), ("lossy", 0.0, "rs")]
    out: dict = {}
    for i, (comm, p, fec) in enumerate(runs):
        name = (f"{comm}-loss{int(p * 100)}-mtu{mtu}" + (f"-{fec}" if fec else "")
                + ("-b" if i >= first else ""))
        cfg = RunConfig(nproc=4, testbed="netns", comm=comm, steps=steps, seed=0,
                        faults=[f"loss:host=all,p={p}"] if p > 0 else [],
                        out=str(workdir / "runs"), name=name, mtu=mtu, detect=False,
                        eval_every=steps, ckpt_every=10**6, fec=fec or None)
        if progress:
            progress(f"training MTU {mtu}: run {i + 1}/{len(runs)} ({name})")
        t = time.time()
        rc = launch(cfg, show_progress=False, on_line=lambda s: None)
        if rc != 0:
            raise RuntimeError(f"training run {name} failed (exit {rc}); see {cfg.run_dir}")
        d = RunData.load(cfg.run_dir)
        ms = [m for m in d.metrics if "pkts_recv" in m]
        lost = sum(m.get("pkts_lost", 0) for m in ms)
        recv = sum(m.get("pkts_recv", 0) for m in ms)
        rec = {"val_loss": d.final_val_loss(), "tokens_per_s": d.total_tokens_per_s(),
               "lost_frac": lost / max(lost + recv, 1) if ms else None,
               "chunks_lost": lost, "recovered": sum(m.get("recovered", 0) for m in ms),
               "parity": sum(m.get("parity", 0) for m in ms),
               "deadline_hits": sum(m.get("deadline_hits", 0) for m in d.metrics),
               "pkts_rejected": sum(m.get("pkts_rejected", 0) for m in d.metrics),
               "wall_s": time.time() - t}
        key = f"{comm}{p}" + ("-none" if fec == "none" else "")
        if key in out:  # a repeat: keep the first run's loss, average the throughputs
            out[key]["tokens_per_s_runs"].append(rec["tokens_per_s"])
            out[key]["tokens_per_s"] = float(np.mean(out[key]["tokens_per_s_runs"]))
        else:
            rec["tokens_per_s_runs"] = [rec["tokens_per_s"]]
            out[key] = rec
    return out


TRAIN_FIGURES = ("val_loss_rel_change_loss1", "val_loss_rel_change_loss10",
                 "val_loss_rel_change_loss20", "val_loss_rel_change_loss1_unprotected",
                 "val_loss_rel_change_loss5_unprotected", "val_loss_rel_change_loss10_unprotected",
                 "tokens_per_s_ratio_loss5", "tokens_per_s_kept_loss5")


def allreduce_figures(ar: dict, sfx: str, figures: dict, details: dict) -> None:
    """The all-reduce figures of ``bench_allreduce``'s result ``ar`` at the levels it has
    (``figures``) and its summary per level (``details["allreduce" + sfx]``)."""
    details[f"allreduce{sfx}"] = {
        k: ({"ours_median": _p(v["ours"], 50), "ours_p99": _p(v["ours"], 99),
             **({"gloo_median": _p(v["gloo"], 50), "gloo_p99": _p(v["gloo"], 99)}
                if v["gloo"] else {}),
             "ours_cpu_median": _p(v["cpu"], 50),
             **({"gloo_cpu_median": _p(v["gloo_cpu"], 50)} if v["gloo_cpu"] else {}),
             "chunks_lost": v["lost"], "chunks": v["chunks"], "lost_frac": v["lost_frac"],
             "recovered": v["recovered"], "wire_bytes_ratio": v["wire"],
             "deadline_hits": v["deadline_hits"], "n": len(v["ours"]),
             "tail": v.get("tail", {}), "gloo_start_skew": v.get("gloo_start_skew", [])}
            if k not in ("rejected", "engine") else v)
        for k, v in ar.items()}
    if "0.0" in ar:
        figures[f"allreduce_median_ratio_loss0{sfx}"] = (
            _p(ar["0.0"]["ours"], 50) / _p(ar["0.0"]["gloo"], 50))
        figures[f"allreduce_cpu_ratio_loss0{sfx}"] = (
            _p(ar["0.0"]["cpu"], 50) / _p(ar["0.0"]["gloo_cpu"], 50))
    for k, name, q in (("0.001", "median_ratio_loss0.1", 50), ("0.001", "p99_ratio_loss0.1", 99),
                       ("0.01", "p99_ratio_loss1", 99), ("0.05", "median_ratio_loss5", 50)):
        if k in ar and ar[k]["gloo"]:
            figures[f"allreduce_{name}{sfx}"] = _p(ar[k]["ours"], q) / _p(ar[k]["gloo"], q)


def run_tail(quick: bool, workdir: Path, figures: dict, details: dict,
             progress: Progress) -> None:
    """The all-reduce at the tail's loss levels alone (``--only tail``), ours and gloo, MTU
    9000 and 1500, with the same iterations as the whole suite: its figures, and the account
    of the slow iterations (``tail_account``) as a table on stderr."""
    n = {0.001: 10, 0.01: 8, 0.05: 3} if quick else {0.001: 40, 0.01: 40, 0.05: 12}
    for mtu in (9000, 1500):
        sfx = "" if mtu == 9000 else "_mtu1500"
        ar = bench_allreduce(mtu, n, workdir, gloo_levels=list(TAIL_LEVELS), progress=progress)
        allreduce_figures(ar, sfx, figures, details)
        details[f"tail_markdown{sfx}"] = tail_markdown(ar, mtu)
        print(details[f"tail_markdown{sfx}"], file=sys.stderr)


def run_profile(quick: bool, workdir: Path, figures: dict, details: dict,
                progress: Progress) -> None:
    for mtu in (9000, 1500):
        sfx = "" if mtu == 9000 else "_mtu1500"
        progress(f"CPU profile at MTU {mtu} (perf), ours and gloo")
        tab = bench_profile(mtu, 4 if quick else 10, workdir)
        details[f"cpu_ns_per_byte{sfx}"] = tab
        figures.update(profile_figures(tab, sfx))
        if tab and "markdown" in tab:
            print(tab["markdown"], file=sys.stderr)


def run_only(only: list[str], quick: bool, workdir: Path, details: dict, progress: Progress,
             engine: str) -> BenchResult:
    """``--only profile`` and/or ``--only tail``: those stages alone, with their figures."""
    figures: dict[str, float | None] = {}
    targets: dict[str, str] = {}
    if "profile" in only:
        run_profile(quick, workdir, figures, details, progress)
    if "tail" in only:
        run_tail(quick, workdir, figures, details, progress)
        for k in figures:
            base = k.removesuffix("_mtu1500")
            if base in TARGETS and k.startswith("allreduce_"):
                targets[k] = TARGETS_MTU1500.get(base, TARGETS[base]) if k != base else TARGETS[k]
    return BenchResult(suite="lossy", figures=figures, targets=targets, details=details,
                       command="stalwart bench lossy --only " + " ".join(only)
                       + (" --quick" if quick else "") + f"  (engine: {engine})")


def run(quick: bool, workdir: Path, only: list[str] | None = None) -> BenchResult:
    from stalwart.comm import native
    from stalwart.errors import ConfigError

    workdir = Path(workdir)
    figures: dict[str, float | None] = {}
    try:
        engine = native.engine_name()
    except ValueError as e:  # a bad STALWART_ENGINE: one line and exit 2, not a traceback
        raise ConfigError(str(e)) from None
    details: dict = {"quick": quick, "engine": engine}
    progress = Progress()
    progress(f"engine: {engine}")
    if only:  # "profile": the per-stage CPU account; "tail": the all-reduce under loss
        return run_only(only, quick, workdir, details, progress, engine)
    if quick:
        ar_iters = {0.0: 6, 0.001: 10, 0.01: 8, 0.05: 3, 0.10: 4}
        steps, drift_steps, train_mtus = 30, 40, (9000,)
    else:
        ar_iters = {0.0: 15, 0.001: 40, 0.01: 40, 0.05: 12, 0.10: 12}
        steps, drift_steps, train_mtus = 200, 200, (9000, 1500)
    st = Steps("lossy", 2 + len(train_mtus) + 2)
    st.start("CPU per stage and payload byte (perf), ours and gloo, MTU 9000 and 1500")
    run_profile(quick, workdir, figures, details, progress)
    for mtu in (9000, 1500):
        sfx = "" if mtu == 9000 else "_mtu1500"
        st.start(f"all-reduce at MTU {mtu}, ours and gloo, {len(ar_iters)} loss levels")
        ar = bench_allreduce(mtu, ar_iters, workdir, gloo_levels=[0.0, 0.001, 0.01, 0.05],
                             progress=progress)
        allreduce_figures(ar, sfx, figures, details)
        figures[f"wire_bytes_ratio_loss10{sfx}"] = ar["0.1"]["wire"]
        figures[f"residual_chunk_loss_loss10{sfx}"] = ar["0.1"]["lost_frac"]
    for mtu in (9000, 1500):
        sfx = "" if mtu == 9000 else "_mtu1500"
        if mtu not in train_mtus:
            for k in TRAIN_FIGURES:
                figures[k + sfx] = None
            continue
        st.start(f"training at MTU {mtu}, reliable and lossy, {steps} steps per run")
        tr = bench_training(mtu, steps, workdir, repeat=not quick, progress=progress)
        details[f"training{sfx}"] = tr
        ref = tr["reliable0.0"]["val_loss"]
        for key, name in (("lossy0.01", "loss1"), ("lossy0.1", "loss10"), ("lossy0.2", "loss20"),
                          ("lossy0.01-none", "loss1_unprotected"),
                          ("lossy0.05-none", "loss5_unprotected"),
                          ("lossy0.1-none", "loss10_unprotected")):
            got = tr[key]["val_loss"]
            figures[f"val_loss_rel_change_{name}{sfx}"] = abs(got - ref) / ref
        figures[f"tokens_per_s_ratio_loss5{sfx}"] = (
            tr["lossy0.05"]["tokens_per_s"] / tr["reliable0.05"]["tokens_per_s"])
        figures[f"tokens_per_s_kept_loss5{sfx}"] = (
            tr["lossy0.05"]["tokens_per_s"] / tr["lossy0.0"]["tokens_per_s"])
    st.start(f"replica drift, {drift_steps} steps")
    dr = bench_drift(drift_steps, workdir)
    details["drift"] = {m: {"growth": growth(v["drift"]), "max": max(v["drift"]),
                            "lost_frac": v["lost_frac"], "series": v["drift"]}
                        for m, v in dr.items()}
    figures["drift_growth_loss10"] = growth(dr["params"]["drift"])
    figures["naive_drift_growth_loss10"] = growth(dr["naive"]["drift"])
    # informational: how far apart the two schemes' replicas end up (last quarter's max drift)
    n = len(dr["params"]["drift"])
    figures["naive_over_params_drift_loss10"] = (
        max(dr["naive"]["drift"][3 * n // 4:]) / max(max(dr["params"]["drift"][3 * n // 4:]),
                                                      1e-12))
    targets = dict(TARGETS)
    for k, v in TARGETS.items():
        if k.startswith(("allreduce_", "val_loss_", "tokens_", "wire_", "residual_")):
            targets[k + "_mtu1500"] = TARGETS_MTU1500.get(k, v)
    progress("done")
    return BenchResult(suite="lossy", figures=figures, targets=targets, details=details,
                       command="stalwart bench lossy" + (" --quick" if quick else "")
                       + f"  (engine: {engine})")
