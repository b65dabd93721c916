"""Where a verdict's slowdown began and what it costs: onset placement and pricing.

Mechanism: a change-point split (``robust.rise_onset``) on the series the evidence carries
-- a compute straggler's compute relative to its peers' (``culprit_onset``, ``born_onset``), the
job's step time for a link (``changed_link_onset``, ``link_onset``); a straggler with no
healthy "before" is priced from its peers (``born_severity``) or the healthy pairs
(``link_severity``). Guarantees: pure functions of the evidence (every rank computes the same
answer); the thresholds of the rise are the caller's (localize.py). Cost: a few medians over
at most ~``BEFORE`` + the decision window samples per rank.
"""

from __future__ import annotations

import math
import statistics
from statistics import NormalDist

import numpy as np

from stalwart.detect.evidence import RankEvidence, peer_series, rows_by_step
from stalwart.detect.outlier import MIN_SHIFT
from stalwart.detect.robust import rank_sum_z, rise_onset

# a compute straggler's onset is looked for on its own series from this many steps before the
# detected onset (the channel that fired can also place it a few steps late)
ONSET_SLACK = 4
BEFORE = 20  # steps of the level before an onset (profile medians, the onset's baseline)
# a rise of a born straggler's relative compute counts as its onset only after this many
# samples: the first ones are the warm-up's (a 2x rank "rose" at step 3 of a run slow from 0)
RISE_MIN_BEFORE = 10
# a slow link the audit finds began within its window if the step time rose this much there
# (a 10 mbit host link from step 30 raised it ~13x; healthy steps swing by 10-30%)
LINK_RISE = 1.5
# a born straggler is called healthy before a rise only if its relative compute after the rise
# ranks above the samples before it at this rank-sum z (one-sided p 2.3e-4 at the split; <= 1%
# over the ~30 splits a window offers, Bonferroni). Why: a plain script's 5 ms steps under a
# 5 ms CFS period swing a 2x rank's per-step ratio from 0.4x to 4.7x, and the median rule alone
# called a rank slow from step 0 "healthy until step k" in 292 of 1137 recorded 41-step windows
# (0 of 1137 with this test; tests/detect/test_born.py)
RISE_Z = 3.5


def step_level(ev: list[RankEvidence]) -> tuple[float, float] | None:
    """The job's step time and communication time since the onset (medians over ranks of
    their compute + communication, and of their communication), None without a profile."""
    steps = [e.compute_after + e.comm_after for e in ev
             if e.compute_after is not None and e.comm_after is not None]
    comms = [e.comm_after for e in ev if e.comm_after is not None]
    if not steps or not comms:
        return None
    return statistics.median(steps), statistics.median(comms)


def born_severity(ev: list[RankEvidence], rank: int) -> float:
    """A compute straggler's cost priced from its peers, for a straggler with no healthy
    "before": the job's step time over the step time without the rank's excess compute over
    its peers' median (every rank waits for the slowest at the collective). 1.0 without a
    profile."""
    level = step_level(ev)
    own = next((e.compute_after for e in ev if e.rank == rank), None)
    peers = [e.compute_after for e in ev if e.rank != rank and e.compute_after is not None]
    if level is None or own is None or not peers:
        return 1.0
    t = level[0]
    excess = max(own - statistics.median(peers), 0.0)
    return t / max(t - excess, 0.1 * t)


def link_severity(ev: list[RankEvidence], ratio: float) -> float:
    """A slow link's cost priced from the healthy pairs, for a link with no healthy "before":
    the job's step time over the step time with its communication ``ratio`` times faster (the
    healthy pairs' speed; an upper bound: communication also holds waits for peers)."""
    level = step_level(ev)
    if level is None or ratio <= 1.0:
        return 1.0
    t, comm = level
    return t / max(t - comm * (1.0 - 1.0 / ratio), 0.1 * t)


