"""The simulation's run directory page: figures, plots (JCT per policy and scale, step-time
timelines, decision cost against ranks), calibration table. matplotlib's object API (no
pyplot state touched), as report/plots.py."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from stalwart.rundir import atomic_write_text

COLORS = {"healthy": "#1b9e77", "none": "#d95f02", "rebalance": "#7570b3",
          "exclude": "#e7298a", "auto": "#66a61e"}


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_jct(scales: dict[str, dict[str, float]], out: Path) -> Path | None:
    """Grouped bars: JCT (hours) per policy at each scale."""
    if not scales:
        return None
    fig = Figure(figsize=(8, 4))
    ax = fig.add_subplot()
    names = [n for n in COLORS if any(n in v for v in scales.values())]
    width = 0.8 / max(len(names), 1)
    for i, n in enumerate(names):
        xs = [k + i * width for k in range(len(scales))]
        ax.bar(xs, [v.get(n, 0.0) for v in scales.values()], width, label=n,
               color=COLORS[n])
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(scales))], list(scales))
    ax.set_ylabel("job completion time (h)")
    ax.set_title("same job, same faults: JCT without mitigation, per rung, full policy")
    ax.legend(fontsize=8)
    return _save(fig, out)


def plot_timeline(timelines: dict[str, list[tuple[float, float]]], faults: list[dict],
                  title: str, out: Path) -> Path | None:
    if not timelines:
        return None
    fig = Figure(figsize=(9, 3.6))
    ax = fig.add_subplot()
    for f in faults:
        if f.get("kind") == "stop" or f.get("end_s") is None:
            continue
        ax.axvspan(f["start_s"] / 3600, f["end_s"] / 3600, color="#fbb4ae", alpha=0.25, lw=0)
    for name, pts in timelines.items():
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=0.6, label=name,
                    color=COLORS.get(name))
    ax.set_xlabel("simulated clock (h); shaded: fail-slows")
    ax.set_ylabel("step time (s)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, out)


def plot_cost(rows: list[dict[str, Any]], out: Path) -> Path | None:
    if not rows:
        return None
    fig = Figure(figsize=(9, 3.6))
    a1, a2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for variant, style in (("before", "o--"), ("after", "s-")):
        rs = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["ranks"])
        if not rs:
            continue
        n = [r["ranks"] for r in rs]
        a1.plot(n, [r["ms_median"] for r in rs], style, label=f"{variant}: median")
        a1.plot(n, [r["ms_max"] for r in rs], style, alpha=0.5, label=f"{variant}: max")
        a2.plot(n, [r["pauses_per_1000_steps"] for r in rs], style, label=variant)
    for a in (a1, a2):
        a.set_xscale("log")
        a.set_xlabel("ranks")
        a.legend(fontsize=8)
    a1.set_yscale("log")
    a1.set_ylabel("rank 0 decision CPU per step (ms)")
    a2.set_ylabel("validation pauses per 1,000 clean steps")
    return _save(fig, out)


def write_page(run_dir: Path, figures: dict[str, Any], calib: list[dict[str, Any]],
               plots: list[tuple[str, Path]], command: str) -> Path:
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(json.dumps(v))}</td></tr>"
                   for k, v in figures.items())
    cal = "".join(f"<tr><td>{html.escape(r['case'])}</td><td>{r['kind']}</td>"
                  f"<td>{r['measured_s']}</td><td>{r['predicted_s']}</td>"
                  f"<td>{r['error']:+.3f}</td></tr>" for r in calib)
    imgs = "".join(f"<h2>{html.escape(t)}</h2><img src='{p.name}' alt='{html.escape(t)}'>"
                   for t, p in plots)
    page = f"""<!doctype html><html><head><meta charset="utf-8">
<title>stalwart simulate {html.escape(run_dir.name)}</title>
<style>body{{font-family:sans-serif;max-width:960px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;margin:.5em 0}}th,td{{border:1px solid #ccc;padding:2px 8px;
text-align:left;font-size:13px}}img{{max-width:100%}}</style></head><body>
<h1>stalwart simulate <code>{html.escape(run_dir.name)}</code></h1>
<p><code>{html.escape(command)}</code></p>
{imgs}
<h2>Figures</h2><table><tr><th>figure</th><th>value</th></tr>{rows}</table>
<h2>Calibration against the testbed</h2>
<table><tr><th>case</th><th></th><th>measured (s)</th><th>predicted (s)</th><th>error</th></tr>
{cal}</table>
</body></html>
"""
    out = run_dir / "report.html"
    atomic_write_text(out, page)
    return out
