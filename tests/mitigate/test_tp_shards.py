"""Tensor parallel in place: moving shards between live ranks keeps the training exact.

Four real gloo processes train a 2 x 2 (TP x DP) GPT with AdamW for two steps, then rebuild
their default process group on a fresh store with the ranks permuted so that two processes
change TP index (the new rank 0 held shard 1, the new rank 1 held shard 0: each is the source
of the shard the other needs), rebind the trainer's TP and DP groups (``TPTrainer.rebind``),
move the shards (``regroup.agree_shards``) and train two more steps. The full model must equal
that of the same four steps without a regroup; without the shard move it must not (the test
can fail).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from stalwart.mitigate.planner import assignment
from stalwart.train.data import load_corpus, micro_batch, step_starts
from stalwart.train.model import GPTConfig
from tests.helpers import free_port, spawn_ranks

pytestmark = pytest.mark.slow

CFG = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
MBS, COUNTS, TP = 2, [2, 2], 2
PERM = [1, 0, 2, 3]  # process p is rank PERM[p] after the regroup


def _steps(trainer: object, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    corpus = load_corpus(max_bytes=1 << 20)
    for s in steps:
        starts = step_starts(corpus, sum(COUNTS) * MBS, CFG.block_size, 0, s)
        batches = [micro_batch(corpus, starts, MBS, CFG.block_size, g)
                   for g in assignment(COUNTS)[rank // TP]]
        trainer.forward_backward(batches, len(COUNTS) / sum(COUNTS))  # type: ignore[attr-defined]
        opt.step()
        opt.zero_grad(set_to_none=True)


def _worker(p: int, world: int, port: int, store: str, mode: str, out: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=p, world_size=world, timeout=timedelta(seconds=60))
    from stalwart.mitigate.regroup import agree_shards
    from stalwart.overlap import build_tp_trainer
    from stalwart.train.steps import make_groups

    torch.manual_seed(0)
    tp_g, dp_g, _, _ = make_groups(world, TP)
    trainer = build_tp_trainer(CFG, tp_g, dp_g, "off", None)
    opt = torch.optim.AdamW(trainer.model.parameters(), lr=1e-2)
    rank = p
    _steps(trainer, opt, rank, range(2))
    if mode != "plain":
        dist.destroy_process_group()
        rank = PERM[p]
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        tp_g, dp_g, _, _ = make_groups(world, TP)
        trainer.rebind(tp_g, dp_g)
        if mode == "regroup":
            step, _ = agree_shards(trainer.model, opt, 2, p % TP, TP)
            assert step == 2
    _steps(trainer, opt, rank, range(2, 4))
    state = trainer.model.full_state_dict()
    # numpy arrays travel by value (a tensor on a queue is shared memory of a process that
    # is about to exit)
    out.put((rank, {k: v.detach().numpy().copy()  # type: ignore[attr-defined]
                    for k, v in state.items()} if rank == 0 else None))
    dist.destroy_process_group()


def _run(tmp_path: Path, mode: str) -> dict[str, torch.Tensor]:
    got = spawn_ranks(_worker, 4, free_port(), str(tmp_path / f"{mode}.store"), mode,
                      timeout=120)
    return {k: torch.from_numpy(v) for k, v in got[0].items()}


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[k] - b[k]).double().norm() ** 2) for k in a) ** 0.5
    return num / sum(float(b[k].double().norm() ** 2) for k in b) ** 0.5


def test_moving_tp_shards_between_live_ranks_keeps_the_training(tmp_path: Path) -> None:
    plain = _run(tmp_path, "plain")
    moved = _run(tmp_path, "regroup")
    assert _rel(moved, plain) < 1e-6, _rel(moved, plain)
    wrong = _run(tmp_path, "no_move")  # the new groups, but every process keeps its shard
    assert _rel(wrong, plain) > 1e-3, _rel(wrong, plain)
