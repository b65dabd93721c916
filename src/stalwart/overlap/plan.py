"""Plan search: which forward segment runs together with which backward segment.

Mechanism (DHelix's dynamic programme, arXiv 2411.15871 section "plan search"): with forward
segments f_1..f_m and backward segments b_1..b_n in their dependency order, and a profile giving
the time of f_i alone, b_j alone and of the pair (f_i, b_j) run together,

    T[i][j] = min(T[i-1][j] + P(f_i, -), T[i][j-1] + P(-, b_j), T[i-1][j-1] + P(f_i, b_j))

is the least time to finish the first i forward and j backward segments; backtracking from
T[m][n] yields the steps ("F", "B", "FB"). O(m*n). Guarantee: the returned plan is optimal for
the given profile (tests check a known optimum) and is a deterministic function of it, so TP
ranks holding the same (max-reduced) profile derive the same plan.

A ``Plan`` is saved as JSON next to the run with a *signature* (model shape, micro-batch shape,
TP and world sizes, torch version, segment counts); ``load_plan`` returns it only when the
signature matches, so a changed shape or world triggers re-profiling.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STEPS = ("F", "B", "FB")


@dataclass
class Profile:
    """Seconds: fwd[i] = P(f_i, -), bwd[j] = P(-, b_j), pair[i][j] = P(f_i, b_j).

    Optional bytes: fwd_bytes[i] = activations f_i saves, bwd_bytes[j] = activations b_j frees
    (empty lists: memory is not constrained).
    """

    fwd: list[float]
    bwd: list[float]
    pair: list[list[float]]
    fwd_bytes: list[float] = field(default_factory=list)
    bwd_bytes: list[float] = field(default_factory=list)

    def validate(self) -> None:
        m, n = len(self.fwd), len(self.bwd)
        if len(self.pair) != m or any(len(r) != n for r in self.pair):
            raise ValueError(f"pair table must be {m}x{n}")
        if self.fwd_bytes and len(self.fwd_bytes) != m or self.bwd_bytes and len(
                self.bwd_bytes) != n:
            raise ValueError("byte profiles must have one entry per segment")

    def live_bytes(self) -> Callable[[int, int], float] | None:
        """live(i, j): activations held after i forward and j backward segments, or None.

        The backward strand's micro-batch starts fully saved (sum of bwd_bytes); the forward
        strand's grows segment by segment. A pair runs its backward segment first, so the
        states of the grid are the only peaks (see strands.run_plan).
        """
        if not (self.fwd_bytes and self.bwd_bytes):
            return None
        sf = [0.0, *itertools.accumulate(self.fwd_bytes)]
        fb = [0.0, *itertools.accumulate(self.bwd_bytes)]
        total = fb[-1]
        return lambda i, j: total + sf[i] - fb[j]

    def sequential_time(self) -> float:
        return sum(self.fwd) + sum(self.bwd)


def search(profile: Profile, max_extra_memory: float | None = None
           ) -> tuple[list[str], float]:
    """The optimal step sequence and its predicted time.

    With `max_extra_memory` (and a byte profile), states whose live activations exceed
    (1 + max_extra_memory) x one micro-batch's are forbidden -- the forward strand may not run
    too far ahead of the backward strand's freeing. Running all of the backward first is always
    feasible, so a plan always exists.
    """
    profile.validate()
    m, n = len(profile.fwd), len(profile.bwd)
    live = profile.live_bytes() if max_extra_memory is not None else None
    budget = 0.0
    if live is not None:
        budget = (1.0 + max_extra_memory) * max(sum(profile.fwd_bytes), sum(profile.bwd_bytes))
    inf = float("inf")
    T = [[inf] * (n + 1) for _ in range(m + 1)]
    how: list[list[str]] = [[""] * (n + 1) for _ in range(m + 1)]
    T[0][0] = 0.0
    for i in range(m + 1):
        for j in range(n + 1):
            if i == j == 0:
                continue
            if live is not None and live(i, j) > budget * (1 + 1e-9):
                continue  # over the memory budget
            # ties prefer the pair, then forward: fixed so that every rank breaks them alike
            cands = []
            if i and j:
                cands.append((T[i - 1][j - 1] + profile.pair[i - 1][j - 1], 0, "FB"))
            if i:
                cands.append((T[i - 1][j] + profile.fwd[i - 1], 1, "F"))
            if j:
                cands.append((T[i][j - 1] + profile.bwd[j - 1], 2, "B"))
            t, _, step = min(cands)
            if t < inf:
                T[i][j], how[i][j] = t, step
    steps: list[str] = []
    i, j = m, n
    while i or j:
        step = how[i][j]
        steps.append(step)
        i -= "F" in step
        j -= "B" in step
    steps.reverse()
    return steps, T[m][n]


def plan_time(steps: list[str], profile: Profile) -> float:
    """Predicted time of an arbitrary step sequence under `profile`."""
    i = j = 0
    t = 0.0
    for s in steps:
        if s == "FB":
            t += profile.pair[i][j]
        elif s == "F":
            t += profile.fwd[i]
        elif s == "B":
            t += profile.bwd[j]
        else:
            raise ValueError(f"bad step {s!r}")
        i += "F" in s
        j += "B" in s
    if (i, j) != (len(profile.fwd), len(profile.bwd)):
        raise ValueError(f"plan covers {i}/{len(profile.fwd)} forward and "
                         f"{j}/{len(profile.bwd)} backward segments")
    return t


@dataclass
class Plan:
    signature: dict[str, Any]
    steps: list[str]
    predicted_time: float
    sequential_time: float
    profile: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return signature_key(self.signature)

    def to_json(self) -> str:
        d = asdict(self)
        d["key"] = self.key
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        d = json.loads(text)
        d.pop("key", None)
        plan = cls(**d)
        bad = [s for s in plan.steps if s not in STEPS]
        if bad:
            raise ValueError(f"bad plan steps {bad}")
        return plan


def signature_key(signature: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:16]


def make_plan(signature: dict[str, Any], profile: Profile,
              max_extra_memory: float | None = None) -> Plan:
    steps, t = search(profile, max_extra_memory)
    return Plan(signature, steps, t, profile.sequential_time(), asdict(profile))


def save_plan(plan: Plan, path: Path) -> None:
    from stalwart.rundir import atomic_write_text

    atomic_write_text(Path(path), plan.to_json() + "\n")


def load_plan(path: Path, signature: dict[str, Any]) -> Plan | None:
    """The plan stored at `path` if it was made for `signature`; None otherwise."""
    try:
        plan = Plan.from_json(Path(path).read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return plan if plan.key == signature_key(signature) else None
