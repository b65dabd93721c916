"""Validation micro-benchmarks run while training is paused (FALCON/Greyhound validation).

Mechanism: once a slowdown is detected, every rank stops at the same collective boundary and
runs short tests whose answer does not depend on the training job:
- compute: the same matrix multiplications on every rank at the same time (after a barrier),
  timed locally; a rank far above the healthy level has slow compute (throttling, contention,
  a degraded device);
- links: the ring is split into disjoint point-to-point pairs so that every ring link is
  measured in O(1) passes -- 2 passes for an even ring (0-1, 2-3, ... then 1-2, 3-4, ...),
  3 for an odd one -- with equal message sizes, so a slow link is simply a longer time. Pairs
  off the ring (a slow link between two hosts that are not ring neighbours) are covered by an
  optional round-robin schedule of the remaining pairs (n-1 or n passes), used when the ring
  finds nothing.

Where the tests run (``validation_device``, a pure function of the job's backend string and
its CUDA state): a job whose default group carries CUDA tensors -- backend "nccl", a
per-device string with a "cuda:" entry such as "cpu:gloo,cuda:nccl", or "undefined" (no
backend given: torch picks NCCL when CUDA is available) -- tests its own GPU and sends device
buffers over its default group; every other job (gloo, mpi, ucc, or no CUDA) tests its CPU over
the caller's gloo group, exactly as before. The GPU path is written for GPUs but has never
run here (no GPU on the testbed).

Guarantees: every function here but ``validation_device`` is collective over ``group``
(default: the default group; ranks are global ranks, the group must hold them all) and must
be called by all ranks with the same arguments; each pass ends with a barrier, so passes
never overlap; message sizes are equal in every pair and both directions are timed (a
one-way slow link shows).
"""

from __future__ import annotations

import time
from itertools import combinations
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

Pair = tuple[int, int]


class ValidationPath(NamedTuple):
    """Where one rank's validation tests run."""

    device: str  # "cpu" or "cuda:<index>": the compute test's device and the link buffers'
    link_group: str  # "monitor": the caller's own gloo group; "default": the job's default


CPU_PATH = ValidationPath("cpu", "monitor")


def cuda_backend(backend: str, cuda_available: bool) -> str | None:
    """The backend the job's default group uses for CUDA tensors (None: it has none).

    ``backend`` is ``dist.get_backend()``'s string: one name ("nccl", "gloo", ...), a
    per-device list ("cpu:gloo,cuda:nccl"), or "undefined" (``init_process_group()`` without
    a backend: torch gives the default group the accelerator's backend -- NCCL for CUDA -- or
    gloo on a machine without one).
    """
    b = backend.strip().lower()
    if ":" in b:
        for part in b.split(","):
            dev, _, name = part.partition(":")
            if dev.strip() == "cuda":
                return name.strip() or None
        return None
    if b == "nccl":
        return "nccl"
    if b == "undefined":
        return "nccl" if cuda_available else None
    # "gloo" can carry CUDA tensors too, but a gloo job is taken to be a CPU job (what the
    # testbed runs, and what the tests have always done); mpi, ucc, ...: likewise
    return None


def validation_device(backend: str, cuda_available: bool, local_rank: int | None,
                      current: int | None, device_count: int | None = None
                      ) -> ValidationPath:
    """Where this rank's validation tests run, from what the job actually uses.

    A job whose default group has a CUDA backend (``cuda_backend``) and a visible GPU tests
    that GPU and sends device buffers over its default group (the path its gradients take);
    any other job tests its CPU over the caller's gloo group (``CPU_PATH``).

    Which GPU: ``current`` (``torch.cuda.current_device()``, None when CUDA was never
    initialised) when it is not 0 -- only ``torch.cuda.set_device`` or a ``torch.cuda.device``
    block makes it so, the job's own choice; else ``local_rank`` (LOCAL_RANK, torchrun's
    convention, which ``stalwart run`` follows) when it names a visible device -- a script
    that moves its model to ``cuda:LOCAL_RANK`` without ``set_device`` leaves the current
    device at 0 on every rank, and testing GPU 0 from every rank measured one GPU, shared;
    else ``current`` or 0 (one GPU visible per process, e.g. CUDA_VISIBLE_DEVICES per rank,
    where LOCAL_RANK may exceed ``device_count``). Not covered: a job that calls
    ``set_device(0)`` on a rank whose LOCAL_RANK names another visible GPU.
    """
    if not cuda_available or cuda_backend(backend, cuda_available) is None:
        return CPU_PATH
    if current is not None and current != 0:
        idx = current
    elif local_rank is not None and local_rank >= 0 and (
            device_count is None or local_rank < device_count):
        idx = local_rank
    else:
        idx = current or 0
    return ValidationPath(f"cuda:{idx}", "default")


