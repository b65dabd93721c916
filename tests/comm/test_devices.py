"""The lossy transport works on CPU or CUDA parameters (CUDA through pinned host staging,
comm/staging.py): any other device is refused at attach with one line, before any socket is
opened. A "meta" tensor stands for such a device here."""

from __future__ import annotations

import pytest
import torch

import stalwart.comm
from stalwart.comm.staging import HostStaging, check_devices


def test_attach_refuses_parameters_neither_on_cpu_nor_cuda() -> None:
    model = torch.nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match=r"CPU or CUDA parameters \(got meta\)") as e:
        stalwart.comm.attach(model, torch.optim.SGD, lr=0.1)  # before any socket or setup
    assert "\n" not in str(e.value)


def test_parameters_on_two_devices_are_refused() -> None:
    params = [torch.zeros(2), torch.zeros(2, device="meta")]
    with pytest.raises(ValueError, match="all parameters on one device"):
        check_devices(params)


def test_cpu_staging_round_trips_the_flat_vectors() -> None:
    a, b = torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))
    a.grad, b.grad = torch.randn(3, 2), None
    st = HostStaging([a, b])
    g = st.grads()
    assert g.tolist() == [*a.grad.reshape(-1).tolist(), 0.0, 0.0, 0.0, 0.0]
    v = st.values()
    assert st.slice_values(4, 8).tolist() == v[4:8].tolist()
    st.put_values(v * 2)
    assert torch.equal(b.detach(), torch.from_numpy(v[6:] * 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_round_trips_the_flat_vectors_bit_for_bit() -> None:
    a = torch.nn.Parameter(torch.randn(300, 7, device="cuda"))
    b = torch.nn.Parameter(torch.randn(5, device="cuda"))
    a.grad, b.grad = torch.randn_like(a), None
    st = HostStaging([a, b])
    g = st.grads()
    assert g.tobytes() == torch.cat([a.grad.reshape(-1), torch.zeros(5, device="cuda")]).cpu(
    ).numpy().tobytes()
    v = st.values()
    assert st.slice_values(2095, 2105).tobytes() == v[2095:2105].tobytes()
    st.put_values(v * 2)
    y = a * 1  # a kernel on the compute stream: it must see the new values
    assert torch.equal(b.detach().cpu(), torch.from_numpy(v[2100:] * 2))
    assert torch.equal(y.detach().cpu().reshape(-1), torch.from_numpy(v[:2100] * 2))
