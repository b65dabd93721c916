"""Elastic torchrun: a node leaves and the job goes on at the smaller world size.

Two local torchrun agents (two "nodes" of 2 ranks each, ``--nnodes 1:2``) rendezvous over
c10d and train one job at world size 4. Once a checkpoint saved by all 4 ranks exists, one
agent and its workers are killed -- a node that disappears. The surviving ranks fail on their
broken collectives, torchrun re-forms the rendezvous without the dead node and restarts its own
workers at WORLD_SIZE 2 (TORCHELASTIC_RESTART_COUNT 1); they must resume from that checkpoint
with the same global batch (twice the micro-batches per rank) and finish every step.

Real processes, real gloo, real files; nothing is mocked. Every wait has a deadline and every
process started here (agents and the workers torchrun puts in sessions of their own) is killed
in ``finally``, found by an environment tag they all inherit.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from stalwart.rundir import RunData, read_jsonl
from tests.helpers import SRC, free_port

pytestmark = pytest.mark.slow

TORCHRUN = Path(sys.executable).parent / "torchrun"
STEPS, CKPT_EVERY, KILL_AFTER = 30, 4, 8  # kill once a 4-rank checkpoint >= step 8 exists
TAG = "STALWART_ELASTIC_TEST"




def _tagged(tag: str) -> list[int]:
    """Pids of live processes whose environment carries TAG=tag (an agent and its workers)."""
    want = f"{TAG}={tag}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if want in (d / "environ").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except OSError:
            continue  # gone, or not ours
    return pids


def _signal_all(tag: str, sig: signal.Signals) -> None:
    for pid in _tagged(tag):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_for(what: str, cond: Callable[[], bool], timeout: float,
              agents: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for a in agents:
            assert a.poll() is None, f"agent exited with {a.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.1)


def _latest(run_dir: Path) -> tuple[int, int | None]:
    """(step, world) of the newest complete checkpoint; (-1, None) when there is none."""
    try:
        step = int((run_dir / "checkpoints" / "LATEST").read_text())
        world = (run_dir / "checkpoints" / f"step-{step:06d}" / "WORLD").read_text()
        return step, int(world)
    except (OSError, ValueError):
        return -1, None


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
def test_a_node_leaves_and_the_other_goes_on_from_the_checkpoint(  # noqa: PLR0915
        tmp_path: Path) -> None:  # one scenario, asserted step by step
    # a small corpus: four ranks reading the whole stdlib would dominate the test's time
    data = tmp_path / "corpus.txt"
    text = "".join(p.read_text(errors="replace") for p in sorted(
        Path(os.__file__).parent.glob("[a-f]*.py")))
    data.write_text(text[:400_000])
    run_dir = tmp_path / "runs" / "el"
    port, tag = free_port(), uuid.uuid4().hex
    # keep_alive: the dead node's heartbeats lapse after 3 s, not 15; last_call: a rendezvous
    # with fewer than 2 nodes closes 3 s after the first one joined
    conf = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"

    def agent(name: str, is_host: bool) -> subprocess.Popen[bytes]:
        cmd = [str(TORCHRUN), "--nnodes", "1:2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", tag, "--rdzv-conf", f"{conf},is_host={int(is_host)}",
               "--max-restarts", "3", "--monitor-interval", "0.5",
               "-m", "stalwart.train.worker", "--preset", "tiny", "--data", str(data),
               "--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--eval-every", "10",
               "--eval-batches", "2", "--micro-batch-size", "4", "--warmup", "5",
               "--out", str(tmp_path / "runs"), "--name", "el", "--resume"]
        env = {**os.environ, TAG: f"{tag}-{name}",
               "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        log = open(tmp_path / f"agent-{name}.log", "wb")  # noqa: SIM115 -- owned by the child
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=tmp_path, start_new_session=True)

    agents: list[subprocess.Popen[bytes]] = []
    try:
        # the leaving node is a client of the rendezvous store; the staying one hosts it (with
        # the c10d backend the store lives in the agent at --rdzv-endpoint). The client starts
        # first and waits for the store, so both join the first round together: world 4.
        leaving = agent("leaving", is_host=False)
        agents.append(leaving)
        time.sleep(1.0)
        staying = agent("staying", is_host=True)
        agents.append(staying)

        def four_rank_checkpoint() -> bool:
            step, world = _latest(run_dir)
            return step >= KILL_AFTER and world == 4

        _wait_for("a checkpoint written by 4 ranks", four_rank_checkpoint, 180, agents)
        # freeze the leaving node first: with a peer stopped no step (and no checkpoint) can
        # complete, so the checkpoint to resume from is known before the node goes away
        _signal_all(f"{tag}-leaving", signal.SIGSTOP)
        time.sleep(0.5)  # let a checkpoint whose barrier had already passed land
        ckpt_step, ckpt_world = _latest(run_dir)
        assert ckpt_world == 4 and ckpt_step < STEPS
        global_batch = RunData.load(run_dir).config["global_batch"]
        _signal_all(f"{tag}-leaving", signal.SIGKILL)
        leaving.wait(timeout=30)

        try:
            rc = staying.wait(timeout=240)
        except subprocess.TimeoutExpired:
            pytest.fail("the surviving agent did not finish within 240 s:\n"
                        + _tail(tmp_path / "agent-staying.log"))
        assert rc == 0, _tail(tmp_path / "agent-staying.log")
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
        for name in ("leaving", "staying"):
            _signal_all(f"{tag}-{name}", signal.SIGKILL)
        for a in agents:
            a.wait(timeout=30)

    run = RunData.load(run_dir)
    resumed = run.events_of("resumed")
    assert resumed, "no rank resumed"
    res = resumed[-1]
    # the surviving node resumed at world size 2 from the 4-rank checkpoint it left off at
    assert res["world"] == 2 and res["saved_world"] == 4, res
    assert res["step"] == ckpt_step, (res, ckpt_step)
    before = [m for m in run.metrics if m["time"] < res["time"]]
    after = [m for m in run.metrics if m["time"] >= res["time"]]
    assert {m["rank"] for m in before} == {0, 1, 2, 3}
    assert {m["rank"] for m in after} == {0, 1} and {m["world"] for m in after} == {2}
    for rank in (0, 1):
        steps = sorted(m["step"] for m in after if m["rank"] == rank)
        assert steps == list(range(ckpt_step, STEPS)), (rank, steps)
    # the same global batch at world 2: each step's samples over both ranks add up to it
    assert run.config["global_batch"] == global_batch and run.config["nproc"] == 2
    per_step: dict[int, int] = {}
    for m in after:
        per_step[m["step"]] = per_step.get(m["step"], 0) + m["samples"]
    assert set(per_step.values()) == {global_batch}
    assert all(math.isfinite(m["loss"]) for m in run.metrics)
    assert _latest(run_dir) == (STEPS, 2)
    assert run.events_of("run_finished"), read_jsonl(run_dir / "events.jsonl")[-5:]
    assert run.final_val_loss() < run.initial_val_loss()
