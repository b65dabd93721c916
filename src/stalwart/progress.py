"""The launcher's one progress display, fed by the run directory's metrics and events.

On a terminal: a live rich progress bar (step, loss, validation loss, tokens/s, the mitigation
plan in force, ETA, the latest straggler finding, fault or mitigation action). Otherwise (CI, a
pipe, a log file): a plain line roughly every 10% of the run and at least every 30 seconds, so
logs stay short but show that the job is alive, and one line per notable event.

The plan in force is read from the metrics lines (``micro_batches`` and ``plan_version`` per
rank, see stalwart.mitigate): "plan v2 [4 4 2 4]" while a non-uniform plan is active, "host 1
excluded" while the job runs without one of its hosts.
"""

from __future__ import annotations

import re
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from stalwart.config import RunConfig
from stalwart.events import (
    Eval,
    FaultApplied,
    FaultRemoved,
    MitigationApplied,
    MitigationMeasured,
    MitigationReverted,
    Restart,
    describe,
)

PLAIN_EVERY_S = 30.0
RATE_WINDOW_S = 5.0


def uniform_plan(m: int, g: int) -> list[int]:
    """The healthy plan: m micro-batches over g data-parallel ranks, the first m % g one more.

    The same split as ``stalwart.mitigate.planner.uniform`` (not imported: the display must not
    depend on the planner's numerical stack).
    """
    q, r = divmod(m, max(g, 1))
    return [q + (1 if i < r else 0) for i in range(max(g, 1))]


def _fmt_plan(counts: list[int]) -> str:
    return "[" + " ".join(str(c) for c in counts) + "]"


def _fmt_hosts(hosts: list[int]) -> str:
    return (f"host {hosts[0]}" if len(hosts) == 1
            else "hosts " + ",".join(str(h) for h in hosts))


def _step_change(gain: Any) -> str:
    """A predicted gain (fraction of step time saved) as the step-time change, e.g. '-28%'."""
    try:
        return f"{-float(gain) * 100:+.0f}%"
    except (TypeError, ValueError):
        return "?"


def _target_index(target: Any, prefix: str) -> int | None:
    """3 from "rank3" / "host3" (the mitigation events' target); None when it is not that."""
    m = re.fullmatch(rf"{prefix}(\d+)", str(target or ""))
    return int(m.group(1)) if m else None


def _fmt_mitigation(e: dict[str, Any], plan: list[int] | None, hosts: list[int] | None,
                    tp: int) -> str | None:
    """The mitigation events (stalwart.mitigate, and the launcher's restart) as one line."""
    ev = e.get("event")
    if ev == MitigationApplied.name:
        return _fmt_applied(e, plan, tp)
    if ev == MitigationReverted.name:
        return f"reverted to uniform plan at step {e.get('step')}"
    if ev == MitigationMeasured.name:
        return _fmt_measured(e)
    if ev == Restart.name:
        return _fmt_restart(e, hosts)
    return None


def _fmt_applied(e: dict[str, Any], plan: list[int] | None, tp: int) -> str:
    strategy, new, step = e.get("strategy"), list(e.get("plan") or []), e.get("step")
    pred = f"predicted {_step_change(e.get('predicted_gain'))}"
    if strategy == "rebalance":
        return _fmt_rebalance(e, plan, new, tp, pred)
    host = _target_index(e.get("target"), "host")
    who = f"host {host}" if host is not None else str(e.get("target", "a host"))
    if strategy == "exclude_host":
        return f"excluding {who}: restart on {len(new)} hosts at step {step}, {pred}"
    if strategy == "restore_host":
        return f"taking {who} back: restart on {len(new)} hosts at step {step}, {pred}"
    return f"mitigation {strategy} ({e.get('target')}) at step {step}, {pred}"


def _fmt_rebalance(e: dict[str, Any], plan: list[int] | None, new: list[int], tp: int,
                   pred: str) -> str:
    """A new plan: the target's share before and after, else the shares that moved."""
    step = e.get("step")
    rank = _target_index(e.get("target"), "rank")
    before = plan if plan is not None and len(plan) == len(new) else \
        uniform_plan(sum(new), len(new))
    g = rank // max(tp, 1) if rank is not None else None
    if g is not None and 0 <= g < len(new) and before[g] != new[g]:
        return (f"rebalanced: rank{rank} {before[g]}->{new[g]} micro-batches "
                f"from step {step}, {pred}")
    moved = [f"rank{i * max(tp, 1)} {a}->{b}"
             for i, (a, b) in enumerate(zip(before, new, strict=True)) if a != b]
    if g is not None and 0 < len(moved) <= 3:  # the target keeps its share
        return (f"replanned around rank{rank}: {', '.join(moved)} micro-batches "
                f"from step {step}, {pred}")
    return (f"rebalanced to plan v{e.get('version')} {_fmt_plan(new)} from step {step}, "
            f"{pred}")


