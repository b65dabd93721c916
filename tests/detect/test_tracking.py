"""Collective tracking on a real (one-process) gloo group: wrappers, async, DDP hooks."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from stalwart.detect import Monitor
from stalwart.detect.tracking import Tracker, install, uninstall


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this test process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, timeout=timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def tracker(group: None) -> Iterator[Tracker]:
    tr = Tracker(capacity=64)
    install(tr)
    try:
        yield tr
    finally:
        uninstall(tr)


def test_sync_ops_are_recorded_with_volume_and_times(tracker: Tracker) -> None:
    t = torch.ones(2048)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    dist.barrier()
    ops = [r.op for r in tracker.records]
    assert ops == ["all_reduce", "broadcast", "barrier"]
    ar = tracker.records[0]
    assert ar.numel == 2048 and ar.nbytes == 2048 * 4 and ar.group is None
    assert all(r.complete is not None and r.complete >= r.issue for r in tracker.records)


def test_async_op_completion_comes_from_its_future(tracker: Tracker) -> None:
    work = dist.all_reduce(torch.ones(4096), async_op=True)
    work.wait()
    rec = tracker.records[-1]
    assert rec.op == "all_reduce"
    # the completion callback may run on gloo's thread just after wait() returns
    fut = work.get_future()
    fut.wait()
    for _ in range(1000):
        if rec.complete is not None:
            break
        torch.futures.wait_all([fut])
    assert rec.complete is not None and rec.complete >= rec.issue


def test_internal_ops_and_disabled_tracking_are_not_recorded(tracker: Tracker) -> None:
    with tracker.internal():
        dist.all_reduce(torch.ones(8))
    tracker.enabled = False
    dist.all_reduce(torch.ones(8))
    tracker.enabled = True
    assert len(tracker.records) == 0


def test_ring_buffer_is_bounded(tracker: Tracker) -> None:
    for _ in range(200):
        dist.all_reduce(torch.ones(1))
    assert len(tracker.records) == 64


def test_uninstall_restores_the_original_functions(group: None) -> None:
    before = dist.all_reduce
    tr = Tracker()
    install(tr)
    assert dist.all_reduce is not before
    uninstall(tr)
    assert dist.all_reduce is before
    assert dist.distributed_c10d.all_reduce is before


def _train(model: nn.Module, steps: int = 3) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        loss = model(torch.randn(16, 64)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_ddp_bucket_allreduces_are_recorded_by_an_automatic_hook(group: None) -> None:
    mon = Monitor(rank=0, world=1)
    try:
        _train(DDP(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))))
        ddp = [r for r in mon.tracker.records if r.source == "ddp"]
        assert len(ddp) >= 3
        assert all(r.op == "ddp_allreduce" and r.numel > 0 for r in ddp)
        assert all(r.complete is not None and r.complete >= r.issue for r in ddp)
        # the default hook calls dist.all_reduce itself: counted once, as the bucket
        assert not [r for r in mon.tracker.records if r.op == "all_reduce"]
    finally:
        mon.close()


def test_a_users_own_comm_hook_still_registers_and_is_timed(group: None) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls = []

    def my_hook(state, bucket):  # unannotated: DDP checks hook annotations
        calls.append(1)
        return allreduce_hook(state, bucket)

    mon = Monitor(rank=0, world=1)
    try:
        model = DDP(nn.Linear(64, 8))
        model.register_comm_hook(None, my_hook)
        _train(model)
        assert calls
        assert [r for r in mon.tracker.records if r.source == "ddp"]
    finally:
        mon.close()


def test_track_ddp_false_leaves_ddp_alone(group: None) -> None:
    mon = Monitor(rank=0, world=1, track_ddp=False)
    try:
        _train(DDP(nn.Linear(64, 8)))
        assert not [r for r in mon.tracker.records if r.source == "ddp"]
    finally:
        mon.close()


def test_monitor_finds_the_period_of_a_hintless_loop(group: None) -> None:
    mon = Monitor(rank=0, world=1)
    try:
        a, b = torch.ones(4096), torch.ones(2048)
        for _ in range(40):
            dist.all_reduce(a)
            dist.all_reduce(b)
            dist.all_reduce(torch.ones(4))  # tiny control op: not part of the period
        assert mon.periods.period == 2
        assert len(mon.samples) >= 20
    finally:
        mon.close()


class _Event:
    """Stands in for a CUDA event (none can exist here): like CUDA, an event never recorded
    reports itself reached, and reading the time between it and another fails."""

    def __init__(self) -> None:
        self.at: float | None = None

    def record(self) -> None:
        self.at = 1.0 if self.at is None else self.at

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _Event) -> float:
        if self.at is None or end.at is None:
            raise ValueError("Both events must be recorded before calculating elapsed time.")
        return 2.0  # ms


def test_an_async_cuda_op_is_not_read_from_an_end_event_never_recorded() -> None:
    # an asynchronous collective on CUDA tensors completes through its Work's future; its
    # end event is never recorded (the TP layers' all-reduces on a GPU crashed the monitor)
    from stalwart.detect.tracking import OpRecord, Tracker

    start, end = _Event(), _Event()
    start.record()
    rec = OpRecord("all_reduce", None, 4, 16, issue=10.0, cuda=(start, end))
    assert rec.finish() is None  # in flight: unknown, not an error
    rec.complete = 10.5  # the future's callback
    assert rec.finish() == 10.5
    sync = OpRecord("all_reduce", None, 4, 16, issue=10.0, cuda=(_Event(), _Event()))
    sync.cuda[0].record()
    Tracker.end(sync)  # a synchronous op records its end event
    assert sync.finish() == 10.0 + 2.0 / 1e3
