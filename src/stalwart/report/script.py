"""The report of a ``stalwart run --script`` run: a user's script has no metrics.jsonl.

What the page is built from: events.jsonl (the testbed's ground truth, the monitor's findings,
the launcher's start, end and failures), iterations.jsonl (each iteration the monitor counted,
per rank, with ``--detect``) and logs/rank-R.log. Everything is placed on one clock, seconds
since the run started -- the clock fault windows in seconds count on -- so a shaded fault, the
iteration times it caused and the finding it produced line up without any step counter. The
page has: a summary (outcome, the failing rank, iteration time during each fault relative to
the fault-free median), the timeline plot, ground truth against findings (which fault each
finding explains, which fault nothing found), the events, and the end of each rank's log.
A run without ``--detect`` gets the same page without iteration times.
"""

from __future__ import annotations

import html
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import blended_transform_factory

from stalwart.events import (
    FaultApplied,
    FaultRemoved,
    RankFailed,
    RunFinished,
    RunStarted,
    SlowdownUnexplained,
    StragglerDetected,
    StragglerRecovered,
)
from stalwart.rundir import ITERATIONS, LOGS, RunData, read_jsonl

DPI = 110
LOG_TAIL = 12  # lines of each rank's log on the page


def is_script_run(run: RunData) -> bool:
    return bool(run.config.get("script")) or (
        not run.metrics and (run.path / ITERATIONS).exists())


@dataclass
class Span:
    """One injected fault on the run's clock (seconds since the start)."""

    spec: str
    kind: str
    start: float
    end: float | None  # None: still on when the run ended (no fault_removed)
    rank: int | None
    hosts: list[int]
    achieved: float | None = None  # a CPU fault's measured factor (fault_removed)


class ScriptRun:
    """A script run's data on one clock: t = seconds since run_started."""

    def __init__(self, run: RunData) -> None:
        self.run = run
        started = run.events_of(RunStarted)
        times = [e["time"] for e in run.events if isinstance(e.get("time"), (int, float))]
        self.t0 = started[0]["time"] if started else min(times, default=0.0)
        finished = run.events_of(RunFinished)
        self.t_end = finished[-1]["time"] - self.t0 if finished else (
            max(times, default=self.t0) - self.t0)
        self.iterations = read_jsonl(run.path / ITERATIONS)
        self.spans = self._spans()

    def t(self, wall: float) -> float:
        return wall - self.t0

    def _spans(self) -> list[Span]:
        open_: dict[str, Span] = {}
        out: list[Span] = []
        for e in self.run.events_of(FaultApplied, FaultRemoved):
            spec = str(e.get("spec") or e.get("kind"))
            if e["event"] == FaultApplied.name:
                open_[spec] = Span(spec, str(e.get("kind")), self.t(e["time"]), None,
                                   e.get("rank"), list(e.get("hosts") or []))
            elif spec in open_:
                s = open_.pop(spec)
                s.end = self.t(e["time"])
                if isinstance(e.get("achieved_factor"), (int, float)):
                    s.achieved = float(e["achieved_factor"])
                out.append(s)
        return sorted(out + list(open_.values()), key=lambda s: s.start)

    def series(self, rank: int, key: str = "step_time") -> tuple[list[float], list[float]]:
        """(t, value) of one rank's iterations, in the order the monitor counted them."""
        rows = sorted((m for m in self.iterations if m.get("rank") == rank),
                      key=lambda m: m["time"])
        return [self.t(m["time"]) for m in rows], [float(m.get(key) or 0.0) for m in rows]

    @property
    def ranks(self) -> list[int]:
        return sorted({int(m["rank"]) for m in self.iterations if "rank" in m})

    def iteration_time(self, rank0_step: int) -> float | None:
        """When rank 0's iteration `rank0_step` began (the monitor's onset_step is one)."""
        for m in self.iterations:
            if m.get("rank") == 0 and m.get("step") == rank0_step:
                return self.t(m["time"] - float(m.get("step_time") or 0.0))
        return None

    def slowdown(self, span: Span) -> float | None:
        """Median rank-0 iteration time inside the fault over the median outside all faults."""
        ts, vs = self.series(0)
        if not ts:
            return None

        def inside(t: float, s: Span) -> bool:
            return s.start <= t and (s.end is None or t < s.end)

        during = [v for t, v in zip(ts, vs, strict=True) if inside(t, span)]
        clean = [v for t, v in zip(ts, vs, strict=True)
                 if not any(inside(t, s) for s in self.spans)]
        if len(during) < 3 or len(clean) < 3:
            return None
        return statistics.median(during) / max(statistics.median(clean), 1e-12)


