"""The rank loop -- ``train(cfg)``, the algorithm in one screen -- and the rank's entry point.
The rank itself and each capability it plugs in are built by ``Rank.start`` (train/rank.py);
the step is train/steps.py, the in-place membership side train/inplace.py, a run directory
under torchrun train/torchrun.py.

Started by ``stalwart run`` (``--config RUN_DIR/config.json``) or directly by torchrun with the
same options as ``stalwart run``::

    torchrun --standalone --nproc-per-node 2 -m stalwart.train.worker --steps 100 --name demo

Guarantees:
- deterministic: the same seed gives the same losses; a run resumed from a checkpoint
  reproduces the uninterrupted run's losses (train/rank.py);
- per step and rank one metrics line; each evaluation and checkpoint once per step boundary;
- in a job that regroups in place, a failed collective or a planned change redoes at most the
  step in flight; a rank whose regroup cannot be done, or that is left out, exits 0 with its
  reason in an exit record for the launcher (elastic/runlink.py); an S3/S4 decision that
  takes a restart checkpoints and exits the same way (``restart``, rank 0's record with the
  host map) -- outside ``stalwart run`` (no launcher to relaunch it) it exits 1, which a
  torchrun with ``--max-restarts`` answers by restarting the workers;
- a ConfigError (bad checkpoint, bad option) exits with code 2 and one line on stderr.

Cost: the loop adds nothing to a step beyond its capabilities' (see their modules).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path

from stalwart import heartbeat
from stalwart.config import ConfigError, RunConfig
from stalwart.events import Halted
from stalwart.train import elastic_loop
from stalwart.train.inplace import first_line, regroup_until_done
from stalwart.train.rank import Rank


def train(cfg: RunConfig, link: str | None = None, rejoin: bool = False) -> int:
    """Each step: its share of the work, forward/backward and optimizer step, measurements to
    the metrics, the monitor and the plan; evaluations and checkpoints. In a job that regroups
    in place a failed collective (a rank lost) or a planned change (S3/S4) rebuilds the rank's
    groups and the loop goes on at the agreed step (``InPlace.regroup``). ``link``: the
    launch's token (its records: elastic/ranklink.py); ``rejoin``: this launch rank was
    started again to take its host back live."""
    from stalwart.mitigate.regroup import NotAMember

    if elastic_loop.wanted():  # torchrun nodes joined by stalwart's membership store
        return elastic_loop.train_elastic(cfg)
    r = Rank.start(cfg, link, rejoin)
    cfg = r.cfg  # as resolved (under plain torchrun: by rank 0)
    heartbeat.ready()  # set up: the launcher now judges its silence at SILENT_S
    applied = r.enter()  # optimizer steps applied: the next step to run
    if applied is None:  # started to rejoin and not taken back
        return r.inplace.leave() if r.inplace is not None else 1
    stop = cfg.train.halt_at if cfg.train.halt_at is not None else cfg.train.steps
    while True:
        try:
            r.after(applied)  # the evaluation and checkpoint due, each once
            if applied >= stop:
                break
            step = applied
            t0 = time.perf_counter()
            r.set_lr(step)
            share = r.work.assign(step)  # which of the step's micro-batches this rank computes
            if r.restart_due(step):  # S3/S4 (in place, they raise PlannedRegroup)
                r.checkpoint(step)
                if r.inplace is None:
                    print(f"stalwart: an S3/S4 decision at step {step} takes a restart; "
                          "checkpointed, and no launcher of ours to relaunch", file=sys.stderr)
                    return r.finish(1)
                return r.finish(r.inplace.leave_for_restart(step))
            rec, fb = r.train_step(step, share, t0)
            applied = step + 1
            r.record(step, rec, fb)
        except Exception as e:  # noqa: BLE001 -- only a failed collective is handled here
            members = r.inplace
            if members is None or not members.regroups_after(e):
                raise
            why = first_line(e)
            del e  # its traceback holds the failed step's graph, and with it the old DDP
            try:
                applied = regroup_until_done(members, applied, why)
            except NotAMember:  # left out by the plan (S4): its host is probed from outside
                return members.leave()
            except Exception as e:  # noqa: BLE001 -- any failure: checkpoint-and-relaunch
                return members.fall_back(applied, e)
    if cfg.train.halt_at is not None and r.rank == 0:
        r.events.emit(Halted(step=cfg.train.halt_at))
    return r.finish(0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["--config"] and len(argv) >= 2:
            # from the launcher: ``--config PATH [--link TOKEN] [--rejoin]``
            cfg = RunConfig.load(Path(argv[1]))
            rest = argv[2:]
            link = rest[rest.index("--link") + 1] if "--link" in rest[:-1] else None
            return train(cfg, link, "--rejoin" in rest)
        from stalwart.runargs import config_from_run_args

        return train(config_from_run_args(argv))
    except ConfigError as e:
        print(f"stalwart: error: {e}", file=sys.stderr)
        return 2


def leave(code: int) -> None:
    """End the process with ``code``, everything written and closed by then.

    A rank of a job that regroups in place has a membership watcher (mitigate/regroup.py)
    blocked in a store wait, in c10d's C++ with the GIL released. At interpreter
    finalization the store's connection is torn down under it; when the wait returns, the
    daemon thread cannot take the GIL back and is ended by ``pthread_exit`` inside C++
    frames, which aborts the process ("terminate called without an active exception": two of
    four ranks exited -6 at the last step of a clean-clone CI run). Such a process leaves
    with ``os._exit`` after flushing what the interpreter would have flushed; any other
    with ``sys.exit``."""
    from stalwart.mitigate.regroup import watching

    if watching():
        logging.shutdown()
        for f in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                f.flush()
        heartbeat.leaving()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    leave(main())
