"""Which device and which process-group backend each rank uses (``--device auto|cpu|cuda``).

Mechanism: a pure function of (requested device, ranks on this machine, visible GPUs) --
``plan_devices`` -- that every rank of a machine evaluates alike, so all agree on the backend
without talking:

* ``cpu`` (or ``auto`` with no GPU): gloo, CPU tensors.
* ``cuda`` with at least one GPU per rank on the machine: rank slot i uses ``cuda:i`` and the
  default group is ``cpu:gloo,cuda:nccl`` -- NCCL for device tensors (gradients, activations),
  gloo for the few host tensors the job still reduces (evaluation sums, object collectives).
* ``cuda`` with more ranks than GPUs: slot i uses ``cuda:(i mod G)`` and the default group is
  plain gloo, which reduces CUDA tensors through host staging. NCCL cannot serve this case: it
  refuses two ranks of one communicator on one GPU ("Duplicate GPU detected").

A rank's slot is its index among the ranks of its machine: ``STALWART_DEVICE_SLOT`` /
``STALWART_DEVICE_SLOTS`` when ``stalwart run`` started it (its testbed hosts are namespaces
of ONE machine, whose LOCAL_RANK is 0 everywhere), else torchrun's LOCAL_RANK /
LOCAL_WORLD_SIZE. Multi-node torchrun jobs must give every node the same number of GPUs per
rank, or nodes would pick different backends.

Cost: a ``torch.cuda.device_count()`` per rank at start.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEVICE_MODES = ("auto", "cpu", "cuda")


class DeviceError(ValueError):
    """A device request this machine cannot serve (one line naming the value)."""


@dataclass(frozen=True)
class DevicePlan:
    kind: str  # "cpu" or "cuda"
    backend: str  # init_process_group's backend string
    gpus: int  # visible GPUs (0 on cpu)
    slots: int  # ranks on this machine
    shared: bool  # True when ranks share GPUs (gloo on CUDA tensors)

    def device_of(self, slot: int) -> str:
        """The device string of the rank in ``slot`` on this machine."""
        if self.kind == "cpu":
            return "cpu"
        return f"cuda:{slot % self.gpus}"

    def describe(self) -> str:
        if self.kind == "cpu":
            return f"{self.slots} rank(s) on CPU, gloo"
        how = "shared, gloo on CUDA tensors" if self.shared else "one per rank, NCCL"
        return f"{self.slots} rank(s) on {self.gpus} GPU(s) ({how})"


def plan_devices(requested: str, slots: int, gpus: int) -> DevicePlan:
    """The device plan for ``slots`` ranks on a machine with ``gpus`` visible GPUs."""
    if requested not in DEVICE_MODES:
        raise DeviceError(f"unknown --device {requested!r} (choose from "
                          f"{', '.join(DEVICE_MODES)})")
    if slots < 1:
        raise DeviceError(f"ranks on this machine must be >= 1, got {slots}")
    if requested == "cuda" and gpus < 1:
        raise DeviceError("--device cuda: no CUDA device is visible to torch "
                          "(torch.cuda.is_available() is False)")
    if requested == "cpu" or gpus < 1:
        return DevicePlan("cpu", "gloo", 0, slots, False)
    if gpus >= slots:
        return DevicePlan("cuda", "cpu:gloo,cuda:nccl", gpus, slots, False)
    return DevicePlan("cuda", "gloo", gpus, slots, True)


def visible_gpus() -> int:
    """GPUs torch can use here (0 without CUDA); imports torch."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_slot(env: dict[str, str] | None = None) -> tuple[int, int]:
    """(slot, slots): this rank's index among the ranks of its machine, and their number."""
    env = dict(os.environ) if env is None else env
    if "STALWART_DEVICE_SLOT" in env:
        return int(env["STALWART_DEVICE_SLOT"]), int(env["STALWART_DEVICE_SLOTS"])
    return int(env.get("LOCAL_RANK", "0")), int(env.get("LOCAL_WORLD_SIZE", "1"))


def check_request(requested: str, nproc: int) -> None:
    """Raise DeviceError now (before any rank starts) if ``requested`` cannot run here."""
    plan_devices(requested, nproc, visible_gpus() if requested != "cpu" else 0)
