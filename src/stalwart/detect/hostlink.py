"""A slow host link: the link-test pairs that cross one host's link, slow together, name it.

Ranks on one host talk inside it (NVLink, loopback) and cross its link (uplink, NIC) only to
reach other hosts, so a slow host link slows exactly the tested pairs with one end on the
host and the other elsewhere -- with several ranks per host, the ring's two pairs at the
host's boundaries, which share no rank (the rank rule of localize.py named one of them as a
pair, then the other: one finding per validation). ``name_host`` names the host instead.

Rule: for each host H with at least ``MIN_PAIRS`` tested crossing pairs (pairs whose ends
are on different hosts; needs ``MIN_HOSTS`` hosts, else the two ends cannot be told apart),
the ratio of each of its crossing pairs to the reference -- the median of the crossing pairs
that do not touch H -- must reach ``threshold(...)``; a pair whose slowness a slow rank at
its end may explain (``explained``, localize's starved-rank rule) does not count, unless the
pairs inside the host read as fast as those inside the other hosts (starvation would slow
them too; a slow host link does not) -- a slow rank at either end: the far end's host's
inside pairs are the ones its starvation would slow. And the host's crossing pairs must be
slow alike (``alike``): one slow link slows them by one factor, up to the noise, while a slow
pair beside a host's merely noisy other pair (216x and 2.5x: seen in CI) is that pair. Where
the host has tested pairs inside it, its crossing pairs must also reach the threshold over
those (``above_inside``): a slow link leaves the traffic inside the host alone, while load
that slows every transfer on the machine does not (seen: host 1's crossing pairs 3.5x and
4.9x with its inside pair at 3.3x, while a starved rank sat at the far end).

Noise model and false-alarm rate: a healthy pair's log ratio is normal with log-sd sigma,
estimated from this verdict's own reference pairs (1.4826 x MAD, raised by two standard
errors of that estimate) when there are at least
``SPREAD_PAIRS`` of them, else ``SIGMA_PRIOR`` (the testbed's healthy pairs); the reference
median adds its own spread (sigma^2 x pi / 2n). The threshold for a host with m crossing
pairs is exp(z sigma) with Phi(-z)^m = ``ALPHA`` / (hosts tested), so by the union bound a
verdict names a healthy host with chance at most ``ALPHA`` (pairs taken as independent;
the testbed's pairs have heavier tails than normal: 2 of 34 healthy pairs read >= 5x,
stated in docs/calibration.md). Where the verdict has enough reference pairs to read their
own tail there (``tail_threshold``: at least ``TAIL_PAIRS`` beyond the per-pair quantile,
about 1,100+ crossing pairs at 1,000+ hosts), the threshold is at least that empirical quantile: the
same false-alarm rate without the normal model. Never below ``MIN_RATIO``. Pure and torch-free; cost
O(pairs log pairs) per verdict.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np

ALPHA = 1e-3  # chance per verdict of naming a healthy host (union bound over the hosts)
# log-sd of a healthy pair's link-test ratio when the verdict has too few pairs to measure
# it: 1.4826 x MAD of log ratio of the 34 healthy pairs in the replay corpus's verdicts
# (tests/replay/corpus, 2-4 ranks on 2 loaded cores): 0.318
SIGMA_PRIOR = 0.32
SIGMA_MIN = 0.05  # the spread is never taken below this (a link test's timer resolution)
SPREAD_PAIRS = 8  # reference pairs needed to measure the spread from the verdict itself
MIN_RATIO = 1.5  # never below: a healthy pair reads up to ~1.7x in the replay corpus
MIN_PAIRS = 2  # a host is named from two crossing pairs at least (the ring gives two)
MIN_HOSTS = 3  # with two hosts, both hosts' links carry the same pairs
ALIKE_BETA = 1e-3  # chance that a slow host's own crossing pairs fail ``alike`` by noise
# chance that a healthy host whose crossing pairs passed one reading passes the second one
# too (``retest_threshold``): a host is named at <= ALPHA x RETEST_ALPHA per verdict for
# independent readings, while a slow host's pairs, past the first threshold, clear the
# lower second one nearly always
RETEST_ALPHA = 0.1
TAIL_PAIRS = 1  # reference pairs that must lie beyond the per-pair tail for it to be read
#                 from them (tail_threshold); fewer: the normal model alone


@dataclass(frozen=True)
class HostLink:
    """The host whose link is slow: its name, its ranks, and the test behind it."""

    host: str
    ranks: list[int]  # the host's ranks among the verdict's
    pairs: dict[str, float]  # its crossing pairs' ratios to the reference, slowest first
    threshold: float
    sigma: float
    chance: float  # that a healthy host (of those tested) reads this slow: <= ALPHA
    others: dict[str, float] = field(default_factory=dict)  # the reference pairs' ratios

    @property
    def slowest(self) -> list[int]:
        return [int(x) for x in next(iter(self.pairs)).split("-")]

    def evidence(self) -> dict[str, Any]:
        return {"host": self.host, "ranks": self.ranks,
                "pairs": {k: round(v, 3) for k, v in self.pairs.items()},
                "threshold": round(self.threshold, 3), "sigma": round(self.sigma, 3),
                "chance": float(f"{self.chance:.3g}")}


def _pair(key: str) -> tuple[int, int]:
    a, b = key.split("-")
    return int(a), int(b)


def crossing(links: Mapping[str, float], host_of: Mapping[int, str]) -> dict[str, float]:
    """The tested pairs whose two ends are on different (known) hosts."""
    out = {}
    for k, t in links.items():
        a, b = _pair(k)
        if a in host_of and b in host_of and host_of[a] != host_of[b]:
            out[k] = t
    return out


def spread(log_ratios: list[float] | np.ndarray) -> float:
    """The noise model's sigma from reference pairs' log ratios (module docstring). An
    array goes through numpy's median (the same arithmetic as ``statistics.median``): one
    C pass, where a list of 10,000 pairs cost ~30,000 Python calls per host examined."""
    if len(log_ratios) < SPREAD_PAIRS:
        return SIGMA_PRIOR
    if isinstance(log_ratios, np.ndarray):
        med = float(np.median(log_ratios))
        mad = 1.4826 * float(np.median(np.abs(log_ratios - med)))
    else:
        med = statistics.median(log_ratios)
        mad = 1.4826 * statistics.median(abs(x - med) for x in log_ratios)
    # an upper bound of the estimate: the MAD's relative standard error is ~1.17/sqrt(n),
    # and a sigma read low by chance would make the threshold name healthy hosts
    return max(SIGMA_MIN, mad * (1.0 + 2.0 * 1.17 / math.sqrt(len(log_ratios))))


def threshold(hosts: int, pairs: int, sigma: float, alpha: float = ALPHA) -> float:
    """The ratio every one of a host's ``pairs`` crossing pairs must reach so that a healthy
    host among ``hosts`` is named with chance <= ``alpha`` (module docstring)."""
    per_pair = (alpha / max(hosts, 1)) ** (1.0 / max(pairs, 1))
    z = -NormalDist().inv_cdf(per_pair)
    return max(MIN_RATIO, math.exp(z * sigma))


def retest_threshold(pairs: int, sigma: float, alpha: float = RETEST_ALPHA) -> float:
    """The ratio each of a named host's ``pairs`` crossing pairs must reach again when read a
    second time: a healthy host's pairs all reach it with chance <= ``alpha`` under the
    normal model of ``sigma`` (one host tested, no union bound); never below ``MIN_RATIO``.
    Why a second reading: the testbed's healthy pairs have heavier tails than the model (two
    pairs of one host read 9.5x and 4.5x on a clean run under load, past a 2.5x threshold),
    and a burst of load that slows one reading passes, while a slow link slows both."""
    return threshold(1, pairs, sigma, alpha)


def alike(ratios: list[float], sigma: float, ref_range: float = 0.0,
          beta: float = ALIKE_BETA) -> bool:
    """Whether a host's crossing pairs are slowed by one factor, up to the noise: under the
    noise model each pair's log ratio is log(factor) + N(0, sigma^2), so two pairs differ by
    N(0, 2 sigma^2); the widest gap among the m pairs must stay within z sigma sqrt(2), z
    for a two-sided chance ``beta`` / C(m, 2) per gap (union bound), so a slow host fails
    this with chance <= ``beta``. At sigma 0.32 and two pairs: within 4.4x of each other.
    Or within ``ref_range``, the log range of the verdict's healthy reference pairs: a gap
    that healthy pairs show among themselves is noise whatever the model says (the
    testbed's pairs have heavier tails than normal; at 1,000 ranks the normal gap alone
    lost 3 of 40 simulated host faults)."""
    m = len(ratios)
    if m < 2:
        return True
    logs = [math.log(max(x, 1e-12)) for x in ratios]
    z = -NormalDist().inv_cdf(beta / (m * (m - 1)))
    return max(logs) - min(logs) <= max(z * sigma * math.sqrt(2.0), ref_range)


def above_inside(cross_times: list[float], inside_times: list[float], t: float) -> bool:
    """Whether every one of a host's crossing pairs is at least ``t`` x the median of the
    pairs inside that host (True when none inside was tested: one rank per host). On real
    hosts the inside pairs (NVLink, loopback) are faster than any crossing pair, so this
    holds for every slow host link; it fails where the whole host's traffic is slow."""
    if not inside_times:
        return True
    ref = statistics.median(inside_times)
    return ref > 0 and min(cross_times) >= t * ref


