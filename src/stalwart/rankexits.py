"""What a rank's exit means to the launcher, and how it answers: whom to blame for a failed
job, how the other ranks are stopped, and how a rank lost or left is dropped from a job that
goes on without it.

What it guarantees:
- ``culprit`` names the likely cause of a failure, not the first rank seen dead: a rank
  killed by an outside signal first, then one that exited with an error (the one whose
  script raised first when that is known), and last a SIGABRT, which is how gloo peers of a
  dead rank end; while only such aborts are seen it waits up to ABORT_SETTLE_S for the rank
  that caused them;
- ``stop_all`` ends every live rank: SIGTERM, then SIGKILL after GRACE_S;
- a rank lost (``lose_ranks``: a job that regroups in place; ``drop_lost``: ``keep_going``)
  is logged as ``rank_lost`` with its exit and the last line of its error, and dropped; a
  rank that exited 2 (bad input: every rank would hit it) is never dropped, the job stops;
- a rank that left (S4, ``ranks_left``) is logged as ``rank_left`` and its host probed for
  the way back (mitigate/probe.py).

Cost: reading exit statuses and, per failed rank, its log file's last line; ``culprit``
sleeps in 0.05 s steps for at most ABORT_SETTLE_S, ``stop_all`` waits at most GRACE_S.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stalwart.events import RankLeft, RankLost
from stalwart.rundir import LOGS, EventLog

GRACE_S = 3.0
# When only aborted ranks (SIGABRT: how gloo peers of a dead rank end) have failed so far, how
# long to wait for the rank that caused it: it may still be unwinding its own error
ABORT_SETTLE_S = 3.0


def rank_log(run_dir: Path, r: int) -> Path:
    """Rank ``r``'s stdout and stderr (launch.py)."""
    return run_dir / LOGS / f"rank-{r}.log"


def last_error_line(log: Path) -> str:
    """The last non-blank line of a rank's log: its error, when it raised."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def _blame_order(failure: tuple[int, int],
                 raised_at: float | None = None) -> tuple[bool, bool, float, int]:
    """Sort key over (rank, exit code): a rank killed by an outside signal first, then one that
    exited with an error -- the one whose script raised first when that is known (a script
    run's ranks record it) -- and last a SIGABRT, which is how peers of a dead rank usually
    end."""
    rank, code = failure
    return (code == -signal.SIGABRT, code > 0,
            raised_at if raised_at is not None else float("inf"), rank)


def failures(procs: dict[int, subprocess.Popen]) -> list[tuple[int, int]]:
    """(rank, exit code) of each rank that exited other than with 0 (a rank that leaves
    early exits 0 too, with its reason in an exit record: elastic/runlink.py)."""
    return [(r, p.returncode) for r, p in procs.items() if p.poll() not in (None, 0)]


def culprit(procs: dict[int, subprocess.Popen], raised: Callable[[], dict[int, dict]],
            settle_s: float = ABORT_SETTLE_S) -> tuple[int, int] | None:
    """(rank, exit code) of the rank to blame for a failed job, or None while none failed.

    The peers of a rank that dies abort within milliseconds (gloo: "connection closed by
    peer"), often before the dead rank itself has exited: while every failure seen is such an
    abort, wait up to ``settle_s`` for another failure; a rank whose script recorded a raise
    (``raised()``: script runs) counts as failed even while it is still exiting."""
    failed = failures(procs)
    if not failed:
        return None
    deadline = time.monotonic() + settle_s
    errs = raised()
    while all(code == -signal.SIGABRT for _, code in failed) and time.monotonic() < deadline:
        if any(r not in dict(failed) for r in errs):
            break
        time.sleep(0.05)
        failed, errs = failures(procs), raised()
    codes = dict(failed)
    for r in errs:  # raised, maybe still exiting: an error exit, by its own account
        codes.setdefault(r, procs[r].poll() or 1)
    return min(codes.items(), key=lambda f: _blame_order(f, errs.get(f[0], {}).get("time")))


def stop_all(procs: dict[int, subprocess.Popen]) -> None:
    """SIGTERM every live rank, then SIGKILL what is left after GRACE_S."""
    live = [p for p in procs.values() if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in live:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()


def lose_ranks(failed: list[tuple[int, int]], procs: dict[int, subprocess.Popen],
               members: Any, run_dir: Path, events: EventLog, say: Callable[[str], None],
               step: int, tp: int = 1) -> bool:
    """Ranks died in a job that regroups in place: log each (``rank_lost``), drop it, and
    announce the next generation to the survivors (with tensor parallelism, without the rest
    of the dead rank's TP group, which leaves: membership.survivors). False (the job stops as
    before) when no rank would be left, or a rank exited 2 (bad input: every rank would hit
    it)."""
    from stalwart.mitigate.membership import survivors

    dead = [r for r, _ in failed]
    cur = members.newest()  # rank 0 may have changed it since (S3/S4, a host taken back)
    kept, left = survivors(cur, dead, tp)
    alive = [r for r, p in procs.items() if p.poll() is None and r in kept]
    if not alive or any(code == 2 for _, code in failed):
        return False
    with_it = f" ({len(left)} more of its tensor-parallel group leave)" if left else ""
    for r, code in failed:
        # a signal leaves no error of the rank's own (its last line is whatever came before)
        why = last_error_line(rank_log(run_dir, r)) if code > 0 else ""
        host = cur.hosts[cur.alive.index(r)] if r in cur.alive else -1
        events.emit(RankLost(step=step, rank=r, host=host, exit_code=code, error=why,
                             world_after=len(alive), left=left))
        say(f"stalwart: rank {r} (host {host}) lost ({describe_exit(code)}){with_it}; the "
            f"other {len(alive)} regroup in place")
        del procs[r]
    members.lose(dead, step, tp)
    return True


def drop_lost(failed: list[tuple[int, int]], procs: dict[int, subprocess.Popen],
              run_dir: Path, events: EventLog, say: Callable[[str], None], step: int) -> bool:
    """``keep_going``: ranks died; log each (``rank_lost``, with its exit and last error line)
    and stop supervising it. False (the job stops as usual) when a rank exited 2: bad input,
    which every rank would hit."""
    if any(code == 2 for _, code in failed):
        return False
    for r, code in failed:
        why = last_error_line(rank_log(run_dir, r)) if code > 0 else ""
        events.emit(RankLost(step=step, rank=r, host=r, exit_code=code, error=why,
                             world_after=len(procs) - 1))
        say(f"stalwart: rank {r} lost ({describe_exit(code)}); the other {len(procs) - 1} go on")
        del procs[r]
    return True


def ranks_left(left: list[int], procs: dict[int, subprocess.Popen], members: Any, tb: Any,
               events: EventLog, say: Callable[[str], None], step: int,
               probe_hosts: bool = True) -> Any:
    """Ranks ``left`` that an in-place regroup left out (S4, or a dead rank's TP group)
    exited (their ``left`` exit records say so): log each (``rank_left``) and, with
    ``probe_hosts``, probe its host for the way back (probe.py); returns the probe (or
    None)."""
    from stalwart.mitigate.probe import HostProbe

    probe = None
    g = members.newest() if members is not None else None  # rank 0's planned one
    for r in left:
        host = tb.host(r)
        del procs[r]
        events.emit(RankLeft(step=step, rank=r, host=host))
        say(f"stalwart: rank {r} left; host {host} is out of the job"
            + (" and probed for the way back" if probe_hosts else ""))
        if g is not None and probe is None and hasattr(tb, "hosts") and probe_hosts:
            probe = HostProbe(tb, host, list(g.hosts), members.link)
    return probe

