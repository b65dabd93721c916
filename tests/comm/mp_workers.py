"""Worker functions for the multi-process comm tests (spawned by torch.multiprocessing).

Each worker initialises a gloo group on loopback (setup only: secret and address exchange,
reference results), runs the real UDP collective, and writes what it saw to ``out/rank-R.json``
for the test to check in the parent.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

CLIP = 0.05  # small enough that clipping is active on every step of the tiny model


def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    if "STALWART_HOST_ADDR" not in os.environ:  # spawned locally (on a testbed host: env set)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          STALWART_HOST_ADDR="127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=world)


def kernel_drops(sock) -> int:
    """Datagrams the kernel dropped for this UDP socket (its receive buffer was full): the
    ``drops`` column of /proc/net/udp for the socket's inode; -1 where it cannot be read."""
    ino = os.fstat(sock.fileno()).st_ino
    try:
        lines = Path("/proc/net/udp").read_text().splitlines()[1:]
    except OSError:
        return -1
    for line in lines:
        f = line.split()
        if len(f) >= 13 and f[9] == str(ino):
            return int(f[12])
    return -1


def _dump(out: str, rank: int, rec: dict) -> None:
    Path(out, f"rank-{rank}.json").write_text(json.dumps(rec))


def allreduce_worker(rank: int, world: int, port: int, numel: int, rounds: int, out: str,
                     mtu: int = 1500, silent_rank: int = -1, silent_from: int = 10**9,
                     cap: float = 5.0, floor: float | None = None, values: str = "random",
                     copies: int = 1, copies_target: float | None = None,
                     late_rank: int = -1, late_round: int = -1, late_by: float = 0.0,
                     fec: str = "copies") -> None:
    """``rounds`` all-reduces of random vectors; compares with gloo's exact average.

    ``silent_rank`` stops taking part from round ``silent_from`` on (it just sleeps until the
    others are done, so its socket stays open but sends nothing: a hung peer).
    ``late_rank`` sleeps ``late_by`` seconds before round ``late_round`` (a rank held up by
    something else, e.g. a TCP retransmission in its eval traffic).
    """
    from stalwart.comm.collective import LossyCollective
    from stalwart.comm.deadline import AdaptiveDeadline

    _init(rank, world, port)
    dl = AdaptiveDeadline(initial=cap, cap=cap, floor=cap if floor is None else floor)
    coll = LossyCollective(numel, mtu=mtu, deadline=dl, value_copies=copies, grad_copies=copies,
                           copies_target=copies_target, fec_mode=fec)
    rng = np.random.default_rng(1000 + rank)
    rec: dict = {"err": [], "hits": [], "lost": [], "recv": [], "silent": [], "elapsed": [],
                 "out": [], "copies": [], "recovered": [], "parity": []}
    try:
        for r in range(rounds):
            x = rng.standard_normal(numel).astype(np.float32)
            if values == "rank":  # rank i contributes 2**i everywhere: a sum names its senders
                x = np.full(numel, 2.0 ** rank, np.float32)
            ref = torch.from_numpy(x.copy())
            if rank == silent_rank and r >= silent_from:
                continue
            if rank == late_rank and r == late_round:
                time.sleep(late_by)
            t = time.perf_counter()
            got, ps = coll.allreduce(x)
            rec["elapsed"].append(time.perf_counter() - t)
            if silent_rank < 0:
                dist.all_reduce(ref)
                rec["err"].append(float(np.abs(got - ref.numpy() / world).max()))
            rec["hits"].append([int(p.deadline_hit) for p in ps])
            rec["copies"].append([p.copies for p in ps])
            rec["recovered"].append([p.recovered for p in ps])
            rec["parity"].append([p.parity for p in ps])
            rec["lost"].append([p.lost for p in ps])
            rec["recv"].append([p.recv for p in ps])
            rec["silent"].append(sorted(coll.silent))
            if values == "rank":
                rec["out"].append(got.tolist())
        rec["rejected"] = coll.rejected_counts()
        rec["port"] = coll.transport.addr[1]
        rec["kernel_drops"] = kernel_drops(coll.transport.sock)
    finally:
        dist.barrier()
        coll.close()
    _dump(out, rank, rec)
    dist.destroy_process_group()


