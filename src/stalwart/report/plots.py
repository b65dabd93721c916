"""The report's plots, each a function RunData -> PNG file (or None when the run lacks the data).

matplotlib with the Agg backend (no display needed). Ground-truth faults from the testbed are
shaded on every time axis, and straggler detections are marked, so a reader can compare what
happened with what stalwart saw.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from stalwart.rundir import RunData  # noqa: E402

DPI = 110


def fault_spans(run: RunData) -> list[tuple[int, int, str]]:
    """(start step, end step, label) of each injected fault, from the ground-truth events."""
    last = max((m["step"] for m in run.metrics), default=0) + 1
    open_: dict[str, int] = {}
    spans = []
    for e in run.events:
        key = e.get("spec") or f"{e.get('kind')}:{e.get('rank', e.get('hosts'))}"
        if e.get("event") == "fault_applied":
            open_[key] = e.get("step", 0)
        elif e.get("event") == "fault_removed" and key in open_:
            spans.append((open_.pop(key), e.get("step", last), key))
    spans += [(s, last, k) for k, s in open_.items()]
    return spans


def overlay(ax: Axes, run: RunData) -> None:
    for i, (s, e, label) in enumerate(fault_spans(run)):
        ax.axvspan(s, e, color=f"C{(i + 3) % 10}", alpha=0.12,
                   label=f"fault {label}" if len(label) < 50 else "fault")
    for d in run.events_of("straggler_detected"):
        who = d.get("ranks") or d.get("link")
        ax.axvline(d.get("onset_step", d.get("step", 0)), color="red", ls="--", lw=1,
                   label=f"detected {d.get('kind')} {who}")
    for d in run.events_of("straggler_recovered"):
        ax.axvline(d.get("step", 0), color="green", ls=":", lw=1, label="recovered")


def _legend(ax: Axes) -> None:
    handles, labels = ax.get_legend_handles_labels()
    seen: dict[str, object] = {}
    for h, lab in zip(handles, labels, strict=True):
        seen.setdefault(lab, h)
    if seen:
        ax.legend(seen.values(), seen.keys(), fontsize=7, loc="best")


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_loss(run: RunData, out: Path) -> Path | None:
    if not run.metrics:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.6))
    table = run.step_table("loss")
    steps = sorted(table)
    ax.plot(steps, [sum(table[s].values()) / len(table[s]) for s in steps], lw=1,
            label="train loss (mean over ranks)")
    vs, vl = run.eval_losses()
    if vs:
        ax.plot(vs, vl, "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title("Loss")
    overlay(ax, run)
    _legend(ax)
    return _save(fig, out / "loss.png")


def plot_rank_times(run: RunData, out: Path) -> Path | None:
    if not run.metrics:
        return None
    fig, axes = plt.subplots(2, 1, figsize=(7, 5.2), sharex=True)
    for key, ax, title in ((("compute_time"), axes[0], "compute time per step"),
                           (("comm_time"), axes[1], "communication / wait time per step")):
        for r in run.ranks:
            s, v = run.series(key, r)
            ax.plot(s, [x * 1000 for x in v], lw=0.9, label=f"rank {r}")
        ax.set_ylabel("ms")
        ax.set_title(title)
        overlay(ax, run)
        _legend(ax)
    axes[1].set_xlabel("step")
    fig.suptitle("Per-rank time: a slow rank computes longer, its peers wait longer", fontsize=9)
    return _save(fig, out / "rank_times.png")


def plot_slowness(run: RunData, out: Path) -> Path | None:
    """Heat map: each rank's compute time divided by the median over ranks at that step.

    Red rows are slow ranks; a fault that starts and ends shows as a red band in one row, which
    stays readable even when communication noise (e.g. packet loss) swamps the raw timings.
    """
    table = run.step_table("compute_time")
    ranks = run.ranks
    if len(ranks) < 2 or not table:
        return None
    import numpy as np

    steps = sorted(table)
    grid = np.full((len(ranks), len(steps)), np.nan)
    for j, s in enumerate(steps):
        row = table[s]
        med = float(np.median(list(row.values()))) or 1e-9
        for i, r in enumerate(ranks):
            if r in row:
                grid[i, j] = row[r] / med
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(ranks) + 1.6))
    im = ax.imshow(grid, aspect="auto", cmap="coolwarm", vmin=0.5, vmax=2.0, interpolation="none",
                   extent=(steps[0] - 0.5, steps[-1] + 0.5, len(ranks) - 0.5, -0.5))
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_xlabel("step")
    ax.set_title("Compute time / median over ranks (red = slower than its peers)")
    for s, e, _label in fault_spans(run):
        ax.axvline(s, color="k", lw=0.8, ls="--")
        ax.axvline(e, color="k", lw=0.8, ls="--")
    fig.colorbar(im, ax=ax, fraction=0.03)
    return _save(fig, out / "slowness.png")


def plot_share(run: RunData, out: Path) -> Path | None:
    if not run.metrics:
        return None
    ranks = run.ranks
    comp = [sum(m["compute_time"] for m in run.rank_metrics(r)) for r in ranks]
    comm = [sum(m["comm_time"] for m in run.rank_metrics(r)) for r in ranks]
    tot = [c + m or 1.0 for c, m in zip(comp, comm, strict=True)]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar([str(r) for r in ranks], [c / t for c, t in zip(comp, tot, strict=True)],
           label="compute")
    ax.bar([str(r) for r in ranks], [c / t for c, t in zip(comm, tot, strict=True)],
           bottom=[c / t for c, t in zip(comp, tot, strict=True)], label="communication / wait")
    ax.set_xlabel("rank")
    ax.set_ylabel("share of step time")
    ax.set_ylim(0, 1)
    ax.set_title("Compute vs communication share")
    ax.legend(fontsize=8)
    return _save(fig, out / "share.png")


def plot_iteration(run: RunData, out: Path) -> Path | None:
    steps, times = run.iteration_times()
    if not steps:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.4))
    ax.plot(steps, [t * 1000 for t in times], lw=1, color="k",
            label="iteration time (slowest rank)")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.set_title("Iteration time, injected faults (shaded) and detections")
    overlay(ax, run)
    _legend(ax)
    return _save(fig, out / "iteration.png")


def plot_extra(run: RunData, out: Path, key: str, title: str, fname: str,
               scale: float = 1.0, unit: str = "") -> Path | None:
    """One line per rank for a capability's own metric (e.g. drift, pkts_lost, comm_hidden)."""
    if not any(key in m for m in run.metrics):
        return None
    fig, ax = plt.subplots(figsize=(7, 3))
    for r in run.ranks:
        s, v = run.series(key, r)
        ax.plot(s, [x * scale for x in v], lw=0.9, label=f"rank {r}")
    ax.set_xlabel("step")
    ax.set_ylabel(unit or key)
    ax.set_title(title)
    overlay(ax, run)
    _legend(ax)
    return _save(fig, out / fname)


def all_plots(run: RunData, out: Path) -> list[tuple[str, Path]]:
    made = [
        ("Loss", plot_loss(run, out)),
        ("Iteration time", plot_iteration(run, out)),
        ("Which rank is slow", plot_slowness(run, out)),
        ("Per-rank compute and wait time", plot_rank_times(run, out)),
        ("Compute vs communication", plot_share(run, out)),
        ("Hidden communication (strand interleaving)",
         plot_extra(run, out, "comm_hidden", "communication hidden under compute", "hidden.png",
                    1000, "ms")),
        ("Packets lost (lossy transport)",
         plot_extra(run, out, "pkts_lost", "packets lost per step", "pkts_lost.png")),
        ("Replica drift (lossy transport)",
         plot_extra(run, out, "drift", "max |param - owner's param|", "drift.png")),
    ]
    return [(t, p) for t, p in made if p is not None]
