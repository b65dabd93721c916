"""Local elastic jobs for the tests: a membership store process and torchrun agents (each
``torchrun --standalone --nproc-per-node 2``: a "node") running examples/elastic_ddp.py, with
real faults on them (a node killed with its workers, a worker SIGSTOPped), and the per-process
JSONL the script writes, read back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from tests.helpers import free_port

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "examples" / "elastic_ddp.py"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


class Records:
    """The per-process JSONL files examples/elastic_ddp.py wrote to ``out``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def files(self) -> dict[Path, list[dict[str, Any]]]:
        out = {}
        for f in sorted(self.out.glob("steps-*.jsonl")):
            out[f] = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        return out

    def rows(self) -> list[dict[str, Any]]:
        return [r for rs in self.files().values() for r in rs if "step" in r]

    def by_step(self) -> dict[int, list[dict[str, Any]]]:
        by: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for r in self.rows():
            by[r["step"]].append(r)
        return by


class Cluster(Records):
    def __init__(self, out: Path, min_world: int, script_args: list[str]) -> None:
        self.out = out
        self.args = script_args
        self.port = free_port()
        self.env = dict(os.environ, STALWART_STORE=f"127.0.0.1:{self.port}",
                        STALWART_MIN_WORLD=str(min_world), OMP_NUM_THREADS="1",
                        PYTHONPATH=str(ROOT / "src"))
        self.store = subprocess.Popen(
            [sys.executable, "-m", "stalwart.elastic.store", "--host", "127.0.0.1",
             "--port", str(self.port)], env=self.env, stdout=subprocess.PIPE, text=True)
        assert self.store.stdout is not None
        line = self.store.stdout.readline()  # printed once it serves
        assert line.startswith("STALWART_STORE="), line
        self.nodes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def start(self, name: str, extra_env: dict[str, str] | None = None,
              args: list[str] | None = None) -> subprocess.Popen:
        log = self.out / f"{name}.log"
        self.logs[name] = log
        p = subprocess.Popen(
            [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.5",
             str(SCRIPT), *(args if args is not None else self.args), "--out", str(self.out)],
            env={**self.env, **(extra_env or {})}, stdout=open(log, "w"),  # noqa: SIM115
            stderr=subprocess.STDOUT, start_new_session=True)
        self.nodes[name] = p
        return p

    def workers(self, name: str) -> list[int]:
        """The worker processes of a node's agent (torchrun starts each in its own session)."""
        pid = self.nodes[name].pid
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                             text=True).stdout
        return [int(x) for x in out.split()]

    def kill(self, *names: str) -> float:
        """SIGKILL nodes' agents and workers at once; returns the time."""
        pids = [pid for n in names for pid in [self.nodes[n].pid, *self.workers(n)]]
        t = time.time()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for n in names:
            self.nodes[n].wait()
        return t

    def wait_step(self, step: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(r["step"] >= step for r in self.rows()):
                return
            time.sleep(0.1)
        raise AssertionError(f"no step {step} in {timeout:.0f} s: " + self.tail())

    def wait(self, name: str, timeout: float = 180.0) -> int:
        try:
            return self.nodes[name].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node {name} did not finish: " + self.tail()) from None

    def tail(self) -> str:
        return "\n".join(f"--- {n}\n" + p.read_text()[-1500:] for n, p in self.logs.items())

    def close(self) -> None:
        for p in [*self.nodes.values(), self.store]:
            if p.poll() is None:
                for pid in ([*self.workers_of(p.pid)] if p is not self.store else []):
                    os.kill(pid, signal.SIGKILL)
                p.kill()
                p.wait()

    @staticmethod
    def workers_of(pid: int) -> list[int]:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                             text=True).stdout
        return [int(x) for x in out.split()]


def skipped_in_flight(got: list[int]) -> list[int]:
    """The steps a process's log skips: each run of its steps is consecutive, and between
    two runs at most the one step in flight is missing -- a step the member gave up (a peer
    was lost) that another member applied with every contribution; the new generation then
    moved that member's state to it (elastic.Job: "a step some survivors logged and others
    did not"). Anything else fails here."""
    gaps = []
    for a, b in zip(got, got[1:], strict=False):
        assert b in (a + 1, a + 2), ("a step redone or more than the step in flight skipped",
                                     a, b)
        if b == a + 2:
            gaps.append(a + 1)
    assert len(gaps) <= 1, ("skipped more than once", gaps)
    return gaps


def trained_every_step(rs: list[dict[str, Any]], steps: int) -> bool:
    """A process that trained from step 0 to the end: every step logged, but for at most the
    one step in flight it gave up when a peer was lost (``skipped_in_flight``)."""
    got = [r["step"] for r in rs if "step" in r]
    return bool(got) and got[0] == 0 and got[-1] == steps - 1 and \
        len(got) >= steps - len(skipped_in_flight(got))


def check_same_training(c: Records, steps: int, batch: int) -> None:
    """Every step trained once, in one generation, on the whole global batch, none missing;
    each process's steps strictly increase by one (nothing redone but the step in flight --
    which is never logged twice -- nothing skipped but a step in flight that another member
    applied: ``skipped_in_flight``). A step may lack the rows of members that died (or froze)
    in it after their contribution (their log ends just before it) or that gave it up while
    others applied it (their log skips it)."""
    by = c.by_step()
    assert sorted(by) == list(range(steps)), sorted(set(range(steps)) - set(by))
    ends: dict[tuple[int, int], int] = {}  # (generation, last step) -> processes ending there
    for rs in c.files().values():
        got = [r["step"] for r in rs if "step" in r]
        if not got:
            continue
        for s in skipped_in_flight(got):  # (gen of the step before it)
            gen = next(r["gen"] for r in rs if r.get("step") == s - 1)
            ends[(gen, s - 1)] = ends.get((gen, s - 1), 0) + 1
        last = [r for r in rs if "step" in r][-1]
        if not rs[-1].get("final"):
            key = (last["gen"], last["step"])
            ends[key] = ends.get(key, 0) + 1
    for s, rows in by.items():
        gens = {r["gen"] for r in rows}
        assert len(gens) == 1, (s, rows)
        assert len({r["member"] for r in rows}) == len(rows), (s, rows)
        missing = rows[0]["world"] - len(rows)
        if missing == 0:
            assert sum(r["samples"] for r in rows) == batch, (s, rows)
        else:  # died in step s after contributing to it, or gave it up as others applied it
            assert missing <= ends.get((rows[0]["gen"], s - 1), 0), (s, rows)
