"""Scenarios at a scale: the same job and fault trace under each mitigation policy.

For one number of ranks: a healthy job (fail-stops only) fixes how many steps ``hours`` of
training are; then the same steps with the drawn fail-slows under each policy -- ``none``
(no stalwart), ``rebalance`` (S2 only), ``exclude`` (S4 only), ``auto`` (the full policy).
Every scenario sees the same noise stream and the same faults (one seed), so their job
completion times (JCT) differ only by what the decision code did.

Figures (suffix = the scale, e.g. ``_10k``): ``jct_h_<policy>``; ``jct_recovered_<policy>``
= (JCT none - JCT policy) / (JCT none - JCT healthy), the fraction of the fail-slows'
inflation a policy removes (``jct_recovered`` is the full policy's); detection of the
full-policy run scored against the fault log (``detected``, ``detection_latency_s``,
``false_alarms_per_day``: logged findings with no fault in force on the named rank or host
at their onset, per simulated day; ``pauses_per_day``: validation pauses); rank 0's decision
CPU per step (``decision_ms_per_step`` median, ``_p99``, ``_max``, and as a fraction of the
healthy step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stalwart.simulate.engine import Engine, Outcome, Settings
from stalwart.simulate.faults import Fault, draw, draw_events
from stalwart.simulate.model import Job, Link
from stalwart.simulate.noise import Noise

POLICIES = ("none", "rebalance", "exclude", "auto")
HOSTLINK_TRIALS = 40  # host-link faults validated per scale (hostlink_figures)
HOSTLINK_VERDICTS = 3  # validation pauses each of them meets (one finding expected)
MATCH_SLACK_S = 120.0  # a finding's onset this close to a fault's span counts as that fault


def scale_tag(ranks: int) -> str:
    return f"{ranks // 1000}k" if ranks % 1000 == 0 else str(ranks)


def scale_job(ranks: int, tp: int = 8, pp: int = 5, gpus_per_host: int = 8,
              micro_per_replica: int = 8, mb_compute_s: float = 0.6,
              params: float = 175e9) -> Job:
    """A GPT-3-class job on ``ranks`` GPUs (tp x pp per replica). Assumptions, each stated:
    bf16 gradients (2 bytes per parameter, each rank all-reduces its tp x pp shard), 400 Gbit/s
    between hosts (alpha 10 us), NVLink 300 GB/s within (alpha 3 us), 50 MB of activations per
    micro-batch between stages, half the data-parallel all-reduce hidden under the backward,
    0.6 s per micro-batch and stage (so a step is ~8 s without noise)."""
    if ranks % (tp * pp):
        raise ValueError(f"--ranks {ranks} is not a multiple of tp x pp = {tp * pp}")
    dp = ranks // (tp * pp)
    if dp < 2:
        raise ValueError(f"--ranks {ranks} gives {dp} data-parallel replica(s); need >= 2")
    return Job(dp=dp, tp=tp, pp=pp, micro=micro_per_replica * dp, mb_compute_s=mb_compute_s,
               grad_bytes=2 * params / (tp * pp), act_bytes=50e6, tp_bytes=4e9, fixed_s=0.2,
               overlap=0.5, gpus_per_host=gpus_per_host, intra=Link(3e-6, 300e9),
               inter=Link(10e-6, 50e9))


@dataclass
class ScaleResult:
    job: Job
    steps: int
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)


def run_scale(job: Job, hours: float, noise: Noise, settings: Settings,
              policies: tuple[str, ...] = POLICIES, scripted: list[Fault] | None = None,
              report: Callable[[str, int, int], None] | None = None,
              events: int = 0) -> ScaleResult:
    """Every scenario at one scale (module docstring). ``report(name, done, total)``;
    ``events`` > 0: that many FALCON-drawn fail-slows within ``hours`` (faults.draw_events)
    instead of the Poisson rate."""
    rng = np.random.default_rng(settings.seed)
    horizon = hours * 3600.0 * 3.0  # the slowed jobs run longer than ``hours``
    if scripted is not None:
        faults = list(scripted)
    elif events > 0:
        faults = draw_events(rng, events, job.ranks, job.gpus_per_host, hours * 3600.0)
    else:
        faults = draw(rng, job.ranks, job.gpus_per_host, horizon)
    stops = [f for f in faults if f.kind == "stop"]
    res = ScaleResult(job, 0, faults=faults)

    def healthy_steps() -> int:
        # the healthy job's mean step (noise included) from a short clean run
        probe = Engine(job, [], noise, _with(settings, "none")).run(200, "probe")
        return max(1, int(hours * 3600.0 / (probe.jct_s / probe.steps)))

    res.steps = healthy_steps()
    plan = [("healthy", stops, "none")] + [(p, faults, p) for p in policies]
    for name, fl, pol in plan:
        eng = Engine(job, fl, noise, _with(settings, pol),
                     progress=(lambda d, n=name: report(n, d, res.steps)) if report else None)
        res.outcomes[name] = eng.run(res.steps, name)
        if report:
            report(name, res.steps, res.steps)
    res.figures = figures(res)
    trials = HOSTLINK_TRIALS if job.ranks <= 4000 else HOSTLINK_TRIALS // 2  # ~30 s at 10k
    res.figures.update(hostlink_figures(job, settings.seed, trials, scale=noise.scale))
    return res


def _with(s: Settings, policy: str) -> Settings:
    return Settings(policy=policy, restart_s=s.restart_s, validation_s=s.validation_s,
                    ckpt_every_s=s.ckpt_every_s, every=s.every, seed=s.seed)


def _matches(ev: dict[str, Any], f: Fault, job: Job, onset_s: float) -> bool:
    if not (f.start_s - MATCH_SLACK_S <= onset_s <= f.end_s + MATCH_SLACK_S):
        return False
    ranks = ev.get("ranks") or []
    link = ev.get("link") or []
    named = {int(r) for r in [*ranks, *link]}
    if f.kind == "compute":
        return f.target in named
    hosts = {r // job.gpus_per_host for r in named}
    return f.target in hosts or not named


def score(out: Outcome, faults: list[Fault], job: Job) -> dict[str, Any]:
    """Detection in one run against the fault log (module docstring)."""
    slow = [f for f in faults if f.kind != "stop" and f.start_s < out.jct_s]
    step_clock = {}
    found = [e for e in out.events if e["event"] in ("straggler_detected",
                                                      "slowdown_unexplained")]
    for e in out.events:  # clock of each step, from events that carry both
        if "step" in e:
            step_clock.setdefault(int(e["step"]), float(e["clock_s"]))
    detected, latency, false = 0, [], 0
    for f in slow:
        hit = [e for e in found if _matches(e, f, job, float(e["clock_s"]))]
        if hit:
            detected += 1
            latency.append(max(0.0, float(hit[0]["clock_s"]) - f.start_s))
    for e in found:
        if not any(_matches(e, f, job, float(e["clock_s"])) for f in slow):
            false += 1
    days = out.jct_s / 86400.0
    return {"faults": len(slow), "detected": detected,
            "detection_rate": round(detected / len(slow), 3) if slow else None,
            "detection_latency_s": round(float(np.median(latency)), 1) if latency else None,
            "false_alarms": false,
            "false_alarms_per_day": round(false / days, 2) if days > 0 else None,
            "pauses_per_day": round(out.pauses / days, 1) if days > 0 else None}


def figures(res: ScaleResult) -> dict[str, Any]:
    tag = scale_tag(res.job.ranks)
    o = res.outcomes
    fig: dict[str, Any] = {f"steps_{tag}": res.steps}
    for name, out in o.items():
        fig[f"jct_h_{name}_{tag}"] = round(out.jct_s / 3600.0, 3)
        fig[f"sim_wall_s_{name}_{tag}"] = round(out.wall_s, 1)
    healthy, none = o.get("healthy"), o.get("none")
    if healthy is not None and none is not None:
        infl = none.jct_s - healthy.jct_s
        fig[f"inflation_{tag}"] = round(infl / healthy.jct_s, 4)
        for name, out in o.items():
            if name in ("healthy", "none"):
                continue
            rec = (none.jct_s - out.jct_s) / infl if infl > 0 else math.nan
            key = f"jct_recovered_{tag}" if name == "auto" else f"jct_recovered_{name}_{tag}"
            fig[key] = round(rec, 3) if math.isfinite(rec) else None
    auto = o.get("auto")
    if auto is not None:
        job_steps = healthy.jct_s / res.steps if healthy else None
        sc = score(auto, res.faults, res.job)
        for k, v in sc.items():
            fig[f"{k}_{tag}"] = v
        d = np.asarray(auto.decision_s) * 1e3
        if d.size:
            fig[f"decision_ms_per_step_{tag}"] = round(float(np.median(d)), 3)
            # rank 0's decision CPU per rank and step (median step; us)
            fig[f"decision_us_per_rank_step_{tag}"] = round(
                1e3 * float(np.median(d)) / res.job.ranks, 4)
            fig[f"decision_ms_p99_{tag}"] = round(float(np.percentile(d, 99)), 2)
            fig[f"decision_ms_max_{tag}"] = round(float(d.max()), 1)
            if job_steps:
                fig[f"decision_frac_of_step_{tag}"] = round(
                    float(np.median(d)) / 1e3 / job_steps, 5)
        fig[f"sim_wall_s_{tag}"] = round(auto.wall_s, 1)
    return fig


def _ring(n: int) -> list[tuple[int, int]]:
    """The link test's ring pairs (validate.ring_pair_passes: r-(r+1), and 0-(n-1))."""
    return [(r, r + 1) for r in range(n - 1)] + ([(0, n - 1)] if n > 2 else [])