def subgroup_worker(rank: int, world: int, port: int, out: str, members: list[int],
                    numel: int = 5000) -> None:
    """The collective over a subgroup of the world (``members``), e.g. one without global
    rank 0: each member all-reduces ``rank`` everywhere and records the result."""
    from stalwart.comm.collective import LossyCollective

    _init(rank, world, port)
    sub = dist.new_group(members)  # every rank of the world takes part in creating it
    rec: dict = {"member": rank in members}
    if rank in members:
        coll = LossyCollective(numel, group=sub)
        try:
            got, _ = coll.allreduce(np.full(numel, float(rank), np.float32))
            rec["mean"] = [float(got.min()), float(got.max())]
            rec["world"], rec["rank"] = coll.world, coll.rank
        finally:
            coll.close()
    _dump(out, rank, rec)
    dist.barrier()
    dist.destroy_process_group()


def ddp_worker(rank: int, world: int, port: int, steps: int, out: str, comm: str,  # noqa: PLR0915
               mtu: int = 1500, patient: bool = True, fec: str | None = None,
               accumulate: int = 2) -> None:
    """A tiny GPT trained the way nanoGPT sets it up -- two parameter groups (no weight decay on
    biases and norms), a cosine learning-rate schedule, gradient accumulation with
    ``no_sync`` -- with reliable DDP, or switched to the lossy transport by ONE line."""
    from contextlib import nullcontext

    from torch.nn.parallel import DistributedDataParallel as DDP

    import stalwart.comm
    from stalwart.comm.deadline import AdaptiveDeadline
    from stalwart.train.model import GPT, GPTConfig

    _init(rank, world, port)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16))
    ddp = DDP(model)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))
    # patient: deadlines long enough that CPU contention never makes a packet late, so the
    # result must equal the reliable run's
    dl = AdaptiveDeadline(initial=10, floor=10, cap=10) if patient else None
    if comm == "lossy":  # THE line that switches a script to the lossy transport
        opt = stalwart.comm.attach(ddp, opt, max_grad_norm=CLIP, mtu=mtu, deadline=dl, fec=fec)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    g = torch.Generator().manual_seed(rank)
    stats = []
    for _step in range(steps):
        for micro in range(accumulate):
            sync = micro == accumulate - 1
            with nullcontext() if sync else ddp.no_sync():
                x = torch.randint(0, 256, (4, 16), generator=g)
                _, loss = ddp(x, x.roll(1, 1))
                (loss / accumulate).backward()
        if comm != "lossy":  # lossy: the owners clip the averaged gradient (max_grad_norm)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if hasattr(opt, "stats"):
            stats.append(opt.stats())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rec = {"params": flat.tolist(), "stats": stats,
           "lr": [grp["lr"] for grp in opt.param_groups]}
    if comm == "lossy":
        sd = opt.state_dict()
        rec["state_keys"] = sorted(sd)
        rec["rejected"] = opt.coll.rejected_counts()
        opt.load_state_dict(sd)  # round trip must be accepted
        # exact drift: every element this replica received in the last step equals its
        # owner's value; the others (missed chunks) are stale copies, counted
        lay = opt.coll.layout
        mine = torch.cat([p.detach().reshape(-1) for p in opt.params])
        allp = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(allp, mine)
        owners = torch.cat([allp[s][lay.shard(s)[0]: lay.shard(s)[1]] for s in range(world)])
        fresh = torch.from_numpy(opt.age == 0)
        rec["fresh_mismatch"] = float((mine - owners)[fresh].abs().max())
        rec["stale_elems"] = int((~fresh).sum())
        rec["stale_gap"] = float((mine - owners)[~fresh].abs().max()) if (~fresh).any() else 0.0
        opt.close()
    _dump(out, rank, rec)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    """Entry point for ranks started inside testbed hosts (env: RANK, WORLD_SIZE, MASTER_*)."""
    import sys

    kind, out = sys.argv[1], sys.argv[2]
    kw = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if kind == "allreduce":
        allreduce_worker(rank, world, 0, out=out, **kw)
    else:
        ddp_worker(rank, world, 0, out=out, **kw)


if __name__ == "__main__":
    main()