def _fmt_measured(e: dict[str, Any]) -> str | None:
    try:
        got = f"{float(e['measured_gain']) * 100:.0f}%"
    except (KeyError, TypeError, ValueError):
        return None
    if e.get("strategy") == "revert":
        return f"measured gain {got} after the revert (plan v{e.get('version')})"
    try:
        pred = f" (predicted {float(e['predicted_gain']) * 100:.0f}%)"
    except (KeyError, TypeError, ValueError):
        pred = ""
    return f"measured gain {got}{pred} for plan v{e.get('version')}"


def _fmt_restart(e: dict[str, Any], hosts: list[int] | None) -> str:
    new = [int(h) for h in e.get("hosts") or []]
    n, step = e.get("nproc", len(new)), e.get("step")
    if hosts is not None and new:
        gone = sorted(set(hosts) - set(new))
        back = sorted(set(new) - set(hosts))
        if gone and not back:
            return f"restarted on {n} hosts without {_fmt_hosts(gone)}, from step {step}"
        if back and not gone:
            return f"restarted on {n} hosts with {_fmt_hosts(back)} back, from step {step}"
    return f"restarted on {n} hosts {_fmt_plan(new)}, from step {step}"


def _fmt_event(e: dict[str, Any], *, plan: list[int] | None = None,
               hosts: list[int] | None = None, tp: int = 1) -> str | None:
    """One line for an event worth showing, or None.

    plan: the micro-batch counts per data-parallel rank in force before the event (None: the
    uniform plan); hosts: the hosts the job ran on before the event (for a restart's "without
    host 2"); tp: tensor-parallel ranks per data-parallel rank (target "rank4" is DP rank 2 at
    tp 2).
    """
    ev = e.get("event")
    if (detected := describe(e)) is not None:
        return detected
    if ev in (FaultApplied.name, FaultRemoved.name):
        return f"{ev.replace('_', ' ')}: {e.get('spec', e.get('kind'))} at step {e.get('step')}"
    return _fmt_mitigation(e, plan, hosts, tp)


