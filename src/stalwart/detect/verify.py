"""Validation measured live: every rank runs the tests together and gathers their results.

FALCON's validation step: the same matmul on every rank (compute) and equal transfers over
disjoint ring pairs (links), then -- for a slowdown nothing explains -- the pairs that are not
ring neighbours (round robin, up to 16 ranks). Every rank gathers every rank's evidence
(profile and test times) over the monitor's own gloo group. ``LiveEvidence`` is the
``EvidenceSource`` the monitor's ``Detector`` (detector.py) asks for these measurements; the
rules that ask (a mild suspect's longer compute tests, ``localize.more_rounds``: 3 -> 7 -> 10
rounds; the round-robin pairs; the verdict) are the Detector's, the same in replay and in the
simulator, and every rank applies them to the same gathered evidence.

Cost: a validation pause of the tests' length (tens to hundreds of milliseconds on the tiny
preset), only when an alarm is raised.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from stalwart.detect import validate
from stalwart.detect.evidence import RankEvidence

MAX_ROUND_ROBIN = 16  # world sizes above this test only the ring pairs


class LiveEvidence:
    """The validation tests run live: every rank together over the monitor's gloo group (or
    the job's device path, ``where_to_test``), gathered everywhere -- the ``EvidenceSource``
    the monitor gives its ``Detector`` (detector.py). ``enabled`` False (one process, or
    validation switched off): this rank's own profile only, no tests. ``pause_s``: the last
    tests' wall time. ``skip_links``: rank pairs (a < b) known slow and taken off the ring by
    a mitigation still in force (an S3 placement): the round-robin pairs leave them out, so a
    validation neither sends over them again (what the mitigation took away: seconds of pause
    on a 10 mbit pair) nor finds that link again; every rank passes the same set. Collective:
    every rank calls the same methods in the same order (the Detector's rules decide from
    gathered evidence, so they agree)."""

    def __init__(self, group: Any, world: int, rank: int, *, compute_reps: int,
                 link_bytes: int, device: Any = None, enabled: bool = True,
                 skip_links: set[tuple[int, int]] | None = None) -> None:
        self._group, self.world, self.rank = group, world, rank
        self.skip_links = set(skip_links or ())
        self.compute_reps, self.link_bytes, self.device = compute_reps, link_bytes, device
        self.enabled = enabled
        self.pause_s = 0.0
        self._ev: RankEvidence | None = None
        self._ring: list[list[tuple[int, int]]] = []
        self._where: tuple[Any, Any, Any] = (None, None, None)
        self._t0 = 0.0

    def group(self) -> Any:
        return self._group() if callable(self._group) else self._group

    def tests(self, alarm: Any, decided: int, own: RankEvidence) -> list[RankEvidence]:
        self._t0 = time.perf_counter()
        self._ev = ev = own
        if not self.enabled:
            return self._done([ev])
        group = self.group()
        self._where = dev, link_dev, link_pg = where_to_test(group, self.device)
        ev.compute_rounds = validate.compute_test(reps=self.compute_reps, group=group,
                                                  device=dev)
        ev.compute_test = statistics.median(ev.compute_rounds)
        self._ring = validate.ring_pair_passes(self.world)
        ev.links = {f"{a}-{b}": t for (a, b), t in validate.link_test(
            self._ring, self.rank, self.link_bytes, group=link_pg, device=link_dev).items()}
        return self._done(gather(ev, group, self.world))

    def more_rounds(self, rounds: int) -> list[RankEvidence]:
        ev = self._ev
        assert ev is not None
        if not self.enabled:
            return self._done([ev])
        group = self.group()
        ev.compute_rounds += validate.compute_test(reps=self.compute_reps, rounds=rounds,
                                                   group=group, device=self._where[0])
        ev.compute_test = statistics.median(ev.compute_rounds)
        return self._done(gather(ev, group, self.world))

    def more_links(self) -> list[RankEvidence] | None:
        ev = self._ev
        tested = {p for ps in self._ring for p in ps}
        extra = validate.round_robin_passes(self.world, tested | self.skip_links)
        if ev is None or not self.enabled or not extra or self.world > MAX_ROUND_ROBIN:
            return None
        group = self.group()
        _, link_dev, link_pg = self._where
        ev.links.update({f"{a}-{b}": t for (a, b), t in validate.link_test(
            extra, self.rank, self.link_bytes, group=link_pg, device=link_dev).items()})
        return self._done(gather(ev, group, self.world))

    def retest_links(self, pairs: list[str]) -> dict[str, float]:
        """Collective: the link test once more on ``pairs`` ("a-b", every rank the same
        list), in passes of disjoint pairs, gathered; pair -> round-trip seconds."""
        ev = self._ev
        if ev is None or not self.enabled or not pairs:
            return {}
        todo = [(int(a), int(b)) for a, b in (k.split("-") for k in pairs)]
        passes: list[list[tuple[int, int]]] = []
        for pr in todo:  # first fit: a pass holds each rank once
            for ps in passes:
                if not {pr[0], pr[1]} & {x for q in ps for x in q}:
                    ps.append(pr)
                    break
            else:
                passes.append([pr])
        group = self.group()
        _, link_dev, link_pg = self._where
        mine = {f"{a}-{b}": t for (a, b), t in validate.link_test(
            passes, self.rank, self.link_bytes, group=link_pg, device=link_dev).items()}
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, mine, group=group)
        self.pause_s = round(time.perf_counter() - self._t0, 3)
        return {k: float(t) for d in out for k, t in (d or {}).items()}

    def recovery_ratio(self, suspect: int, decided: int) -> float | None:
        if not self.enabled:
            return None
        t0 = time.perf_counter()
        r = recovery_ratio(self.group(), self.world, suspect, compute_reps=self.compute_reps,
                           device=self.device)
        self.pause_s = round(time.perf_counter() - t0, 3)
        return r

    def _done(self, ev: list[RankEvidence]) -> list[RankEvidence]:
        self.pause_s = round(time.perf_counter() - self._t0, 3)
        return ev


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