def explains(finding: dict[str, Any], span: Span) -> bool:
    """Whether a finding names what the fault did: its rank (compute, contention), its host's
    link (link, loss on one host), its pair of hosts (pairlink)."""
    kind, ranks = finding.get("kind"), set(finding.get("ranks") or [])
    link = set(finding.get("link") or [])
    if span.kind in ("compute", "contention"):
        return kind == "compute" and span.rank in ranks
    if span.kind == "pairlink":
        return kind == "link" and set(span.hosts) == link
    if span.kind in ("link", "loss") and len(span.hosts) == 1:
        host = (finding.get("evidence") or {}).get("host")
        if host is not None:  # named as a host (several ranks per host: hostlink.py)
            return kind == "link" and str(host) == str(span.hosts[0])
        return kind == "link" and (span.hosts[0] in ranks or (not ranks and
                                                              span.hosts[0] in link))
    return False


def running_median(xs: list[float], window: int = 9) -> list[float]:
    """The median of each sample's centred window (shorter at the ends)."""
    h = window // 2
    return [statistics.median(xs[max(0, i - h):i + h + 1]) for i in range(len(xs))]


def _who(e: dict[str, Any]) -> str:
    """"rank 2", "link 1-2", or "rank 1's link (pair 1-2)" when several slow pairs share
    rank 1 (its host's own link)."""
    ranks, link = e.get("ranks") or [], e.get("link")
    pair = "-".join(map(str, link)) if isinstance(link, list) else ""
    who = f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}" if ranks else ""
    host = (e.get("evidence") or {}).get("host")
    if e.get("kind") == "link" and host is not None:
        return f"host {host}'s link ({who})"
    if e.get("kind") == "link" and ranks:
        return f"{who}'s link" + (f" (pair {pair})" if pair else "")
    return who or (f"link {pair}" if pair else "-")


