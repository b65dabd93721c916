"""The rank's pluggable parts meet their Protocols (train/rank.py): every step class has the
``Stepper`` methods the rank calls without asking, and only the loss-tolerant optimizer is an
``UndoableOptimizer`` (the rank turns its undo record on in a job that regroups in place)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from stalwart.comm import attach
from stalwart.train.model import GPT, PRESETS
from stalwart.train.rank import Stepper, UndoableOptimizer
from stalwart.train.steps import DataParallelStep, DetachedStep, TensorParallelStep

STEPPER_METHODS = sorted(n for n, v in vars(Stepper).items()
                         if not n.startswith("_") and callable(v))


def test_the_protocol_names_the_calls_the_rank_makes() -> None:
    assert STEPPER_METHODS == ["clip_grad_norm_", "close", "forward_backward", "interruptible"]


@pytest.mark.parametrize("cls", [DataParallelStep, TensorParallelStep, DetachedStep])
def test_every_step_class_has_the_stepper_methods(cls: type) -> None:
    missing = [n for n in STEPPER_METHODS if not callable(getattr(cls, n, None))]
    assert missing == []


def test_a_detached_step_is_interruptible_but_never_steps() -> None:
    step = DetachedStep(GPT(PRESETS["tiny"]["model"]))
    step.interruptible()
    with pytest.raises(RuntimeError):
        step.forward_backward([], 1.0)
    with pytest.raises(RuntimeError):
        step.clip_grad_norm_(1.0)


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank")
def test_only_the_loss_tolerant_optimizer_is_undoable() -> None:
    model = torch.nn.Linear(4, 4)
    assert not isinstance(torch.optim.AdamW(model.parameters()), UndoableOptimizer)
    opt = attach(DDP(model), torch.optim.AdamW, lr=1e-2)
    try:
        assert isinstance(opt, UndoableOptimizer)
        assert opt.keep_undo is False and not opt.can_undo()
    finally:
        opt.close()
