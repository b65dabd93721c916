"""Builds report.html: a summary, the event log, mitigation's actions and the plots of one run
directory (a ``--script`` run's page comes from report/script.py)."""

from __future__ import annotations

import html
import json
from pathlib import Path

from stalwart.events import (
    FaultApplied,
    FaultRemoved,
    Halted,
    OverlapPlan,
    RankFailed,
    Resumed,
    RunFinished,
    SlowdownUnexplained,
    StragglerDetected,
    StragglerRecovered,
)
from stalwart.report import mitigation, script
from stalwart.report.plots import all_plots
from stalwart.rundir import RunData, atomic_write_text

SHOWN_EVENTS = (FaultApplied, FaultRemoved, StragglerDetected, StragglerRecovered,
                SlowdownUnexplained, OverlapPlan, *mitigation.MITIGATION_EVENTS, RankFailed,
                Resumed, Halted, RunFinished)


def summary(run: RunData) -> dict[str, object]:
    """The headline figures of a run, as label -> text."""
    steps = max((m["step"] for m in run.metrics), default=-1) + 1
    v0, v1 = run.initial_val_loss(), run.final_val_loss()
    out: dict[str, object] = {
        "ranks": len(run.ranks), "steps": steps,
        "initial val loss": f"{v0:.4f}" if v0 is not None else "-",
        "final val loss": f"{v1:.4f}" if v1 is not None else "-",
        "tokens/s (job)": f"{run.total_tokens_per_s():,.0f}",
    }
    if v0 and v1 is not None:
        out["val loss reduction"] = f"{(1 - v1 / v0) * 100:.1f}%"
    if run.metrics:
        comp = sum(m["compute_time"] for m in run.metrics)
        comm = sum(m["comm_time"] for m in run.metrics)
        out["communication share"] = f"{comm / max(comp + comm, 1e-12) * 100:.1f}%"
    mit = mitigation.summary_row(run)
    if mit is not None:
        out["mitigation"] = mit
    return out


def _table(rows: dict[str, object]) -> str:
    body = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
                   for k, v in rows.items())
    return f"<table>{body}</table>"


def build_report(run_dir: str | Path) -> Path:
    """(Re)build run_dir/report.html and its PNGs; returns the report's path."""
    run = RunData.load(run_dir)
    if script.is_script_run(run):
        # a user's script: no metrics.jsonl; the monitor's iterations and the events instead
        out = run.path / "report.html"
        atomic_write_text(out, script.build_page(run))
        return out
    plots = all_plots(run, run.path)
    events = run.events_of(*SHOWN_EVENTS)
    ev_rows = "".join(
        f"<tr><td>{e.get('step', '')}</td><td>{html.escape(e['event'])}</td>"
        f"<td><code>{html.escape(json.dumps({k: v for k, v in e.items() if k not in ('event', 'time', 'step')}))}</code></td></tr>"  # noqa: E501
        for e in events
    )
    figs = "".join(f"<h2>{html.escape(t)}</h2><img src='{p.name}' alt='{html.escape(t)}'>"
                   for t, p in plots)
    cfg = {k: v for k, v in run.config.items() if v not in (None, [], False)}
    mit_table = mitigation.table_html(run)
    mit = (f"<h2>Mitigation</h2><p>Gains are the fraction of step time saved: predicted when "
           f"the action was decided, measured a few steps after it started (median step time "
           f"before and after).</p>{mit_table}") if mit_table else ""
    page = f"""<!doctype html><html><head><meta charset="utf-8">
<title>stalwart run {html.escape(run.path.name)}</title>
<style>body{{font-family:sans-serif;max-width:900px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;margin:.5em 0}}th,td{{border:1px solid #ccc;padding:2px 8px;
text-align:left;font-size:13px}}img{{max-width:100%}}code{{font-size:11px}}</style></head><body>
<h1>stalwart run <code>{html.escape(run.path.name)}</code></h1>
<h2>Summary</h2>{_table(summary(run))}
<h2>Configuration</h2>{_table(cfg)}
<h2>Events</h2><table><tr><th>step</th><th>event</th><th>details</th></tr>{ev_rows}</table>
{mit}
{figs}
</body></html>
"""
    out = run.path / "report.html"
    atomic_write_text(out, page)
    return out