def plot_timeline(sr: ScriptRun, out: Path) -> Path:
    """Top: rank 0's iteration time; below: every rank's compute time (a throttled rank stands
    out); on both, faults shaded, findings marked (bar: onset to decision)."""
    ranks = sr.ranks
    rows = 2 if ranks else 1
    fig = Figure(figsize=(9.5, 3.4 * rows))
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    if ranks:
        # raw samples faint, their running median bold: single iterations are noisy on
        # shared cores, a fault moves the median
        ts, vs = sr.series(0)
        ax.plot(ts, [v * 1000 for v in vs], lw=0.6, color="k", alpha=0.3)
        ax.plot(ts, [v * 1000 for v in running_median(vs)], lw=1.4, color="k",
                label="iteration time, rank 0 (monitor; running median)")
        ax.set_ylabel("ms")
        axc = axes[1]
        for r in ranks:
            ts, vs = sr.series(r, "compute_time")
            axc.plot(ts, [v * 1000 for v in vs], lw=0.5, color=f"C{r % 10}", alpha=0.25)
            axc.plot(ts, [v * 1000 for v in running_median(vs)], lw=1.3, color=f"C{r % 10}",
                     label=f"rank {r} compute")
        axc.set_ylabel("ms")
        axc.set_title("Compute time per iteration, by rank (monitor)", fontsize=9)
    else:
        ax.set_yticks([])
        ax.text(0.5, 0.5, "no iteration times: run with --detect to have the monitor "
                "count them", ha="center", va="center", transform=ax.transAxes, fontsize=9,
                color="0.4")
    for a in axes:
        for i, s in enumerate(sr.spans):
            a.axvspan(s.start, s.end if s.end is not None else sr.t_end,
                      color=f"C{(i + 3) % 10}", alpha=0.15, label=f"fault {s.spec}")
        for e in sr.run.events_of(RankFailed):
            a.axvline(sr.t(e["time"]), color="k", lw=1.2, ls="-.",
                      label=f"rank {e.get('rank')} failed")
    tr = blended_transform_factory(ax.transData, ax.transAxes)
    for d in sr.run.events_of(StragglerDetected, SlowdownUnexplained):
        found = sr.t(d["time"])
        onset = sr.iteration_time(int(d.get("onset_step", -1)))
        known = d["event"] == StragglerDetected.name
        color = "red" if known else "0.45"
        ax.plot([onset if onset is not None else found, found], [0.95, 0.95], color=color,
                lw=2.5, transform=tr, solid_capstyle="butt")
        ax.plot([found], [0.95], marker="v", ms=7, color=color, ls="none", transform=tr,
                label=(f"detected {d.get('kind')} {_who(d)}" if known
                       else "slowdown, no culprit found"))
    for d in sr.run.events_of(StragglerRecovered):
        ax.plot([sr.t(d["time"])], [0.95], marker="^", ms=7, color="green", ls="none",
                transform=tr, label="straggler recovered")
    for a in axes:
        handles, labels = a.get_legend_handles_labels()
        seen = dict(zip(labels, handles, strict=True))
        if seen:  # beside the plot: inside it would hide the curves and markers
            a.legend(seen.values(), seen.keys(), fontsize=7, loc="upper left",
                     bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        a.set_xlim(0, max(sr.t_end, 1.0))
    axes[-1].set_xlabel("seconds since the run started")
    ax.set_title("Iteration time, injected faults (shaded) and findings (\u25bc)", fontsize=10)
    fig.tight_layout()
    path = out / "timeline.png"
    fig.savefig(path, dpi=DPI)
    return path


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def summary(sr: ScriptRun) -> dict[str, str]:
    cfg = sr.run.config
    args = " ".join(cfg.get("script_args") or [])
    out = {"script": f"{cfg.get('script')}{' ' + args if args else ''}",
           "ranks": str(cfg.get("nproc", len(sr.ranks) or "?")),
           "testbed": str(cfg.get("testbed", "?")),
           "duration": f"{sr.t_end:.1f} s"}
    fin = sr.run.events_of(RunFinished)
    failed = sr.run.events_of(RankFailed)
    if failed:
        f = failed[-1]
        out["outcome"] = f"rank {f.get('rank')} failed: {f.get('error') or 'no output'}"
    elif fin:
        out["outcome"] = "ok" if fin[-1].get("ok") else (
            f"failed ({fin[-1].get('reason') or 'exit code ' + str(fin[-1].get('exit_code'))})")
    else:
        out["outcome"] = "unknown (no run_finished event: still running or killed)"
    if sr.ranks:
        ts, vs = sr.series(0)
        out["iterations (rank 0, monitor)"] = (
            f"{len(ts)}, median {statistics.median(vs) * 1000:.1f} ms")
    else:
        out["iterations"] = "not counted (run with --detect)"
    for s in sr.spans:
        x = sr.slowdown(s)
        if x is not None:
            out[f"iteration time during {s.spec}"] = f"{x:.2f}x the fault-free median"
    found = sr.run.events_of(StragglerDetected)
    out["findings"] = str(len(found)) if sr.ranks or found else "-"
    return out



def _since_start(d: dict) -> str:
    """", slow since its first step" for a finding whose rank or link was never healthy."""
    return ", slow since its first step" if (d.get("evidence") or {}).get(
        "never_healthy") else ""

def ground_truth_html(sr: ScriptRun) -> str:
    """Each fault with the findings that explain it; then any finding no fault explains."""
    found = sr.run.events_of(StragglerDetected)
    used: set[int] = set()
    rows = []
    for s in sr.spans:
        mine = [(i, d) for i, d in enumerate(found) if explains(d, s)
                and s.start <= sr.t(d["time"])
                and (s.end is None or sr.t(d["time"]) <= s.end + 5.0)]
        used.update(i for i, _ in mine)
        end = f"{s.end:.1f}" if s.end is not None else "end of run"
        if mine:
            verdict = "; ".join(
                f"<b>found</b> {html.escape(str(d.get('kind')))} straggler: "
                f"{html.escape(_who(d))} at "
                f"{sr.t(d['time']):.1f} s ({sr.t(d['time']) - s.start:.1f} s after the "
                f"fault), x{float(d.get('severity') or 0):.2f}"
                f"{_since_start(d)}" for _, d in mine)
        elif sr.ranks:
            verdict = "not found"
        else:
            verdict = "no monitor (run with --detect)"
        got = (f"<br>achieved {s.achieved:.2f}x (the rank's compute over its peers')"
               if s.achieved is not None else "")
        rows.append([f"<code>{html.escape(s.spec)}</code>{got}", f"{s.start:.1f}", end,
                     verdict])
    for i, d in enumerate(found):
        if i not in used:
            rows.append(["(no fault)", f"{sr.t(d['time']):.1f}", "",
                         f"finding {html.escape(str(d.get('kind')))} {html.escape(_who(d))} "
                         "that no injected fault explains"])
    if not rows:
        return "<p>No faults injected and nothing found.</p>"
    return _table(["fault (ground truth)", "on at (s)", "off at (s)", "monitor"], rows)


SHOWN = (RunStarted, FaultApplied, FaultRemoved, StragglerDetected, StragglerRecovered,
         SlowdownUnexplained, RankFailed, RunFinished)


def events_html(sr: ScriptRun) -> str:
    rows = []
    for e in sr.run.events_of(*SHOWN):
        detail = {k: v for k, v in e.items()
                  if k not in ("event", "time", "step", "mechanism", "evidence")}
        rows.append([f"{sr.t(e['time']):.1f}", str(e.get("step", "")),
                     html.escape(e["event"]),
                     f"<code>{html.escape(json.dumps(detail))}</code>"])
    return _table(["t (s)", "step / iteration", "event", "details"], rows)


def logs_html(run: RunData) -> str:
    parts = []
    for log in sorted((run.path / LOGS).glob("rank-*.log"),
                      key=lambda p: int(p.stem.split("-")[1]) if p.stem[5:].isdigit() else 0):
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        tail = "\n".join(lines[-LOG_TAIL:])
        parts.append(f"<h3>{html.escape(log.name)} (last {min(len(lines), LOG_TAIL)} of "
                     f"{len(lines)} lines)</h3><pre>{html.escape(tail)}</pre>")
    return "".join(parts)


def build_page(run: RunData) -> str:
    sr = ScriptRun(run)
    plot = plot_timeline(sr, run.path)
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                   for k, v in summary(sr).items())
    return f"""<!doctype html><html><head><meta charset="utf-8">
<title>stalwart script run {html.escape(run.path.name)}</title>
<style>body{{font-family:sans-serif;max-width:900px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;margin:.5em 0}}th,td{{border:1px solid #ccc;padding:2px 8px;
text-align:left;font-size:13px}}img{{max-width:100%}}code{{font-size:11px}}
pre{{background:#f6f6f6;font-size:11px;padding:4px;overflow-x:auto}}</style></head><body>
<h1>stalwart script run <code>{html.escape(run.path.name)}</code></h1>
<h2>Summary</h2><table>{rows}</table>
<h2>Timeline</h2><p>Seconds since the run started. Iteration and compute times are the
monitor's (it counts iterations from the script's collectives); shaded: faults as the testbed
applied them (ground truth); &#9660;: the monitor's findings, the bar running from the onset
it located to its decision.</p>
<img src='{plot.name}' alt='timeline'>
<h2>Ground truth and findings</h2>{ground_truth_html(sr)}
<h2>Events</h2>{events_html(sr)}
<h2>Rank logs</h2>{logs_html(run)}
</body></html>
"""
