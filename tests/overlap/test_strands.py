"""Strand mechanics in one process (a TP group of one still parks at every collective)."""

from __future__ import annotations

import threading

import pytest
import torch

from stalwart.overlap import TPGPT, Interleaved, TPComm
from stalwart.overlap.comm import CommLedger, current_strand
from stalwart.overlap.memory import SavedTensorMeter
from stalwart.overlap.plan import Profile, make_plan
from stalwart.overlap.strands import Strand, StrandCancelled, StrandError, run_plan
from stalwart.train.model import GPT, GPTConfig

CFG = GPTConfig(block_size=8, n_layer=2, n_head=2, n_embd=16)


def _model() -> tuple[GPT, TPGPT, TPComm]:
    torch.manual_seed(0)
    gpt = GPT(CFG)
    comm = TPComm(None)
    return gpt, TPGPT.from_full(gpt, comm), comm


def _mbs(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 256, (2, 8), generator=g), torch.randint(0, 256, (2, 8),
                                                                        generator=g))
            for _ in range(n)]


def test_passes_split_at_every_collective() -> None:
    _, model, _ = _model()
    x, y = _mbs(1)[0]
    f = Strand("F", lambda: model(x, y)[1])
    f.run_to_end()
    b = Strand("B", lambda: f.result.backward())
    b.run_to_end()
    # two all-reduces per block in forward (row-parallel outputs) and two in backward
    # (column-parallel input gradients): 2L collectives -> 2L + 1 segments each way
    assert f.segments == 2 * CFG.n_layer + 1
    assert b.segments == 2 * CFG.n_layer + 1
    with pytest.raises(StrandError):
        f.resume()


def test_run_plan_alternates_segments_in_plan_order() -> None:
    trace: list[str] = []

    class Fake:  # stands in for a collective: parks the strand, like TPComm.finish
        def __init__(self, tag: str, n: int) -> None:
            self.tag, self.n = tag, n

        def __call__(self) -> None:
            from stalwart.overlap.comm import Pending, current_strand

            for k in range(self.n):
                trace.append(f"{self.tag}{k}")
                if k < self.n - 1:
                    current_strand().park(Pending(torch.zeros(1), None, 0.0, 0.0))

    f, b = Strand("F", Fake("f", 3)), Strand("B", Fake("b", 2))
    run_plan(["F", "FB", "B"], f, b)
    # F: f0 | FB: b0 then f1 (backward first) | B: b1 (the backward ends) | leftover: f2
    assert trace == ["f0", "b0", "f1", "b1", "f2"]
    assert f.done and b.done


def test_strand_errors_surface_in_the_scheduler() -> None:
    def boom() -> None:
        raise KeyError("inside the strand")

    s = Strand("F", boom)
    with pytest.raises(KeyError):
        s.resume()


def test_a_failing_strand_stops_its_partner_too() -> None:
    from stalwart.overlap.comm import Pending, current_strand

    unwound: list[str] = []

    def passes(tag: str, n: int, fail_at: int) -> None:
        try:
            for k in range(n):
                if k == fail_at:
                    raise KeyError(f"{tag}{k} failed")
                current_strand().park(Pending(torch.zeros(1), None, 0.0, 0.0))
        finally:
            unwound.append(tag)

    f = Strand("F", lambda: passes("f", 4, fail_at=2))
    b = Strand("B", lambda: passes("b", 4, fail_at=99))
    with pytest.raises(KeyError, match="f2 failed"):
        run_plan(["FB", "FB", "FB", "FB"], f, b)
    # the partner was parked mid-pass: it got the error too, unwound and ended (before: it
    # stayed parked for ever, holding its thread and its pass's activations)
    assert f.done and b.done
    assert isinstance(b.error, StrandCancelled) and isinstance(b.error.__cause__, KeyError)
    assert sorted(unwound) == ["b", "f"]
    assert not any(t.name.startswith("strand-") for t in threading.enumerate())


