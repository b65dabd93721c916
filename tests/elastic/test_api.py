"""The user API in one process (a job of one member, its store served in-process): a loop as
the README writes it trains; calls out of order raise one line naming the call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stalwart import elastic


def job_of_one(global_batch: int = 8) -> tuple[elastic.Job, torch.nn.Module, torch.optim.SGD]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return elastic.Job(model, opt, global_batch=global_batch, micro_batch=3, env={}), model, opt


def test_a_loop_trains_every_sample_of_every_step_once() -> None:
    job, model, opt = job_of_one()
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    y = x.sum(dim=1, keepdim=True)
    seen = []
    first = None
    for step in job.steps(8):
        opt.zero_grad()
        total = 0.0
        for idx in job.my_batch(step):
            seen.extend(idx)
            loss = F.mse_loss(model(x[idx]), y[idx]) * job.weight(len(idx))
            loss.backward()
            total += float(loss.detach())
        assert job.commit(total)
        first = job.loss if first is None else first
    assert seen == list(range(64))  # micro-batches of 3 over steps of 8
    assert job.loss is not None and first is not None and job.loss < first
    assert job.world == 1 and job.generation == 0 and job.rank == 0


def test_calls_out_of_order_raise_one_line_naming_the_call() -> None:
    job, model, opt = job_of_one()
    with pytest.raises(elastic.UsageError, match=r"^job\.commit\(\) called outside a step"):
        job.commit()
    it = job.steps(3)
    step = next(it)
    with pytest.raises(elastic.UsageError, match=r"job\.my_batch\(5\) called in step 0"):
        next(iter(job.my_batch(5)))
    for idx in job.my_batch(step):
        model(torch.zeros(len(idx), 4)).sum().backward()
    assert job.commit()
    with pytest.raises(elastic.UsageError, match=r"job\.commit\(\) called after job\.commit"):
        job.commit()
    with pytest.raises(elastic.UsageError, match=r"job\.weight\(\) called after"):
        job.weight(3)
    assert next(it) == 1  # no commit in step 1: the loop says so when it goes on
    with pytest.raises(elastic.UsageError, match=r"job\.commit\(\) was not called in step 1"):
        next(it)
    with pytest.raises(elastic.UsageError, match=r"job\.steps\(\) called again"):
        next(iter(job.steps(3)))
    job.close()
