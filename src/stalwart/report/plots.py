"""The report's plots, each a function RunData -> PNG file (or None when the run lacks the data).

matplotlib through its object API: every figure is a ``matplotlib.figure.Figure`` with its own
Agg canvas (no display needed), never a pyplot figure, so importing or calling this module
leaves the user's pyplot backend and figure list alone (it used to call
``matplotlib.use("Agg")`` at import, which switched an interactive session's backend).
Ground-truth faults from the testbed are
shaded on every time axis, and straggler detections and mitigation actions are marked, so a
reader can compare what happened with what stalwart saw and did. In a run with mitigation the
iteration-time plot becomes a timeline: faults (shaded spans), detections (markers, a bar from
the onset to the detection), actions (labelled vertical lines) and, in a second panel, the
micro-batches each host or rank computed at every step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import blended_transform_factory

from stalwart.events import (
    FaultApplied,
    FaultRemoved,
    SlowdownUnexplained,
    StragglerDetected,
    StragglerRecovered,
)
from stalwart.report.mitigation import (
    Action,
    actions,
    has_mitigation,
    plan_grid,
    rows_by_host,
)
from stalwart.rundir import RunData

DPI = 110
# mitigation actions: colour and legend entry per kind (see mitigation.Action)
ACTION_STYLE = {"rebalance": ("#6a3d9a", "mitigation: rebalance"),
                "revert": ("#1b9e77", "mitigation: back to uniform plan"),
                "host": ("#d95f02", "mitigation: restart without / with a host")}


def fault_spans(run: RunData) -> list[tuple[int, int, str]]:
    """(start step, end step, label) of each injected fault, from the ground-truth events."""
    last = max((m["step"] for m in run.metrics), default=0) + 1
    open_: dict[str, int] = {}
    spans = []
    for e in run.events_of(FaultApplied, FaultRemoved):
        key = e.get("spec") or f"{e.get('kind')}:{e.get('rank', e.get('hosts'))}"
        if e.get("event") == FaultApplied.name:
            open_[key] = e.get("step", 0)
        elif e.get("event") == FaultRemoved.name and key in open_:
            spans.append((open_.pop(key), e.get("step", last), key))
    spans += [(s, last, k) for k, s in open_.items()]
    return spans


def overlay(ax: Axes, run: RunData) -> None:
    for i, (s, e, label) in enumerate(fault_spans(run)):
        ax.axvspan(s, e, color=f"C{(i + 3) % 10}", alpha=0.12,
                   label=f"fault {label}" if len(label) < 50 else "fault")
    for d in run.events_of(StragglerDetected):
        who = d.get("ranks") or d.get("link")
        ax.axvline(d.get("onset_step", d.get("step", 0)), color="red", ls="--", lw=1,
                   label=f"detected {d.get('kind')} {who}")
    for d in run.events_of(StragglerRecovered):
        ax.axvline(d.get("step", 0), color="green", ls=":", lw=1, label="recovered")
    action_lines(ax, actions(run))


def action_lines(ax: Axes, acts: list[Action], legend: bool = True) -> None:
    """A vertical line at the first step of each mitigation action, coloured by kind."""
    for a in acts:
        color, label = ACTION_STYLE[a.kind]
        ax.axvline(a.step, color=color, lw=1.2, alpha=0.85, label=label if legend else None)


def _legend(ax: Axes) -> None:
    handles, labels = ax.get_legend_handles_labels()
    seen: dict[str, object] = {}
    for h, lab in zip(handles, labels, strict=True):
        seen.setdefault(lab, h)
    if seen:
        ax.legend(seen.values(), seen.keys(), fontsize=7, loc="best")


def _subplots(*grid: int, figsize: tuple[float, float], **kw: Any) -> tuple[Figure, Any]:
    """``plt.subplots`` without pyplot: a Figure on its own Agg canvas (freed with it)."""
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(*grid, **kw)


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return path


def plot_loss(run: RunData, out: Path) -> Path | None:
    if not run.metrics:
        return None
    fig, ax = _subplots(figsize=(7, 3.6))
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
    fig, axes = _subplots(2, 1, figsize=(7, 5.2), sharex=True)
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
    lines = [m for m in run.metrics if m.get("compute_time") is not None]
    # ranks that compute different amounts of work (a mitigation plan, an uneven split) are
    # compared per micro-batch
    per_mb = all(isinstance(m.get("micro_batches"), int) and m["micro_batches"] > 0
                 for m in lines) and len({m["micro_batches"] for m in lines}) > 1
    by_host = rows_by_host(lines)
    table: dict[int, dict[int, float]] = {}
    for m in lines:
        key = m["host"] if by_host else m["rank"]
        table.setdefault(m["step"], {})[key] = float(m["compute_time"]) / (
            m["micro_batches"] if per_mb else 1)
    rows = sorted({k for row in table.values() for k in row})
    if len(rows) < 2 or not table:
        return None
    import numpy as np

    steps = sorted(table)
    grid = np.full((len(rows), len(steps)), np.nan)
    for j, s in enumerate(steps):
        row = table[s]
        med = float(np.median(list(row.values()))) or 1e-9
        for i, r in enumerate(rows):
            if r in row:
                grid[i, j] = row[r] / med
    fig, ax = _subplots(figsize=(7, 0.5 * len(rows) + 1.6))
    im = ax.imshow(grid, aspect="auto", cmap="coolwarm", vmin=0.5, vmax=2.0, interpolation="none",
                   extent=(steps[0] - 0.5, steps[-1] + 0.5, len(rows) - 0.5, -0.5))
    ax.set_yticks(range(len(rows)), [f"{'host' if by_host else 'rank'} {r}" for r in rows])
    ax.set_xlabel("step")
    what = "Compute time per micro-batch" if per_mb else "Compute time"
    ax.set_title(f"{what} / median over ranks (red = slower than its peers)")
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
    fig, ax = _subplots(figsize=(6, 3))
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
    if has_mitigation(run):
        return plot_timeline(run, out)
    fig, ax = _subplots(figsize=(7, 3.4))
    ax.plot(steps, [t * 1000 for t in times], lw=1, color="k",
            label="iteration time (slowest rank)")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.set_title("Iteration time, injected faults (shaded) and detections")
    overlay(ax, run)
    _legend(ax)
    return _save(fig, out / "iteration.png")


def _detections(ax: Axes, run: RunData) -> None:
    """Detections as markers near the top of the axes: a bar from the onset the detector
    estimated to the step it reported (its latency), a triangle at the report."""
    tr = blended_transform_factory(ax.transData, ax.transAxes)
    for d in run.events_of(StragglerDetected, SlowdownUnexplained):
        found = d.get("step")
        if not isinstance(found, int):
            continue
        onset = d.get("onset_step", found)
        known = d["event"] == StragglerDetected.name
        color = "red" if known else "0.45"
        ranks, link = d.get("ranks"), d.get("link")
        who = (f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}" if ranks
               else f"link {'-'.join(map(str, link))}" if isinstance(link, list) else "")
        label = (f"detected {d.get('kind')} {who} (bar: onset to report)" if known
                 else "slowdown, no culprit found")
        ax.plot([onset, found], [0.965, 0.965], color=color, lw=2.5, transform=tr,
                solid_capstyle="butt")
        ax.plot([found], [0.965], marker="v", ms=7, color=color, transform=tr, ls="none",
                label=label)
    for d in run.events_of(StragglerRecovered):
        if isinstance(d.get("step"), int):
            ax.plot([d["step"]], [0.965], marker="^", ms=7, color="green", transform=tr,
                    ls="none", label="straggler recovered")


def _action_labels(ax: Axes, acts: list[Action], span: float) -> None:
    """Each action's label along its line (vertical, inside the axes); actions closer than
    2% of the x range share one label, one column per action."""
    tr = blended_transform_factory(ax.transData, ax.transAxes)
    groups: list[list[Action]] = []
    for a in acts:
        if groups and a.step - groups[-1][-1].step < 0.02 * span:
            groups[-1].append(a)
        else:
            groups.append([a])
    for g in groups:
        ax.text(g[0].step - 0.004 * span, 0.91, "\n".join(a.label for a in g), rotation=90,
                va="top", ha="right", fontsize=7, color=ACTION_STYLE[g[0].kind][0],
                transform=tr, bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.7,
                                    "pad": 0.5})


def _plan_panel(ax: Axes, run: RunData) -> bool:
    """Heat map of the micro-batches per step, one row per host (or rank), the count written
    on each stretch of steps that is wide enough; False when the metrics lack the counts."""
    import numpy as np
    from matplotlib.colors import Normalize

    grid = plan_grid(run)
    if grid is None:
        return False
    data = np.array(grid.counts, dtype=float)
    lo, hi = float(np.nanmin(data)), float(np.nanmax(data))
    cmap = matplotlib.colormaps["YlGnBu"].with_extremes(bad="#e6e6e6")
    norm = Normalize(vmin=lo - 1.0, vmax=hi + 0.5)  # the smallest count stays legible
    s0, s1 = grid.steps[0], grid.steps[-1]
    ax.imshow(np.ma.masked_invalid(data), aspect="auto", cmap=cmap, norm=norm,
              interpolation="none", extent=(s0 - 0.5, s1 + 0.5, len(grid.rows) - 0.5, -0.5))
    ax.set_yticks(range(len(grid.rows)), grid.row_labels, fontsize=8)
    min_run = max(0.035 * len(grid.steps), 1)
    for i, row in enumerate(data):
        j = 0
        while j < len(row):
            k = j
            while k + 1 < len(row) and (row[k + 1] == row[j] or
                                        (np.isnan(row[k + 1]) and np.isnan(row[j]))):
                k += 1
            if k - j + 1 >= min_run:
                x = (grid.steps[j] + grid.steps[k]) / 2
                if np.isnan(row[j]):
                    ax.text(x, i, "not running", ha="center", va="center", fontsize=7,
                            color="0.35")
                else:
                    r, g, b, _ = cmap(norm(row[j]))
                    dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5
                    ax.text(x, i, f"{row[j]:.0f}", ha="center", va="center", fontsize=8,
                            color="white" if dark else "black", fontweight="bold")
            j = k + 1
    ax.set_title("Micro-batches computed per step (the plan in force; grey: not running)",
                 fontsize=9)
    return True


def plot_timeline(run: RunData, out: Path) -> Path | None:
    """Iteration time with faults, detections and mitigation actions, above the micro-batch
    counts per host or rank: what happened, what stalwart saw, what it did, what it cost."""
    import numpy as np

    steps, times = run.iteration_times()
    grid = plan_grid(run)
    n_rows = len(grid.rows) if grid is not None else 0
    acts = actions(run)
    if n_rows:
        fig, (ax, axp) = _subplots(
            2, 1, figsize=(7.5, 3.6 + 0.3 * n_rows + 0.7), sharex=True,
            gridspec_kw={"height_ratios": [3.6, 0.3 * n_rows + 0.5]})
    else:
        fig, ax = _subplots(figsize=(7.5, 3.8))
        axp = None
    ms = [t * 1000 for t in times]
    ax.plot(steps, ms, lw=1, color="k", label="iteration time (slowest rank)")
    # room above the curve for the markers and labels; a restart's long step is clipped
    ax.set_ylim(0, float(np.percentile(ms, 98)) * 1.7 or 1.0)
    for i, (s, e, label) in enumerate(fault_spans(run)):
        ax.axvspan(s, e, color=f"C{(i + 3) % 10}", alpha=0.13,
                   label=f"fault {label}" if len(label) < 50 else "fault")
    _detections(ax, run)
    action_lines(ax, acts)
    span = max(steps[-1] - steps[0], 1)
    _action_labels(ax, acts, span)
    ax.set_ylabel("ms")
    fig.suptitle("Iteration time: injected faults (shaded), detections (\u25bc), "
                 "mitigation actions (lines)", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    seen: dict[str, object] = {}
    for h, lab in zip(handles, labels, strict=True):
        seen.setdefault(lab, h)
    # above the axes: the curve, the markers and the labels keep the whole plot area
    ax.legend(seen.values(), seen.keys(), fontsize=7, loc="lower left", ncol=2,
              bbox_to_anchor=(0.0, 1.01, 1.0, 0.1), mode="expand", frameon=False)
    if axp is not None:
        _plan_panel(axp, run)
        action_lines(axp, acts, legend=False)
        axp.set_xlabel("step")
    else:
        ax.set_xlabel("step")
    ax.set_xlim(steps[0] - 0.5, steps[-1] + 0.5)
    return _save(fig, out / "iteration.png")


def plot_extra(run: RunData, out: Path, key: str, title: str, fname: str,
               scale: float = 1.0, unit: str = "") -> Path | None:
    """One line per rank for a capability's own metric (e.g. drift, pkts_lost, comm_hidden)."""
    if not any(key in m for m in run.metrics):
        return None
    fig, ax = _subplots(figsize=(7, 3))
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