def test_an_error_inside_an_interleaved_step_leaves_no_strand_behind() -> None:
    _, model, comm = _model()
    m = n = 2 * CFG.n_layer + 1
    prof = Profile.uniform([1.0] * m, [1.0] * n, 0.1, 0.1)
    calls = [0]

    def loss_fn(mdl: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:  # the forward of micro-batch 2, while B(1) is parked mid-pass
            raise RuntimeError("bad batch")
        return mdl(x, y)[1]

    step = Interleaved(model, comm, schedule="si", loss_fn=loss_fn, plan=make_plan({}, prof))
    with pytest.raises(RuntimeError, match="bad batch"):
        step.forward_backward(_mbs(4))
    assert not any(t.name.startswith("strand-") for t in threading.enumerate())
    calls[0] = -100  # and the executor still works afterwards
    step.forward_backward(_mbs(4))


def test_interleaved_gradients_equal_sequential_accumulation() -> None:
    gpt, model, comm = _model()
    mbs = _mbs(4)
    for x, y in mbs:
        (gpt(x, y)[1] / len(mbs)).backward()
    ref = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    m = n = 2 * CFG.n_layer + 1
    # a fixed plan that pairs a lot, and one that pairs nothing: same gradients
    for after_other in (0.1, 100.0):
        prof = Profile.uniform([1.0] * m, [1.0] * n, after_other, after_other)
        step = Interleaved(model, comm, schedule="si", plan=make_plan({}, prof))
        loss, _ = step.forward_backward(mbs)
        got = dict(model.named_parameters())
        for name, g in ref.items():
            assert torch.allclose(got[name].grad, g, atol=1e-5, rtol=0), name
        assert loss == pytest.approx(sum(gpt(x, y)[1].item() for x, y in mbs) / len(mbs),
                                     abs=1e-5)


def test_memory_meter_counts_saved_activations_and_frees_them() -> None:
    _, model, _ = _model()
    meter = SavedTensorMeter(exclude=list(model.parameters()))
    x, y = _mbs(1)[0]
    with meter.tracking():
        loss = model(x, y)[1]
    held = meter.live
    assert held > 0 and meter.peak >= held
    loss.backward()
    del loss
    assert meter.live == 0
    # a second forward kept alive doubles what is held
    with meter.tracking():
        l1 = model(x, y)[1]
        l2 = model(x.clone(), y.clone())[1]  # distinct inputs: inputs are saved too
    assert meter.live == 2 * held
    del l1, l2


def test_meter_release_inside_its_locked_region_does_not_deadlock() -> None:
    # a saved tensor's release runs in a weakref finalizer, which the cyclic collector can run
    # on any allocation -- also while this very meter holds its lock (inside _pack). Holding
    # the lock while the last reference goes is that situation made deterministic.
    meter = SavedTensorMeter()
    x = torch.ones(1000, requires_grad=True)
    with meter.tracking():
        y = (x * x).sum()  # saves x for backward
    assert meter.live == 4000
    box = [y]
    del y

    def release_under_lock() -> None:
        with meter._lock:
            box.clear()  # the graph and its saved x go: the finalizer runs here

    t = threading.Thread(target=release_under_lock, daemon=True)
    t.start()
    t.join(timeout=10)
    assert not t.is_alive(), "the finalizer deadlocked on the meter's lock"
    assert meter.live == 0  # and the release was accounted


def test_memory_is_measured_only_when_asked() -> None:
    _, model, comm = _model()
    quiet = Interleaved(model, comm, schedule="off")
    _, t = quiet.forward_backward(_mbs(2))
    assert "act_peak_bytes" not in t and quiet.meter.peak == 0  # no hooks ran
    loud = Interleaved(model, comm, schedule="off", measure_memory=True)
    _, t = loud.forward_backward(_mbs(2))
    assert t["act_peak_bytes"] > 0


def test_union_of_comm_intervals() -> None:
    led = CommLedger(intervals=[(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.2, 3.5)])
    assert led.comm_time() == pytest.approx(3.0)


def _exact_union(iv: list[tuple[float, float]]) -> float:
    return CommLedger(intervals=list(iv)).comm_time()


def test_comm_ledger_stays_bounded_without_resets_and_keeps_the_union() -> None:
    # a model using the layers outside Interleaved never resets its ledger: 20,000 collectives
    # (two strands' worth, overlapping) must not grow it past its bound, and the union stays
    # exact because every fold happens behind the oldest collective in flight
    from stalwart.overlap.comm import Pending

    led = CommLedger(max_intervals=64)
    rng = torch.Generator().manual_seed(3)
    done: list[tuple[float, float]] = []
    t = 0.0
    for _ in range(10_000):
        gaps = torch.rand(4, generator=rng).tolist()
        p1 = Pending(torch.zeros(1), None, t)
        p2 = Pending(torch.zeros(1), None, t + gaps[0])
        with led.lock:
            led.issued(p1)
            led.issued(p2)
            led.completed(p1, t + gaps[0] + gaps[1])
            led.completed(p2, t + gaps[0] + gaps[2])
        done += [(t, t + gaps[0] + gaps[1]), (t + gaps[0], t + gaps[0] + gaps[2])]
        t += gaps[0] + gaps[3] * 1.5
        assert len(led.intervals) <= 64
    assert led.comm_time() == pytest.approx(_exact_union(done), rel=1e-9)
    # one collective stuck in flight: still bounded
    stuck = Pending(torch.zeros(1), None, t)
    with led.lock:
        led.issued(stuck)
    for k in range(1000):
        p = Pending(torch.zeros(1), None, t + k + 1)
        with led.lock:
            led.issued(p)
            led.completed(p, t + k + 1.5)
        assert len(led.intervals) <= 64
    led.reset()
    assert led.comm_time() == 0.0 and not led.intervals


def test_unknown_schedule_is_rejected() -> None:
    _, model, comm = _model()
    with pytest.raises(ValueError, match="schedule"):
        Interleaved(model, comm, schedule="fast")


def test_whole_step_stream_plan_keeps_gradients_and_memory() -> None:
    gpt, model, comm = _model()
    mbs = _mbs(4)
    for x, y in mbs:
        (gpt(x, y)[1] / len(mbs)).backward()
    ref = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    off = Interleaved(model, comm, schedule="off", measure_memory=True)
    _, t_off = off.forward_backward(mbs)
    step = Interleaved(model, comm, schedule="si", max_extra_memory=0.05, measure_memory=True)
    _, t_si = step.forward_backward(mbs)
    assert step.plan_source == "profiled"
    steps = step.stream_steps(len(mbs))
    assert steps is not None  # a profiled plan runs the step as two continuous strands
    # every segment of F(1..3) and B(0..3) is scheduled exactly once
    m, n = step.plan.signature["segments"]
    assert sum("F" in s for s in steps) == 3 * m and sum("B" in s for s in steps) == 4 * n
    assert step.predicted_step_time(len(mbs)) > 0
    got = dict(model.named_parameters())
    for name, g in ref.items():
        assert torch.allclose(got[name].grad, g, atol=1e-5, rtol=0), name
    # the plan search bounds live activations to one micro-batch's + 5%, and the deferred
    # weight-gradient queue holds at most 10% more (its default cap)
    assert t_si["act_peak_bytes"] <= (1 + 0.05 + 0.10) * t_off["act_peak_bytes"]
    plain = Interleaved(model, comm, schedule="si", max_extra_memory=0.05,
                        measure_memory=True, defer_wgrad=False)
    _, t_plain = plain.forward_backward(mbs)
    assert t_plain["act_peak_bytes"] <= 1.05 * t_off["act_peak_bytes"]


def test_a_strand_parks_from_a_thread_it_handed_its_pass_to() -> None:
    # CUDA autograd runs a backward on its device thread, not on the strand's: a collective
    # reached there must park the strand whose pass it is (the one holding the baton)
    order: list[str] = []

    def pass_on_another_thread() -> None:
        def body() -> None:
            order.append("b1")
            current_strand().yield_()
            order.append("b2")

        t = threading.Thread(target=body)
        t.start()
        t.join()

    def fwd() -> None:
        order.append("f1")
        current_strand().yield_()
        order.append("f2")

    run_plan(["B", "F", "B", "F"], Strand("F", fwd), Strand("B", pass_on_another_thread))
    assert order == ["b1", "f1", "b2", "f2"]
    assert current_strand() is None  # the scheduler's thread runs no strand afterwards
