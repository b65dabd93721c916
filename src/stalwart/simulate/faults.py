"""Faults for the simulator: drawn from FALCON's characterisation, or scripted.

Drawn (``draw``): a Poisson process per GPU-hour over the job's horizon. FALCON/Greyhound's
production study (>10,000 GPUs; docs in /work/shared/papers) gives the shape, not every
constant, so the constants below are this module's assumptions, each tied to what the study
says:
- kinds: "communication fail-slows far more often than compute ones" -> 3 link faults per
  compute fault (``COMM_SHARE`` 0.75);
- durations "from tens of seconds to ~10 hours" -> log-uniform on [30 s, 10 h];
- causes: CPU contention, GPU degradation/thermal throttling (compute, a rank 1.2-3x slower)
  and network congestion (a host's link 2-50x slower: congestion cuts a flow's bandwidth
  share by integer factors, and FALCON's S3 exists because some are severe);
- rate: 2e-5 fail-slows per GPU-hour, i.e. ~0.5 a day at 1,024 GPUs and ~5 a day at 10,000
  (FALCON: 16 of 27 jobs of 512-1,024 GPUs hit at least one; their mean JCT rose 34.6%);
- fail-stops: 2e-5 per GPU-hour (Meta's Llama 3 report: 419 unexpected interruptions in 54
  days on 16,384 GPUs, ~2e-5), each costing a restart plus the work since the last
  checkpoint -- the same for every policy.

Scripted (``parse``): ``KIND:key=value,...`` as the testbed's ``--fault`` grammar --
``compute:rank=R,factor=F``, ``link:host=H,factor=F``, ``stop:host=H`` with ``start``/``end``
as steps (``30``) or seconds (``30s``). Bad values raise ValueError naming them.

Cost: ``Schedule.at`` keeps the active set incrementally (faults sorted by start): O(active)
per step plus one vector multiply per active fault.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

COMM_SHARE = 0.75
DURATION_S = (30.0, 10 * 3600.0)
COMPUTE_FACTOR = (1.2, 3.0)
LINK_FACTOR = (2.0, 50.0)
SLOW_PER_GPU_H = 2e-5
STOP_PER_GPU_H = 2e-5
KINDS = ("compute", "link", "stop")


@dataclass
class Fault:
    """One fault; times in simulated seconds since the job began (end exclusive)."""

    kind: str  # "compute" (a rank) | "link" (a host's inter-host link) | "stop" (a host)
    target: int  # rank for compute, host for link and stop
    factor: float  # slowdown factor (ignored for stop)
    start_s: float
    end_s: float = math.inf

    def as_event(self) -> dict[str, object]:
        key = "rank" if self.kind == "compute" else "host"
        return {"kind": self.kind, key: self.target, "factor": round(self.factor, 3),
                "start_s": round(self.start_s, 1),
                "end_s": None if math.isinf(self.end_s) else round(self.end_s, 1)}


def _loguniform(rng: np.random.Generator, lo: float, hi: float, n: int) -> np.ndarray:
    return np.exp(rng.uniform(math.log(lo), math.log(hi), n))


def draw(rng: np.random.Generator, ranks: int, gpus_per_host: int, horizon_s: float,
         slow_rate: float = SLOW_PER_GPU_H, stop_rate: float = STOP_PER_GPU_H) -> list[Fault]:
    """Fail-slows and fail-stops over ``[0, horizon_s)`` (module docstring)."""
    gpu_h = ranks * horizon_s / 3600.0
    hosts = math.ceil(ranks / gpus_per_host)
    out: list[Fault] = []
    n = int(rng.poisson(slow_rate * gpu_h))
    starts = rng.uniform(0.0, horizon_s, n)
    durs = _loguniform(rng, *DURATION_S, n)
    comm = rng.random(n) < COMM_SHARE
    cf = _loguniform(rng, *COMPUTE_FACTOR, n)
    lf = _loguniform(rng, *LINK_FACTOR, n)
    rk = rng.integers(0, ranks, n)
    hs = rng.integers(0, hosts, n)
    for i in range(n):
        if comm[i]:
            out.append(Fault("link", int(hs[i]), float(lf[i]), float(starts[i]),
                             float(starts[i] + durs[i])))
        else:
            out.append(Fault("compute", int(rk[i]), float(cf[i]), float(starts[i]),
                             float(starts[i] + durs[i])))
    m = int(rng.poisson(stop_rate * gpu_h))
    for t, h in zip(rng.uniform(0.0, horizon_s, m), rng.integers(0, hosts, m), strict=True):
        out.append(Fault("stop", int(h), 1.0, float(t), float(t)))
    return sorted(out, key=lambda f: f.start_s)


def draw_events(rng: np.random.Generator, k: int, ranks: int, gpus_per_host: int,
                within_s: float, stop_rate: float = STOP_PER_GPU_H,
                horizon_s: float | None = None) -> list[Fault]:
    """Exactly ``k`` fail-slows, each drawn like ``draw``'s (kind, duration, severity),
    starting uniformly within ``[0, within_s)``, plus fail-stops at their usual rate: the
    protocol of FALCON's end-to-end experiment (12 injected events over one job), for a trace
    short enough that the Poisson rate would give one or none."""
    hosts = math.ceil(ranks / gpus_per_host)
    comm = rng.random(k) < COMM_SHARE
    starts = rng.uniform(0.0, within_s, k)
    durs = _loguniform(rng, *DURATION_S, k)
    cf, lf = _loguniform(rng, *COMPUTE_FACTOR, k), _loguniform(rng, *LINK_FACTOR, k)
    rk, hs = rng.integers(0, ranks, k), rng.integers(0, hosts, k)
    out = [Fault("link", int(hs[i]), float(lf[i]), float(starts[i]), float(starts[i] + durs[i]))
           if comm[i] else
           Fault("compute", int(rk[i]), float(cf[i]), float(starts[i]),
                 float(starts[i] + durs[i])) for i in range(k)]
    horizon = horizon_s or 3 * within_s
    m = int(rng.poisson(stop_rate * ranks * horizon / 3600.0))
    for t, h in zip(rng.uniform(0.0, horizon, m), rng.integers(0, hosts, m), strict=True):
        out.append(Fault("stop", int(h), 1.0, float(t), float(t)))
    return sorted(out, key=lambda f: f.start_s)


def _time(v: str, step_s: float, what: str) -> float:
    try:
        return float(v[:-1]) if v.endswith("s") else float(v) * step_s
    except ValueError:
        raise ValueError(f"bad {what} in fault spec: {v!r}") from None


def parse(spec: str, ranks: int, hosts: int, step_s: float) -> Fault:
    """One scripted fault (module docstring); ``step_s`` converts step numbers to seconds."""
    kind, _, rest = spec.partition(":")
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r} in {spec!r} (one of {', '.join(KINDS)})")
    kv: dict[str, str] = {}
    for part in filter(None, rest.split(",")):
        k, eq, v = part.partition("=")
        if not eq:
            raise ValueError(f"bad fault field {part!r} in {spec!r}: need key=value")
        kv[k.strip()] = v.strip()
    key, limit = ("rank", ranks) if kind == "compute" else ("host", hosts)
    allowed = {key, "start", "end"} | ({"factor"} if kind != "stop" else set())
    extra = set(kv) - allowed
    if extra:
        raise ValueError(f"unknown field {sorted(extra)[0]!r} in fault spec {spec!r}")
    try:
        target = int(kv[key])
    except (KeyError, ValueError):
        raise ValueError(f"fault spec {spec!r} needs {key}=INT") from None
    if not 0 <= target < limit:
        raise ValueError(f"{key}={target} out of range 0..{limit - 1} in {spec!r}")
    factor = 1.0
    if kind != "stop":
        try:
            factor = float(kv.get("factor", "2"))
        except ValueError:
            raise ValueError(f"bad factor in fault spec {spec!r}") from None
        if not 1.0 <= factor <= 1000.0:
            raise ValueError(f"factor={factor} out of range 1..1000 in {spec!r}")
    start = _time(kv.get("start", "0"), step_s, "start")
    end = _time(kv["end"], step_s, "end") if "end" in kv else math.inf
    if kind == "stop":
        end = start
    elif end <= start:
        raise ValueError(f"end must be after start in fault spec {spec!r}")
    return Fault(kind, target, factor, start, end)


class Schedule:
    """The faults in force at a simulated time, as per-rank and per-host factor arrays."""

    def __init__(self, faults: list[Fault], ranks: int, hosts: int) -> None:
        self.slow = sorted((f for f in faults if f.kind != "stop"), key=lambda f: f.start_s)
        self.stops = sorted((f for f in faults if f.kind == "stop"), key=lambda f: f.start_s)
        self.ranks, self.hosts = ranks, hosts
        self._next = 0
        self._next_stop = 0
        self.active: list[Fault] = []

    def at(self, t: float) -> tuple[np.ndarray, np.ndarray, list[Fault], list[Fault]]:
        """(compute factor per rank, link factor per host, faults started, faults ended)
        at time ``t``; call with non-decreasing ``t``."""
        started, ended = [], []
        while self._next < len(self.slow) and self.slow[self._next].start_s <= t:
            f = self.slow[self._next]
            self._next += 1
            if f.end_s > t:
                self.active.append(f)
                started.append(f)
        keep = []
        for f in self.active:
            (ended if f.end_s <= t else keep).append(f)
        self.active = keep
        comp = np.ones(self.ranks)
        link = np.ones(self.hosts)
        for f in self.active:
            if f.kind == "compute":
                comp[f.target] *= f.factor
            else:
                link[f.target] *= f.factor
        return comp, link, started, ended

    def stops_until(self, t: float) -> list[Fault]:
        """Fail-stops due by ``t`` not returned before."""
        out = []
        while self._next_stop < len(self.stops) and self.stops[self._next_stop].start_s <= t:
            out.append(self.stops[self._next_stop])
            self._next_stop += 1
        return out
