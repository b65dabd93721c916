"""What mitigation did in a run, read from its run directory (for the plots and the HTML).

Records (written by stalwart.mitigate and the launcher; see docs/mitigate.md):

- metrics.jsonl: ``micro_batches`` (micro-batches this rank computed this step),
  ``plan_version`` (0 = the uniform plan) and ``host`` (the testbed host of the rank; may be
  absent).
- events.jsonl: ``mitigation_applied`` (step, strategy "rebalance" | "exclude_host" |
  "restore_host", plan, version, predicted_gain, reason, target, decided_step),
  ``mitigation_reverted`` (step, strategy, version, reason), ``mitigation_measured`` (step,
  version, strategy, predicted_gain, measured_gain, step_time_before, step_time_after) and
  ``restart`` (step, nproc, hosts, reason); ``rank_lost`` (launcher: step, rank, host,
  exit_code, error) and ``regroup`` (the new rank 0: step, generation, world, members, hosts,
  lost, regroup_s) for a rank that died in a job that regroups in place; ``regroup_failed``
  (launcher: step, generation, reason, fallback "restart" | "none", hosts, resume_step) when
  an in-place regroup failed and the job fell back to a checkpoint-and-relaunch.

A run without any of these has no mitigation: every function here then returns an empty result
and the report looks as it did before mitigation existed.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any

from stalwart.events import (
    Event,
    HostProbed,
    MitigationApplied,
    MitigationMeasured,
    MitigationReverted,
    RankLost,
    Regroup,
    RegroupFailed,
    Restart,
)
from stalwart.rundir import RunData

MITIGATION_EVENTS: tuple[type[Event], ...] = (
    MitigationApplied, MitigationReverted, MitigationMeasured, Restart, HostProbed, RankLost,
    Regroup, RegroupFailed)
ACTIONS = (MitigationApplied, MitigationReverted, Restart, Regroup)
AROUND = 10  # steps before a lost rank and after its regroup whose step time the table shows


def has_mitigation(run: RunData) -> bool:
    """Whether the run shows any mitigation: one of its events, a plan version above 0, or a
    rank whose micro-batch count changed during the run (a static uneven split, e.g. 18
    micro-batches over 4 ranks, is not mitigation)."""
    if run.events_of(*MITIGATION_EVENTS):
        return True
    seen: dict[int, int] = {}
    for m in run.metrics:
        if (m.get("plan_version") or 0) > 0:
            return True
        n = m.get("micro_batches")
        if isinstance(n, int) and seen.setdefault(m["rank"], n) != n:
            return True
    return False


@dataclass
class Action:
    """One mitigation action on the step timeline."""

    step: int
    kind: str  # "rebalance" | "revert" | "host" (a restart without / with a host)
    label: str


def actions(run: RunData) -> list[Action]:
    """The actions in step order: plan switches, reverts and restarts (a restart at the step of
    the host action that caused it is that action's, not a second one)."""
    out: list[Action] = []
    host_steps = set()
    straggler = None  # the target of the plan in force: its replans get a short label
    for e in run.events_of(*ACTIONS):
        step = e.get("step")
        if not isinstance(step, int):
            continue
        ev, strategy, version = e["event"], e.get("strategy"), e.get("version")
        if ev == MitigationApplied.name and strategy == "rebalance":
            target = e.get("target", "")
            out.append(Action(step, "rebalance", f"v{version} replan" if target == straggler
                              else f"v{version} rebalance {target}"))
            straggler = target
            continue
        straggler = None
        if ev == MitigationApplied.name:
            verb = {"exclude_host": "exclude", "restore_host": "restore"}.get(str(strategy),
                                                                             str(strategy))
            out.append(Action(step, "host", f"v{version} {verb} {e.get('target', '')}"))
            host_steps.add(step)
        elif ev == MitigationReverted.name:
            out.append(Action(step, "revert", f"v{version} uniform"))
        elif ev == Regroup.name:
            out.append(Action(step, "host", f"regroup on {e.get('world', '?')} ranks"))
    for e in run.events_of(Restart):
        step = e.get("step")
        if isinstance(step, int) and step not in host_steps:
            out.append(Action(step, "host", f"restart on {e.get('nproc', '?')} hosts"))
    return sorted(out, key=lambda a: a.step)


@dataclass
class PlanGrid:
    """Micro-batch counts per step: rows (hosts, or ranks when hosts are unknown) x steps."""

    steps: list[int]
    rows: list[int]
    by_host: bool
    counts: list[list[float]]  # counts[row][step index]; nan where the row did not run

    @property
    def row_labels(self) -> list[str]:
        return [f"{'host' if self.by_host else 'rank'} {r}" for r in self.rows]


def rows_by_host(lines: list[dict[str, Any]]) -> bool:
    """Whether metrics lines can be laid out one row per host: every line names its host and
    no two ranks share a host at a step (then a host's row stays put when a restart renumbers
    the ranks, and an excluded host's row is empty)."""
    if not lines or not all(isinstance(m.get("host"), int) for m in lines):
        return False
    if all(m["host"] == m["rank"] for m in lines):
        return False  # the same rows either way: keep the usual "rank r" labels
    return len({(m["step"], m["host"]) for m in lines}) == len({(m["step"], m["rank"])
                                                                 for m in lines})


def plan_grid(run: RunData) -> PlanGrid | None:
    """Per-step micro-batch counts, one row per host when every line names a distinct host
    (rows stay put when a restart renumbers the ranks), else one row per rank; None when the
    metrics lack ``micro_batches``."""
    lines = [m for m in run.metrics if isinstance(m.get("micro_batches"), int)]
    if not lines:
        return None
    by_host = rows_by_host(lines)
    cell: dict[tuple[int, int], tuple[float, int]] = {}  # (row, step) -> (time, count)
    for m in lines:
        key = (m["host"] if by_host else m["rank"], m["step"])
        t = float(m.get("time", 0.0))
        if key not in cell or t >= cell[key][0]:  # a step run again after a restart: the last
            cell[key] = (t, m["micro_batches"])
    steps = sorted({s for _, s in cell})
    rows = sorted({r for r, _ in cell})
    col = {s: j for j, s in enumerate(steps)}
    row_of = {r: i for i, r in enumerate(rows)}
    counts = [[math.nan] * len(steps) for _ in rows]
    for (r, s), (_, n) in cell.items():
        counts[row_of[r]][col[s]] = float(n)
    return PlanGrid(steps, rows, by_host, counts)


def summary_row(run: RunData) -> str | None:
    """One summary line, e.g. "3 rebalances, 1 revert; measured gains 17% to 45%"; None when
    the run has no mitigation events."""
    if not run.events_of(*MITIGATION_EVENTS):
        return None
    strategies = [e.get("strategy") for e in run.events_of(MitigationApplied)]
    parts = []
    for n, what in ((strategies.count("rebalance"), "rebalance"),
                    (strategies.count("exclude_host"), "host exclusion"),
                    (strategies.count("restore_host"), "host restore"),
                    (len(run.events_of(MitigationReverted)), "revert"),
                    (len(run.events_of(Restart)), "restart"),
                    (len(run.events_of(RankLost)), "rank lost"),
                    (len(run.events_of(Regroup)), "in-place regroup"),
                    (len(run.events_of(RegroupFailed)), "failed regroup")):
        if n:
            plural = ("ranks lost" if what == "rank lost" else f"{what}s") if n > 1 else what
            parts.append(f"{n} {plural}")
    gains = [float(e["measured_gain"]) for e in run.events_of(MitigationMeasured)
             if e.get("strategy") != "revert" and isinstance(e.get("measured_gain"), int | float)]
    text = ", ".join(parts) or "no action"
    if gains:
        lo, hi = min(gains), max(gains)
        text += (f"; measured gain {lo:.0%}" if lo == hi else
                 f"; measured gains {lo:.0%} to {hi:.0%}")
    return text


def _pct(x: Any) -> str:
    return f"{float(x):.0%}" if isinstance(x, int | float) else ""


def _plan(e: dict[str, Any]) -> str:
    plan = e.get("plan") if e["event"] != Restart.name else e.get("hosts")
    if not isinstance(plan, list):
        return ""
    text = "[" + " ".join(str(x) for x in plan) + "]"
    host_list = e["event"] == Restart.name or e.get("strategy") in ("exclude_host", "restore_host")
    return f"hosts {text}" if host_list else text


def step_time_around(run: RunData, lost_step: int, back_step: int) -> tuple[float | None,
                                                                            float | None]:
    """Median step time (the slowest rank's, per step) over the ``AROUND`` steps before a
    rank was lost and the ``AROUND`` steps after the regroup's first one (which warms up)."""
    per: dict[int, float] = {}
    for m in run.metrics:
        s, t = m.get("step"), m.get("step_time")
        if isinstance(s, int) and isinstance(t, int | float):
            per[s] = max(per.get(s, 0.0), float(t))

    def med(steps: range) -> float | None:
        xs = sorted(per[s] for s in steps if s in per)
        return xs[len(xs) // 2] if xs else None

    return (med(range(lost_step - AROUND, lost_step)),
            med(range(back_step + 1, back_step + 1 + AROUND)))


def _regroup_cells(run: RunData, e: dict[str, Any]) -> tuple[str, str, str]:
    """(plan, target, measured) cells of a rank_lost / regroup row."""
    if e["event"] == RankLost.name:
        return "", f"rank {e.get('rank')} (host {e.get('host')})", ""
    lost = [x.get("step") for x in run.events_of(RankLost)
            if isinstance(x.get("step"), int) and x["step"] <= e.get("step", 0) + 1]
    before, after = step_time_around(run, max(lost) if lost else e["step"], e["step"])
    measured = f"regroup {e.get('regroup_s', '?')} s"
    if before is not None and after is not None:
        measured += f" ({before * 1000:.0f} &rarr; {after * 1000:.0f} ms/step)"
    hosts = e.get("hosts") or []
    return ("hosts [" + " ".join(map(str, hosts)) + "]", f"without {e.get('lost')}", measured)


def _failed_row(e: dict[str, Any]) -> str:
    """The table row of a failed in-place regroup and its fallback."""
    hosts = "hosts [" + " ".join(map(str, e.get("hosts") or [])) + "]"
    done = (f"relaunched from step {e.get('resume_step')}" if e.get("fallback") == "restart"
            else "no fallback: the job stopped")
    cells = (str(e.get("step", "")), "", "regroup_failed", f"fallback: {e.get('fallback')}",
             hosts, f"generation {e.get('generation')}", "", done, str(e.get("reason", "")))
    return "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>"


def table_html(run: RunData) -> str:
    """The mitigation events as an HTML table ("" when the run has none)."""
    events = run.events_of(*MITIGATION_EVENTS)
    if not events:
        return ""
    head = ("<tr><th>step</th><th>decided</th><th>event</th><th>strategy</th><th>plan</th>"
            "<th>target</th><th>predicted gain</th><th>measured gain</th><th>reason</th></tr>")
    rows = []
    for e in events:
        measured = ""
        if e["event"] == MitigationMeasured.name:
            measured = _pct(e.get("measured_gain"))
            before, after = e.get("step_time_before"), e.get("step_time_after")
            if isinstance(before, int | float) and isinstance(after, int | float):
                measured += f" ({before * 1000:.0f} &rarr; {after * 1000:.0f} ms/step)"
        version = f" v{e['version']}" if e.get("version") is not None else ""
        if e["event"] == RegroupFailed.name:
            rows.append(_failed_row(e))
            continue
        if e["event"] in ("rank_lost", "regroup"):
            plan, target, measured = _regroup_cells(run, e)
            reason = e.get("error", "") if e["event"] == RankLost.name else (
                f"generation {e.get('generation')}: {e.get('world')} ranks, same global batch")
            rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in (
                html.escape(str(e.get("step", ""))), "", html.escape(e["event"]),
                "in place" if e["event"] == Regroup.name else "", html.escape(plan),
                html.escape(target), "", measured, html.escape(str(reason or "")))) + "</tr>")
            continue
        cells = [
            html.escape(str(e.get("step", ""))), html.escape(str(e.get("decided_step", ""))),
            html.escape(e["event"].removeprefix("mitigation_")),
            html.escape(f"{e.get('strategy') or ''}{version}"), html.escape(_plan(e)),
            html.escape(str(e.get("target", e.get("host", "")))),
            _pct(e.get("predicted_gain")), measured, html.escape(str(e.get("reason", ""))),
        ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f"<table class='mitigation'>{head}{''.join(rows)}</table>"
