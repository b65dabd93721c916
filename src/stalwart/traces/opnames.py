"""Operation names to kinds: compute, communication, a step marker, or neither.

The default rules cover Megatron-LM's timer names and PyTorch profiler (Kineto) names; the
user's rules (``--map 'PATTERN=KIND'``, shell-style patterns, case-insensitive) are tried
first, then the defaults, first match wins. An unmatched name is ``other``: it counts in
neither the compute nor the communication time (listed in the verdict's coverage, so a
missing rule shows).
Guarantees: pure, deterministic. Cost: one pattern match per distinct name (memoised).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

from stalwart.errors import ConfigError

COMPUTE, COMM, STEP, OTHER = "compute", "comm", "step", "other"
KINDS = (COMPUTE, COMM, STEP, OTHER)

# (pattern, kind): first match wins; tried after the user's own rules
DEFAULT_RULES: tuple[tuple[str, str], ...] = (
    # Kineto: the step annotation; profiler bookkeeping
    ("ProfilerStep#*", STEP),
    ("[[]memory[]]", OTHER),
    # Megatron-LM timers: wrappers that hold both compute and communication come first
    ("forward-backward*", OTHER),
    ("forward-send-backward-recv*", COMM),
    ("backward-send-forward-recv*", COMM),
    ("forward-send*", COMM), ("forward-recv*", COMM),
    ("backward-send*", COMM), ("backward-recv*", COMM),
    ("*all-gather*", COMM), ("*reduce-scatter*", COMM), ("*all-reduce*", COMM),
    ("all-grads-sync*", COMM), ("*grads-sync*", COMM),
    ("forward-compute*", COMPUTE), ("backward-compute*", COMPUTE),
    ("optimizer*", COMPUTE),
    ("batch-generator*", OTHER), ("interval-time*", OTHER), ("save-checkpoint*", OTHER),
    # Kineto: collectives (NCCL kernels, record_function names of c10d, gloo and nccl)
    ("nccl*", COMM), ("gloo:*", COMM), ("c10d::*", COMM), ("record_param_comms*", COMM),
    ("*allreduce*", COMM), ("*all_reduce*", COMM), ("*allgather*", COMM),
    ("*all_gather*", COMM), ("*reducescatter*", COMM), ("*reduce_scatter*", COMM),
    ("*alltoall*", COMM), ("*all_to_all*", COMM), ("*sendrecv*", COMM),
    ("*broadcast*", COMM), ("aten::wait*", COMM), ("*barrier*", COMM),
    ("*irecv*", COMM), ("*isend*", COMM),
    # Kineto: copies are neither (host<->device traffic, not the model's arithmetic)
    ("memcpy*", OTHER), ("memset*", OTHER), ("cuda*", OTHER),
    # Kineto: CPU operators and GPU kernels are compute
    ("aten::*", COMPUTE), ("autograd::*", COMPUTE), ("Optimizer.*", COMPUTE),
    ("*gemm*", COMPUTE), ("*kernel*", COMPUTE), ("void *", COMPUTE), ("triton_*", COMPUTE),
    ("*flash*", COMPUTE),
)


def parse_rule(text: str) -> tuple[str, str]:
    pat, eq, kind = text.rpartition("=")
    kind = kind.strip().lower()
    if not eq or not pat.strip() or kind not in KINDS:
        raise ConfigError(f"--map {text!r}: expected NAME=KIND, KIND one of "
                          f"{', '.join(KINDS)} (NAME may use * and ?)")
    return pat.strip(), kind


class OpMap:
    """Classifies operation names: the user's rules first, then ``DEFAULT_RULES``."""

    def __init__(self, user_rules: Iterable[tuple[str, str]] = ()) -> None:
        self.rules = [*user_rules, *DEFAULT_RULES]
        self._compiled = [(re.compile(fnmatch.translate(p.lower())), k) for p, k in self.rules]
        self._memo: dict[str, str] = {}

    def kind(self, name: str) -> str:
        k = self._memo.get(name)
        if k is None:
            low = name.lower()
            k = next((kind for rx, kind in self._compiled if rx.match(low)), OTHER)
            self._memo[name] = k
        return k
