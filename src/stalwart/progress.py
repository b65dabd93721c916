"""The launcher's one progress display, fed by the run directory's metrics and events.

On a terminal: a live rich progress bar (step, loss, validation loss, tokens/s, ETA, the latest
straggler finding or fault). Otherwise (CI, a pipe, a log file): a plain line roughly every 10%
of the run and at least every 30 seconds, so logs stay short but show that the job is alive.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from stalwart.config import RunConfig

PLAIN_EVERY_S = 30.0
RATE_WINDOW_S = 5.0


def _fmt_event(e: dict[str, Any]) -> str | None:
    ev = e.get("event")
    if ev == "straggler_detected":
        who = (f"rank {','.join(map(str, e['ranks']))}" if e.get("ranks")
               else f"link {e.get('link')}")
        return (f"straggler: {e.get('kind')} {who} x{e.get('severity', 0):.2f} "
                f"since step {e.get('onset_step')}")
    if ev == "slowdown_unexplained":
        return f"job slowed at step {e.get('step')}, no culprit rank or link found"
    if ev == "straggler_recovered":
        return f"straggler recovered at step {e.get('step')}"
    if ev in ("fault_applied", "fault_removed"):
        return f"{ev.replace('_', ' ')}: {e.get('spec', e.get('kind'))} at step {e.get('step')}"
    return None


class Progress:
    def __init__(self, cfg: RunConfig, run_dir: Path, enabled: bool = True) -> None:
        self.total = cfg.halt_at if cfg.halt_at is not None else cfg.steps
        self.nproc = cfg.nproc
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
        if self.first_step_t is None:
            self.first_step_t, self.first_step = time.monotonic(), m["step"]
        self._recent.append((m.get("time", time.time()), m.get("tokens", 0)))
        while self._recent and self._recent[-1][0] - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()
        if m["step"] > self.step:
            self.step = m["step"]
        if m["rank"] == 0:
            self.loss = m.get("loss")

    def on_event(self, e: dict[str, Any]) -> None:
        if e.get("event") == "eval":
            self.val_loss = e.get("val_loss")
        text = _fmt_event(e)
        if text:
            self.note = text
            if not self.live and self.enabled:
                print(f"stalwart: {text}", flush=True)

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