def _drawn_verdict(rng: np.random.Generator, noise: Any, keys: list[str], hosts: list[str],
                   slow: np.ndarray, step: int) -> tuple[Any, Any]:
    """One validation drawn from ``noise``: the ring pairs ``keys`` each ``slow`` x (the
    order of ``keys``) x pair noise, every rank's compute rounds x test noise, through the
    product's ``localize.decide`` and -- for the pairs a link finding rests on -- a second
    reading and ``retested``, as the Detector does. Returns (first verdict, final verdict)."""
    from stalwart.detect.evidence import RankEvidence
    from stalwart.detect.localize import decide, pairs_to_retest, retested

    n = len(hosts)
    rtt = noise.rtts(rng, slow)
    rounds = noise.rounds(rng, np.ones(n), 3)
    tests, rows = np.median(rounds, axis=1).tolist(), rounds.tolist()
    ev = [RankEvidence(r, 1.0, 1.0, 1.0, 2.0, tests[r], {}, rows[r], host=hosts[r])
          for r in range(n)]
    ev[0].links = dict(zip(keys, rtt.tolist(), strict=True))
    first = decide(ev, 100, step, 1.5)
    again = pairs_to_retest(first, ev)
    if not again:
        return first, first
    at = {k: i for i, k in enumerate(keys)}
    second = noise.rtts(rng, slow[[at[k] for k in again]])
    return first, retested(first, ev, dict(zip(again, second.tolist(), strict=True)))


