"""``bench elastic``'s runs: one plain DDP user script on emulated nodes under each arm, with a
fault on the last node, and the step records they leave.

Arms (each node runs its own launcher; node 0 hosts the rendezvous store or the Lighthouse,
and no fault touches it):

- ``stalwart``: ``examples/elastic_ddp.py`` (stalwart's elastic API) under one torchrun agent
  per node, ``--nnodes MIN:MAX`` with c10d rendezvous;
- ``torchrun_elastic``: ``examples/plain_ddp_ckpt.py`` (the same training, its own
  checkpoint and resume) under the same agents with ``--max-restarts``: torchrun restarts
  every worker from the latest checkpoint when a node leaves or joins;
- ``torchft``: ``stalwart.bench.peers.torchft_ddp`` (the same training with torchft's Manager)
  under one single-node torchrun per node, torchft's Lighthouse as its own process in host 0.

Faults, all on the last node (a node of ``per_node`` ranks): ``kill`` (its processes
SIGKILLed; started again ``back_after_s`` later; the run goes to its end), ``hang`` (its ranks
SIGSTOPped) and ``cut`` (its link dropped both ways; root only); a hang or a cut run ends once
the survivors have gone on for a while, or after ``cap_s``. ``none``: the healthy run.

The torchrun agents' rendezvous settings (``RDZV_CONF``): the dead node's keep-alive lapses
after 3 s (not 15 s) and a rendezvous closes 3 s after its minimum joined -- torchrun's
fastest settings that are not flaky here, given to every torchrun arm alike.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.bench import elastic_figures as ef
from stalwart.bench.elastic_nodes import Nodes

ROOT = Path(__file__).resolve().parents[3]  # the repository (examples/ lives there)
EXAMPLES = ROOT / "examples"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
RDZV_CONF = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"
RDZV_PORT = 29400
LIGHTHOUSE_PORT = 29510
BARRIER_PORT = 29620
ARMS = ("stalwart", "torchrun_elastic", "torchft")
FAULTS = ("none", "kill", "hang", "cut")
START_TIMEOUT_S = 180.0
END_GRACE_S = 20.0  # after the job's last step, for the processes' final lines and exits


@dataclass(frozen=True)
class Plan:
    steps: int = 120
    batch: int = 64  # the global batch (samples per step)
    compute_ms: float = 0.0  # extra compute per step (elastic_ddp.py's --compute-ms)
    nodes: int = 4
    per_node: int = 2
    fault_at: int = 30  # the fault comes once a step >= this is done
    back_after_s: float | None = 10.0  # None: the killed node is not started again
    cap_s: float = 45.0  # a hang or cut: how long to wait for the survivors
    run_timeout_s: float = 300.0
    ckpt_every: int = 20

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node


@dataclass
class Episode:
    arm: str
    fault: str
    out: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    t_fault: float | None = None
    t_back: float | None = None
    seen: dict[int, tuple[int, float]] = field(default_factory=dict)
    finished: bool = False
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {"out": str(self.out), "finished": self.finished, "notes": self.notes,
                "t_fault": self.t_fault, "t_back": self.t_back,
                "steps_kept": len(ef.kept(self.records)),
                "samples_trained": ef.samples_trained(self.records),
                "final_val_loss": ef.final_val_loss(self.records)}


def read_records(folder: Path) -> list[dict[str, Any]]:
    """Every JSON object line of every ``*.jsonl`` under ``folder`` (a torn last line is
    skipped)."""
    out = []
    for f in sorted(folder.glob("*.jsonl")):
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Arm:
    """How one arm starts its nodes."""

    name = ""

    def __init__(self, plan: Plan, netns: bool) -> None:
        self.plan = plan
        self.netns = netns
        self.port = RDZV_PORT if netns else free_port()

    def setup(self, nodes: Nodes, rec: Path) -> None:  # noqa: B027 -- optional hook
        """Processes of the arm's own before the nodes (torchft's Lighthouse)."""

    def command(self, nodes: Nodes, i: int, rec: Path, first: bool) -> list[str]:
        raise NotImplementedError

    def env(self, nodes: Nodes, i: int) -> dict[str, str] | None:
        return None

    def script_args(self) -> list[str]:
        p = self.plan
        return ["--steps", str(p.steps), "--batch", str(p.batch), "--compute-ms",
                str(p.compute_ms)]

    def torchrun(self, nodes: Nodes, i: int, target: list[str], max_restarts: int,
                 run_id: str) -> list[str]:
        p = self.plan
        return [TORCHRUN, "--nnodes", f"{max(p.nodes - 1, 1)}:{p.nodes}",
                "--nproc-per-node", str(p.per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{nodes.addr(0)}:{self.port}", "--rdzv-id", run_id,
                "--rdzv-conf", f"{RDZV_CONF},is_host={int(i == 0)}",
                "--max-restarts", str(max_restarts), "--monitor-interval", "0.5",
                "--local-addr", nodes.addr(i), *target]


class Stalwart(Arm):
    """examples/elastic_ddp.py as its docstring runs it: stalwart's membership store as its
    own process in host 0 (``python -m stalwart.elastic.store``), one ``torchrun
    --standalone`` per node joined by it (``STALWART_STORE``)."""

    name = "stalwart"
    script = EXAMPLES / "elastic_ddp.py"

    def setup(self, nodes: Nodes, rec: Path) -> None:
        self.store_port = RDZV_PORT if self.netns else free_port()
        nodes.start(0, [sys.executable, "-m", "stalwart.elastic.store", "--port",
                        str(self.store_port)], log="store.log", agent=False, host=0)

    def env(self, nodes: Nodes, i: int) -> dict[str, str] | None:
        return {"STALWART_STORE": f"{nodes.addr(0)}:{self.store_port}",
                "STALWART_MIN_WORLD": str(self.plan.ranks), "STALWART_NODE": f"node{i}",
                "STALWART_HOST_ADDR": nodes.addr(i)}

    def command(self, nodes: Nodes, i: int, rec: Path, first: bool) -> list[str]:
        return [TORCHRUN, "--standalone", "--nproc-per-node", str(self.plan.per_node),
                "--max-restarts", "0", "--monitor-interval", "0.5", str(self.script),
                "--out", str(rec), *self.script_args()]


class TorchrunElastic(Arm):
    """examples/plain_ddp_ckpt.py under torchrun's c10d rendezvous with ``--max-restarts``.
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torch's opt-out): with the default, the store
    that rank 0's agent serves to the workers is created in the first round and kept, so
    workers restarted in a later round read their predecessors' addresses from it (gloo's
    connectFullMesh fails: "Connection refused") and a node that joins waits for a
    ``MASTER_ADDR`` the old rank 0 never republishes -- the job never resumed, in 3 of 3
    runs of 4 nodes here."""

    name = "torchrun_elastic"
    script = EXAMPLES / "plain_ddp_ckpt.py"

    def env(self, nodes: Nodes, i: int) -> dict[str, str] | None:
        return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    def command(self, nodes: Nodes, i: int, rec: Path, first: bool) -> list[str]:
        p = self.plan
        return self.torchrun(nodes, i, [str(self.script), "--out", str(rec), "--ckpt",
                                        str(rec.parent / "ckpt.pt"), "--ckpt-every",
                                        str(p.ckpt_every), *self.script_args()],
                             max_restarts=10, run_id=f"te{nodes.tag}")


class Torchft(Arm):
    name = "torchft"

    def setup(self, nodes: Nodes, rec: Path) -> None:
        self.lh_port = LIGHTHOUSE_PORT if self.netns else free_port()
        self.barrier = BARRIER_PORT if self.netns else free_port()
        nodes.start(0, [str(Path(sys.executable).parent / "torchft_lighthouse"),
                        "--min_replicas", "1", "--quorum_tick_ms", "100",
                        "--join_timeout_ms", "10000", "--bind", f"0.0.0.0:{self.lh_port}"],
                    log="lighthouse.log", agent=False, host=0)

    def command(self, nodes: Nodes, i: int, rec: Path, first: bool) -> list[str]:
        p = self.plan
        target = ["-m", "stalwart.bench.peers.torchft_ddp", "--out", str(rec),
                  *self.script_args(), "--replicas", str(p.ranks),
                  "--replica-base", str(i * p.per_node)]
        if first:
            target += ["--barrier", f"{nodes.addr(0)}:{self.barrier}"]
        # one replica group per worker, one single-node torchrun per node (torchft's docs);
        # a crashed worker is restarted by it and heals from a peer
        return [TORCHRUN, "--standalone", "--nproc-per-node", str(p.per_node),
                "--max-restarts", "3", "--monitor-interval", "0.5", *target]

    def env(self, nodes: Nodes, i: int) -> dict[str, str] | None:
        return {"TORCHFT_LIGHTHOUSE": f"http://{nodes.addr(0)}:{self.lh_port}"}


ARM_CLASSES: dict[str, type[Arm]] = {"stalwart": Stalwart,
                                      "torchrun_elastic": TorchrunElastic, "torchft": Torchft}


def make_arm(name: str, plan: Plan, netns: bool) -> Arm:
    return ARM_CLASSES[name](plan, netns)


def max_step(records: list[dict[str, Any]]) -> int:
    steps = [int(e.step) for e in ef.executions(records) if e.complete]
    return max(steps, default=-1)


def run_episode(arm: Arm, fault: str, workdir: Path, say: Any = print) -> Episode:
    """One run of ``arm`` with ``fault`` on the last node; its records and fault times."""
    p = arm.plan
    out = workdir / f"{arm.name}-{fault}"
    rec = out / "records"
    rec.mkdir(parents=True, exist_ok=True)
    ep = Episode(arm.name, fault, out)
    victim = p.nodes - 1
    with Nodes(p.nodes, out, arm.netns) as nodes:
        arm.setup(nodes, rec)
        # the store's node last: the others wait for it, and all join the first round
        for i in [*range(1, p.nodes), 0]:
            nodes.start(i, arm.command(nodes, i, rec, first=True), log=f"node{i}.log",
                        env=arm.env(nodes, i))
        t_end = time.monotonic() + START_TIMEOUT_S + p.run_timeout_s
        if fault != "none":
            _apply(arm, nodes, fault, victim, rec, ep, say)
        if fault in ("hang", "cut"):
            _wait_survivors(nodes, rec, ep, p.cap_s)
        else:
            _wait_end(nodes, rec, ep, p.steps, t_end, p.run_timeout_s)
        ep.seen = dict(nodes.seen)
        codes = sorted({q.returncode for ps in nodes.agents.values() for q in ps
                        if q.returncode not in (None, 0, -9)})
        if codes:
            ep.notes.append(f"launcher exit codes {codes} (logs in {out})")
    ep.records = read_records(rec)
    if fault in ("none", "kill"):
        ks = ef.kept(ep.records)
        ep.finished = bool(ks) and ks[-1].step == p.steps - 1
        if not ep.finished:
            ep.notes.append(f"the job did not train all {p.steps} steps (last kept: "
                            f"{ks[-1].step if ks else None})")
    return ep


def _apply(arm: Arm, nodes: Nodes, fault: str, victim: int, rec: Path, ep: Episode,
           say: Any) -> None:
    """The fault once the job has done ``fault_at`` steps; a killed node started again
    ``back_after_s`` later."""
    p = arm.plan
    reached = nodes.wait(START_TIMEOUT_S, lambda: max_step(read_records(rec)) >= p.fault_at)
    if not reached or not nodes.live_agents():
        ep.notes.append(f"step {p.fault_at} not reached; no fault applied")
        return
    ep.t_fault = {"kill": nodes.kill, "hang": nodes.hang, "cut": nodes.cut}[fault](victim)
    say(f"bench elastic: {arm.name}: {fault} of node {victim} at step >= {p.fault_at}")
    if fault == "kill" and p.back_after_s is not None:
        time.sleep(p.back_after_s)
        ep.t_back = time.time()
        nodes.start(victim, arm.command(nodes, victim, rec, first=False),
                    log=f"node{victim}-back.log", env=arm.env(nodes, victim))


def _wait_survivors(nodes: Nodes, rec: Path, ep: Episode, cap_s: float) -> None:
    """A hang or a cut: until the survivors have gone on for 2 s, or ``cap_s``."""
    if ep.t_fault is None:
        return
    tf = ep.t_fault

    def moved_on() -> bool:
        res = ef.resume_s(read_records(rec), tf)
        return res is not None and time.time() > tf + res + 2.0

    if not nodes.wait(cap_s, moved_on):
        ep.notes.append(f"the survivors did not go on within {cap_s:.0f} s")


def _wait_end(nodes: Nodes, rec: Path, ep: Episode, steps: int, t_end: float,
              timeout_s: float) -> None:
    """Until every launcher has exited, or ``END_GRACE_S`` after the job's last step (for
    the final lines) -- what still runs then is named and stopped."""
    last: list[float] = []

    def trained() -> bool:
        if not last and max_step(read_records(rec)) >= steps - 1:
            last.append(time.monotonic())
        return bool(last) and time.monotonic() > last[0] + END_GRACE_S

    if not nodes.wait(max(t_end - time.monotonic(), 1.0), trained):
        ep.notes.append(f"the run did not end within {timeout_s:.0f} s")
    stuck = sorted({i for i, ps in nodes.agents.items() for q in ps if q.poll() is None})
    if stuck:
        ep.notes.append(f"node(s) {stuck} still running {END_GRACE_S:.0f} s after the job's "
                        "last step (stopped by the bench)")
