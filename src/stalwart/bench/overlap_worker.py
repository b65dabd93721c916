"""One rank of the overlap benchmark: the three schedules, interleaved, on one model.

Mechanism measured: DHelix strand interleaving against sequential execution and against
intra-micro-batch overlap (arXiv 2411.15871). Every rank builds the same TP GPT over the whole
world (one TP group), creates the three executors over that one model ("off", "async", "si"),
profiles and plans the interleaved one, then runs repetitions in rotating order (off, async,
si; async, si, off; ...) with a barrier before each step, so slow drifts of the shared machine
hit all three alike. Each step's wall time and the executor's own accounting (compute, comm
in flight, exposed, activation peak) go to ``RUN_DIR/bench-rank-R.json``.

Started by ``stalwart.bench.overlap`` through the launcher (``python -m
stalwart.bench.overlap_worker --config RUN_DIR/config.json [options]``), inside testbed hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from stalwart.overlap.comm import TPComm
from stalwart.overlap.executor import SCHEDULES, Interleaved
from stalwart.overlap.tpgpt import TPGPT
from stalwart.train.model import GPT, GPTConfig


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="stalwart.bench.overlap_worker")
    p.add_argument("--config", required=True)  # the launcher passes it; shapes come from below
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--profile-reps", type=int, default=2)
    p.add_argument("--defer-wgrad", type=int, default=1, help="split backward for si (0/1)")
    p.add_argument("--wgrad-memory", type=float, default=0.05,
                   help="deferred weight-gradient bytes, x one micro-batch's activations")
    p.add_argument("--chunks", type=int, default=1, help="chunked collectives for si")
    p.add_argument("--serial-comm", type=int, default=0,
                   help="si: one collective on the wire at a time (0/1)")
    p.add_argument("--probe", action="store_true",
                   help="instead of the schedules: how long one all-reduce of a block's "
                        "activations takes alone, and while this rank computes")
    p.add_argument("--gloo-threads", type=int, default=0,
                   help="the TP group's gloo worker threads (0: the default group)")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=DEFER,WGRAD_MEMORY,CHUNKS,SERIAL: one more interleaved executor, "
                        "timed in the same rotation (e.g. si_plain=0,0,1,0: strand "
                        "interleaving alone), for comparisons within one run")
    p.add_argument("--device", default="cpu", help="auto | cpu | cuda (devices.py)")
    p.add_argument("--tag", default="bench")
    p.add_argument("--trace", action="store_true",
                   help="after the timed steps, one traced step per schedule: every "
                        "collective's issue, completion and wait times (monotonic clock)")
    return p.parse_args(argv)


def probe(block: int, batch: int, n_embd: int, reps: int = 15) -> dict[str, list[float]]:
    """All-reduce time alone ("idle") and while this rank computes GEMM pieces of ~1 ms,
    polling for completion between pieces ("busy"; completion time = first poll that saw it,
    so at most one piece late) -- how much computing slows the transfer on this machine."""
    t = torch.randn(batch * block, n_embd)
    a, b = torch.randn(128, 768), torch.randn(768, 384)
    out: dict[str, list[float]] = {"idle": [], "busy": [], "piece": []}
    for r in range(reps + 1):
        for kind in ("idle", "busy"):
            dist.barrier()
            t0 = time.perf_counter()
            w = dist.all_reduce(t, async_op=True)
            if kind == "busy":
                while not w.is_completed():
                    p0 = time.perf_counter()
                    a.matmul(b)
                    if r:
                        out["piece"].append(time.perf_counter() - p0)
            w.wait()
            if r:  # the first round warms up
                out[kind].append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:  # noqa: PLR0915 (one bench flow, in order)
    a = parse(list(sys.argv[1:] if argv is None else argv))
    torch.set_num_threads(1)
    from stalwart.devices import plan_devices, rank_slot, visible_gpus

    slot, slots = rank_slot()
    dplan = plan_devices(a.device, slots, visible_gpus() if a.device != "cpu" else 0)
    device = torch.device(dplan.device_of(slot))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(dplan.backend, timeout=timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = Path(os.environ.get("STALWART_RUN_DIR", Path(a.config).parent))
    try:
        if a.probe:
            res = probe(a.block, a.batch, a.n_embd)
            (run_dir / f"{a.tag}-rank-{rank}.json").write_text(json.dumps(res))
            dist.barrier()
            return 0
        cfg = GPTConfig(block_size=a.block, n_layer=a.n_layer, n_head=a.n_head,
                        n_embd=a.n_embd)
        torch.manual_seed(0)
        group = dist.group.WORLD
        if a.gloo_threads:
            opts = dist.ProcessGroupGloo._Options()
            opts._threads = a.gloo_threads
            group = dist.new_group(list(range(world)), backend="gloo", pg_options=opts)
        comm = TPComm(group)
        model = TPGPT.from_full(GPT(cfg), comm).to(device)
        g = torch.Generator().manual_seed(1)
        mbs = [(torch.randint(0, cfg.vocab_size, (a.batch, a.block), generator=g).to(device),
                torch.randint(0, cfg.vocab_size, (a.batch, a.block), generator=g).to(device))
               for _ in range(a.micro_batches)]
        scheds = a.schedules.split(",")
        execs = {s: Interleaved(model, comm, schedule=s, profile_reps=a.profile_reps,
                                measure_memory=True, defer_wgrad=bool(a.defer_wgrad),
                                wgrad_memory=a.wgrad_memory, chunks=a.chunks,
                                serial_comm=bool(a.serial_comm))
                 for s in scheds}
        for v in a.variant:
            name, opts = v.split("=")
            defer, wmem, chunks, serial = opts.split(",")
            execs[name] = Interleaved(model, comm, schedule="si", profile_reps=a.profile_reps,
                                      measure_memory=True, defer_wgrad=bool(int(defer)),
                                      wgrad_memory=float(wmem), chunks=int(chunks),
                                      serial_comm=bool(int(serial)))
            scheds.append(name)
        t0 = time.perf_counter()
        if "si" in execs:
            execs["si"].ensure_plan(mbs)
        profile_time = time.perf_counter() - t0
        for s in scheds[len(scheds) - len(a.variant):]:
            execs[s].ensure_plan(mbs)
        # a step ends when the device is done with it (a no-op on CPU): the deferred
        # weight-gradient GEMMs of "si" are enqueued after the loss was read
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        for s in scheds:  # warm-up (first-touch allocations, gloo connections)
            dist.barrier()
            execs[s].forward_backward(mbs)
            sync()
        steps: dict[str, list[dict[str, float]]] = {s: [] for s in scheds}
        for r in range(a.reps):
            for k in range(len(scheds)):
                s = scheds[(r + k) % len(scheds)]
                dist.barrier()
                t = time.perf_counter()
                loss, timings = execs[s].forward_backward(mbs)
                sync()
                wall = time.perf_counter() - t
                steps[s].append({"wall": wall, "loss": loss, "bytes": comm.ledger.bytes,
                                 **timings})
        traces = {}
        if a.trace:
            for s in scheds:
                comm.trace = []
                dist.barrier()
                t = time.perf_counter()
                execs[s].forward_backward(mbs)
                traces[s] = {"t0": t, "t1": time.perf_counter(), "collectives": [
                    [p.t_issue, p.t_done, *(p.t_wait or (None, None)),
                     p.tensor.numel() * p.tensor.element_size()] for p in comm.trace]}
            comm.trace = None
        plan = execs["si"].plan if "si" in execs else None
        stream = execs["si"].stream_steps(a.micro_batches) if "si" in execs else None
        predicted = execs["si"].predicted_step_time(a.micro_batches) if "si" in execs else None
        out = {
            "rank": rank, "world": world, "model": cfg.to_dict(), "batch": a.batch,
            "device": str(device), "backend": dplan.backend, "devices": dplan.describe(),
            "micro_batches": a.micro_batches, "reps": a.reps, "profile_time": profile_time,
            "si_options": {"defer_wgrad": bool(a.defer_wgrad), "wgrad_memory": a.wgrad_memory,
                           "chunks": a.chunks, "serial_comm": bool(a.serial_comm),
                           "gloo_threads": a.gloo_threads},
            "plan": None if plan is None else {"steps": plan.steps,
                                               "predicted_time": plan.predicted_time,
                                               "sequential_time": plan.sequential_time,
                                               "profile": plan.profile,
                                               "stream_steps": stream,
                                               "predicted_step_time": predicted},
            "steps": steps,
            "traces": traces,
            "variants": {s: {"predicted_step_time": execs[s].predicted_step_time(
                a.micro_batches), "stream_steps": execs[s].stream_steps(a.micro_batches)}
                for s in scheds[len(scheds) - len(a.variant):]},
        }
        (run_dir / f"{a.tag}-rank-{rank}.json").write_text(json.dumps(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
