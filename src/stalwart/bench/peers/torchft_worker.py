"""One torchft replica group (of one rank) training stalwart's tiny GPT, for ``bench mitigate``.

Started by the launcher inside testbed host r (``torchft_run.py``: ``launch(..., module=this,
keep_going=True)``), so the testbed's faults (kill, CPU quota) act on it as on stalwart's own
ranks. Replica group r = launch rank r of N. Set up as torchft's documentation does it
(its ``train_ddp.py``): ``ProcessGroupGloo(timeout=5 s)``, ``Manager(min_replica_size=1,
timeout=30 s, checkpoint_transport=PGTransport)``, the optimizer wrapped in torchft's
``Optimizer`` (``zero_grad`` starts the quorum, ``step`` commits only when every member's
collectives succeeded), data sharded by replica group (a lost group's shard is not trained),
and a Lighthouse (``--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``,
heartbeat timeout 5 s) run by replica 0 on its host. Two ways to average gradients:
``--mode ddp`` torchft's ``DistributedDataParallel`` (documented), ``--mode allreduce``
one ``Manager.allreduce`` of all gradients flattened, after the backward passes.

The workload is stalwart's, step for step: the same model and seed (so ``init_sync=False``,
as torchft's docs advise for identically seeded replicas), the step's global batch of
``global_batch`` samples cut into the same micro-batches (replica r computes micro-batches
r, r+N, ...), each micro-batch loss weighted 1/k so the average over replicas is the mean over
the step's micro-batches, the same clipping, AdamW and learning-rate schedule (``lr_at`` of the
committed step). As in torchft's docs the data position advances per attempted step (its
data loader's next batch), committed or not: a dropped step's samples are not trained.

Per attempt every replica writes a metrics line (stalwart's keys, so the launcher's fault
schedule follows it) with ``committed``, ``data_step`` and ``world`` = the quorum's
participants; the lowest participating replica logs the final ``eval`` event.

Usage: python -m stalwart.bench.peers.torchft_worker --config RUN_DIR/config.json --mode MODE
       python -m stalwart.bench.peers.torchft_worker --lighthouse BIND   (replica 0 starts it)
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed import TCPStore

from stalwart.config import RunConfig
from stalwart.events import Eval, TorchftQuorum
from stalwart.rundir import LOGS, METRICS, EventLog, JsonlWriter
from stalwart.train.data import load_corpus, micro_batch, step_starts, val_batches
from stalwart.train.model import GPT, PRESETS
from stalwart.train.rank import lr_at

MODES = ("ddp", "allreduce")
LIGHTHOUSE_PORT = 29510  # torchft's default
STORE_PORT = 29600  # + r: replica group r's own TCPStore, on its host
# torchft's documented Lighthouse settings (README); its heartbeat timeout is the default 5 s
LIGHTHOUSE_ARGS = {"min_replicas": 1, "quorum_tick_ms": 100, "join_timeout_ms": 10_000,
                   "heartbeat_timeout_ms": 5_000}
START_TIMEOUT_S = 120.0


def run_lighthouse(bind: str) -> int:
    """torchft's Lighthouse server in this process until it is killed (lifeline ties it to
    replica 0). The in-process server, not the ``torchft_lighthouse`` script: that one parses
    the process's own argv, which here is ``python -m ...``."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind=bind, **LIGHTHOUSE_ARGS)
    print(f"lighthouse at {server.address()} ({LIGHTHOUSE_ARGS})", flush=True)
    while True:
        time.sleep(3600)


