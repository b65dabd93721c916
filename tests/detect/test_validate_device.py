"""Where validation runs (validate.validation_device): the backend strings torch reports,
mapped to the device to test and the group the link test uses. Pure: no GPU needed."""

from __future__ import annotations

import pytest

from stalwart.detect.validate import CPU_PATH, ValidationPath, cuda_backend, validation_device


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo",
                                     "undefined", "NCCL"])
def test_a_job_whose_default_group_carries_cuda_tensors_tests_its_gpu(backend: str) -> None:
    # mixed and undefined backends were read as "not nccl": GPU jobs tested the CPU over gloo
    path = validation_device(backend, cuda_available=True, local_rank=1, current=None,
                             device_count=4)
    assert path == ValidationPath("cuda:1", "default")


@pytest.mark.parametrize("backend", ["gloo", "mpi", "ucc", "undefined", "cpu:gloo",
                                     "cpu:gloo,cuda:nccl", "nccl"])
def test_without_a_gpu_every_backend_tests_the_cpu_on_the_monitors_group(backend: str) -> None:
    assert validation_device(backend, cuda_available=False, local_rank=0, current=None) \
        == CPU_PATH == ValidationPath("cpu", "monitor")


@pytest.mark.parametrize("backend", ["gloo", "mpi", "ucc", "cpu:gloo"])
def test_a_job_without_a_cuda_backend_tests_the_cpu_even_with_a_gpu(backend: str) -> None:
    assert validation_device(backend, cuda_available=True, local_rank=0, current=0,
                             device_count=2) == CPU_PATH


def test_every_rank_tests_its_own_gpu_not_gpu_0() -> None:
    # a script that moved its model to cuda:LOCAL_RANK without set_device: current is 0
    # everywhere, and every rank used to test GPU 0
    devs = [validation_device("nccl", True, local_rank=r, current=0, device_count=4).device
            for r in range(4)]
    assert devs == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]


def test_the_jobs_own_set_device_wins_over_local_rank() -> None:
    assert validation_device("nccl", True, local_rank=1, current=3, device_count=4).device \
        == "cuda:3"


def test_one_visible_gpu_per_process_or_no_local_rank_falls_back_to_the_current_one() -> None:
    # CUDA_VISIBLE_DEVICES per rank: LOCAL_RANK 2 names no visible device
    assert validation_device("nccl", True, local_rank=2, current=0, device_count=1).device \
        == "cuda:0"
    assert validation_device("nccl", True, local_rank=None, current=None).device == "cuda:0"
    assert validation_device("nccl", True, local_rank=None, current=2).device == "cuda:2"


def test_cuda_backend_reads_every_form_of_the_backend_string() -> None:
    assert cuda_backend("cpu:gloo, cuda:nccl", True) == "nccl"
    assert cuda_backend("cpu:gloo,cuda:gloo", True) == "gloo"
    assert cuda_backend("cpu:gloo", True) is None
    assert cuda_backend("undefined", True) == "nccl"
    assert cuda_backend("undefined", False) is None
    assert cuda_backend("gloo", True) is None


@pytest.mark.parametrize(("backend", "cuda", "want"), [
    ("nccl", True, "cuda:2"), ("cpu:gloo,cuda:nccl", True, "cuda:2"),
    ("undefined", True, "cuda:2"), ("gloo", True, None), ("undefined", False, None)])
def test_the_monitor_validates_where_the_job_runs(monkeypatch: pytest.MonkeyPatch,
                                                  backend: str, cuda: bool,
                                                  want: str | None) -> None:
    # what the monitor reads from torch, faked: rank 2 of a job on 4 GPUs that never called
    # set_device (current device 0)
    import torch
    import torch.distributed as dist

    from stalwart.detect.verify import where_to_test

    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4 if cuda else 0)
    own = object()  # the monitor's gloo group (a real one needs a job)
    dev, link_dev, group = where_to_test(own)
    if want is None:
        assert (dev, link_dev, group) == (None, None, own)  # the CPU path, as before
    else:  # the job's default group
        assert (dev, link_dev, group) == (torch.device(want), torch.device(want), None)


@pytest.mark.parametrize(("backend", "link"), [("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "gpu")])
def test_a_monitor_told_its_gpu_tests_compute_there(monkeypatch: pytest.MonkeyPatch,
                                                    backend: str, link: str) -> None:
    # ranks that share a GPU over gloo (devices.py): the compute test runs on the GPU, the
    # link test on host buffers over the monitor's gloo group (gloo's send/recv take no
    # device memory); with NCCL both run on the GPU over the job's group
    import torch
    import torch.distributed as dist

    from stalwart.detect.verify import where_to_test

    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    own = object()
    got = where_to_test(own, "cuda:0")
    gpu = torch.device("cuda:0")
    assert got == ((gpu, None, own) if link == "cpu" else (gpu, gpu, None))
