"""Which device and backend each rank gets (devices.py): a pure function of the request,
the ranks on the machine and the visible GPUs -- checked here without a GPU."""

from __future__ import annotations

import pytest

from stalwart.devices import DeviceError, plan_devices, rank_slot
from tests.helpers import stalwart


def test_cpu_and_auto_without_a_gpu_use_gloo_on_the_cpu() -> None:
    for req in ("cpu", "auto"):
        p = plan_devices(req, 4, 0)
        assert (p.kind, p.backend, p.device_of(3)) == ("cpu", "gloo", "cpu")
    assert plan_devices("cpu", 2, 8).kind == "cpu"  # asked for: the GPUs stay unused


def test_a_gpu_per_rank_uses_nccl_for_device_tensors_and_gloo_for_host_ones() -> None:
    p = plan_devices("auto", 4, 8)
    assert p.backend == "cpu:gloo,cuda:nccl" and not p.shared
    assert [p.device_of(s) for s in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]


def test_more_ranks_than_gpus_share_them_over_gloo() -> None:
    # NCCL refuses two ranks of one communicator on one GPU: gloo reduces CUDA tensors
    p = plan_devices("cuda", 4, 1)
    assert p.backend == "gloo" and p.shared
    assert {p.device_of(s) for s in range(4)} == {"cuda:0"}
    assert [plan_devices("cuda", 4, 2).device_of(s) for s in range(4)] == [
        "cuda:0", "cuda:1", "cuda:0", "cuda:1"]


def test_cuda_without_a_gpu_and_unknown_devices_are_one_line_errors() -> None:
    with pytest.raises(DeviceError, match="no CUDA device is visible"):
        plan_devices("cuda", 2, 0)
    with pytest.raises(DeviceError, match="unknown --device 'tpu'"):
        plan_devices("tpu", 2, 0)


def test_the_launchers_slot_wins_over_local_rank() -> None:
    # netns hosts are namespaces of one machine: LOCAL_RANK is 0 on every one of them
    env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "STALWART_DEVICE_SLOT": "2",
           "STALWART_DEVICE_SLOTS": "4"}
    assert rank_slot(env) == (2, 4)
    assert rank_slot({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == (1, 2)


def test_run_refuses_cuda_on_a_machine_without_one_in_one_line(tmp_path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = stalwart("run", "--device", "cuda", "--nproc", "2", "--out", str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "--device cuda: no CUDA device is visible" in r.stderr
    assert not list(tmp_path.iterdir())  # refused before any run directory was made
