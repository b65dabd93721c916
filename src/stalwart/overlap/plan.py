"""Plan search: in which order the segments of the two strands run.

Mechanism (DHelix's dynamic programme, arXiv 2411.15871 section "plan search"): forward
segments f_0..f_{m-1} and backward segments b_0..b_{n-1} each run in their dependency order;
a plan interleaves the two sequences. DHelix's recurrence

    T[i][j] = min(T[i-1][j] + P(f_i, -), T[i][j-1] + P(-, b_j), T[i-1][j-1] + P(f_i, b_j))

prices each step by a profiled time. On a CPU rank there is one compute thread, so "running a
pair together" means: b_j computes while f's last collective is in flight, then f_i computes
while b_j's collective is in flight. What a step costs therefore depends on which strand's
collective is still in flight when it starts -- a segment that follows its own strand's segment
must first wait for that collective; one that follows the other strand's segment overlaps it.
The state of the programme carries that: T[i][j][last], last in {none, F, B}, with

    F step: T[i+1][j][F]   <- T[i][j][last] + (fwd[i]        if last != B else fwd_after_b[i][j])
    B step: T[i][j+1][B]   <- T[i][j][last] + (bwd[j]        if last != F else bwd_after_f[i][j])
    pair:   T[i+1][j+1][F] <- the B step, then the F step (backward first: it frees memory)

where fwd[i] is f_i's time right after f_{i-1} (waiting for its collective, then computing),
fwd_after_b[i][j] its time right after b_{j-1} (overlapping b_{j-1}'s collective), and likewise
for bwd. All four tables are measured (``profiler.py``). O(m*n). Optionally memory-aware: with
the bytes each segment saves/frees, states where the forward strand has allocated too far ahead
of the backward strand's freeing are excluded. Guarantee: the returned plan is optimal for the
given profile (tests check known optima and exhaustive enumeration) and is a deterministic
function of it, so TP ranks holding the same (max-reduced) profile derive the same plan.

A ``Plan`` is saved as JSON next to the run with a *signature* (model shape, micro-batch shape,
TP and world sizes, torch version, segment counts); ``load_plan`` returns it only when the
signature matches, so a changed shape or world triggers re-profiling.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STEPS = ("F", "B", "FB")
_NONE, _F, _B = 0, 1, 2


@dataclass
class Profile:
    """Seconds per segment, by what ran just before it (see the module docstring).

    fwd[i]: f_i after f_{i-1} (or first); bwd[j]: b_j after b_{j-1} (or first);
    fwd_after_b[i][j] (m x (n+1), column 0 unused): f_i right after b_{j-1};
    bwd_after_f[i][j] ((m+1) x n, row 0 unused): b_j right after f_{i-1}.
    Optional bytes: fwd_bytes[i] = activations f_i saves, bwd_bytes[j] = activations b_j frees
    (empty lists: memory is not constrained).
    """

    fwd: list[float]
    bwd: list[float]
    fwd_after_b: list[list[float]]
    bwd_after_f: list[list[float]]
    fwd_bytes: list[float] = field(default_factory=list)
    bwd_bytes: list[float] = field(default_factory=list)
    # the per-segment measurements a profile was derived from (``from_segments``), if any
    segments: dict[str, list[float]] = field(default_factory=dict)
    # live bytes at (0, 0) (default: sum of bwd_bytes) and one micro-batch's activations, the
    # unit of the memory budget (default: the larger of the two sums)
    base_bytes: float | None = None
    unit_bytes: float | None = None
    # split backward: seconds of deferred weight-gradient work each backward segment leaves
    # in the queue (empty: weight gradients are computed inside the segments)
    bwd_wgrad: list[float] = field(default_factory=list)

    @classmethod
    def from_segments(cls, fc: list[float], fm: list[float], bc: list[float], bm: list[float],
                      **kw: Any) -> Profile:
        """Tables from each segment's compute time c and collective time m, measured alone.

        A segment waits for its own strand's previous collective, then computes. Right after a
        segment of the other strand, that collective has had the other segment's compute to
        hide behind: f_i after b_{j-1} costs max(0, fm[i-1] - bc[j-1]) + fc[i]; after f_{i-1}
        it costs fm[i-1] + fc[i]. (Symmetrically for the backward strand.)
        """
        m, n = len(fc), len(bc)
        fprev = [0.0, *fm[:-1]]  # the collective f_i waits for (none before f_0)
        bprev = [0.0, *bm[:-1]]
        fwd = [fprev[i] + fc[i] for i in range(m)]
        bwd = [bprev[j] + bc[j] for j in range(n)]
        fa = [[fwd[i]] + [max(0.0, fprev[i] - bc[j - 1]) + fc[i] for j in range(1, n + 1)]
              for i in range(m)]
        ba = [[bwd[j] for j in range(n)]] + [
            [max(0.0, bprev[j] - fc[i - 1]) + bc[j] for j in range(n)] for i in range(1, m + 1)]
        seg = {"fwd_compute": list(fc), "fwd_comm": list(fm), "bwd_compute": list(bc),
               "bwd_comm": list(bm)}
        if kw.get("bwd_wgrad"):
            seg["bwd_wgrad"] = list(kw["bwd_wgrad"])
        return cls(fwd, bwd, fa, ba, segments=seg, **kw)

    def validate(self) -> None:
        m, n = len(self.fwd), len(self.bwd)
        if len(self.fwd_after_b) != m or any(len(r) != n + 1 for r in self.fwd_after_b):
            raise ValueError(f"fwd_after_b must be {m}x{n + 1}")
        if len(self.bwd_after_f) != m + 1 or any(len(r) != n for r in self.bwd_after_f):
            raise ValueError(f"bwd_after_f must be {m + 1}x{n}")
        if self.fwd_bytes and len(self.fwd_bytes) != m or self.bwd_bytes and len(
                self.bwd_bytes) != n:
            raise ValueError("byte profiles must have one entry per segment")

    @classmethod
    def uniform(cls, fwd: list[float], bwd: list[float], fwd_after_b: float | None = None,
                bwd_after_f: float | None = None, **kw: Any) -> Profile:
        """A profile whose after-the-other-strand times are constants (None: no overlap)."""
        m, n = len(fwd), len(bwd)
        fa = [[fwd[i] if fwd_after_b is None else fwd_after_b] * (n + 1) for i in range(m)]
        ba = [[bwd[j] if bwd_after_f is None else bwd_after_f for j in range(n)]
              for _ in range(m + 1)]
        return cls(list(fwd), list(bwd), fa, ba, **kw)

    def cost_f(self, i: int, j: int, last: int) -> float:
        return self.fwd_after_b[i][j] if last == _B else self.fwd[i]

    def cost_b(self, i: int, j: int, last: int) -> float:
        return self.bwd_after_f[i][j] if last == _F else self.bwd[j]

    def pair(self, i: int, j: int, last: int) -> float:
        """DHelix's P(f_i, b_j): b_j, then f_i overlapping b_j's collective."""
        return self.cost_b(i, j, last) + self.fwd_after_b[i][j + 1]

    def sequential_time(self) -> float:
        return sum(self.fwd) + sum(self.bwd)

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
        base = fb[-1] if self.base_bytes is None else self.base_bytes
        return lambda i, j: base + sf[i] - fb[j]

    def unit(self) -> float:
        if self.unit_bytes is not None:
            return self.unit_bytes
        return max(sum(self.fwd_bytes), sum(self.bwd_bytes))


def search(profile: Profile, max_extra_memory: float | None = None,  # noqa: C901 (one DP)
           b_ready: Callable[[int, int], bool] | None = None) -> tuple[list[str], float]:
    """The optimal step sequence and its predicted time.

    With `max_extra_memory` (and a byte profile), states whose live activations exceed
    (1 + max_extra_memory) x one micro-batch's are forbidden -- the forward strand may not run
    too far ahead of the backward strand's freeing. `b_ready(i, j)`: may backward segment j
    run once i forward segments are done (a dependency between the strands, see
    ``stream_profile``). Backward first wherever allowed keeps memory at its floor, so a plan
    exists whenever the backward strand's dependencies can be met.
    """
    profile.validate()
    m, n = len(profile.fwd), len(profile.bwd)
    live = profile.live_bytes() if max_extra_memory is not None else None
    budget = 0.0
    if live is not None:
        budget = (1.0 + max_extra_memory) * profile.unit()

    def ok(i: int, j: int) -> bool:
        return live is None or live(i, j) <= budget * (1 + 1e-9)

    def ready(i: int, j: int) -> bool:
        return b_ready is None or b_ready(i, j)

    inf = float("inf")
    T = [[[inf] * 3 for _ in range(n + 1)] for _ in range(m + 1)]
    # state -> (predecessor i, j, last, step, tie-break rank)
    back: dict[tuple[int, int, int], tuple[int, int, int, str, int]] = {}
    T[0][0][_NONE] = 0.0

    def relax(src: tuple[int, int, int], dst: tuple[int, int, int], cost: float, step: str,
              rank: int) -> None:
        i, j, last = dst
        t = T[src[0]][src[1]][src[2]] + cost
        # ties prefer the pair, then forward: fixed so that every rank breaks them alike
        if t < T[i][j][last] - 1e-15 or (t <= T[i][j][last] + 1e-15
                                          and rank < back.get(dst, (0, 0, 0, "", 9))[4]):
            T[i][j][last] = t
            back[dst] = (src[0], src[1], src[2], step, rank)

    for i in range(m + 1):
        for j in range(n + 1):
            for last in (_NONE, _F, _B):
                if T[i][j][last] == inf:
                    continue
                src = (i, j, last)
                if i < m and j < n and ready(i, j) and ok(i, j + 1) and ok(i + 1, j + 1):
                    relax(src, (i + 1, j + 1, _F), profile.pair(i, j, last), "FB", 0)
                if i < m and ok(i + 1, j):
                    relax(src, (i + 1, j, _F), profile.cost_f(i, j, last), "F", 1)
                if j < n and ready(i, j) and ok(i, j + 1):
                    relax(src, (i, j + 1, _B), profile.cost_b(i, j, last), "B", 2)
    end = min((_F, _B, _NONE), key=lambda k: T[m][n][k])
    if T[m][n][end] == inf:
        raise ValueError("no plan satisfies the memory budget and the strands' dependencies")
    steps: list[str] = []
    node = (m, n, end)
    while node != (0, 0, _NONE):
        i, j, last, step, _ = back[node]
        steps.append(step)
        node = (i, j, last)
    steps.reverse()
    return steps, T[m][n][end]


def stream_profile(prof: Profile, micro_batches: int
                   ) -> tuple[Profile, Callable[[int, int], bool]]:
    """One grid for a whole step: the forward strand runs F(1..M-1) back to back, the backward
    strand B(0..M-1) back to back (F(0) runs alone before).

    A strand yields at the end of each pass (a segment that issues no collective), so the
    search may run the next forward pass's first segment before the backward strand moves on
    -- keeping a collective in flight across the micro-batch boundary -- or the backward
    first, to free memory. The returned ``b_ready`` encodes the one dependency: B(k) may start
    only once F(k) is done. Needs a profile made by ``Profile.from_segments``.
    """
    if not prof.segments:
        raise ValueError("stream_profile needs per-segment measurements (from_segments)")
    M = micro_batches
    seg = prof.segments
    m, n = len(seg["fwd_compute"]), len(seg["bwd_compute"])
    if M < 2:
        raise ValueError("stream_profile needs >= 2 micro-batches")
    fb = prof.fwd_bytes or [0.0] * m
    bb = prof.bwd_bytes or [0.0] * n
    stream = Profile.from_segments(
        seg["fwd_compute"] * (M - 1), seg["fwd_comm"] * (M - 1),
        seg["bwd_compute"] * M, seg["bwd_comm"] * M,
        fwd_bytes=fb * (M - 1) if prof.fwd_bytes else [],
        bwd_bytes=bb * M if prof.bwd_bytes else [],
        base_bytes=sum(fb), unit_bytes=max(sum(fb), sum(bb)),
        bwd_wgrad=list(seg.get("bwd_wgrad", [])) * M)

    def b_ready(i: int, j: int) -> bool:
        # backward segment j = k*n starts B(k); F(k) is the strand's (k-1)-th pass, done
        # once i >= k*m forward segments have run
        k, r = divmod(j, n)
        return r != 0 or k == 0 or i >= k * m

    return stream, b_ready


def simulate_step(segments: dict[str, list[float]], micro_batches: int,  # noqa: C901
                  steps: list[str]) -> float:  # one event loop over the plan (the model below)
    """Predicted wall time of one interleaved step: F(0) alone, then the stream plan `steps`.

    A finer model than the DP's pairwise tables, run on the plan the DP chose:

    * one compute thread: segments run one at a time, in plan order (a pair: B, then F);
    * one link: a collective's transfer starts when it is issued *and* the previous transfer
      has finished (the strands' all-reduces share the same links; ``TPComm.serial``). It
      takes its measured time alone after an idle link, and ``comm_sustained_factor`` times
      that right behind another transfer (burst credit, e.g. a token bucket, is spent), with
      the credit regained one-for-one with idle time in between;
    * split backward: each backward segment adds its deferred weight-gradient seconds to a
      pool; a segment that must wait for its strand's previous collective first spends the
      wait on the pool (``WGradQueue.fill``), and what is left runs at the end (``flush``);
    * CPU contention: while a segment computes with a transfer in flight, the computation
      runs ``compute_contention`` times slower and the transfer ``comm_contention`` times
      slower (both measured by the profiler; on a CPU the collective's copies, reductions and
      sockets take cycles from the compute -- 1.0, i.e. none, on a GPU with its own DMA).

    `segments` is ``Profile.segments`` of the per-pass profile (``from_segments``).
    """
    fc, fm = segments["fwd_compute"], segments["fwd_comm"]
    bc, bm = segments["bwd_compute"], segments["bwd_comm"]
    bw = segments.get("bwd_wgrad") or [0.0] * len(bc)
    factor = (segments.get("comm_sustained_factor") or [1.0])[0]
    ca = (segments.get("compute_contention") or [1.0])[0]
    cb = (segments.get("comm_contention") or [1.0])[0]
    m, n = len(fc), len(bc)
    t = pool = 0.0
    link = -math.inf  # when the link's last transfer ends (idle long before the step)
    pend: dict[str, float | None] = {"F": None, "B": None}

    def compute(c: float) -> None:
        """Advance the compute thread by `c` seconds of work, and the link by what it moves
        meanwhile: while both are busy (for ``w`` seconds) compute progresses ``w / ca`` and
        the link ``w / cb``; the link's later completions move by the difference."""
        nonlocal t, link
        busy = link - t  # the link's remaining work, uncontended seconds
        if busy <= 0.0 or (ca == 1.0 and cb == 1.0):
            t += c
            return
        w = min(c * ca, busy * cb)
        start = t

        def moved(x: float) -> float:  # an uncontended completion time -> the contended one
            r = x - start
            return start + r * cb if r * cb <= w else start + w + (r - w / cb)

        for k, d in pend.items():
            if d is not None and d > start:
                pend[k] = moved(d)
        link = moved(link)
        t = start + w + (c - w / ca)

    def run(strand: str, c: float, comm: float, w: float) -> None:
        nonlocal t, link, pool
        d = pend[strand]
        if d is not None and d > t:
            use = min(pool, d - t)
            pool -= use
            t = max(t + use, d)
        compute(c)
        pool += w
        if comm > 0:
            gap = max(0.0, t - link)  # the link's idle time before this transfer
            link = max(t, link) + comm * factor - min(gap, comm * (factor - 1.0))
            pend[strand] = link
        else:
            pend[strand] = None

    for i in range(m):  # F(0): no partner, and nothing in the pool yet
        run("F", fc[i], fm[i], 0.0)
    i = j = 0
    for s in steps:
        if "B" in s:
            run("B", bc[j % n], bm[j % n], bw[j % n])
            j += 1
        if "F" in s:
            run("F", fc[i % m], fm[i % m], 0.0)
            i += 1
    if (i, j) != ((micro_batches - 1) * m, micro_batches * n):
        raise ValueError(f"plan covers {i} forward and {j} backward segments of "
                         f"{(micro_batches - 1) * m} and {micro_batches * n}")
    return max([t, *(d for d in pend.values() if d is not None)]) + pool


def plan_time(steps: list[str], profile: Profile) -> float:
    """Predicted time of an arbitrary step sequence under `profile`."""
    i = j = 0
    last = _NONE
    t = 0.0
    for s in steps:
        if s not in STEPS:
            raise ValueError(f"bad step {s!r}")
        if "B" in s:
            if j >= len(profile.bwd):
                raise ValueError("plan runs past the last backward segment")
            t += profile.cost_b(i, j, last)
            j, last = j + 1, _B
        if "F" in s:
            if i >= len(profile.fwd):
                raise ValueError("plan runs past the last forward segment")
            t += profile.cost_f(i, j, last)
            i, last = i + 1, _F
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
