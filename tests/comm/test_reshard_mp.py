"""Re-sharding the lossy optimizer's state between live ranks (an in-place regroup): real
processes, gloo for the state's collectives, the UDP transport for the training steps.

Three ranks train a tiny GPT (two parameter groups, AdamW) for a few steps; then:
- ``full_state`` gives every rank the whole optimizer, each element exactly its owner's;
- a lossy optimizer made for two of the ranks loads its new shard of it: the new owners'
  state equals the slices of the old full state exactly, and it trains on;
- gathered over the two survivors only (rank 2 lost), the dead owner's elements take rank
  0's replica values and zero per-element state (``reset`` counts them), the rest is exact;
- rank 2's shard handed to rank 0 (``piece``, as a rank leaving for S4 does) makes the
  gather over ranks 0 and 1 whole again, and a rank that holds nothing (one that joins)
  gets the whole state from the same gather;
- ``undo_last`` takes an owner's last update back exactly, and a step whose collective is
  interrupted after the owner's update (``interrupt``) raises and leaves the shard as it was,
  while the peers that finished it can undo theirs: the state before the step, exactly.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stalwart.launch import free_port

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("engine")]


def _same(a, b) -> bool:  # noqa: ANN001 -- FullState, in the ranks only
    return (np.array_equal(a.values, b.values) and a.reset == b.reset
            and all(ea.keys() == eb.keys() and all(torch.equal(ea[k], eb[k]) for k in ea)
                    for ea, eb in zip(a.elem, b.elem, strict=True))
            and all(sa.keys() == sb.keys() and all(torch.equal(torch.as_tensor(sa[k]),
                                                               torch.as_tensor(sb[k]))
                                                   for k in sa)
                    for sa, sb in zip(a.scalar, b.scalar, strict=True)))


def _owned_exact(opt, full) -> bool:  # noqa: ANN001
    """This rank's shard of ``full`` is exactly what ``opt`` holds (values and state)."""
    if not np.array_equal(full.values[opt.lo: opt.hi], opt.flat_model_shard()):
        return False
    for gi, (v, (slo, shi)) in enumerate(zip(opt._views, opt._segs, strict=True)):
        a = opt.lo + slo - full.bounds[gi][0]
        st = opt.inner.state[v]
        for k, t in full.elem[gi].items():
            if not torch.equal(st[k], t[a: a + shi - slo]):
                return False
        if any(not torch.equal(torch.as_tensor(st[k]), torch.as_tensor(x))
               for k, x in full.scalar[gi].items()):
            return False
    return True


