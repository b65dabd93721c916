"""Split backward (deferred weight gradients), chunked collectives and the step model, in one
process (a TP group of one: collectives complete at once, so deferred work waits for the
end-of-step flush or the memory cap). The two-process versions are in test_tp_distributed."""

from __future__ import annotations

import pytest
import torch

from stalwart.overlap import TPGPT, Interleaved, TPComm
from stalwart.overlap.layers import ColumnParallelLinear, RowParallelLinear
from stalwart.overlap.memory import SavedTensorMeter
from stalwart.overlap.plan import Profile, make_plan, simulate_step
from stalwart.overlap.wgrad import WGradQueue
from stalwart.train.model import GPT, GPTConfig

CFG = GPTConfig(block_size=8, n_layer=2, n_head=2, n_embd=16)


def _mbs(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 256, (2, 8), generator=g), torch.randint(0, 256, (2, 8),
                                                                        generator=g))
            for _ in range(n)]


def _reference(mbs) -> tuple[TPGPT, TPComm, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    gpt = GPT(CFG)
    for x, y in mbs:
        (gpt(x, y)[1] / len(mbs)).backward()
    comm = TPComm(None)
    return TPGPT.from_full(gpt, comm), comm, {n: p.grad.clone()
                                              for n, p in gpt.named_parameters()}


def _assert_grads(model: torch.nn.Module, ref: dict[str, torch.Tensor]) -> None:
    got = dict(model.named_parameters())
    for name, g in ref.items():
        assert got[name].grad is not None, name
        assert torch.allclose(got[name].grad, g, atol=1e-5, rtol=0), name


@pytest.mark.parametrize("wgrad_memory", [None, 0.3])
def test_deferred_weight_gradients_are_exact(wgrad_memory: float | None) -> None:
    mbs = _mbs(4)
    model, comm, ref = _reference(mbs)
    step = Interleaved(model, comm, schedule="si", wgrad_memory=wgrad_memory)
    step.forward_backward(mbs)
    assert step.wgrad is not None
    every = 4 * 4 * CFG.n_layer  # 4 micro-batches x 4 parallel layers per block
    # without a cap every weight gradient is deferred; with one, those that fit
    assert step.wgrad.pushed == every if wgrad_memory is None else 0 < step.wgrad.pushed < every
    assert len(step.wgrad) == 0 and comm.wgrad is None  # flushed, and detached after the step
    # the profile timed the deferred work of the segments that have weights
    assert sum(step.plan.profile["bwd_wgrad"]) > 0 and step.plan.profile["bwd_wgrad"][-1] == 0
    _assert_grads(model, ref)
    # a second step overwrites (does not accumulate onto) the first one's gradients
    step.forward_backward(mbs)
    _assert_grads(model, ref)


def test_queue_runs_first_in_first_out_in_pieces() -> None:
    # two micro-batches' gradients for one weight: the order of accumulation is autograd's
    lin = torch.nn.Linear(6, 10, bias=True)
    q = WGradQueue(piece_macs=3 * 6 * 2)  # 2 rows of the 10-row weight gradient per piece
    xs = [torch.randn(3, 6) for _ in range(2)]
    gs = [torch.randn(3, 10) for _ in range(2)]
    for x, g in zip(xs, gs, strict=True):
        q.push(x, g, lin.weight, lin.bias)
    assert lin.weight.grad is None and len(q) == 2
    calls = [0]

    def after_three() -> bool:
        calls[0] += 1
        return calls[0] > 3

    q.fill(after_three)  # three pieces, then the "collective" completed
    assert len(q) == 2 and q.tasks[0].next_row == 6
    q.flush()
    assert len(q) == 0
    ref_w = gs[0].t() @ xs[0]
    ref_w += gs[1].t() @ xs[1]
    assert torch.allclose(lin.weight.grad, ref_w, atol=1e-6)
    assert torch.allclose(lin.bias.grad, gs[0].sum(0) + gs[1].sum(0), atol=1e-6)


def test_queue_memory_cap_and_meter_accounting() -> None:
    lin = torch.nn.Linear(8, 8, bias=False)
    meter = SavedTensorMeter()
    x, g = torch.randn(4, 8), torch.randn(4, 8)
    task_bytes = 2 * 4 * 8 * 4
    q = WGradQueue(max_bytes=1.5 * task_bytes)
    q.hold = meter.hold
    q.push(x, g, lin.weight, None)
    assert len(q) == 1 and meter.live == task_bytes  # held tensors count as live
    other = torch.nn.Linear(8, 8, bias=False)
    q.push(x.clone(), g.clone(), other.weight, None)  # does not fit: runs now, queue stays
    assert len(q) == 1 and q.tasks[0].weight is lin.weight and meter.live == task_bytes
    assert other.weight.grad is not None and lin.weight.grad is None
    q.push(x, g, lin.weight, None)  # same weight: the queued task runs first (its order)
    assert len(q) == 0 and meter.live == 0
    assert torch.allclose(lin.weight.grad, 2 * g.t() @ x, atol=1e-6)
    tiny = WGradQueue(max_bytes=0.5 * task_bytes)  # a task larger than the cap runs at once
    tiny.push(x, g, lin.weight, None)
    assert len(tiny) == 0


def test_split_backward_off_restores_immediate_weight_gradients() -> None:
    mbs = _mbs(3)
    model, comm, ref = _reference(mbs)
    step = Interleaved(model, comm, schedule="si", defer_wgrad=False)
    step.forward_backward(mbs)
    assert step.wgrad is None
    _assert_grads(model, ref)
    # plain autograd through the layers (no executor) never defers
    model.zero_grad(set_to_none=True)
    for x, y in mbs:
        (model(x, y)[1] / len(mbs)).backward()
    _assert_grads(model, ref)


def test_a_failed_step_leaves_no_deferred_work_behind() -> None:
    mbs = _mbs(4)
    model, comm, ref = _reference(mbs)
    calls = [0]

    def loss_fn(mdl: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("bad batch")
        return mdl(x, y)[1]

    m = n = 2 * CFG.n_layer + 1
    plan = make_plan({}, Profile.uniform([1.0] * m, [1.0] * n, 0.1, 0.1))
    step = Interleaved(model, comm, schedule="si", loss_fn=loss_fn, plan=plan,
                       wgrad_memory=None)
    with pytest.raises(RuntimeError, match="bad batch"):
        step.forward_backward(mbs)
    assert step.wgrad is not None and len(step.wgrad) == 0 and comm.wgrad is None
    calls[0] = -100
    step.forward_backward(mbs)
    _assert_grads(model, ref)


def test_chunked_matmul_equals_the_whole_product() -> None:
    # one rank: start_matmul's chunking needs a group; the arithmetic is checked here by
    # pretending to be a group of two whose all-reduce is the identity
    comm = TPComm(None)
    comm.world = 2
    comm.chunks = 3
    comm.completion_callbacks = False
    a, b = torch.randn(2, 9, 5), torch.randn(5, 7)

    class Done:
        def wait(self) -> None:
            pass

        def is_completed(self) -> bool:
            return True

    import stalwart.overlap.comm as cm

    real = cm.dist.all_reduce
    issued: list[int] = []
    cm.dist.all_reduce = lambda t, group=None, async_op=False: issued.append(t.shape[0]) or Done()
    try:
        p = comm.start_matmul(a, b)
        out = comm.finish(p)
    finally:
        cm.dist.all_reduce = real
    assert issued == [6, 6, 6] and len(p.parts) == 3  # 18 rows in three blocks
    assert out.shape == (2, 9, 7)
    assert torch.allclose(out, a @ b, atol=1e-6)


def test_parallel_layers_with_chunks_keep_their_gradients() -> None:
    torch.manual_seed(0)
    comm = TPComm(None)
    up, down = ColumnParallelLinear(6, 12, comm), RowParallelLinear(12, 6, comm)
    x = torch.randn(2, 5, 6, requires_grad=True)
    down(torch.relu(up(x))).sum().backward()
    ref = [t.grad.clone() for t in (x, up.weight, up.bias, down.weight, down.bias)]
    for t in (x, up.weight, up.bias, down.weight, down.bias):
        t.grad = None
    comm.chunks = 2  # one rank: start_matmul falls back to one piece, same arithmetic
    down(torch.relu(up(x))).sum().backward()
    for r, t in zip(ref, (x, up.weight, up.bias, down.weight, down.bias), strict=True):
        assert torch.allclose(t.grad, r, atol=1e-6)


def _segments(fc, fm, bc, bm, bw=None) -> dict[str, list[float]]:
    seg = {"fwd_compute": fc, "fwd_comm": fm, "bwd_compute": bc, "bwd_comm": bm}
    if bw is not None:
        seg["bwd_wgrad"] = bw
    return seg


def test_step_model_alone_equals_the_sequential_sum() -> None:
    # no pairing: every segment waits for its own strand's collective before it computes
    seg = _segments([1.0, 2.0], [3.0, 0.0], [4.0, 1.0], [2.0, 0.0])
    steps = ["B", "B", "F", "F", "B", "B"]  # B(0); F(1); B(1)  (F(0) runs alone first)
    assert simulate_step(seg, 2, steps) == pytest.approx(2 * (1 + 3 + 2) + 2 * (4 + 2 + 1))
    with pytest.raises(ValueError, match="plan covers"):
        simulate_step(seg, 2, ["B", "FB"])


def test_step_model_shares_the_link_between_the_strands() -> None:
    seg = _segments([1.0, 1.0], [4.0, 0.0], [1.0, 1.0], [4.0, 0.0])
    # F(0) ends at 6. b0 at 7 puts its collective on the link 7..11; f0 of F(1) computes
    # until 8 but its collective queues behind: 11..15. b1 waits to 11 (12); f1 to 15 (16);
    # B(1): b0 17, link 17..21; b1 22. (With a link per collective it would be 19.)
    assert simulate_step(seg, 2, ["B", "F", "B", "F", "B", "B"]) == pytest.approx(22.0)
    # burst credit: right behind another transfer a collective takes 1.5x (6 s); after 2 s
    # of idle link, 4 s again. f0's collective now queues behind b0's for 11..17: f1 waits
    # to 17 (18); B(1): b0 at 19 after 2 s idle, 19..23; b1 24
    seg["comm_sustained_factor"] = [1.5]
    assert simulate_step(seg, 2, ["B", "F", "B", "F", "B", "B"]) == pytest.approx(24.0)


def test_step_model_charges_cpu_contention_while_a_transfer_is_in_flight() -> None:
    seg = _segments([1.0, 1.0], [4.0, 0.0], [1.0, 1.0], [4.0, 0.0])
    steps = ["B", "F", "B", "F", "B", "B"]
    # transfers twice as slow while a segment computes: f0 of F(1) computes 7..8 under b0's
    # transfer, which moves 0.5 s of its 4 then and ends at 11.5; f0's own queues to 15.5.
    # b1 waits to 11.5 and computes to 12.5 under it (it now ends at 16); f1 waits to 16
    # (17); B(1): b0 18, link 18..22; b1 23 -- one second more than without contention
    seg["comm_contention"] = [2.0]
    assert simulate_step(seg, 2, steps) == pytest.approx(23.0)
    # compute twice as slow under a transfer. Without: F(0) 0..2 (link 2..4), f1 4..5; b0
    # 5..7 (link 7..9); f0 7..9 (link 9..11); b1 9..10; f1 11..12; b0 12..14 (link 14..16);
    # b1 16..17. With: f0 computes its first 2 s-worth under b0's transfer (7..9 moves 1 s
    # of work) and ends at 10 (link 10..12); b1 runs under it, 10..12; f1 12..13; b0 13..15
    # (link 15..17); b1 17..18
    seg = _segments([2.0, 1.0], [2.0, 0.0], [2.0, 1.0], [2.0, 0.0])
    assert simulate_step(seg, 2, steps) == pytest.approx(17.0)
    seg["compute_contention"] = [2.0]
    assert simulate_step(seg, 2, steps) == pytest.approx(18.0)


def test_step_model_fills_waits_with_deferred_weight_gradients() -> None:
    plain = _segments([1.0, 1.0], [4.0, 0.0], [1.0, 1.0], [4.0, 0.0])
    deferred = _segments([1.0, 1.0], [4.0, 0.0], [1.0, 1.0], [4.0, 0.0], [3.0, 0.0])
    steps = ["B", "FB", "F", "B", "B"]
    assert simulate_step(plain, 2, steps) == pytest.approx(24.0)
    # each b0 defers 3 s; b1 then waits 4 s for b0's collective: the 3 s fit in the wait
    assert simulate_step(deferred, 2, steps) == pytest.approx(24.0)
    # 5 s each: 4 s fill b1's wait, 1 s fills F(1) f1's (from 13 to 17); B(1) leaves 1 s
    # for the end
    more = _segments([1.0, 1.0], [4.0, 0.0], [1.0, 1.0], [4.0, 0.0], [5.0, 0.0])
    assert simulate_step(more, 2, steps) == pytest.approx(25.0)


def test_serial_comm_keeps_one_collective_on_the_wire_in_program_order() -> None:
    comm = TPComm(None)
    comm.world = 2
    comm.serial = True
    comm.completion_callbacks = False
    issued: list[float] = []
    works: list[Work] = []

    class Work:
        def __init__(self, tag: float) -> None:
            self.tag, self.done = tag, False

        def is_completed(self) -> bool:
            return self.done

        def wait(self) -> None:
            self.done = True

    def fake_all_reduce(t, group=None, async_op=False):
        issued.append(float(t[0]))
        works.append(Work(float(t[0])))
        return works[-1]

    import stalwart.overlap.comm as cm

    real = cm.dist.all_reduce
    cm.dist.all_reduce = fake_all_reduce
    try:
        ps = [comm.start(torch.full((4,), float(k))) for k in range(3)]
        assert issued == [0.0] and [p.queued for p in ps] == [False, True, True]
        assert not comm.poll(ps[1])  # the first is still on the wire
        works[0].done = True
        assert not comm.poll(ps[2]) and issued == [0.0, 1.0]  # seen complete: next goes
        comm.finish(ps[2])  # waits for 1, issues 2, waits for 2
        assert issued == [0.0, 1.0, 2.0] and all(p.t_done is not None for p in ps)
        assert comm._inflight is None and not comm._queued
    finally:
        cm.dist.all_reduce = real


def test_one_micro_batch_defers_nothing_under_a_memory_cap() -> None:
    # no profile yet says what one micro-batch's activations are: nothing may be held
    mbs = _mbs(1)
    model, comm, ref = _reference(mbs)
    step = Interleaved(model, comm, schedule="si")
    step.forward_backward(mbs)
    assert step.wgrad is not None and step.wgrad.pushed == 0
    _assert_grads(model, ref)
