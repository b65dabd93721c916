"""One rank of the lossy benchmark (started by stalwart.bench.lossy inside a testbed host).

``allreduce``: 16 MiB all-reduce, gloo and ours (with the erasure-coded protection that
training uses) interleaved iteration by iteration, at each loss level in turn (each rank sets
the loss of its own host through the testbed's nftables helper, between barriers).
``profile``: CPU per stage and payload byte of loss-free all-reduces, ours and gloo
(``lossy_profile``).
``drift``: the tiny GPT trained with ``comm.attach`` in mode ``params`` or
``naive`` under UDP loss set by the parent; after every step an exact drift probe (a reliable
gloo all-gather, outside the timed path) measures max |replica - owners' parameters|.

Usage: python -m stalwart.bench.lossy_worker OUT_DIR KIND JSON_ARGS
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist


def _barrier() -> None:
    dist.barrier()


class FileBarrier:
    """A barrier through named pipes in a folder every rank sees, for the timed operations:
    the testbed's hosts are network namespaces of one machine, so a pipe is not a network
    message and the loss under test cannot delay anyone's release. gloo's ``barrier`` can:
    under loss one of its TCP segments waits out a retransmission timeout (>= 200 ms) and the
    ranks it releases late start the next timed all-reduce that much after the others, whose
    time then includes the wait (measured at 0.1-5% loss, MTU 9000: the slowest iteration of
    every level was two ranks starting 0.17-0.2 s after the other two).

    Rank 0 reads one byte per other rank from ``arrive``, then writes one byte into each
    ``release-R``; every other rank writes its byte and blocks reading its ``release-R``.
    Guarantee: no rank leaves call ``n`` before every rank has entered it (a rank writes its
    byte of call n + 1 only after leaving call n, so calls cannot mix). Cost: a few syscalls
    per call and none while waiting -- the kernel wakes a blocked reader, no polling (a
    polling version's sleepers took CPU from the ranks still working and left 27-74 ms apart
    on a machine at load 13-16)."""

    def __init__(self, folder: Path, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        folder.mkdir(parents=True, exist_ok=True)
        names = ["arrive"] + [f"release-{r}" for r in range(1, world)]
        for name in names:  # whoever comes first makes them; O_RDWR never blocks the open
            try:
                os.mkfifo(folder / name)
            except FileExistsError:
                pass
        mine = ["arrive"] + ([f"release-{rank}"] if rank else names[1:])
        self.fds = {name: os.open(folder / name, os.O_RDWR) for name in mine}

    def __call__(self) -> None:
        if self.rank:
            os.write(self.fds["arrive"], bytes([self.rank % 256]))
            while not os.read(self.fds[f"release-{self.rank}"], 1):
                pass
            return
        need = self.world - 1
        while need > 0:
            need -= len(os.read(self.fds["arrive"], need))
        for r in range(1, self.world):
            os.write(self.fds[f"release-{r}"], b"g")

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def _settle(lay, world: int) -> int:
    """All-reduces of warm-up after which the parity a link gets is the one its loss level
    keeps getting: its loss window (~10,000 datagrams, ``copies.DECAY``) has turned over
    twice, and then ``copies.REPORTS_KEPT`` more reports (two per all-reduce and link: one per
    phase) have replaced the earlier ones whose maximum sizes the parity. Without the second
    term a loss-free link still got parity during the first timed all-reduces at MTU 1500
    (4 of warm-up by the window alone; measured: parity on until the 5th-10th all-reduce)."""
    from stalwart.comm.copies import REPORTS_KEPT

    per_link = 2 * max(lay.n_chunks(s) for s in range(world))
    return -(-20_000 // per_link) + -(-REPORTS_KEPT // 2)


def allreduce(out: Path, numel: int, levels: list[float], iters: list[int], warmup: int,  # noqa: PLR0915
              netns: list[str], gloo_levels: list[float] | None = None,
              fec: str = "rs", fec_target: float = 2e-5) -> dict:
    """Per loss level: gloo and ours interleaved (ours with the protection training uses:
    ``fec``, for the residual target ``attach`` uses). gloo is skipped at levels not in
    ``gloo_levels`` (at 10% loss one of its all-reduces takes seconds). Records per iteration:
    times, chunks lost after decoding, chunks rebuilt, UDP bytes sent per payload byte, and per
    phase where its wait went (``waits``: end state, t_started, t_ended, elapsed, last peer,
    lost, rebuilt, t_sent, parity sent; ``rounds.PhaseStats``), and when each timed operation
    started (``starts``, ``gloo_starts``: ``perf_counter``, one clock for every network
    namespace of the machine, so the ranks' start skew can be read). The ranks are lined up
    before each timed operation by a ``FileBarrier`` (the loss cannot delay it)."""
    from stalwart.comm.collective import LossyCollective
    from stalwart.testbed.loss import set_loss

    rank = dist.get_rank()
    coll = LossyCollective(numel, fec_mode=fec, fec_target=fec_target)
    rng = np.random.default_rng(rank)
    x = rng.standard_normal(numel).astype(np.float32)
    lay, world = coll.layout, coll.world
    mine = lay.shard_len(rank)
    # payload this rank must send per all-reduce: its contributions to every other shard, and
    # its own shard's values to every other rank
    payload_bytes = 4 * ((numel - mine) + (world - 1) * mine)
    res: dict = {"levels": {}, "fec": fec, "engine": coll.engine}
    align = FileBarrier(out / "sync", rank, world)
    try:
        for i, (p, n) in enumerate(zip(levels, iters, strict=True)):
            with_gloo = gloo_levels is None or p in gloo_levels
            if rank == 0:  # the parent shows it (a quick run is minutes long)
                (out / "progress").write_text(
                    f"loss {p:.1%} ({i + 1}/{len(levels)} levels), engine {coll.engine}\n")
            _barrier()
            set_loss(netns[rank], p)
            _barrier()
            ours, gloo, lost, chunks, rec, wire, hits, cpu = [], [], [], [], [], [], [], []
            starts: list[float] = []
            gstarts: list[float] = []
            waits: list[list[list]] = []  # per timed iteration, per phase: the wait's account
            gcpu: list[float] = []
            settle = max(warmup, _settle(lay, world))
            for it in range(settle + n):
                t = torch.from_numpy(x.copy())
                buf = x.copy()  # ours in place too, like gloo's all_reduce (lost chunks keep x)
                align()
                timed = it >= settle
                if with_gloo and (timed or it < warmup):
                    tg0, c0 = time.perf_counter(), time.process_time()
                    dist.all_reduce(t)
                    tg, cg = time.perf_counter() - tg0, time.process_time() - c0
                    align()
                b0 = coll.transport.bytes_sent
                t0, c0 = time.perf_counter(), time.process_time()
                _, ps = coll.allreduce(buf, out=buf)
                to = time.perf_counter() - t0
                cpu.append(time.process_time() - c0)
                if timed:
                    if with_gloo:
                        gloo.append(tg)
                        gcpu.append(cg)
                        gstarts.append(tg0)
                    ours.append(to)
                    starts.append(t0)
                    lost.append(sum(q.lost for q in ps))
                    chunks.append(sum(q.lost + q.recv for q in ps))
                    rec.append(sum(q.recovered for q in ps))
                    wire.append((coll.transport.bytes_sent - b0) / payload_bytes)
                    hits.append(sum(int(q.deadline_hit) for q in ps))
                    waits.append([[q.end, round(q.t_started, 5), round(q.t_ended, 5),
                                   round(q.elapsed, 5), q.last, q.lost, q.recovered,
                                   round(q.t_sent, 5), q.parity]
                                  for q in ps])
            res["levels"][str(p)] = {"ours": ours, "gloo": gloo, "lost": lost, "chunks": chunks,
                                     "recovered": rec, "wire": wire, "deadline_hits": hits,
                                     "cpu": cpu[settle:], "gloo_cpu": gcpu, "settle": settle,
                                     "waits": waits, "starts": starts,
                                     "gloo_starts": gstarts,
                                     "lost_frac": [a / max(b, 1) for a, b in zip(
                                         lost, chunks, strict=True)]}
        _barrier()
        set_loss(netns[rank], 0.0)
        align.close()
        res["rejected"] = coll.rejected_counts()
        res["rcvbuf"] = coll.transport.rcvbuf
    finally:
        coll.close()
    return res


def profile(out: Path, numel: int, iters: int, warmup: int, fec: str = "rs",
            fec_target: float = 2e-5) -> dict:
    """CPU per stage of a block of ``iters`` loss-free all-reduces, ours then gloo, each
    sampled by ``perf`` (``lossy_profile``); the vectors are made before sampling starts and
    reused (nothing but the all-reduces and their barriers is in a block)."""
    from stalwart.bench.lossy_profile import Sampler
    from stalwart.comm.collective import LossyCollective

    rank = dist.get_rank()
    coll = LossyCollective(numel, fec_mode=fec, fec_target=fec_target)
    lay, world = coll.layout, coll.world
    mine = lay.shard_len(rank)
    x = np.random.default_rng(rank).standard_normal(numel).astype(np.float32)
    buf = x.copy()
    t = torch.from_numpy(x.copy())
    res: dict = {"payload_bytes": 4 * ((numel - mine) + (world - 1) * mine), "iters": iters,
                 "engine": coll.engine}
    try:
        for _ in range(max(warmup, _settle(lay, world))):
            coll.allreduce(buf, out=buf)
            dist.all_reduce(t)
            t.copy_(torch.from_numpy(x))
        for system in ("ours", "gloo"):
            s = Sampler(out / f"perf-{system}-{rank}.data")
            s.start()
            _barrier()
            c0 = time.process_time()
            for _ in range(iters):
                if system == "ours":
                    coll.allreduce(buf, out=buf)
                else:
                    dist.all_reduce(t)
            cpu = time.process_time() - c0
            _barrier()
            res[system] = {"samples": s.stop(), "cpu_s": cpu}
            _barrier()
    finally:
        coll.close()
    return res


def drift(out: Path, mode: str, steps: int, lr: float, seed: int, preset: str,
          optim: str = "adamw") -> dict:
    import stalwart.comm
    from stalwart.train.data import load_corpus, train_batch
    from stalwart.train.model import GPT, PRESETS

    rank, world = dist.get_rank(), dist.get_world_size()
    mcfg = PRESETS[preset]["model"]
    bs = PRESETS[preset]["batch_size"]
    torch.manual_seed(seed)
    model = GPT(mcfg)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    # copies=1: the bare mechanism at the full loss rate (no forward error protection)
    if optim == "sgd":
        opt = stalwart.comm.attach(ddp, torch.optim.SGD, mode=mode, max_grad_norm=1.0, lr=lr,
                                   copies=1)
    else:
        opt = stalwart.comm.attach(ddp, torch.optim.AdamW, mode=mode, max_grad_norm=1.0,
                                   lr=lr, betas=(0.9, 0.95), weight_decay=0.0, copies=1)
    corpus = load_corpus(None, 4 * 1024 * 1024)
    lay = opt.coll.layout
    drifts, lost = [], []
    try:
        for step in range(steps):
            x, y = train_batch(corpus, bs, mcfg.block_size, seed, step, rank, 0)
            _, loss = ddp(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            st = opt.stats()
            lost.append(st["pkts_lost"] / max(1, st["pkts_lost"] + st["pkts_recv"]))
            # exact drift: every rank's replica against the owners' own shards (gloo, lossless)
            mine = torch.cat([p.detach().reshape(-1) for p in opt.params])
            allp = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(allp, mine)
            owners = torch.cat([allp[s][lay.shard(s)[0]: lay.shard(s)[1]] for s in range(world)])
            d = torch.tensor([(mine - owners).abs().max().item()])
            dist.all_reduce(d, op=dist.ReduceOp.MAX)
            drifts.append(float(d))
    finally:
        opt.close()
    return {"drift": drifts, "lost_frac": lost}


def main() -> None:
    out, kind, args = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        fn = {"allreduce": allreduce, "profile": profile, "drift": drift}[kind]
        res = fn(out, **args)
        (out / f"rank-{rank}.json").write_text(json.dumps(res))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # do not wait for daemon threads of torch/gloo at interpreter exit


if __name__ == "__main__":
    main()
