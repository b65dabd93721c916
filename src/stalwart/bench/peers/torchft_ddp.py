"""The plain DDP user script of ``bench elastic`` written for torchft: one replica group per
rank, as torchft's ``train_ddp.py`` sets it up.

Each emulated node runs its own ``torchrun --standalone --nproc-per-node K`` of this script;
every worker is a replica group of one rank (``replica_id`` = node * K + local rank) with its
own store, a ``ProcessGroupGloo(timeout=5 s)``, a ``Manager(min_replica_size=1, timeout=10 s)``
talking to torchft's Lighthouse (its own process, ``TORCHFT_LIGHTHOUSE``), and the optimizer
wrapped in torchft's ``Optimizer`` (``zero_grad`` starts the step's quorum, ``step`` commits
only when every member's collectives succeeded). A replica restarted by the harness heals
from a peer (torchft's checkpoint transport over the process group, ``PGTransport``: its HTTP
transport advertises the machine's host name, which a network namespace cannot reach).

Gradients are averaged by one ``Manager.allreduce`` of all gradients flattened, after the
backward pass: torchft's ``DistributedDataParallel`` wrapper crashes a survivor with an
``AssertionError`` in its communication hook when a peer dies inside a gradient all-reduce
(measured in ``bench mitigate``: ``torchft_ddp_crashed``); the Manager's own all-reduce is the
form that survives a kill.

The workload is examples/elastic_ddp.py's (its ``make_data`` and ``make_model``, imported
from ``--workload``; AdamW, the same seed): step s's global batch is the ``batch`` samples
``s * batch + i``, replica r of R computes its contiguous share r (``share``, as
examples/plain_ddp_ckpt.py splits it), gradients averaged over the quorum. torchft keeps the
number of steps, not the global batch: a missing replica's share of a step is not trained
(torchft's ``DistributedSampler`` shards over a fixed number of replica groups). The data of a
step is chosen by the committed step: a discarded attempt is redone on the same data.

Output (``--out DIR``): ``DIR/torchft-r<replica>.jsonl`` in elastic_ddp.py's format: a
``start`` line, one line per attempted step (``step``, ``t``, ``samples``, ``world`` = the
quorum's participants, ``gen`` = the quorum id, ``committed``, ``loss``, ``member`` = the
replica), a ``final`` line with ``val_loss``.

Usage: torchrun ... -m stalwart.bench.peers.torchft_ddp --out DIR --steps N --batch B
       --replicas R [--replica-base NODE*K] [--barrier ADDR:PORT] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

STORE_BASE = 29700  # + replica: each replica group's own TCPStore, on its node
START_TIMEOUT_S = 120.0
WORKLOAD = Path(__file__).resolve().parents[4] / "examples" / "elastic_ddp.py"


def workload(path: Path) -> Any:
    """The user script's module (its ``make_data`` and ``make_model``), imported by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("elastic_workload", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"torchft_ddp: cannot import the workload {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def share(batch: int, replicas: int, r: int) -> range:
    """Replica r's contiguous positions of a global batch (the first ``batch % replicas``
    one more), as examples/plain_ddp_ckpt.py and stalwart.elastic split it."""
    base, extra = divmod(batch, replicas)
    start = r * base + min(r, extra)
    return range(start, start + base + (1 if r < extra else 0))


def main(argv: list[str] | None = None) -> int:  # noqa: PLR0915 (the peer as its docs run it)
    p = argparse.ArgumentParser(prog="torchft_ddp")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=64, help="global batch (samples per step)")
    p.add_argument("--samples", type=int, default=16384, help="training set size")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--compute-ms", type=float, default=0.0)
    p.add_argument("--workload", type=Path, default=WORKLOAD)
    p.add_argument("--replicas", type=int, required=True, help="replica groups in all")
    p.add_argument("--replica-base", type=int, default=0, help="this node's first replica")
    p.add_argument("--barrier", default=None, help="ADDR:PORT: wait for --replicas Managers "
                   "there before the first step (a first start; a restart does not wait)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    a = p.parse_args(argv)
    t_start = time.time()

    from torch.distributed import TCPStore
    from torchft import Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    torch.set_num_threads(1)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    replica = a.replica_base + local
    addr = os.environ.get("STALWART_NODE_ADDR", "127.0.0.1")
    w = workload(a.workload)
    torch.manual_seed(a.seed)
    x, y = w.make_data(a.samples, a.seed)
    xv, yv = w.make_data(2048, a.seed + 1)
    net = w.make_model(hidden=a.hidden)
    inner = torch.optim.AdamW(net.parameters(), lr=a.lr)

    def load(sd: dict[str, Any]) -> None:
        net.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def state() -> dict[str, Any]:
        return {"model": net.state_dict(), "optim": inner.state_dict()}

    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    port = STORE_BASE + replica
    store = TCPStore(addr, port, 1, True, wait_for_workers=False)  # noqa: F841 -- serves
    manager = Manager(
        pg=pg, min_replica_size=1, load_state_dict=load, state_dict=state,
        replica_id=f"r{replica}", timeout=timedelta(seconds=10),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10),
                                         device=torch.device("cpu")),
        store_addr=addr, store_port=port, rank=0, world_size=1,
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"], hostname=addr, init_sync=False)
    opt = Optimizer(manager, inner)
    if a.barrier:  # every Manager heartbeats before anyone asks for the first quorum
        host, _, bport = a.barrier.rpartition(":")
        job = TCPStore(host, int(bport), a.replicas, replica == 0,
                       timeout=timedelta(seconds=START_TIMEOUT_S))
        job.add("managers", 1)
        deadline = time.monotonic() + START_TIMEOUT_S
        while job.add("managers", 0) < a.replicas and time.monotonic() < deadline:
            time.sleep(0.05)
    a.out.mkdir(parents=True, exist_ok=True)
    log = open(a.out / f"torchft-r{replica}.jsonl", "a", buffering=1)  # noqa: SIM115
    log.write(json.dumps({"start": True, "t_start": t_start, "t_joined": time.time(),
                          "member": replica, "node": addr, "local_rank": local}) + "\n")
    params = list(net.parameters())
    mine = share(a.batch, a.replicas, replica)
    while manager.current_step() < a.steps:
        step = manager.current_step()
        opt.zero_grad(set_to_none=True)  # torchft: starts this step's quorum
        idx = torch.tensor([step * a.batch + i for i in mine]) % len(x)
        loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
        loss.backward()
        time.sleep(a.compute_ms / 1000)
        flat = torch.cat([q.grad.reshape(-1) for q in params])
        manager.allreduce(flat).wait()  # the average over the quorum's replicas
        off = 0
        for q in params:
            n = q.grad.numel()
            q.grad.copy_(flat[off:off + n].view_as(q.grad))
            off += n
        opt.step()  # commits only when every member agrees
        log.write(json.dumps({
            "step": step, "t": time.time(), "samples": len(mine),
            "world": manager.num_participants(), "gen": manager._quorum_id,
            "committed": manager.current_step() > step, "loss": float(loss.detach()),
            "member": replica, "node": addr, "local_rank": local}) + "\n")
    with torch.no_grad():
        val = float(nn.functional.cross_entropy(net(xv), yv))
    log.write(json.dumps({"final": True, "steps": a.steps, "val_loss": val}) + "\n")
    log.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # torchft's manager, transport and quorum threads can hold the interpreter's exit for
    # their own timeouts; the run's lines are written
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
