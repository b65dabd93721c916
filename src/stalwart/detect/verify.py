"""Validation of an alarm: every rank runs the tests together and reaches the same verdict.

FALCON's validation step: the same matmul on every rank (compute) and equal transfers over
disjoint ring pairs (links), then -- for a slowdown nothing explains -- the pairs that are not
ring neighbours (round robin, up to 16 ranks). Every rank gathers every rank's evidence
(profile and test times) over the monitor's own gloo group, so ``localize.decide`` computes
the same verdict everywhere. A mild straggler gets longer compute tests (``more_rounds``:
3 -> 7 -> 10 rounds), decided from the gathered evidence, so every rank runs the same rounds.

Cost: a validation pause of the tests' length (tens to hundreds of milliseconds on the tiny
preset), only when an alarm is raised.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from stalwart.detect import validate
from stalwart.detect.localize import CHANGE_MODE, Finding, RankEvidence, decide, more_rounds

MAX_ROUND_ROBIN = 16  # world sizes above this test only the ring pairs


def validate_alarm(ev: RankEvidence, group: Any, world: int, rank: int, onset: int,
                   decided: int, severity: float, suspect: int | None, *,
                   compute_reps: int, link_bytes: int, device: Any = None,
                   mode: str = CHANGE_MODE) -> Finding:
    """Collective on ``group``: run the tests, gather, decide (see the module docstring).
    ``device``: the job's compute device when the caller knows it (``where_to_test``);
    ``mode``: what raised the alarm (localize.decide)."""
    dev, link_dev, link_pg = where_to_test(group, device)
    ev.compute_rounds = validate.compute_test(reps=compute_reps, group=group, device=dev)
    ev.compute_test = statistics.median(ev.compute_rounds)
    ring = validate.ring_pair_passes(world)
    ev.links = {f"{a}-{b}": t for (a, b), t in validate.link_test(
        ring, rank, link_bytes, group=link_pg, device=link_dev).items()}
    gathered = gather(ev, group, world)
    while extra_rounds := more_rounds(gathered, suspect, mode):
        ev.compute_rounds += validate.compute_test(reps=compute_reps, rounds=extra_rounds,
                                                   group=group, device=dev)
        ev.compute_test = statistics.median(ev.compute_rounds)
        gathered = gather(ev, group, world)
    finding = decide(gathered, onset, decided, severity, suspect, mode)
    tested = {p for ps in ring for p in ps}
    extra = validate.round_robin_passes(world, tested)
    if finding.kind == "unknown" and extra and world <= MAX_ROUND_ROBIN:
        # a slow link between hosts that are not ring neighbours
        ev.links.update({f"{a}-{b}": t for (a, b), t in validate.link_test(
            extra, rank, link_bytes, group=link_pg, device=link_dev).items()})
        finding = decide(gather(ev, group, world), onset, decided, severity, suspect, mode)
    return finding


def recovery_ratio(group: Any, world: int, suspect: int, *, compute_reps: int,
                   device: Any = None) -> float:
    """Collective on ``group``: the compute test on every rank (the same work everywhere,
    whatever share of the batch a plan gave each), gathered; the suspect's median round
    time over the median of its peers'. What ``DecisionCore.recovery_test`` judges."""
    dev, _, _ = where_to_test(group, device)
    mine = statistics.median(validate.compute_test(reps=compute_reps, group=group, device=dev))
    times: list[Any] = [None] * world
    dist.all_gather_object(times, mine, group=group)
    peers = [float(t) for r, t in enumerate(times) if r != suspect]
    return float(times[suspect]) / statistics.median(peers) if peers else 1.0


def where_to_test(group: Any, device: Any = None) -> tuple[Any, Any, Any]:
    """Where the validation tests run: (compute device, link buffers' device, link group).

    A caller that knows the job's device (``stalwart run`` passes it) decides: CPU -> the
    monitor's gloo group; CUDA with a CUDA backend (NCCL) -> device buffers over the job's
    default group; ranks sharing GPUs over gloo -> the compute test on the GPU and the link
    test on host buffers (gloo's send/recv move host memory only). Otherwise
    ``validate.validation_device`` decides from the default group's backend string: a CPU
    job tests its CPU and links on ``group``; a job whose default group carries CUDA tensors
    tests its own GPU and sends device buffers over its default group -- the path its
    gradients take.
    """
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return None, None, group
        if validate.cuda_backend(dist.get_backend(), True) is not None:
            return device, device, None
        return device, None, group
    cuda = torch.cuda.is_available()
    try:
        local_rank: int | None = int(os.environ["LOCAL_RANK"])
    except (KeyError, ValueError):
        local_rank = None
    # only a job that initialised CUDA can have chosen a current device; asking an
    # uninitialised one would create a CUDA context in a CPU job
    current = torch.cuda.current_device() if cuda and torch.cuda.is_initialized() else None
    path = validate.validation_device(dist.get_backend(), cuda, local_rank, current,
                                      torch.cuda.device_count() if cuda else None)
    if path.link_group == "default":
        return torch.device(path.device), torch.device(path.device), None
    return None, None, group


def gather(ev: RankEvidence, group: Any, world: int) -> list[RankEvidence]:
    out: list[Any] = [None] * world
    dist.all_gather_object(out, asdict(ev), group=group)
    return [RankEvidence(**d) for d in out]
