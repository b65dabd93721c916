"""The rank's pluggable parts meet their Protocols (train/rank.py, train/inplace.py): every
step class has the ``Stepper`` methods the rank calls without asking; only the loss-tolerant
optimizer is an ``UndoableOptimizer``, ``ReportingOptimizer``, ``InterruptibleOptimizer`` and
``ShardedOptimizer`` (what the rank and its in-place membership ask of it, AdamW having none
of it); both work plans have every ``WorkPlan`` member the rank and its membership use."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import stalwart.train
from stalwart.comm import attach
from stalwart.mitigate.decisions import EXCLUDE, Decision
from stalwart.mitigate.rebalance import Rebalancer, StaticPlan
from stalwart.train.inplace import InPlace, InterruptibleOptimizer, ShardedOptimizer
from stalwart.train.model import GPT, PRESETS
from stalwart.train.rank import ReportingOptimizer, Stepper, UndoableOptimizer, WorkPlan
from stalwart.train.steps import DataParallelStep, DetachedStep, TensorParallelStep

STEPPER_METHODS = sorted(n for n, v in vars(Stepper).items()
                         if not n.startswith("_") and callable(v))
PLAN_MEMBERS = sorted({*(n for n, v in vars(WorkPlan).items()
                         if not n.startswith("_") and callable(v)),
                       *WorkPlan.__annotations__})


def test_the_protocol_names_the_calls_the_rank_makes() -> None:
    assert STEPPER_METHODS == ["clip_grad_norm_", "close", "forward_backward", "interrupt",
                               "interruptible"]


@pytest.mark.parametrize("cls", [DataParallelStep, TensorParallelStep, DetachedStep])
def test_every_step_class_has_the_stepper_methods(cls: type) -> None:
    missing = [n for n in STEPPER_METHODS if not callable(getattr(cls, n, None))]
    assert missing == []


def test_a_detached_step_is_interruptible_but_never_steps() -> None:
    step = DetachedStep(GPT(PRESETS["tiny"]["model"]))
    step.interruptible()
    step.interrupt("a member was lost")
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
    plain = torch.optim.AdamW(model.parameters())
    for proto in (UndoableOptimizer, InterruptibleOptimizer, ShardedOptimizer,
                  ReportingOptimizer):
        assert not isinstance(plain, proto)
    assert not issubclass(type(plain), ReportingOptimizer)  # how Rank.train_step asks
    opt = attach(DDP(model), torch.optim.AdamW, lr=1e-2)
    try:
        assert isinstance(opt, UndoableOptimizer)
        assert opt.keep_undo is False and not opt.can_undo()
        for proto in (InterruptibleOptimizer, ShardedOptimizer, ReportingOptimizer):
            assert isinstance(opt, proto)
        assert issubclass(type(opt), ReportingOptimizer)
    finally:
        opt.close()


class _Step:
    """A step that records what it was told to interrupt with (only ``interrupt`` used)."""

    def __init__(self) -> None:
        self.told: list[str] = []

    def interrupt(self, why: str) -> None:
        self.told.append(why)


class _Opt:
    """An ``InterruptibleOptimizer`` that records what it was told."""

    def __init__(self) -> None:
        self.told: list[str] = []

    def interrupt(self, why: str) -> None:
        self.told.append(why)


def _inplace(opt: Any) -> tuple[InPlace, _Step]:
    """An ``InPlace`` over a rank holding ``opt`` and a recording step; its regrouper has
    nothing but the watcher's abort hooks (any other use fails the test)."""
    step = _Step()
    rank = SimpleNamespace(opt=opt, stepper=step)
    return InPlace(rank, SimpleNamespace(on_abort=[])), step  # type: ignore[arg-type]


@pytest.mark.parametrize("interruptible", [False, True])
def test_a_lost_member_interrupts_the_step_and_an_interruptible_optimizer(
        interruptible: bool) -> None:
    opt = _Opt() if interruptible else torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    members, step = _inplace(opt)
    assert members.regrouper.on_abort == [members.interrupt_comm]
    members.interrupt_comm()
    assert len(step.told) == 1 and "member was lost" in step.told[0]
    if interruptible:
        assert opt.told == step.told


def test_an_unsharded_optimizer_hands_nothing_over() -> None:
    members, _ = _inplace(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()))
    members.planned_change = [0, 1]
    members._hand_over()  # returns before it reads the old generation (the regrouper has none)
    assert members.planned_change is None and members.lossy_extra == []


def test_the_work_plan_protocol_names_every_member_train_uses() -> None:
    """Every ``work.NAME`` the train package reads (the rank, its loop and its in-place
    membership) is a ``WorkPlan`` member, and the Protocol names nothing they do not use."""
    used = {"close"}  # Rank.release and Rank.finish close it with the rank's other parts
    for path in Path(stalwart.train.__file__).parent.glob("*.py"):
        used |= set(re.findall(r"\bwork\.([A-Za-z_]\w*)", path.read_text()))
    assert sorted(used) == PLAN_MEMBERS
    assert PLAN_MEMBERS == ["assign", "basis", "close", "end_step", "measure_from",
                            "normalised", "planned_hosts", "restart_due", "restart_request"]


def _plans() -> list[WorkPlan]:
    return [StaticPlan(8, 4, 0), Rebalancer(None, micro_batches=8, rank=0, world=4,
                                            mode="rebalance")]


@pytest.mark.parametrize("i", [0, 1])
def test_both_work_plans_have_every_member(i: int) -> None:
    plan = _plans()[i]
    try:
        missing = [n for n in PLAN_MEMBERS if not hasattr(plan, n)]
        assert missing == []
        assert plan.restart_request is None  # nothing decided yet
        assert plan.restart_due(0) is None
    finally:
        plan.close()


def test_the_static_plan_measures_nothing_and_plans_no_change() -> None:
    plan = StaticPlan(8, 4, 1)
    before = plan.assign(3)
    plan.measure_from({"strategy": "exclude", "predicted_gain": 0.2, "step_time_before": 1.0},
                      5)
    assert plan.assign(7) == before and plan.restart_due(7) is None
    dec = Decision(EXCLUDE, 1, 8, [], 2, 0.2, "")
    with pytest.raises(RuntimeError):
        plan.planned_hosts(dec)
    with pytest.raises(RuntimeError):
        plan.basis(dec)