def hostlink_figures(job: Job, seed: int, trials: int = HOSTLINK_TRIALS,
                     verdicts: int = HOSTLINK_VERDICTS, scale: float = 1.0) -> dict[str, Any]:
    """How the product's verdict names host-link faults at this scale (suffix = the scale).

    Each trial: one host's link ``factor`` x slower (log-uniform on faults.LINK_FACTOR, as
    ``draw``), every rank's evidence as the simulator builds it (compute test = 1 x
    ``TEST_NOISE``; the ring's pairs crossing that host ``factor`` x ``LINK_NOISE``, the
    others 1 x ``LINK_NOISE``; a flat training-time profile with the peers waiting longer),
    ``verdicts`` validation pauses in a row through ``localize.decide`` (and the second
    reading of the pairs a link finding rests on, ``localize.retested``), counted as findings
    the way ``verdicts.same_straggler`` dedups them. ``hostlink_localization`` = the share
    of trials whose first verdict names the host (evidence ``host``, its ranks);
    ``hostlink_findings_per_fault`` = distinct findings per trial that named anything.

    What it does not show: the noise is resampled independently per pair and round (the
    testbed's pools, not its correlations: a loaded host slows all its pairs at once) and the
    fault slows exactly the pairs that cross its host by a constant factor (real congestion
    varies)."""
    from stalwart.detect.verdicts import same_straggler
    from stalwart.simulate.decide import default_test_noise
    from stalwart.simulate.faults import LINK_FACTOR, _loguniform

    rng = np.random.default_rng(seed + 35)
    noise = default_test_noise(scale)
    n, host_of = job.ranks, job.host_of()
    hosts = host_of.astype(str).tolist()
    ring = _ring(n)
    a = np.asarray([p[0] for p in ring])
    b = np.asarray([p[1] for p in ring])
    keys = [f"{x}-{y}" for x, y in ring]
    crossing = host_of[a] != host_of[b]
    named, findings = 0, []
    factors = _loguniform(rng, *LINK_FACTOR, trials)
    for i in range(trials):
        h = int(rng.integers(0, job.hosts))
        touch = crossing & ((host_of[a] == h) | (host_of[b] == h))
        found: list[Any] = []
        for v in range(verdicts):
            f = _drawn_verdict(rng, noise, keys, hosts, np.where(touch, factors[i], 1.0),
                               110 + 10 * v)[1]
            if v == 0:
                named += f.kind == "link" and f.evidence.get("host") == str(h)
            if f.kind != "unknown" and not any(same_straggler(f, g) for g in found[-1:]):
                found.append(f)
        if found:
            findings.append(len(found))
    tag = scale_tag(n)
    per_fault = round(float(np.mean(findings)), 3) if findings else None
    # the figure has no scale in its name: the last scale simulated (the largest)
    return {f"hostlink_localization_{tag}": round(named / trials, 3),
            f"hostlink_findings_per_fault_{tag}": per_fault,
            "hostlink_findings_per_fault": per_fault, f"hostlink_trials_{tag}": trials}