def born_onset(ev: list[RankEvidence], rank: int, onset_step: int, step: int,
               min_rise: float, group: list[int] | None = None) -> tuple[int, bool]:
    """Where a straggler found by the outlier test or the audit began, and whether it was
    never healthy: the rise of the rank's compute over its peers' from a healthy level
    (``healthy_rise``; for a slow ``group``, of the group's compute over the other ranks'),
    if there is one; else the first sample of the evidence, "never healthy" when the
    evidence holds nothing before ``onset_step`` (the monitor's first sample: the alarm put
    its onset there because the rank's whole history is in question); else ``onset_step``
    (slow since at least then)."""
    keys, _ = peer_series(ev, rank)
    if len(keys) == 0:
        return onset_step, False
    rise = healthy_rise(ev, rank, step, min_rise, group)
    if rise is not None:
        return rise, False
    if int(keys[0]) >= onset_step:
        return int(keys[0]), True
    return onset_step, False


def healthy_rise(ev: list[RankEvidence], rank: int, step: int, min_rise: float,
                 group: list[int] | None = None) -> int | None:
    """Where the rank's compute over its peers' (``peer_series``; a ``group`` of two or more
    ranks: ``group_series``) rose from a healthy level within the evidence, up to ``step``:
    the split ``rise_onset`` places from the ``RISE_MIN_BEFORE``-th sample on, higher by more
    than ``min_rise`` (log), that passes the rank-sum test (z >= ``RISE_Z``, or
    ``_recent_rise`` with too few samples after it for that test) and whose level before it
    is healthy (``healthy_before``); None when there is no such rise (the rank was as slow
    over the whole evidence). Pure; cost: one ``rise_onset`` and one rank-sum over the
    rank's <= ~``BEFORE`` + window samples."""
    keys, xs = (group_series(ev, group) if group is not None and len(group) > 1
                else peer_series(ev, rank))
    if len(keys) == 0:
        return None
    lo = int(keys[min(RISE_MIN_BEFORE, len(keys) - 1)])
    rise = rise_onset(keys, xs, lo, step, before=BEFORE, min_rise=min_rise)
    if rise is None:
        return None
    before, after = xs[keys < rise], xs[(keys >= rise) & (keys <= step)]
    if healthy_before(before, after) and (
            rank_sum_z(before, after) >= RISE_Z or _recent_rise(before, after)):
        return rise
    return None