def start_lighthouse(run_dir: Path, port: int) -> subprocess.Popen:
    log = open(run_dir / LOGS / "lighthouse.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "stalwart.lifeline", str(os.getpid()),
         "stalwart.bench.peers.torchft_worker", "--lighthouse", f"0.0.0.0:{port}"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    return proc


def wait_port(addr: str, port: int, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens at {addr}:{port}") from None
            time.sleep(0.1)


def wait_count(store: TCPStore, key: str, n: int, timeout_s: float) -> int:
    """Poll a store counter until it reaches ``n`` (or the timeout); its last value."""
    deadline = time.monotonic() + timeout_s
    got = store.add(key, 0)
    while got < n and time.monotonic() < deadline:
        time.sleep(0.05)
        got = store.add(key, 0)
    return got


class Replica:
    """One replica group's training: torchft's Manager around stalwart's workload."""

    def __init__(self, cfg: RunConfig, mode: str) -> None:
        from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
        from torchft.checkpointing.pg_transport import PGTransport

        self.cfg, self.mode = cfg, mode
        self.rank = int(os.environ["RANK"])
        self.n = int(os.environ["WORLD_SIZE"])
        self.addr = os.environ.get("STALWART_HOST_ADDR", "127.0.0.1")
        self.run_dir = Path(os.environ["STALWART_RUN_DIR"])
        torch.set_num_threads(cfg.job.threads)
        self.mcfg = PRESETS[cfg.train.preset]["model"]
        self.corpus = load_corpus(cfg.train.data, cfg.train.max_data_bytes)
        self.mbs, self.gb = cfg.resolved_micro_batch_size(), cfg.resolved_global_batch()
        self.mine = list(range(self.rank, self.gb // self.mbs, self.n))  # this group's shard
        master = os.environ["MASTER_ADDR"]
        self.lighthouse = start_lighthouse(self.run_dir, LIGHTHOUSE_PORT) \
            if self.rank == 0 else None
        # every group up before the first quorum: launch rank 0's store as a barrier
        self.job = TCPStore(master, int(os.environ["MASTER_PORT"]), self.n, self.rank == 0,
                            timeout=timedelta(seconds=START_TIMEOUT_S))
        wait_port(master, LIGHTHOUSE_PORT)
        port = STORE_PORT + self.rank  # distinct where hosts share an address (local)
        self.store = TCPStore(self.addr, port, 1, True, wait_for_workers=False)
        torch.manual_seed(cfg.train.seed)
        self.model = GPT(self.mcfg)
        inner = torch.optim.AdamW(self.model.parameters(), lr=cfg.resolved_lr(),
                                  betas=(0.9, 0.95), weight_decay=cfg.train.weight_decay)
        pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
        self.manager = Manager(
            pg=pg, min_replica_size=1, load_state_dict=self._load, state_dict=self._state,
            replica_id=f"stalwart_{self.rank}", timeout=timedelta(seconds=30),
            checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10),
                                             device=torch.device("cpu")),
            store_addr=self.addr, store_port=port, rank=0, world_size=1,
            lighthouse_addr=f"http://{master}:{LIGHTHOUSE_PORT}", hostname=self.addr,
            init_sync=False)
        self.opt = Optimizer(self.manager, inner)
        self.net: nn.Module = DistributedDataParallel(self.manager, self.model) \
            if mode == "ddp" else self.model
        self.metrics = JsonlWriter(self.run_dir / METRICS)
        self.events = EventLog(self.run_dir)
        # every Manager heartbeats before anyone asks for a quorum: the first one has all
        self.job.add("managers", 1)
        wait_count(self.job, "managers", self.n, START_TIMEOUT_S)

    def _load(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optim"])

    def _state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def batches(self, data_step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        starts = step_starts(self.corpus, self.gb, self.mcfg.block_size, self.cfg.train.seed,
                             data_step)
        return [micro_batch(self.corpus, starts, self.mbs, self.mcfg.block_size, g)
                for g in self.mine]

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        losses = []
        w = 1.0 / len(batches)
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            ctx = self.net.no_sync() if self.mode == "ddp" and not last \
                else contextlib.nullcontext()
            with ctx:
                _, loss = self.net(x, y)
                (loss * w).backward()
            losses.append(loss.item())
        return sum(losses) / len(losses)

    def average_gradients(self) -> None:
        """``--mode allreduce``: one Manager.allreduce (AVG over the quorum) of every
        gradient; on an error torchft discards the step at ``should_commit``."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self.manager.allreduce(flat).wait()
        off = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[off:off + n].view_as(p.grad))
            off += n

    def step(self, attempt: int) -> dict[str, Any]:
        """One attempted step: the quorum, forward/backward, gradients averaged, the commit."""
        t0 = time.perf_counter()
        step = self.manager.current_step()
        self.opt.zero_grad(set_to_none=True)  # torchft: starts this step's quorum
        lr = lr_at(step, self.cfg)
        for g in self.opt.param_groups:
            g["lr"] = lr
        loss = self.forward_backward(self.batches(attempt))
        t_fb = time.perf_counter()
        if self.mode == "allreduce":
            self.average_gradients()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
        self.opt.step()  # should_commit: every member agrees, or nobody steps
        t1 = time.perf_counter()
        committed = self.manager.current_step() > step
        tokens = self.mbs * len(self.mine) * self.mcfg.block_size
        return {"step": step, "data_step": attempt, "rank": self.rank, "time": time.time(),
                "loss": loss, "lr": lr, "step_time": t1 - t0, "compute_time": t_fb - t0,
                "fb_time": t_fb - t0, "comm_time": t1 - t_fb,
                "samples": self.mbs * len(self.mine), "tokens": tokens,
                "tokens_per_s": tokens / (t1 - t0), "micro_batches": len(self.mine),
                "world": self.manager.num_participants(), "host": self.rank,
                "committed": committed, "quorum_id": getattr(self.manager, "_quorum_id", None),
                "peer": f"torchft-{self.mode}"}

    def train(self) -> None:
        attempt, members = 0, self.n
        while self.manager.current_step() < self.cfg.train.steps:
            rec = self.step(attempt)
            self.metrics.write(rec)
            attempt += 1
            if rec["world"] != members and self.manager.participating_rank() == 0:
                self.events.emit(TorchftQuorum(step=rec["step"], world=rec["world"],
                                               quorum_id=rec["quorum_id"],
                                               committed=rec["committed"]))
            members = rec["world"]
        self.finish(members)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        val = val_batches(self.corpus, self.cfg.train.eval_batches, self.cfg.resolved_batch_size(),
                          self.mcfg.block_size, self.cfg.train.seed)
        total = sum(float(self.model(x, y)[1].item()) for x, y in val)
        return total / len(val)

    def finish(self, members: int) -> None:
        """The lowest participating group logs the final validation loss; replica 0 (the
        Lighthouse's host) leaves last, once every member of the last quorum is done."""
        if self.manager.participating_rank() == 0:
            self.events.emit(Eval(step=self.manager.current_step(), val_loss=self.evaluate(),
                                  peer=f"torchft-{self.mode}"))
        self.job.add("done", 1)
        if self.rank == 0:
            wait_count(self.job, "done", members, 30.0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--lighthouse"] and len(argv) == 2:
        return run_lighthouse(argv[1])
    if len(argv) != 4 or argv[0] != "--config" or argv[2] != "--mode" or argv[3] not in MODES:
        print("usage: torchft_worker --config CONFIG --mode {ddp,allreduce} | "
              "--lighthouse BIND", file=sys.stderr)
        return 2
    rep = Replica(RunConfig.load(Path(argv[1])), argv[3])
    rep.train()
    rep.metrics.close()
    rep.events.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # torchft's manager, transport and quorum threads can hold the interpreter's exit for
    # their own timeouts; the run's lines are written
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