def ring_pair_passes(n: int) -> list[list[Pair]]:
    """Disjoint pairs covering each link of the ring 0-1-...-(n-1)-0: 2 passes (even n), 3 (odd)."""
    if n < 2:
        return []
    if n == 2:
        return [[(0, 1)]]
    edges = [(i, (i + 1) % n) for i in range(n)]
    norm = [tuple(sorted(e)) for e in edges]
    if n % 2 == 0:
        return [[norm[i] for i in range(0, n, 2)], [norm[i] for i in range(1, n, 2)]]
    # odd: the closing edge (n-1)-0 shares a node with edge 0, so it gets a pass of its own
    return [[norm[i] for i in range(0, n - 1, 2)], [norm[i] for i in range(1, n - 1, 2)],
            [norm[n - 1]]]


def round_robin_passes(n: int, skip: set[Pair] | None = None) -> list[list[Pair]]:
    """All pairs not in ``skip``, as passes of disjoint pairs (circle method)."""
    skip = skip or set()
    ids = list(range(n)) + ([-1] if n % 2 else [])  # -1 = a bye
    m = len(ids)
    passes: list[list[Pair]] = []
    for _ in range(m - 1):
        pairs = []
        for i in range(m // 2):
            a, b = ids[i], ids[m - 1 - i]
            if a >= 0 and b >= 0:
                p = (min(a, b), max(a, b))
                if p not in skip:
                    pairs.append(p)
        if pairs:
            passes.append(pairs)
        ids = [ids[0]] + [ids[-1]] + ids[1:-1]
    return passes


def all_pairs(n: int) -> set[Pair]:
    return set(combinations(range(n), 2))


def compute_test(size: int = 256, reps: int = 64, rounds: int = 3, group: Any = None,
                 device: Any = None) -> list[float]:
    """Seconds of each of ``rounds`` rounds of ``reps`` (size x size) float32 matmuls.

    Each round starts on all ranks together (barrier), so round i of every rank ran at the
    same time and rounds compare across ranks one by one. Rounds are long enough (tens of ms
    of CPU) for a rank's share of the CPU to average out over many scheduler slices.
    ``device``: where the job computes (a GPU job tests its GPU, synchronising before each
    clock read; the default is the CPU).
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(dev)
    b = torch.randn(size, size, generator=g).to(dev)
    # the tested device, which need not be the current one (validation_device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    torch.mm(a, b)  # first-touch and kernel selection outside the timed region
    sync()
    times = []
    for _ in range(rounds):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        sync()
        times.append(time.perf_counter() - t0)
    return times


def link_test(passes: list[list[Pair]], rank: int, nbytes: int = 1 << 18,
              reps: int = 3, group: Any = None, device: Any = None) -> dict[Pair, float]:
    """Round-trip seconds (best of ``reps``) of ``nbytes`` each way, for this rank's pairs.

    The repetitions go round all passes (pass 1, pass 2, pass 1, pass 2, ...) rather than
    repeating each pass in place, so a burst of load from elsewhere spoils one round of every
    pass instead of every round of one pass -- the best of the rounds stays clean.
    Only the lower rank of a pair reports its time; the result is this rank's part.
    ``device``: where the buffers live -- a GPU job tests the path its gradients take (device
    buffers over its own backend, e.g. NCCL), synchronising before the clock is read.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    # the tested device, which need not be the current one (validation_device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    buf_out = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    buf_in = torch.empty_like(buf_out)
    out: dict[Pair, float] = {}
    for _ in range(reps):
        for pairs in passes:
            for a, b in pairs:
                if rank not in (a, b):
                    continue
                peer = b if rank == a else a
                t0 = time.perf_counter()
                if rank == a:
                    dist.send(buf_out, peer, group=group)
                    dist.recv(buf_in, peer, group=group)
                    sync()
                    dt = time.perf_counter() - t0
                    out[(a, b)] = min(out.get((a, b), dt), dt)
                else:
                    dist.recv(buf_in, peer, group=group)
                    dist.send(buf_out, peer, group=group)
                    sync()
            dist.barrier(group=group)
    return out