def group_series(ev: list[RankEvidence], group: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """A slow group's (keys, log of its members' geometric-mean compute over the other ranks'
    median compute) at the steps of the evidence that every rank has; empty without other
    ranks. One series for one slow worker (a host's ranks slowed alike): its rise is tested
    once, at the single series' false-rise chance, and the mean of k members' logs carries
    ~1/sqrt(k) of one member's independent noise -- a rise a member's own series shows in
    too few samples shows in the group's (a testbed host's two ranks met by the audit one
    step into their fault under load: each member's last samples within its own noise, the
    group's above every sample before). Cost: O(ranks x steps)."""
    members = set(group)
    rows = rows_by_step(ev)
    keys, xs = [], []
    for k in sorted(rows):
        row = rows[k]
        mine = [c for r, c in row.items() if r in members]
        others = [c for r, c in row.items() if r not in members]
        if len(row) != len(ev) or len(mine) != len(members) or not others \
                or min(row.values()) <= 0:
            continue
        keys.append(k)
        xs.append(statistics.fmean(math.log(c) for c in mine)
                  - math.log(statistics.median(others)))
    return np.asarray(keys, dtype=np.int64), np.asarray(xs)


def healthy_before(before: np.ndarray, after: np.ndarray) -> bool:
    """Whether a rank's relative compute (log, over its peers') before a rise counts as
    healthy: its median below ``log(1 + MIN_SHIFT)`` (the outlier test's null), or nearer its
    peers' level (0) than the level after the rise (``after``'s median) -- the rise is larger
    than the excess already there before it.

    Noise model: a healthy rank does not sit at its peers' level. Where it runs sets a
    persistent offset -- two ranks sharing a core, other jobs' processes on its core (every
    2-rank test job pins its rank 1 and that rank's hog to core 1) -- and the median of ~20
    samples carries sampling noise besides (per-step log ratio sd 0.25-0.6: sd 0.07-0.17 of
    the median). Measured healthy levels: 0.39x-1.27x in six runs of one 2-rank job under
    3-6 busy loops (tests/detect/test_multiprocess.py, batched exchanges, steps 1-29), 1.25x
    for rank 2 of the replay corpus's compute2x-n3-lossy. The line ``1 + MIN_SHIFT`` alone
    sits inside that spread, so a healthy rank's "before" crossed it by chance or by its
    offset, and the rank was called "never healthy" with onset 0/1 for a fault at step 30
    (that corpus run; the test under load). Between the two readings of a "before" above
    the line -- already as slow as now (the rise a chance one: "never healthy") or at its
    peers' level plus an offset (a real onset) -- the nearer level decides: the maximum-
    likelihood choice when both medians carry the same symmetric noise; no constant is
    fitted. The chance of a rise on a rank slow all along stays the rank-sum test's
    (``RISE_Z``, <= 1% per window; tests/detect/test_born.py measures it)."""
    b = float(np.median(before))
    return b < math.log1p(MIN_SHIFT) or 2.0 * b < float(np.median(after))


def _recent_rise(before: np.ndarray, after: np.ndarray) -> bool:
    """A rise with too few samples after it for the rank-sum test to reach ``RISE_Z`` (2 to
    4 of them against ~20), tested at the same false-rise chance another way: every sample
    after it above the before-samples' quantile q, where (1 - q) ** n = P(z > RISE_Z) --
    under no rise, n independent samples all land above q with that chance. From 2 samples
    (q 0.985: above the largest of 20-25) to 4 (q 0.877). Why: an audit that ran two or
    three steps after a fault began named its rank "never healthy" with onset 0 (a CI run
    under load)."""
    n = len(after)
    if not 2 <= n or len(before) < RISE_MIN_BEFORE:
        return False
    z_max = (len(before) * n / 2.0) / math.sqrt(len(before) * n * (len(before) + n + 1) / 12.0)
    if z_max >= RISE_Z:
        return False  # the rank-sum test could judge it, and did
    q = 1.0 - NormalDist().cdf(-RISE_Z) ** (1.0 / n)
    return float(np.min(after)) > float(np.quantile(before, q))


def link_onset(ev: list[RankEvidence], onset_step: int, step: int) -> tuple[int, bool]:
    """Where a slow link the audit found began, and whether the job never ran without it:
    the step where the iteration time (the lowest rank's, the same for all in synchronous
    training) rose by ``LINK_RISE`` x over the steps before, if it did; else the first
    sample (never healthy)."""
    keys, xs = _step_series(ev)
    if not len(keys):
        return onset_step, True
    lo = int(keys[min(RISE_MIN_BEFORE, len(keys) - 1)])
    rise = rise_onset(keys, xs, lo, step, before=BEFORE, min_rise=math.log(LINK_RISE))
    if rise is not None:
        return rise, False
    return int(keys[0]), True


def _step_series(ev: list[RankEvidence]) -> tuple[np.ndarray, np.ndarray]:
    """The job's step times in the evidence window as (keys, log seconds): the lowest rank's
    (the same for all in synchronous training)."""
    series = min(ev, key=lambda e: e.rank).steps if ev else []
    pts = [(k, t) for k, t in series if t > 0]
    return (np.asarray([k for k, _ in pts], dtype=np.int64),
            np.log(np.asarray([t for _, t in pts], dtype=float)))


def changed_link_onset(ev: list[RankEvidence], onset_step: int, step: int) -> int:
    """A slow link's onset after a change point: where the step time rose by ``LINK_RISE`` x,
    from ``ONSET_SLACK`` steps before the alarm's onset to the decision; the alarm's onset when
    it shows no such rise (a milder link fault). Why: the alarm that brought the validation
    may be another channel's, a few steps before the link fault began (seen under load: a
    rank's compute blip at step 85 validated at 93 found a host link throttled at 90); a link
    fault lifts every rank's step time at once, so the rise on the step-time series places it.
    """
    keys, xs = _step_series(ev)
    if len(keys) < 4:
        return onset_step
    rise = rise_onset(keys, xs, onset_step - ONSET_SLACK, step, before=BEFORE,
                      min_rise=math.log(LINK_RISE))
    if rise is None:
        rise = _last_sample_rise(keys, xs, onset_step - ONSET_SLACK, step)
    return onset_step if rise is None else rise


def _last_sample_rise(keys: np.ndarray, xs: np.ndarray, lo: int, hi: int) -> int | None:
    """The key of the series' last sample when it alone rose: within ``[lo, hi]``, above every
    one of the up to ``BEFORE`` samples before it and above their median by ``LINK_RISE`` x;
    else None. ``rise_onset`` places a rise only with two samples after it, and a validation
    that ends at the step a link fault began holds one (a CI run: a noise alarm at step 85,
    validated at 90 just as a host link was throttled there, named with onset 85). Asked only
    once the link test has found a slow link, so it places an onset, never detects one;
    under no rise the last sample is the highest of n + 1 with chance 1 / (n + 1)."""
    order = np.argsort(keys, kind="stable")
    keys, xs = keys[order], xs[order]
    if not lo <= int(keys[-1]) <= hi:
        return None
    before = xs[:-1][-BEFORE:]
    if len(before) < RISE_MIN_BEFORE:
        return None
    last = float(xs[-1])
    if last > float(np.max(before)) and last > float(np.median(before)) + math.log(LINK_RISE):
        return int(keys[-1])
    return None


def peer_rise(ev: list[RankEvidence], rank: int, onset: int) -> float | None:
    """How much ``rank``'s compute over its peers' median rose at ``onset`` (log: the median
    from the onset on minus the median of up to ``BEFORE`` samples before it); None with fewer
    than 2 samples after or 1 before. On the compute test's scale (the rank against the
    others), unlike ``culprit_onset``'s series, whose median includes the rank itself (at 2
    ranks a rank's share of the median caps its ratio at 2x)."""
    keys, xs = peer_series(ev, rank)
    after = xs[keys >= onset]
    before = xs[(keys < onset) & (keys >= onset - BEFORE)]
    if len(after) < 2 or len(before) < 1:
        return None
    return float(np.median(after) - np.median(before))


def culprit_onset(ev: list[RankEvidence], rank: int, onset_step: int, step: int,
                  min_rise: float) -> int | None:
    """A compute straggler's onset: where its own compute, relative to the median of every
    rank's at the same step, rose by more than ``min_rise`` (log) -- from ``ONSET_SLACK`` steps
    before the detected onset to the decision, with two samples of the rise at least; the
    detected onset when the evidence holds no series; None when the series shows no such
    rise: the rank the test finds slow now was not slow over this slowdown (localize also
    asks ``peer_rise`` for half the test's ratio: a 1.17x blip on a rank at step 33,
    validated at 40 just as a 2x quota began there, measured 2.28x by the test).

    The channel that fired may have merged an earlier job-wide blip into the slowdown (every
    rank's step slows in an OS hiccup), or fired on noise that validation, run while the
    real fault had just begun, then confirmed: seen with batched exchanges, onset 16-23 for a
    rank slowed from step 30. Compute relative to the peers' is blind to job-wide blips, and
    the evidence is gathered at validation time, so it reaches the decision step.
    """
    by_key: dict[int, list[float]] = {}
    own: dict[int, float] = {}
    for e in ev:
        for k, c in e.recent:
            by_key.setdefault(int(k), []).append(c)
            if e.rank == rank:
                own[int(k)] = c
    keys = [k for k in own if len(by_key[k]) == len(ev) and own[k] > 0]
    if not keys:
        return onset_step
    rel = [math.log(own[k] / statistics.median(by_key[k])) for k in keys]
    return rise_onset(np.asarray(keys), np.asarray(rel), onset_step - ONSET_SLACK, step,
                      before=BEFORE, min_rise=min_rise)