class Progress:
    """The launcher's display; fed with on_metric / on_event, drawn with refresh / finish.

    Lines fed twice (the launcher re-reads the files from the start after a restart) are
    ignored: a metrics line whose time is not later than its rank's last one, an event seen
    before.
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, enabled: bool = True) -> None:
        self.total = cfg.train.halt_at if cfg.train.halt_at is not None else cfg.train.steps
        self.nproc = cfg.job.nproc
        self.tp = max(cfg.train.tp, 1)
        # mitigation: the hosts the job started on and runs on now, the global micro-batches
        # per step (a step's lines are complete when their counts add up to it), the plan in
        # force (version, counts per data-parallel rank) and the last plan an event announced
        job = cfg.job
        self.all_hosts: list[int] = list(job.hosts) if job.hosts else list(range(job.nproc))
        self.hosts: list[int] = list(self.all_hosts)
        try:
            self.global_micro: int | None = cfg.global_micro_batches()
        except Exception:  # noqa: BLE001 -- a config the display cannot resolve: count ranks
            self.global_micro = None
        self.plan: tuple[int, list[int]] | None = None
        self._event_plan: list[int] | None = None
        self._plan_rows: dict[int, dict[int, tuple[int, int]]] = {}  # step -> rank -> (n, v)
        self._last_time: dict[int, float] = {}
        self._seen_events: set[str] = set()
        self.run_dir = run_dir
        self.enabled = enabled
        self.live = enabled and sys.stdout.isatty()
        self.step = -1
        self.loss: float | None = None
        self.val_loss: float | None = None
        self.note = ""
        self.t_start = time.monotonic()
        self.first_step_t: float | None = None
        self.first_step = 0
        self._recent: deque[tuple[float, int]] = deque()  # (wall time, tokens) per metric line
        self._last_plain = 0.0
        self._last_plain_step = -1
        self._bar: Any = None
        self._task: Any = None
        if self.live:
            from rich.progress import BarColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]{task.description}"), BarColumn(),
                TextColumn("{task.completed}/{task.total}"), TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
            )
            self._task = self._bar.add_task(run_dir.name, total=self.total, info="starting")
            self._bar.start()
        elif enabled:
            print(f"stalwart: {self.nproc} ranks, {self.total} steps -> {run_dir}", flush=True)

    # feeding ------------------------------------------------------------------------------
    def on_metric(self, m: dict[str, Any]) -> None:
        """One metrics line (one rank, one step)."""
        t = m.get("time")
        if isinstance(t, (int, float)):
            if t <= self._last_time.get(m["rank"], float("-inf")):
                return  # replayed after a restart: already counted
            self._last_time[m["rank"]] = float(t)
        if self.first_step_t is None:
            self.first_step_t, self.first_step = time.monotonic(), m["step"]
        self._recent.append((m.get("time", time.time()), m.get("tokens", 0)))
        while self._recent and self._recent[-1][0] - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()
        if m["step"] > self.step:
            self.step = m["step"]
        if m["rank"] == 0:
            self.loss = m.get("loss")
        mb = m.get("micro_batches")
        if isinstance(mb, int):
            row = self._plan_rows.setdefault(m["step"], {})
            if m["rank"] in row:
                row.clear()  # the step runs again (resumed after a restart): a new set of lines
            row[m["rank"]] = (mb, int(m.get("plan_version") or 0))
            self._update_plan()

    def _complete(self, row: dict[int, tuple[int, int]]) -> bool:
        if self.global_micro is not None:
            return sum(n for n, _ in row.values()) == self.global_micro * self.tp
        return len(row) >= self.nproc

    def _update_plan(self) -> None:
        """The plan in force: the counts of the latest step whose lines are all in."""
        for step in sorted(self._plan_rows, reverse=True):
            row = self._plan_rows[step]
            if self._complete(row):
                counts = [row[r][0] for r in sorted(row) if r % self.tp == 0]
                self.plan = (max(v for _, v in row.values()), counts)
                for old in [s for s in self._plan_rows if s < step]:
                    del self._plan_rows[old]
                return
        while len(self._plan_rows) > 64:  # never complete (lines lost): keep it bounded
            del self._plan_rows[min(self._plan_rows)]

    def plan_text(self) -> str:
        """"plan v2 [4 4 2 4]" while a non-uniform plan is in force, "host 1 excluded" while
        the job runs without some of its hosts; "" otherwise."""
        parts = []
        if self.plan is not None:
            version, counts = self.plan
            if version > 0 and counts != uniform_plan(sum(counts), len(counts)):
                parts.append(f"plan v{version} {_fmt_plan(counts)}")
        gone = sorted(set(self.all_hosts) - set(self.hosts))
        if gone:
            parts.append(f"{_fmt_hosts(gone)} excluded")
        return "  ".join(parts)

    def on_event(self, e: dict[str, Any]) -> None:
        """One events line: remembered for the display, printed at once when not live."""
        key = repr(sorted(e.items()))
        if key in self._seen_events:
            return  # replayed after a restart
        self._seen_events.add(key)
        if e.get("event") == Eval.name:
            self.val_loss = e.get("val_loss")
        text = _fmt_event(e, plan=self._event_plan, hosts=self.hosts, tp=self.tp)
        self._track_mitigation(e)
        if text:
            self.note = text
            if not self.live and self.enabled:
                print(f"stalwart: {text}", flush=True)

    def _track_mitigation(self, e: dict[str, Any]) -> None:
        ev = e.get("event")
        if ev == MitigationApplied.name and e.get("strategy") == "rebalance":
            self._event_plan = list(e.get("plan") or []) or None
        elif ev == MitigationReverted.name:
            self._event_plan = None
        elif ev == Restart.name and e.get("hosts"):
            self.hosts = [int(h) for h in e["hosts"]]
            self.nproc = int(e.get("nproc", len(self.hosts)))
            self._event_plan = None

    # drawing ------------------------------------------------------------------------------
    def info(self) -> str:
        parts = []
        if self.loss is not None:
            parts.append(f"loss {self.loss:.3f}")
        if self.val_loss is not None:
            parts.append(f"val {self.val_loss:.3f}")
        span = self._recent[-1][0] - self._recent[0][0] if len(self._recent) > 1 else 0.0
        if span > 0:
            # the job's rate over the last few seconds: all ranks' tokens / wall time
            tokens = sum(t for _, t in list(self._recent)[1:])
            parts.append(f"{tokens / span:,.0f} tok/s")
        plan = self.plan_text()
        if plan:
            parts.append(plan)
        if self.note:
            parts.append(self.note)
        return "  ".join(parts)

    def eta_s(self) -> float | None:
        if self.first_step_t is None or self.step <= self.first_step:
            return None
        elapsed = time.monotonic() - self.first_step_t
        if elapsed < 1.0:  # too early: lines that arrive in one burst would fake a high rate
            return None
        rate = (self.step - self.first_step) / elapsed
        return (self.total - self.step - 1) / rate if rate > 0 else None

    def refresh(self) -> None:
        done = self.step + 1
        if self.live:
            self._bar.update(self._task, completed=done, info=self.info())
            return
        if not self.enabled or done <= 0:
            return
        now = time.monotonic()
        every = max(self.total // 10, 1)
        if done // every > self._last_plain_step // every or now - self._last_plain > PLAIN_EVERY_S:
            eta = self.eta_s()
            eta_s = f"  eta {eta:.0f}s" if eta is not None else ""
            print(f"stalwart: step {done}/{self.total}  {self.info()}{eta_s}", flush=True)
            self._last_plain, self._last_plain_step = now, done

    def finish(self) -> None:
        self.refresh()
        if self.enabled:
            elapsed = time.monotonic() - self.t_start
            self.close()
            print(f"stalwart: done, {self.step + 1} steps in {elapsed:.1f}s  {self.info()}",
                  flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        self.live = False
        self.enabled = False  # closed: nothing more is drawn