def _worker(rank: int, world: int, port: int, out: str) -> None:  # noqa: C901, PLR0915 -- one story
    import os
    import threading

    from torch.nn.parallel import DistributedDataParallel as DDP

    from stalwart.comm import attach
    from stalwart.comm.collective import Interrupted
    from stalwart.comm.deadline import AdaptiveDeadline
    from stalwart.comm.optim import gather_full_state
    from stalwart.train.model import GPT, GPTConfig

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      STALWART_HOST_ADDR="127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mcfg = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)

    def make(model, group=None):  # noqa: ANN001, ANN202
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        # patient deadlines: nothing is lost on loopback, so every step is exact
        return attach(model, torch.optim.AdamW, params=groups, lr=1e-2, betas=(0.9, 0.95),
                      max_grad_norm=0.05, group=group,
                      deadline=AdaptiveDeadline(initial=10, floor=10, cap=10))

    gen = torch.Generator().manual_seed(rank)

    def step(opt, model) -> None:  # noqa: ANN001
        x = torch.randint(0, 256, (4, 16), generator=gen)
        _, loss = model(x, x.roll(1, 1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.manual_seed(0)
    model = GPT(mcfg)
    ddp = DDP(model)
    opt = make(ddp)
    opt.keep_undo = True
    for _ in range(3):
        step(opt, ddp)
    rec: dict = {}
    full = opt.full_state()
    rec["keys"] = [sorted(e) for e in full.elem] + [sorted(s) for s in full.scalar]
    rec["reset"] = full.reset
    rec["own_exact"] = _owned_exact(opt, full)
    rec["values_nonzero"] = bool(np.abs(full.values).sum() > 0)

    # the last update taken back exactly
    step(opt, ddp)
    opt.undo_last()
    rec["undo_exact"] = _same(opt.full_state(), full)
    rec["undo_twice"] = opt.can_undo()

    # re-shard to two ranks: a new optimizer for ranks 0 and 1 loads its new shard
    sub = dist.new_group([0, 1])
    if rank < 2:
        torch.manual_seed(1)  # other initial values: everything must come from ``full``
        model2 = GPT(mcfg)
        opt2 = make(model2, sub)
        opt2.load_full_state(full)
        rec["new_shard"] = [opt2.lo, opt2.hi]
        rec["new_exact"] = _owned_exact(opt2, full)
        rec["new_params_exact"] = bool(np.array_equal(opt2.staging.values(), full.values))
        rec["new_step_scalar"] = float(opt2.inner.state[opt2._views[0]]["step"])
        step(opt2, model2)
        rec["new_trains"] = bool(np.isfinite(opt2.staging.values()).all())
        opt2.close()
        # rank 2 lost: the survivors gather what they hold over the new group
        lost = gather_full_state(opt, values_from=0, group=sub)
        lo2, hi2 = opt.coll.layout.shard(2)
        keep = np.ones(full.numel, bool)
        keep[lo2:hi2] = False
        rec["lost_reset"] = [lost.reset, hi2 - lo2]
        rec["lost_kept_values"] = bool(np.array_equal(lost.values[keep], full.values[keep]))
        rec["lost_dead_values"] = bool(np.array_equal(lost.values[lo2:hi2],
                                                      opt._gather_params()[lo2:hi2]))
        ok_state, zero_state = True, True
        for gi, (a, b) in enumerate(full.bounds):
            k = torch.from_numpy(keep[a:b])
            for key, t in full.elem[gi].items():
                ok_state &= torch.equal(lost.elem[gi][key][k], t[k])
                zero_state &= bool((lost.elem[gi][key][~k] == 0).all())
        rec["lost_kept_state"], rec["lost_dead_state_zero"] = ok_state, zero_state
        rec["lost_scalars"] = _same(
            type(full)(full.numel, full.bounds, full.values, [{}] * len(full.elem),
                       lost.scalar, full.hyper),
            type(full)(full.numel, full.bounds, full.values, [{}] * len(full.elem),
                       full.scalar, full.hyper))
    dist.barrier()

    # S4: rank 2 leaves and hands its shard to rank 0, point to point; ranks 0 and 1 then
    # gather the whole state by themselves
    if rank == 2:
        dist.send_object_list([opt.piece()], dst=0)
    handed: list = [None]
    if rank == 0:
        dist.recv_object_list(handed, src=2)
    if rank < 2:
        left = gather_full_state(opt, group=sub, extra=[handed[0]] if rank == 0 else None)
        rec["handed_exact"] = _same(left, full)
    # a rank that holds nothing (one that joins) gets the whole state from the same gather
    joined = gather_full_state(opt if rank < 2 else None,
                               extra=[handed[0]] if rank == 0 else None)
    rec["shared_exact"] = _same(joined, full)

    # rank 0's collective is interrupted after its update (as by a lost member): its step
    # raises and its shard is as before; ranks 1 and 2 finished the step and undo theirs
    if rank == 0:
        real = opt.coll.broadcast

        def interrupted_broadcast(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            threading.Thread(target=opt.interrupt, args=("test: a member was lost",)).start()
            import time

            time.sleep(0.2)
            return real(*a, **kw)

        opt.coll.broadcast = interrupted_broadcast
    try:
        step(opt, ddp)
        rec["raised"] = None
    except Interrupted as e:
        rec["raised"] = str(e)
        opt.zero_grad(set_to_none=True)
    rec["can_undo_after"] = opt.can_undo()
    if rank > 0:
        opt.undo_last()
    rec["interrupted_exact"] = _same(opt.full_state(), full)
    opt.close()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(rec))
    dist.barrier()
    dist.destroy_process_group()


def test_full_state_reshards_exactly_and_the_step_in_flight_is_undone() -> None:
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(3, free_port(), d), nprocs=3, join=True)
        recs = [json.loads(Path(d, f"rank-{r}.json").read_text()) for r in range(3)]
    for r, rec in enumerate(recs):
        assert rec["keys"] == [["exp_avg", "exp_avg_sq"]] * 2 + [["step"]] * 2, rec
        assert rec["reset"] == 0 and rec["own_exact"] and rec["values_nonzero"], rec
        assert rec["undo_exact"] and not rec["undo_twice"], rec
        assert rec["shared_exact"], rec
        if r < 2:
            assert rec["new_exact"] and rec["new_params_exact"], rec
            assert rec["new_step_scalar"] == 3.0 and rec["new_trains"], rec
            assert rec["lost_reset"][0] == rec["lost_reset"][1] > 0, rec
            assert rec["lost_kept_values"] and rec["lost_dead_values"], rec
            assert rec["lost_kept_state"] and rec["lost_dead_state_zero"], rec
            assert rec["lost_scalars"] and rec["handed_exact"], rec
        # rank 0 raised, with its update undone; the others finished and undid theirs
        assert (rec["raised"] is not None) == (r == 0), rec
        assert rec["can_undo_after"] == (r > 0), rec
        assert rec["interrupted_exact"], rec
    assert recs[0]["new_shard"][1] == recs[1]["new_shard"][0]  # two halves of the vector
