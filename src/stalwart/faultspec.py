"""The fault grammar: ``KIND:key=value,...`` -> a validated, immutable ``Fault``.

Kinds (each realised by a kernel mechanism, see docs/testbed.md)::

    compute:rank=R,factor=F         rank R gets 1/F of one CPU       (cgroup CPU quota)
    contention:rank=R,procs=K       K busy processes share R's CPU   (same cgroup, 1 CPU quota)
    link:host=H,rate=RATE           host H's link shaped to RATE     (tc tbf, both directions)
    pairlink:hosts=A-B,rate=RATE    only A<->B traffic shaped        (tc htb + u32 filters)
    loss:host=H|all,p=P             incoming packets dropped w.p. P  (nftables numgen, input hook)
    kill:rank=R,at=STEP|SECONDSs[,back=SECONDSs]
                                    rank R's process is killed       (SIGKILL to its process group)
    hang:rank=R,at=STEP|SECONDSs    rank R's process freezes         (SIGSTOP to its process group)
    cut:host=H                      host H's link is cut: nothing    (nftables drop, input hooks
                                    reaches it or comes from it       of every namespace)

A kill is one event, not a window: ``at`` is the step (or ``at=12.5s``) it happens at, and the
rank stays dead -- unless ``back`` (``--script`` runs) says how many seconds later the
launcher starts it again, as a node restarted after a crash: a script that uses
``stalwart.elastic`` takes it back live (supervise.py). A hang is one event too: the process
stays frozen; the launcher finds it by its missing heartbeat (heartbeat.py) and kills it.
Every other kind takes ``start`` and ``end`` (end exclusive; default: the whole run), each
either a step (``start=20``) or seconds since the ranks were started (``start=10s``,
``end=42.5s``): a user's own script has no step counter stalwart can read unless the monitor
counts its iterations (``--detect``), but the launcher always knows the time.

``parse_fault`` guarantees that a returned Fault is applicable to a testbed of ``nproc`` ranks
of the given kind, ``ranks_per_host`` to a host (rank r on host r // ranks_per_host); anything
else raises ``ConfigError`` with one line naming the bad value. ``rank=`` names a rank and
``host=`` an emulated host: compute, contention and kill act on one rank's process (its own
cgroup, also on a host shared with other ranks); link, pairlink and loss act on a host's
network path, which all its ranks share, so they take no ``rank=``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stalwart.errors import ConfigError

TESTBEDS = ("local", "netns")
FAULT_KINDS = ("compute", "contention", "link", "pairlink", "loss", "kill", "hang", "cut")
MOMENT_KINDS = ("kill", "hang")  # one event at ``at``, not a window

NETNS_ONLY = ("link", "pairlink", "loss", "cut")
MAX_FACTOR = 100.0  # cgroup v1 refuses quotas below 1 ms of a 100 ms period
MAX_PROCS = 64

_KEYS: dict[str, tuple[set[str], set[str]]] = {  # kind -> (required, optional)
    "compute": ({"rank", "factor"}, set()),
    "contention": ({"rank", "procs"}, set()),
    "link": ({"host", "rate"}, set()),
    "pairlink": ({"hosts", "rate"}, set()),
    "loss": ({"host", "p"}, set()),
    "kill": ({"rank", "at"}, {"back"}),
    "hang": ({"rank", "at"}, set()),
    "cut": ({"host"}, set()),
}
_WINDOW = {"start", "end"}
_SECONDS_RE = re.compile(r"^(\d+(?:\.\d+)?)s$")

# tc's units: "bit" units count bits, "bps" units count bytes; k/m/g/t are powers of 1000
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)$", re.IGNORECASE)
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


@dataclass(frozen=True)
class Fault:
    kind: str
    spec: str
    start: int = 0
    end: int | None = None  # exclusive; None = until the end of the run
    # the same bounds in seconds since the ranks were started (``start=10s``); a bound is
    # given in steps or in seconds, and a bound not given is open (start 0, no end)
    start_s: float | None = None
    end_s: float | None = None
    rank: int | None = None  # compute, contention, kill, hang
    hosts: tuple[int, ...] = ()  # link (1), pairlink (2), loss (1 or all), cut (1)
    factor: float = 1.0  # compute
    procs: int = 0  # contention
    rate_bps: int = 0  # link, pairlink: bits per second
    rate: str = ""  # as given, e.g. "50mbit"
    p: float = 0.0  # loss
    back_s: float | None = None  # kill: seconds after it the rank is started again

    def active_at(self, step: int, elapsed: float | None = None) -> bool:
        """Whether the fault is on at `step` and `elapsed` seconds since the ranks started
        (None: not known yet, so a fault that starts at a time is not on)."""
        started = self.start <= step and (
            self.start_s is None or (elapsed is not None and elapsed >= self.start_s))
        ended = (self.end is not None and step >= self.end) or (
            self.end_s is not None and elapsed is not None and elapsed >= self.end_s)
        return started and not ended

    @property
    def uses_steps(self) -> bool:
        """True when a bound is a step (it needs a step counter: stalwart's or the monitor's)."""
        return self.start > 0 or self.end is not None

    @property
    def magnitude(self) -> float:
        return {"compute": self.factor, "contention": float(self.procs),
                "link": float(self.rate_bps), "pairlink": float(self.rate_bps),
                "loss": self.p, "kill": 1.0, "hang": 1.0, "cut": 1.0}[self.kind]

    @property
    def target(self) -> str:
        if self.kind in RANK_KINDS:
            return f"rank{self.rank}"
        if self.kind == "pairlink":
            return f"hosts{self.hosts[0]}-{self.hosts[1]}"
        if self.kind == "loss" and len(self.hosts) != 1:
            return "all"
        return f"host{self.hosts[0]}"

    def event_fields(self) -> dict[str, Any]:
        """The ground-truth fields of a fault_applied / fault_removed event."""
        out: dict[str, Any] = {"kind": self.kind, "target": self.target,
                               "magnitude": self.magnitude, "spec": self.spec,
                               "start": self.start, "end": self.end}
        if self.start_s is not None:
            out["start_s"] = self.start_s
        if self.end_s is not None:
            out["end_s"] = self.end_s
        if self.rank is not None:
            out["rank"] = self.rank
        else:
            out["hosts"] = list(self.hosts)
        if self.kind in ("link", "pairlink"):
            out["rate"] = self.rate
        if self.back_s is not None:
            out["back_s"] = self.back_s
        return out


def parse_rate(text: str) -> int:
    """'50mbit' -> 50_000_000 bits/s (tc units: bit/kbit/mbit/gbit/tbit, bps/kbps/... bytes)."""
    m = _RATE_RE.match(text.strip())
    if not m:
        raise ConfigError(f"bad rate {text!r} (use e.g. 50mbit, 1gbit, 500kbit, 10mbps)")
    value = float(m.group(1)) * _SCALE[m.group(2).lower()]
    if m.group(3).lower() == "bps":
        value *= 8
    bits = int(value)
    if bits < 8000:
        raise ConfigError(f"rate {text!r} is below 8kbit")
    return bits


def _int(key: str, value: str, spec: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r} is not an integer in fault {spec!r}") from None


def _float(key: str, value: str, spec: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r} is not a number in fault {spec!r}") from None
    if not math.isfinite(x):
        raise ConfigError(f"{key}={value!r} is not a finite number in fault {spec!r}")
    return x


def _bound(key: str, value: str | None, spec: str) -> tuple[int | None, float | None]:
    """A window bound: (step, None) for "20", (None, seconds) for "10s" / "2.5s"."""
    if value is None:
        return None, None
    m = _SECONDS_RE.match(value)
    if m:
        return None, float(m.group(1))
    if value.endswith("s"):
        raise ConfigError(f"{key}={value!r} is not a number of seconds (e.g. {key}=10s) "
                          f"in fault {spec!r}")
    try:
        return int(value), None
    except ValueError:
        raise ConfigError(f"{key}={value!r} is neither a step nor seconds (e.g. {key}=20 or "
                          f"{key}=10s) in fault {spec!r}") from None


def _index(key: str, value: str, nproc: int, spec: str) -> int:
    i = _int(key, value, spec)
    if not 0 <= i < nproc:
        raise ConfigError(f"{key}={i} out of range [0, {nproc - 1}] in fault {spec!r}")
    return i


RANK_KINDS = ("compute", "contention", "kill", "hang")  # act on one rank's processes
HOST_KINDS = ("link", "pairlink", "loss", "cut")  # act on a host's network path (all its ranks)


def n_hosts(nproc: int, ranks_per_host: int = 1) -> int:
    """Emulated hosts of a run of ``nproc`` ranks (the last one may hold fewer)."""
    return -(-nproc // max(ranks_per_host, 1))


def _host_or_rank(kind: str, kv: dict[str, str], spec: str, nproc: int, per: int) -> None:
    """One line for a fault that addresses the wrong thing on a shared host."""
    if kind in HOST_KINDS and "rank" in kv:
        r = _int("rank", kv["rank"], spec)
        h = r // per
        share = (f"; host {h} holds ranks {h * per}-{min(nproc, (h + 1) * per) - 1} "
                 f"(--ranks-per-host {per})" if per > 1 and 0 <= r < nproc else "")
        raise ConfigError(f"fault {spec!r}: {kind} faults act on a host's network path, which "
                          f"all its ranks share, so they cannot be per-rank: use host=H{share}")
    if kind in RANK_KINDS and "host" in kv:
        raise ConfigError(f"fault {spec!r}: {kind} faults act on one rank's processes: use "
                          "rank=R (a host's ranks are R = host x ranks-per-host + 0, 1, ...)")


def parse_fault(spec: str, nproc: int, testbed: str, ranks_per_host: int = 1) -> Fault:
    """Parse and validate one ``--fault`` value for a run of `nproc` ranks on `testbed`,
    ``ranks_per_host`` ranks to an emulated host (host indices count hosts, not ranks).
    Raises ``ConfigError`` with one line naming the bad value."""
    per = max(int(ranks_per_host), 1)
    kind, rest = _kind(spec, testbed)
    kv = _params(rest, spec)
    _host_or_rank(kind, kv, spec, nproc, per)
    _check_keys(kind, kv, spec)
    if kind in MOMENT_KINDS:
        return _moment(kind, kv, spec, nproc)
    common = _window(kind, kv, spec)
    if kind in RANK_KINDS:
        return _BUILD[kind](kv, spec, nproc, common)
    return _BUILD[kind](kv, spec, n_hosts(nproc, per), common)


def _kind(spec: str, testbed: str) -> tuple[str, str]:
    """The fault's kind and its parameters' text, checked against the testbed."""
    if testbed not in TESTBEDS:
        raise ConfigError(f"unknown testbed {testbed!r} (choose from {', '.join(TESTBEDS)})")
    kind, sep, rest = spec.strip().partition(":")
    if kind not in FAULT_KINDS:
        raise ConfigError(
            f"unknown fault kind {kind!r} in {spec!r} (choose from {', '.join(FAULT_KINDS)})")
    if not sep or not rest:
        raise ConfigError(f"fault {spec!r} has no parameters (expected {kind}:key=value,...)")
    if kind in NETNS_ONLY and testbed != "netns":
        raise ConfigError(f"fault kind {kind!r} in {spec!r} needs --testbed netns")
    return kind, rest


def _params(rest: str, spec: str) -> dict[str, str]:
    """The key=value pairs, each key once."""
    kv: dict[str, str] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ConfigError(f"bad parameter {item!r} in fault {spec!r} (expected key=value)")
        if key in kv:
            raise ConfigError(f"parameter {key!r} given twice in fault {spec!r}")
        kv[key] = value
    return kv


def _check_keys(kind: str, kv: dict[str, str], spec: str) -> None:
    """Every required key there and no unknown one."""
    required, optional = _KEYS[kind]
    allowed = required | optional | (set() if kind in MOMENT_KINDS else _WINDOW)
    for key in kv:
        if key not in allowed:
            raise ConfigError(f"unknown parameter {key!r} for fault kind {kind!r} in {spec!r} "
                              f"(allowed: {', '.join(sorted(allowed))})")
    for key in sorted(required):
        if key not in kv:
            raise ConfigError(f"fault {spec!r} is missing {key}=...")


def _moment(kind: str, kv: dict[str, str], spec: str, nproc: int) -> Fault:
    """A kill or hang: one moment (``at``), never an end; ``back`` seconds later the rank is
    started again."""
    at, at_s = _bound("at", kv["at"], spec)
    if at is not None and at < 0:
        raise ConfigError(f"at={at} must be >= 0 in fault {spec!r}")
    back_s = None
    if "back" in kv:
        back, back_s = _bound("back", kv["back"], spec)
        if back is not None:  # a bare number: seconds too (a step has no meaning here)
            back_s = float(back)
        if not back_s or back_s <= 0:
            raise ConfigError(f"back={kv['back']} must be a positive number of seconds "
                              f"in fault {spec!r}")
    return Fault(kind=kind, spec=spec.strip(), start=at or 0, start_s=at_s,
                 rank=_index("rank", kv["rank"], nproc, spec), back_s=back_s)


def _window(kind: str, kv: dict[str, str], spec: str) -> dict[str, Any]:
    """The fields every windowed fault has: kind, spec and its start/end (steps or seconds)."""
    start, start_s = _bound("start", kv.get("start"), spec)
    end, end_s = _bound("end", kv.get("end"), spec)
    start = start or 0
    if start < 0:
        raise ConfigError(f"start={start} must be >= 0 in fault {spec!r}")
    if end is not None and end <= start:
        raise ConfigError(f"end={end} must be > start={start} in fault {spec!r}")
    if end_s is not None and end_s <= (start_s or 0.0):
        raise ConfigError(f"end={kv['end']} must be after start={kv.get('start', '0')} "
                          f"in fault {spec!r}")
    return {"kind": kind, "spec": spec.strip(), "start": start, "end": end,
            "start_s": start_s, "end_s": end_s}


# one builder per windowed kind: (params, spec, ranks or hosts to index, window) -> Fault
def _compute(kv: dict[str, str], spec: str, nproc: int, common: dict[str, Any]) -> Fault:
    rank = _index("rank", kv["rank"], nproc, spec)
    factor = _float("factor", kv["factor"], spec)
    if not 1.0 <= factor <= MAX_FACTOR:
        raise ConfigError(
            f"factor={kv['factor']} must be in [1, {MAX_FACTOR:g}] in fault {spec!r}")
    return Fault(rank=rank, factor=factor, **common)


def _contention(kv: dict[str, str], spec: str, nproc: int, common: dict[str, Any]) -> Fault:
    rank = _index("rank", kv["rank"], nproc, spec)
    procs = _int("procs", kv["procs"], spec)
    if not 1 <= procs <= MAX_PROCS:
        raise ConfigError(f"procs={procs} must be in [1, {MAX_PROCS}] in fault {spec!r}")
    return Fault(rank=rank, procs=procs, **common)


def _cut(kv: dict[str, str], spec: str, hosts_n: int, common: dict[str, Any]) -> Fault:
    return Fault(hosts=(_index("host", kv["host"], hosts_n, spec),), **common)


def _loss(kv: dict[str, str], spec: str, hosts_n: int, common: dict[str, Any]) -> Fault:
    host = kv["host"]
    hosts = tuple(range(hosts_n)) if host == "all" else (_index("host", host, hosts_n, spec),)
    p = _float("p", kv["p"], spec)
    if not 0.0 <= p < 1.0:
        raise ConfigError(f"p={kv['p']} must be in [0, 1) in fault {spec!r}")
    return Fault(hosts=hosts, p=p, **common)


def _rate(kv: dict[str, str], spec: str) -> float:
    try:
        return parse_rate(kv["rate"])
    except ConfigError as e:
        raise ConfigError(f"{e} in fault {spec!r}") from None


def _link(kv: dict[str, str], spec: str, hosts_n: int, common: dict[str, Any]) -> Fault:
    rate_bps = _rate(kv, spec)
    return Fault(hosts=(_index("host", kv["host"], hosts_n, spec),), rate_bps=rate_bps,
                 rate=kv["rate"], **common)


def _pairlink(kv: dict[str, str], spec: str, hosts_n: int, common: dict[str, Any]) -> Fault:
    rate_bps = _rate(kv, spec)
    a, dash, b = kv["hosts"].partition("-")
    if not dash:
        raise ConfigError(f"hosts={kv['hosts']!r} must be A-B in fault {spec!r}")
    ha, hb = _index("hosts", a, hosts_n, spec), _index("hosts", b, hosts_n, spec)
    if ha == hb:
        raise ConfigError(f"hosts={kv['hosts']!r} names the same host twice in fault {spec!r}")
    return Fault(hosts=(ha, hb), rate_bps=rate_bps, rate=kv["rate"], **common)


_BUILD: dict[str, Callable[[dict[str, str], str, int, dict[str, Any]], Fault]] = {
    "compute": _compute, "contention": _contention, "cut": _cut, "loss": _loss,
    "link": _link, "pairlink": _pairlink}
