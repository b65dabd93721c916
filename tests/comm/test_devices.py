"""The lossy transport reads gradients through numpy (host memory): parameters off the CPU are
refused at attach with one line. CUDA cannot exist here; a "meta" tensor is off the CPU in the
same way (its device type), and ``.numpy()`` fails on it as it does on CUDA."""

from __future__ import annotations

import pytest
import torch

import stalwart.comm


def test_attach_refuses_parameters_off_the_cpu() -> None:
    model = torch.nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match=r"CPU parameters only \(got meta\)") as e:
        stalwart.comm.attach(model, torch.optim.SGD, lr=0.1)  # before any socket or setup
    assert "\n" not in str(e.value)
