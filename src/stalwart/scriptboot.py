"""Rank side of ``stalwart run --script``: run a user's script as ``__main__``, optionally with
the straggler monitor started for it (zero-code detection).

Started by the launcher as ``python -m stalwart.lifeline PPID stalwart.scriptboot --config
RUN_DIR/config.json`` with torchrun's environment. The script runs as ``python script.py
ARGS`` would run it: ``sys.argv = [script, *ARGS]``, the script's folder first on
``sys.path``, ``__name__ == "__main__"`` (``runpy.run_path``).

Zero-code detection (``--detect``): before the script runs, ``torch.distributed.
init_process_group`` is wrapped so that the moment the script's own call returns, a
``stalwart.detect.Monitor`` is created on every rank -- after the process group exists and
before the script can wrap its model in DDP, which is where the monitor must start (it
installs its collective wrappers and DDP's timing comm hook, tracking.py). The script gives
no step hints, so the monitor finds iterations from the collective sequence itself
(period.py); its findings go to RUN_DIR/events.jsonl as in any stalwart run, and every
iteration it recognises is written to RUN_DIR/iterations.jsonl (step = the monitor's
iteration index, step_time / compute_time / comm_time in seconds, wall time): the report's
time axis, and the step counter that fault windows in steps follow. ``destroy_process_group``
is wrapped to close the monitor first (its last exchange completes on every rank); a script
that never destroys its group gets the monitor closed when it returns.

Liveness (heartbeat.py): with ``--detect`` the rank says it is set up when the script's
``init_process_group`` returns, and is judged silent after 3 s from then (hung, cut off);
without it, at the start-up bound (60 s) throughout.

Failures: when the script raises (or exits non-zero), the time and the error line go to
RUN_DIR/logs/rank-R.error.json before the exception propagates, so that the launcher can blame
the rank that failed first rather than the peers whose collectives failed because of it. The
monitor is not closed then: its pending exchange may wait on a peer that is gone.

Guarantees: the script is not modified and imports nothing from stalwart; without
``--detect`` nothing of torch is imported or wrapped by this module.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import runpy
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from stalwart import envknobs, heartbeat
from stalwart.config import RunConfig
from stalwart.rundir import ERROR_SUFFIX, ITERATIONS, LOGS, JsonlWriter


class _Detection:
    """The monitor started for a script that does not create one, and its iteration log."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.monitor: Any = None
        self.writer: JsonlWriter | None = None

    def install(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        orig_init = dist.init_process_group
        orig_destroy = dist.destroy_process_group

        @functools.wraps(orig_init)
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            out = orig_init(*args, **kwargs)
            heartbeat.ready()  # set up (torch imported, group connected): judged at 3 s
            try:
                self.start()
            except Exception as e:  # noqa: BLE001 -- detection must not cost the user's run
                print(f"stalwart: the monitor did not start on rank {self.rank} ({e}); the "
                      "script runs without detection", file=sys.stderr, flush=True)
            return out

        @functools.wraps(orig_destroy)
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            if not args and not kwargs.get("group"):  # the whole job, not a subgroup
                self.close()
            return orig_destroy(*args, **kwargs)

        # both names: scripts call either torch.distributed.X or the c10d module's X
        for mod in (dist, c10d):
            mod.init_process_group = init_process_group  # type: ignore[assignment]
            mod.destroy_process_group = destroy_process_group  # type: ignore[assignment]

    def start(self) -> None:
        if self.monitor is not None:
            return
        from stalwart.detect import Monitor

        writer = JsonlWriter(self.run_dir / ITERATIONS)
        self.writer = writer
        rank = self.rank

        def log_iteration(s: Any) -> None:
            """Every iteration the monitor counts (all ranks), to iterations.jsonl."""
            try:
                writer.write({"step": int(s.key), "rank": rank, "time": time.time(),
                              "step_time": round(s.seconds, 6),
                              "compute_time": round(s.compute or 0.0, 6),
                              "comm_time": round(s.comm or 0.0, 6), "source": "monitor"})
            except OSError:
                pass  # (disk full, closed) the report loses a point, not the run

        self.monitor = Monitor(run_dir=self.run_dir, on_sample=log_iteration)

    def close(self) -> None:
        mon, self.monitor = self.monitor, None
        if mon is not None:
            try:
                mon.close()
            except Exception as e:  # noqa: BLE001 -- the script's own teardown goes on
                print(f"stalwart: the monitor did not close cleanly on rank {self.rank} "
                      f"({e})", file=sys.stderr, flush=True)
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _record_failure(run_dir: Path, rank: int, error: str, code: Any) -> None:
    rec = {"time": time.time(), "rank": rank, "error": error, "exit_code": code}
    try:
        (run_dir / LOGS / f"rank-{rank}{ERROR_SUFFIX}").write_text(json.dumps(rec) + "\n")
    except OSError:
        pass  # the launcher falls back to the exit codes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="stalwart.scriptboot")
    p.add_argument("--config", required=True, type=Path)
    a = p.parse_args(argv)
    cfg = RunConfig.load(a.config)  # as the launcher resolved it: not checked again
    script = Path(str(cfg.job.script)).resolve()
    run_dir = Path(envknobs.run_dir() or a.config.parent)
    rank = int(os.environ.get("RANK", "0"))
    detection = _Detection(run_dir, rank) if cfg.detect.enabled else None
    if detection is not None:
        detection.install()
    sys.argv = [str(script), *cfg.job.script_args]
    # `python script.py` puts the script's folder first on sys.path (its own imports)
    sys.path[0] = str(script.parent)
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            # the error line is the script's own last output (e.g. argparse's message)
            _record_failure(run_dir, rank, "" if isinstance(e.code, int) else str(e.code),
                            e.code)
        else:
            _finish(detection)
        raise
    except BaseException as e:
        _record_failure(run_dir, rank,
                        traceback.format_exception_only(type(e), e)[-1].strip(), 1)
        raise
    _finish(detection)


def _finish(detection: _Detection | None) -> None:
    """The script ended well: close the monitor (if any), then let the collectives finish."""
    if detection is not None:
        detection.close()
    _let_collectives_finish()


def _let_collectives_finish() -> None:
    """Give gloo's worker threads the GIL once more before the interpreter finalizes.

    A gloo worker drops its reference to a finished collective (its ``AsyncWork``) after it
    has woken the waiting thread; when that reference is the last one to a tensor that has a
    Python object (any tensor the script passed to a collective, e.g. a flag it all-reduces),
    the drop needs the GIL. If the script's thread has returned and the interpreter is
    finalizing by then, the worker is made to exit inside a C++ destructor and the rank dies
    with SIGABRT ("terminate called without an active exception"): seen in CI's plain-DDP
    script test, about 1 run in 15 (core dump: ``ProcessGroupGloo::runLoop`` ->
    ``~AsyncAllreduceWork`` -> ``gil_scoped_acquire`` -> ``PyThread_exit_thread``; a known
    PyTorch race, pytorch/pytorch#190489). ``destroy_process_group`` does not help: the gloo
    groups and their threads outlive it here (and ``gc.collect`` does not free them either:
    measured, the threads stay). Sleeping releases the GIL, so a worker waiting for it
    finishes now; 0 failures in 40 runs with this pause, 2 in 29 without.
    """
    time.sleep(0.05)


if __name__ == "__main__":
    main()
