"""The launcher's side of the elastic membership under ``stalwart run --script``, torch-free:
the store it serves the ranks, and how it knows which ranks handle a lost peer themselves.

- ``LauncherStore``: for every ``--script`` run, and every built-in job that regroups in
  place, the launcher starts the membership store (``python -m stalwart.elastic.store``,
  tied to the launcher by ``stalwart.lifeline``) as a process of its own in rank 0's host --
  its network namespace on the netns testbed -- and gives every rank ``STALWART_STORE`` and
  ``STALWART_JOB`` (the run's name). For a built-in job the launcher also keeps its own
  records there, through the process's stdin and stdout (elastic/runlink.py). The store is no
  rank's: any rank, rank 0 included, may die and the membership goes on. A script that does
  not use ``stalwart.elastic`` never connects to it (cost: one idle process, ~150 MB, its
  torch import beside the ranks' own).
- ``announce`` (the rank's side, called by ``elastic.Job`` once the process is a member of a
  generation, when ``STALWART_RUN_DIR`` says it runs under ``stalwart run``): one line
  ``{"rank", "member", "pid", "time"}`` appended to ``RUN_DIR/elastic-members.jsonl``.
- ``registered(run_dir)``: the launch ranks that announced. This is how the launcher knows a
  script uses the API (no flag): a rank that dies after it announced is dropped (``rank_lost``)
  and the others train on in place; a rank that dies before (a crash on start-up, a refused
  joiner) or exits 2 (bad input) stops the job as for any script.
- ``IterationLog``: every member's completed steps to ``RUN_DIR/iterations.jsonl`` in the
  monitor's line format (``step``, ``rank`` -- the member's rank in its generation, so that
  the progress display and the launcher's step times follow whoever is rank 0 --, ``time``,
  ``step_time``, plus ``launch_rank``, ``world``, ``gen``, ``source: "elastic"``): the step
  counter that faults in steps (``kill:rank=R,at=STEP``, with ``--detect``) follow.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stalwart.rundir import ITERATIONS, LOGS, JsonlWriter, read_jsonl

MEMBERS = "elastic-members.jsonl"
RUN_DIR_ENV = "STALWART_RUN_DIR"


class LauncherStore:
    """The membership store of one ``stalwart run`` job (a ``--script`` run's, or a built-in
    job's that regroups in place), in a process of its own. ``commands``: the launcher also
    keeps records in it through the process's stdin and stdout (``pipe``, elastic/runlink.py);
    the process then also ends when the launcher closes its stdin."""

    def __init__(self, prefix: list[str], addr: str, port: int, job: str, run_dir: Path,
                 commands: bool = False) -> None:
        from stalwart.elastic.runlink import StorePipe

        cmd = [*prefix, sys.executable, "-m", "stalwart.lifeline", str(os.getpid()),
               "stalwart.elastic.store", "--host", addr, "--port", str(port),
               *(["--commands"] if commands else [])]
        (run_dir / LOGS).mkdir(parents=True, exist_ok=True)
        self.log = run_dir / LOGS / "elastic-store.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE if commands else log, stderr=log,
                stdin=subprocess.PIPE if commands else subprocess.DEVNULL,
                start_new_session=True)
        self.job = job
        self.pipe = StorePipe(self.proc, str(self.log)) if commands else None
        # the ranks' clients retry their connection until the store serves (STORE_TIMEOUT_S)
        self.env = {"STALWART_STORE": f"{addr}:{port}", "STALWART_JOB": job}

    def died(self) -> str | None:
        """One line when the store process has exited (None while it runs)."""
        code = self.proc.poll()
        if code is None:
            return None
        return (f"the run's membership store process exited (exit code {code}); its log: "
                f"{self.log}")

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def announce(run_dir: Path, rank: int, member: int) -> None:
    """This process (launch rank ``rank``) is a member of the elastic job."""
    with contextlib.suppress(OSError), JsonlWriter(run_dir / MEMBERS) as w:
        w.write({"rank": rank, "member": member, "pid": os.getpid(), "time": time.time()})


def registered(run_dir: Path) -> set[int]:
    """The launch ranks of ``run_dir`` that joined an elastic job."""
    path = run_dir / MEMBERS
    if not path.is_file():
        return set()
    return {int(r["rank"]) for r in read_jsonl(path) if "rank" in r}


class IterationLog:
    """A member's steps to ``RUN_DIR/iterations.jsonl`` (module docstring)."""

    def __init__(self, run_dir: Path, launch_rank: int) -> None:
        self.writer = JsonlWriter(run_dir / ITERATIONS)
        self.launch_rank = launch_rank
        self.last = time.time()

    def step(self, step: int, rank: int, world: int, gen: int) -> None:
        now = time.time()
        rec: dict[str, Any] = {"step": step, "rank": rank, "time": now,
                               "step_time": round(now - self.last, 6),
                               "launch_rank": self.launch_rank, "world": world, "gen": gen,
                               "source": "elastic"}
        self.last = now
        with contextlib.suppress(OSError):  # the report loses a point, not the run
            self.writer.write(rec)

    def close(self) -> None:
        self.writer.close()


def run_dir_of(env: dict[str, str]) -> Path | None:
    """The run directory when the process runs under ``stalwart run`` (else None)."""
    d = env.get(RUN_DIR_ENV)
    return Path(d) if d else None