def tail_threshold(ref_ratios: list[float], hosts: int, pairs: int,
                   alpha: float = ALPHA) -> float:
    """The reference pairs' own tail: the ratio that only a share ``(alpha / hosts) **
    (1 / pairs)`` of them exceed (every one of a healthy host's ``pairs`` pairs beyond it
    has chance <= alpha / hosts, pairs independent) -- when at least ``TAIL_PAIRS`` of them
    lie beyond it (0 otherwise: too few to read the tail). Why: a link test's healthy
    ratios have heavier tails than a normal of their MAD (the testbed's: 1% of pairs >= 7x
    at a MAD of ~0.6 in log), and among thousands of hosts the normal threshold names
    healthy ones (docs/calibration.md)."""
    per_pair = (alpha / max(hosts, 1)) ** (1.0 / max(pairs, 1))
    beyond = int(per_pair * len(ref_ratios))
    if beyond < TAIL_PAIRS:
        return 0.0
    return sorted(ref_ratios)[len(ref_ratios) - beyond - 1]


def intra_healthy(links: Mapping[str, float], host_of: Mapping[int, str], host: str,
                  t: float) -> bool:
    """Whether the pairs inside ``host`` are no slower than the pairs inside the other
    hosts (ratio of medians below ``t``). A starved rank moves its bytes slowly to every
    peer, its host-mates included; a slow host link leaves the pairs inside the host alone.
    False when either side has no tested pair (nothing to tell them apart)."""
    mine, others = [], []
    for k, v in links.items():
        a, b = _pair(k)
        if a in host_of and b in host_of and host_of[a] == host_of[b]:
            (mine if host_of[a] == host else others).append(v)
    if not mine or not others:
        return False
    ref = statistics.median(others)
    return ref > 0 and statistics.median(mine) / ref < t


