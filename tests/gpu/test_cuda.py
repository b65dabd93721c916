"""Every capability on CUDA tensors: run on a GPU machine (``scripts/gpu_check.sh``), skipped
where torch sees no GPU. Two ranks share the GPUs there are (gloo on CUDA tensors when there
are fewer GPUs than ranks, devices.py), as ``stalwart run --device cuda`` does."""

from __future__ import annotations

import os

import pytest
import torch

from stalwart.launch import free_port
from tests.helpers import spawn_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _init(rank: int, world: int, port: int) -> torch.device:
    import torch.distributed as dist

    from stalwart.devices import plan_devices

    plan = plan_devices("cuda", world, torch.cuda.device_count())
    dev = torch.device(plan.device_of(rank))
    torch.cuda.set_device(dev)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(plan.backend, rank=rank, world_size=world)
    return dev


def _train(rank: int, world: int, port: int, comm: str, out) -> None:  # noqa: ANN001
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import stalwart.comm
    from stalwart.comm.deadline import AdaptiveDeadline
    from stalwart.train.model import GPT, GPTConfig

    dev = _init(rank, world, port)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)).to(dev)
    ddp = DDP(model, device_ids=[dev.index])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    if comm == "lossy":  # long deadlines: nothing is late, so the result must be exact
        opt = stalwart.comm.attach(ddp, opt, max_grad_norm=1.0,
                                   deadline=AdaptiveDeadline(initial=10, floor=10, cap=10))
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        x = torch.randint(0, 256, (4, 16), generator=g).to(dev)
        _, loss = ddp(x, x.roll(1, 1))
        loss.backward()
        if comm != "lossy":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().tolist()
    on_device = all(p.device == dev for p in model.parameters())
    if hasattr(opt, "close"):
        opt.close()
    dist.destroy_process_group()
    out.put((rank, (flat, on_device)))


def test_lossy_transport_on_cuda_matches_reliable_ddp_without_loss() -> None:
    rel = spawn_ranks(_train, 2, free_port(), "reliable", timeout=180)
    los = spawn_ranks(_train, 2, free_port(), "lossy", timeout=180)
    for r in range(2):
        assert los[r][1] and rel[r][1]  # parameters stayed on the GPU
        err = (torch.tensor(los[r][0]) - torch.tensor(rel[0][0])).abs().max().item()
        assert err < 2e-5, err  # float32 summation order only, as on CPU


def _tp_grads(rank: int, world: int, port: int, out) -> None:  # noqa: ANN001
    import torch.distributed as dist

    from stalwart.overlap import TPGPT, Interleaved, TPComm
    from stalwart.train.model import GPT, GPTConfig

    dev = _init(rank, world, port)
    torch.manual_seed(0)
    comm = TPComm(dist.group.WORLD)
    model = TPGPT.from_full(GPT(GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=64)),
                            comm).to(dev)
    g = torch.Generator().manual_seed(1)
    mbs = [(torch.randint(0, 256, (4, 32), generator=g).to(dev),
            torch.randint(0, 256, (4, 32), generator=g).to(dev)) for _ in range(4)]
    res = {}
    for sched in ("off", "si"):
        step = Interleaved(model, comm, schedule=sched, max_extra_memory=None)
        loss, _ = step.forward_backward(mbs)
        torch.cuda.synchronize()
        # plain lists: a tensor sent through the queue would live in shared memory that
        # this process may take down with it when it exits
        res[sched] = (loss, {n: p.grad.detach().reshape(-1).cpu().tolist()
                             for n, p in model.named_parameters()})
        res[sched + "_plan"] = step.plan_source
    dist.destroy_process_group()
    out.put((rank, res))


def test_strand_interleaving_on_cuda_gives_the_sequential_gradients() -> None:
    got = spawn_ranks(_tp_grads, 2, free_port(), timeout=240)
    for r in range(2):
        off, si = got[r]["off"], got[r]["si"]
        assert got[r]["si_plan"] == "profiled"  # the strands really ran (and were profiled)
        assert abs(off[0] - si[0]) < 1e-5
        for name, g in off[1].items():
            assert torch.allclose(torch.tensor(si[1][name]), torch.tensor(g), atol=1e-5,
                                  rtol=0), name


def _validate(rank: int, world: int, port: int, out) -> None:  # noqa: ANN001
    import torch.distributed as dist

    from stalwart.detect import validate

    dev = _init(rank, world, port)
    times = validate.compute_test(reps=8, rounds=2, device=dev)
    # the link test moves device buffers where the job's backend carries them (NCCL); gloo's
    # send/recv take host buffers (the monitor does the same: verify.where_to_test)
    link_dev = dev if validate.cuda_backend(dist.get_backend(), True) else None
    links = validate.link_test(validate.ring_pair_passes(world), rank, nbytes=1 << 16,
                               device=link_dev)
    dist.destroy_process_group()
    out.put((rank, (times, links)))


def test_validation_tests_run_on_the_jobs_gpu() -> None:
    got = spawn_ranks(_validate, 2, free_port(), timeout=120)
    assert all(len(t) == 2 and min(t) > 0 for t, _ in got.values())
    assert got[0][1] and all(v > 0 for v in got[0][1].values())  # rank 0 times pair (0, 1)


def test_host_staging_round_trips_cuda_parameters_exactly() -> None:
    from stalwart.comm.staging import HostStaging

    a = torch.nn.Parameter(torch.randn(300, 7, device="cuda"))
    b = torch.nn.Parameter(torch.randn(5, device="cuda"))
    a.grad = torch.randn_like(a)
    st = HostStaging([a, b])
    g = st.grads()
    assert g[:2100].tolist() == a.grad.reshape(-1).cpu().tolist() and not g[2100:].any()
    v = st.values()
    assert st.slice_values(2098, 2103).tolist() == v[2098:2103].tolist()
    new = v * 3 + 1
    st.put_values(new)
    x = a * 1  # a kernel on the compute stream: it must see the new values
    assert x.reshape(-1).cpu().tolist() == new[:2100].tolist()
    assert b.detach().cpu().tolist() == new[2100:].tolist()


def test_the_step_clock_reads_device_times_without_a_sync() -> None:
    from stalwart.train.model import GPT, GPTConfig
    from stalwart.train.steps import LocalComputeClock

    dev = torch.device("cuda", 0)
    model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=256)).to(dev)
    clock = LocalComputeClock(model, dev)
    seen = []
    for _ in range(3):
        clock.start()
        x = torch.randint(0, 256, (8, 64), device=dev)
        _, loss = model(x, x)
        loss.backward()
        clock.backward_done()
        loss.item()  # the loop's own sync (the loss is read every step anyway)
        seen.append(clock.device_times())
    assert seen[0] is None  # the first step learns which gradient comes last
    for t in seen[1:]:
        assert t is not None and t[0] > 0 and t[1] >= 0