def hostlink_healthy(ranks: int, per_host: int, seed: int = 0, trials: int = 4000,
                     scale: float = 1.0) -> dict[str, Any]:
    """How often the product's verdict names a healthy host at a small job: ``trials``
    validations of ``ranks`` ranks, ``per_host`` to a host, every ring pair and compute
    round drawn from the testbed's measured noise (``default_test_noise(scale)``), none
    slowed. ``hostlink_healthy_one_reading``: the share whose first reading
    (``localize.decide``) named a host; ``hostlink_healthy_named``: the share still named
    after the second reading the Detector takes (``pairs_to_retest``, ``retested``).

    What it does not show: the two readings are drawn independently, while on the testbed
    load that outlasts both slows both."""
    from stalwart.simulate.decide import default_test_noise

    rng = np.random.default_rng(seed)
    noise = default_test_noise(scale)
    keys = [f"{min(a, b)}-{max(a, b)}" for a, b in _ring(ranks)]
    hosts = [f"h{r // per_host}" for r in range(ranks)]
    one = kept = 0
    for _ in range(trials):
        first, f = _drawn_verdict(rng, noise, keys, hosts, np.ones(len(keys)), 110)
        if first.kind == "link" and first.evidence.get("host_link"):
            one += 1
            kept += f.kind == "link"
    return {"hostlink_healthy_one_reading": one / trials, "hostlink_healthy_named": kept / trials,
            "hostlink_healthy_trials": trials}