def name_host(links: Mapping[str, float], host_of: Mapping[int, str],
              explained: Callable[[int, float], bool] | None = None,
              alpha: float = ALPHA) -> HostLink | None:
    """The host whose crossing pairs are all slow (module docstring), or None.

    ``links``: pair "a-b" -> link-test time (any unit); ``host_of``: rank -> host name
    (ranks missing from it are on unknown hosts: their pairs are not used);
    ``explained(rank, ratio)``: True when a slow rank at the pair's end may explain a pair
    this slow (then the pair does not count for its host) -- unless the pairs inside that
    rank's host are as fast as inside the others (``intra_healthy``: a starved rank would
    slow them too). The host's crossing pairs must be slow alike (``alike``). With several
    hosts qualifying, the one whose slowest-but-one pair is slowest.

    Cost: the pairs as arrays (their ends parsed once per set of keys), each host that
    passes the screening one O(pairs) pass in C plus its reference pairs' logs; the same
    answer as ``_name_host_each``, the pair-at-a-time reference
    (tests/detect/test_hostlink.py)."""
    if len(set(host_of.values())) < MIN_HOSTS:
        return None
    keys = list(links)
    a, b = _ends(keys)
    t = np.fromiter(links.values(), float, len(keys))
    names = list(dict.fromkeys(host_of.values()))
    code = {h: i for i, h in enumerate(names)}
    hid = {r: code[h] for r, h in host_of.items()}
    ha = np.fromiter((hid.get(r, -1) for r in a.tolist()), np.int64, len(keys))
    hb = np.fromiter((hid.get(r, -1) for r in b.tolist()), np.int64, len(keys))
    cross = (ha >= 0) & (hb >= 0) & (ha != hb)
    ci = np.flatnonzero(cross)  # the crossing pairs, in the links' order
    if not ci.size:
        return None
    ca, cb, ct = ha[ci], hb[ci], t[ci]
    count = np.bincount(ca, minlength=len(names)) + np.bincount(cb, minlength=len(names))
    # hosts in order of first appearance among the crossing pairs (a's end, then b's)
    seq = np.empty(2 * ci.size, np.int64)
    seq[0::2], seq[1::2] = ca, cb
    hosts, first = np.unique(seq, return_index=True)
    tested = hosts[np.argsort(first)]
    tested = tested[count[tested] >= MIN_PAIRS]
    # screening (cost): a host is examined only if its pairs all reach MIN_RATIO x the
    # crossing pairs' lower quartile, which is at most the reference below in all but
    # contrived cases -- at 10,000 ranks a handful of hosts instead of 1,250
    floor = MIN_RATIO * float(np.partition(ct, (ct.size - 1) // 4)[(ct.size - 1) // 4])
    low = np.full(len(names), np.inf)
    np.minimum.at(low, ca, ct)
    np.minimum.at(low, cb, ct)
    best: tuple[float, HostLink] | None = None
    for h in tested[low[tested] >= floor].tolist():
        own = (ca == h) | (cb == h)
        mine = [keys[i] for i in ci[own].tolist()]
        ref_t = ct[~own]
        if not ref_t.size:
            continue
        ref = float(np.median(ref_t))  # (statistics.median's arithmetic)
        if ref <= 0:
            continue
        logs = np.log(np.maximum(ref_t, 1e-12) / ref)
        sigma = spread(logs) * math.sqrt(1.0 + math.pi / (2 * len(logs)))
        t_h = threshold(len(tested), len(mine), sigma, alpha)
        t_h = max(t_h, tail_threshold((ref_t / ref).tolist(), len(tested), len(mine),
                                      alpha))
        ratios = {k: links[k] / ref for k in mine}
        if min(ratios.values()) < t_h or not alike(list(ratios.values()), sigma,
                                                   float(logs.max() - logs.min())):
            continue
        inside = t[(ha == h) & (hb == h)]
        if not above_inside([links[k] for k in mine], inside.tolist(), t_h):
            continue
        hname = names[h]
        if explained is not None and any(
                explained(r, v) and not _intra_healthy(t, ha, hb, hid[r], t_h)
                for k, v in ratios.items() for r in _pair(k)):
            continue
        ref_keys = [keys[i] for i in ci[~own][:16].tolist()]
        best = _better(best, _finding(hname, host_of, ratios, t_h, sigma, len(tested),
                                      {k: round(links[k] / ref, 3) for k in ref_keys}))
    return None if best is None else best[1]


def _finding(host: Any, host_of: Mapping[int, Any], ratios: dict[str, float], t: float,
             sigma: float, tested: int, reference: dict[str, float]) -> HostLink:
    """The finding for `host`, whose crossing pairs read `ratios` (all >= `t`): the chance
    that `tested` healthy hosts' pairs read as slow under the normal model of `sigma`."""
    chance = tested * NormalDist().cdf(-math.log(min(ratios.values())) / sigma) ** len(ratios)
    ordered = dict(sorted(ratios.items(), key=lambda kv: -kv[1]))
    ranks = sorted(r for r, hh in host_of.items() if hh == host)
    return HostLink(host, ranks, ordered, t, sigma, chance, reference)


def _better(best: tuple[float, HostLink] | None,
            found: HostLink) -> tuple[float, HostLink]:
    """Of two findings the one whose second-slowest crossing pair is slower (one pair:
    its only one); the earlier one on a tie."""
    r = sorted(found.pairs.values())
    key = r[-2] if len(r) > 1 else r[0]
    return (key, found) if best is None or key > best[0] else best


def _intra_healthy(t: np.ndarray, ha: np.ndarray, hb: np.ndarray, h: int,
                   ratio: float) -> bool:
    """``intra_healthy`` over the pairs as arrays (host codes, -1: unknown)."""
    inside = (ha >= 0) & (ha == hb)
    mine, others = t[inside & (ha == h)], t[inside & (ha != h)]
    if not mine.size or not others.size:
        return False
    ref = float(np.median(others))
    return ref > 0 and float(np.median(mine)) / ref < ratio


_ENDS: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}


def _ends(keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The two ranks of each "a-b" key as arrays (the last few key sets kept: a job's
    verdicts test the same pairs each time)."""
    k = tuple(keys)
    if k not in _ENDS:
        if len(_ENDS) >= 4:
            _ENDS.pop(next(iter(_ENDS)))
        ab = np.array([_pair(x) for x in keys], dtype=np.int64).reshape(-1, 2)
        _ENDS[k] = ab[:, 0].copy(), ab[:, 1].copy()
    return _ENDS[k]


def _name_host_each(links: Mapping[str, float], host_of: Mapping[int, str],
              explained: Callable[[int, float], bool] | None = None,
              alpha: float = ALPHA) -> HostLink | None:
    """``name_host``, one pair at a time: the reference the vector version is tested
    against.

    ``links``: pair "a-b" -> link-test time (any unit); ``host_of``: rank -> host name
    (ranks missing from it are on unknown hosts: their pairs are not used);
    ``explained(rank, ratio)``: True when a slow rank at the pair's end may explain a pair
    this slow (then the pair does not count for its host) -- unless the pairs inside that
    rank's host are as fast as inside the others (``intra_healthy``: a starved rank would
    slow them too). The host's crossing pairs must be slow alike (``alike``). With several
    hosts qualifying, the one whose slowest-but-one pair is slowest."""
    cross = crossing(links, host_of)
    by_host: dict[str, list[str]] = {}
    for k in cross:
        a, b = _pair(k)
        by_host.setdefault(host_of[a], []).append(k)
        by_host.setdefault(host_of[b], []).append(k)
    if len(set(host_of.values())) < MIN_HOSTS:
        return None
    tested = [h for h, ks in by_host.items() if len(ks) >= MIN_PAIRS]
    # screening (cost): a host is examined only if its pairs all reach MIN_RATIO x the
    # crossing pairs' lower quartile, which is at most the reference below in all but
    # contrived cases -- at 10,000 ranks a handful of hosts instead of 1,250
    times = sorted(cross.values())
    floor = MIN_RATIO * times[(len(times) - 1) // 4] if times else 0.0
    best: tuple[float, HostLink] | None = None
    for h in tested:
        mine = by_host[h]
        if min(cross[k] for k in mine) < floor:
            continue
        own = set(mine)
        ref_keys = [k for k in cross if k not in own]
        if not ref_keys:
            continue
        ref = statistics.median(cross[k] for k in ref_keys)
        if ref <= 0:
            continue
        logs = [math.log(max(cross[k], 1e-12) / ref) for k in ref_keys]
        sigma = spread(logs) * math.sqrt(1.0 + math.pi / (2 * len(ref_keys)))
        t = threshold(len(tested), len(mine), sigma, alpha)
        t = max(t, tail_threshold([cross[k] / ref for k in ref_keys], len(tested),
                                  len(mine), alpha))
        ratios = {k: cross[k] / ref for k in mine}
        if min(ratios.values()) < t or not alike(list(ratios.values()), sigma,
                                                 max(logs) - min(logs)):
            continue
        inside = [v for k, v in links.items()
                  if all(r in host_of and host_of[r] == h for r in _pair(k))]
        if not above_inside([cross[k] for k in mine], inside, t):
            continue
        if explained is not None and any(
                explained(r, v) and not intra_healthy(links, host_of, host_of[r], t)
                for k, v in ratios.items() for r in _pair(k)):
            continue
        best = _better(best, _finding(h, host_of, ratios, t, sigma, len(tested),
                                      {k: round(cross[k] / ref, 3) for k in ref_keys[:16]}))
    return None if best is None else best[1]
