"""Replay: recorded run directories through the decision code, without training, and scored.

``stalwart replay RUN_DIR... [--json FILE]`` drives the one decision path
(``stalwart.detect.detector.Detector``, the same the live monitor and the simulator drive) over
each run's recording and prints the decisions it makes; ``--score`` also scores them against
the run's ground truth (the faults the testbed applied, events.jsonl; ``stalwart.detect.truth``)
-- detection, localisation, latency in steps and seconds, false positives -- per run and in
total. It is how a rule or threshold is changed: score the corpus's tuning part
(tests/replay/corpus/tune) before and after, and report on its held-out part.

What replay decides and what it takes from the recording:
- the detector sees what the live monitor saw at rank 0: rank 0's step time, and every
  rank's compute time per unit of work (``fb_time`` normalised to the uniform plan's
  micro-batches), one exchange per step, each row read one step after it was sent (a
  ``--comm lossy`` run: every K steps, read L exchanges later, as its monitor did);
- the validation tests cannot be re-run, but their raw measurements can: rank 0 records
  every validation's gathered evidence (each rank's compute-test rounds, link round trips,
  training-time profile and recent steps) and every recovery test in ``validation.jsonl``
  (``RecordedEvidence``). The rules -- more rounds for a mild suspect, the verdict
  (``localize.decide``: localisation, onset, the audit's), recovery at equal load -- run
  again on them. An alarm is given the recorded validation of the same kind nearest to it
  within ``MATCH_STEPS`` steps (any kind if none); one that has none was not validated live
  (replay raised an alarm the live run did not): it gets this rank's profile only (no
  tests, as a monitor with validation off) and is counted in ``unmatched``. A rule that
  asks for more compute rounds than the recording holds decides on what it holds;
- the policy (runs with ``--mitigate``) gets each group's time per micro-batch and the mean
  step time per exchange (every ``EVERY`` steps, one exchange late, as the agreement channel
  delivers them), the replayed findings, and the measured gain of its own plans
  (``MEASURE_STEPS`` steps after their start); a restart's price is ``RESTART_S``.

A run with restarts (S3/S4) is replayed per incarnation: the monitor and the policy start
afresh where the world size changes or the steps start over. Deterministic: same files, same
decisions. Cost: a few milliseconds per step of the recording.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from stalwart.detect.alarms import MODES, NONE, RECOVER, Alarm, IterSample
from stalwart.detect.decision import DecisionCore
from stalwart.detect.detector import VALIDATION_FILE, Detector, StepInput
from stalwart.detect.evidence import Finding, RankEvidence
from stalwart.errors import ConfigError
from stalwart.events import Event
from stalwart.mitigate import planner, remap
from stalwart.mitigate.decisions import EXCLUDE, REBALANCE, REVERT, Decision
from stalwart.mitigate.membership import in_place_ok
from stalwart.mitigate.policy import Policy
from stalwart.presets import PRESETS, n_params
from stalwart.rundir import CONFIG, ITERATIONS, METRICS, read_jsonl

MATCH_STEPS = 12  # a recorded validation this close to a replayed alarm is its evidence
EVERY = 2  # steps per exchange of the mitigation channel, unless the run's config says
MEASURE_STEPS = 6  # steps after a plan's start over which its gain is measured (rebalance.py)
RESTART_S = 15.0  # a restart's price (measured restarts: 9-16 s on the testbed)
# the alarms' names in the replay's output ("detect": a change point)
ACTIONS = {a: ("detect" if m == "change" else m) for a, m in MODES.items()} | {RECOVER: "recover"}


@dataclass
class StepRows:
    """One step of one incarnation: each rank's measurements (rank -> metrics line)."""

    step: int
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)


@dataclass
class Incarnation:
    world: int
    steps: list[StepRows]


def _incarnations(metrics: list[dict[str, Any]]) -> list[Incarnation]:
    """Split the metrics lines where a new incarnation began (world size changed, or rank 0's
    steps started over: a restart resumes from its checkpoint)."""
    out: list[Incarnation] = []
    cur: dict[int, StepRows] = {}
    world = None
    last0 = None
    for m in metrics:
        w, r, s = int(m.get("world", 0)), int(m["rank"]), int(m["step"])
        if r == 0 and ((world is not None and w != world) or (last0 is not None and s <= last0)):
            out.append(Incarnation(world or 0, [cur[k] for k in sorted(cur)]))
            cur = {}
        if r == 0:
            world, last0 = w, s
        cur.setdefault(s, StepRows(s)).ranks[r] = m
    if cur:
        out.append(Incarnation(world or 0, [cur[k] for k in sorted(cur)]))
    # a step every rank finished (a restart cuts the last one short on some ranks)
    for inc in out:
        n = inc.world or max(len(s.ranks) for s in inc.steps)
        inc.world = n
        inc.steps = [s for s in inc.steps if len(s.ranks) == n]
    return out


def monitor_compute(m: dict[str, Any], micro_total: int, groups: int) -> float:
    """The compute time the live monitor was given: forward/backward scaled to the uniform
    plan's micro-batches (mitigate.rebalance ``normalised``), plus the rest of the step's
    compute."""
    comp = float(m["compute_time"])
    fb = m.get("fb_time")
    n = int(m.get("micro_batches") or 0)
    if fb is None or n <= 0 or micro_total <= 0:
        return comp
    return comp - float(fb) + float(fb) * (micro_total / groups) / n


_FIELDS = set(RankEvidence.__dataclass_fields__)


class RecordedEvidence:
    """The validation evidence a run recorded (``validation.jsonl``), as an
    ``EvidenceSource``: each record used once, the nearest to the alarm first (module
    docstring). ``unmatched``: alarms that had no recorded validation (or recovery test)."""

    def __init__(self, records: list[dict[str, Any]], window: int = MATCH_STEPS) -> None:
        self.window = window
        self.validations = [r for r in records if r.get("kind") == "validation"]
        self.recoveries = [r for r in records if r.get("kind") == "recovery"
                           and r.get("ratio") is not None]
        self.unmatched = 0
        self.pause_s = 0.0
        self._ev: list[RankEvidence] = []
        self._retest: dict[str, float] = {}

    def _nearest(self, recs: list[dict[str, Any]], decided: int) -> dict[str, Any] | None:
        near = [r for r in recs if abs(int(r["step"]) - decided) <= self.window]
        if not near:
            return None
        return min(near, key=lambda r: (abs(int(r["step"]) - decided), int(r["step"])))

    def tests(self, alarm: Alarm, decided: int, own: RankEvidence) -> list[RankEvidence]:
        same = [r for r in self.validations if int(r.get("action", -1)) == alarm.action]
        r = self._nearest(same, decided) or self._nearest(self.validations, decided)
        if r is None:
            self.unmatched += 1
            self._ev, self._retest = [own], {}
            return self._ev
        self.validations.remove(r)
        self._retest = {str(k): float(v) for k, v in (r.get("retest") or {}).items()}
        self._ev = [RankEvidence(**{k: v for k, v in e.items() if k in _FIELDS})
                    for e in r["evidence"]]
        for e in self._ev:  # JSON lists back to the tuples the live evidence holds
            e.recent = [(int(k), float(c)) for k, c in e.recent]
            e.steps = [(int(k), float(t)) for k, t in e.steps]
        return self._ev

    def more_rounds(self, rounds: int) -> list[RankEvidence]:
        return self._ev  # the rounds the live run measured are all there are

    def more_links(self) -> list[RankEvidence] | None:
        return None  # recorded pairs (ring and round robin) were in the evidence already

    def retest_links(self, pairs: list[str]) -> dict[str, float]:
        """The second reading the live run recorded ({}: none recorded, the verdict stands
        on the first)."""
        return {k: v for k, v in self._retest.items() if k in pairs}

    def recovery_ratio(self, suspect: int, decided: int) -> float | None:
        r = self._nearest(self.recoveries, decided)
        if r is None:
            self.unmatched += 1
            return None
        self.recoveries.remove(r)
        return float(r["ratio"])


def _round(x: Any) -> Any:
    """Floats to 6 significant digits: the decisions, not the last bits of their arithmetic."""
    if isinstance(x, float):
        return float(f"{x:.6g}") if math.isfinite(x) else x
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    return x


class EventSink:
    """Collects the events the decision code emits, in memory."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def emit(self, ev: Event) -> None:
        self.events.append({"event": ev.name, **ev.fields()})


# ---- the detector ---------------------------------------------------------------------------
def _replay_detector(inc: Incarnation, source: RecordedEvidence, micro_total: int,
                     groups: int, on_step: Callable[[int, list[Finding]], bool],
                     every: int = 1, lag: int = 1) -> dict[str, Any]:
    """Drive the decision path (``Detector.step``) over one incarnation (module docstring):
    each step's sample, then the rows read back now (every rank's compute), then the alarm
    they carry, validated on the recorded evidence -- rows sent every ``every`` steps and read
    ``lag`` exchanges later, as the live exchange did (exchange.py: 1 and 1, or a lossy job's
    8 and 2). ``on_step(step, findings)`` runs after each step's detection, as the policy
    would; True asks for a recovery test (the policy's ``wants_recovery_test``)."""
    sink = EventSink()
    det = Detector(DecisionCore(True, emit=sink.emit), source)
    core = det.core
    inflight: deque[tuple[int, Alarm, list[tuple[int, list[float]]]]] = deque()
    unsent: list[tuple[int, list[float]]] = []
    next_issue = every
    alarms: list[dict[str, Any]] = []
    for c, srow in enumerate(inc.steps, start=1):  # c: the monitor's check number
        k = srow.step
        m0 = srow.ranks[0]
        comps = [monitor_compute(srow.ranks[r], micro_total, groups) for r in range(inc.world)]
        sample = IterSample(k, float(m0["step_time"]), comps[0], float(m0["comm_time"]))
        unsent.append((k, comps))
        got: Alarm | None = None
        rows: list[tuple[int, list[float]]] = []
        if inflight and inflight[0][0] <= c:
            _, got, rows = inflight.popleft()
        issue = c >= next_issue
        out = det.step(StepInput(sample, rows, got, k, issue))
        if issue:
            inflight.append((c + lag * every, out.send, unsent))
            unsent, next_issue = [], c + every
        if got is not None and got.action != NONE:
            alarms.append({"step": k, "action": ACTIONS[got.action],
                           "onset_step": got.onset, "ratio": got.severity,
                           "suspect": got.suspect})
        if on_step(k, core.findings):
            core.request_recovery_test(k)
    core.close()
    return {"events": sink.events, "hiccups": core.hiccups, "alarms": alarms}


# ---- the policy -----------------------------------------------------------------------------
class PolicyReplay:
    """Rank 0's side of the mitigation channel (mitigate/rebalance.py), on recorded times."""

    def __init__(self, cfg: dict[str, Any], world: int, micro_total: int) -> None:
        tp = int(cfg.get("tp", 1))
        self.tp, self.groups, self.micro = tp, world // tp, micro_total
        # the run's own rule (mitigate.work_plan): a lossy job that cannot regroup in place
        # gets S2 only
        run = SimpleNamespace(**{k: cfg.get(k) for k in ("mitigate", "comm", "script")})
        mode = "rebalance" if cfg.get("comm") == "lossy" and not in_place_ok(run) \
            else str(cfg.get("mitigate"))
        pc = dict(cfg.get("policy") or {})  # the run's policy settings (config.json)
        self.every = int(pc.pop("every", EVERY))
        self.policy = Policy(self.groups, micro_total, tp=tp, mode=mode, every=self.every,
                             **pc)
        self.policy.restart_s = RESTART_S
        self.hosts = list(cfg.get("hosts") or range(world))
        self.policy.hosts = list(self.hosts)
        if cfg.get("comm") != "lossy":
            m = PRESETS[str(cfg.get("preset", "tiny"))]["model"]
            mbs = int(cfg.get("micro_batch_size") or 1)
            dp, tpb = remap.model_bytes(n_params(m) // tp, micro_total / self.groups, mbs,
                                        m.block_size, m.n_embd, m.n_layer, tp)
            self.policy.traffic = remap.pair_traffic(world, tp, dp, tpb)
        self.counts = planner.uniform(micro_total, self.groups)
        self.version = 0
        self.decisions: list[dict[str, Any]] = []
        self._win: dict[int, list[float]] = {}
        self._rows: list[list[float]] | None = None  # the previous exchange's rows
        self._pending: Decision | None = None  # sent, not started
        self._sent: Decision | None = None  # decided at the last exchange, not yet read
        self._steps: list[tuple[int, float]] = []
        self._measure: tuple[str, int, float, int] | None = None
        self.stopped = False

    def step(self, srow: StepRows, findings: list[Finding]) -> bool:
        """One recorded step; True when the policy asks the detector for a recovery test."""
        if self.stopped:
            return False
        s = srow.step
        d = self._pending
        if d is not None and s >= d.start_step:
            self._pending = None
            if d.kind in (REBALANCE, REVERT):
                self.counts, self.version = list(d.counts), d.version
            else:
                self.stopped = True  # a restart: the next incarnation is replayed afresh
                return False
        self._steps.append((s, float(srow.ranks[0]["step_time"])))
        self._check_measure()
        for r, m in srow.ranks.items():
            w = self._win.setdefault(r, [0.0, 0.0, 0.0, 0.0])
            fb = float(m.get("fb_time", m["compute_time"]))
            w[0] += fb
            w[1] += int(m.get("micro_batches") or 1)
            w[2] += float(m["step_time"])
            w[3] += 1
        if (s + 1) % self.every:
            return False
        rows = [[w[0] / max(w[1], 1), w[2] / max(w[3], 1), w[3]]
                for _, w in sorted(self._win.items())]
        self._win = {}
        prev, self._rows = self._rows, rows
        if self._sent is not None:  # read now by every rank: it starts at its start step
            self._pending, self._sent = self._sent, None
            self._on_read(self._pending)
        if prev is None or self._pending is not None:
            return False
        units = [max(prev[r][0] for r in range(g * self.tp, (g + 1) * self.tp))
                 for g in range(self.groups)]
        step_s = statistics.median(r[1] for r in prev)
        self.policy.counts = list(self.counts)
        dec = self.policy.observe(s, units, step_s, int(prev[0][2]), findings,
                                  s + self.every + 1)
        if dec is None:
            return self.policy.wants_recovery_test
        if dec.kind == EXCLUDE:
            dec.target = self.hosts[dec.target]
        self._sent = dec
        self.decisions.append(_round({
            "step": s, "decision": dec.name, "version": dec.version,
            "start_step": dec.start_step, "counts": dec.counts, "target": dec.target,
            "predicted_gain": dec.predicted_gain, "hosts": dec.hosts, "reason": dec.reason}))
        return self.policy.wants_recovery_test

    def _recent_step_time(self) -> float | None:
        xs = [t for _, t in self._steps[-2 * self.every:]]
        return statistics.median(xs) if xs else None

    def _on_read(self, dec: Decision) -> None:
        before = self._recent_step_time()
        if dec.kind in (REBALANCE, REVERT) and before is not None:
            self._measure = ("rebalance" if dec.kind == REBALANCE else "revert", dec.version,
                             before, dec.start_step)

    def _check_measure(self) -> None:
        if self._measure is None:
            return
        strategy, version, before, start = self._measure
        after = [t for s, t in self._steps if s >= start]
        if len(after) < MEASURE_STEPS:
            return
        self._measure = None
        self.policy.measured(strategy, version, 1.0 - statistics.median(after) / before)


# ---- a run ----------------------------------------------------------------------------------
def replay_run(run_dir: Path) -> dict[str, Any]:
    """The decisions the decision code makes on one recorded run (see the module docstring)."""
    run_dir = Path(run_dir)
    # a script run (--script) records the monitor's iterations instead of metrics
    series = METRICS if (run_dir / METRICS).is_file() else ITERATIONS
    for name in (CONFIG, series):
        if not (run_dir / name).is_file():
            raise ConfigError(f"not a run directory (no {METRICS}): {run_dir}")
    cfg = json.loads((run_dir / CONFIG).read_text())
    metrics = read_jsonl(run_dir / series)
    rounds = read_jsonl(run_dir / VALIDATION_FILE) if (
        run_dir / VALIDATION_FILE).is_file() else []
    source = RecordedEvidence(rounds)
    # a lossy job's monitor exchanged every K steps and read each row L exchanges later
    det_cfg = cfg.get("detection") or {}
    every, lag = (int(det_cfg.get("lossy_check_every", 8)), int(det_cfg.get("lossy_lag", 2))) \
        if cfg.get("comm") == "lossy" else (1, 1)
    tp = int(cfg.get("tp", 1))
    out: dict[str, Any] = {"run": run_dir.name, "incarnations": []}
    for inc in _incarnations(metrics):
        if not inc.steps:
            continue
        groups = inc.world // tp
        micro_total = sum(int(m.get("micro_batches") or 0)
                          for r, m in inc.steps[0].ranks.items()) // tp
        pol = PolicyReplay(cfg, inc.world, micro_total) if (
            cfg.get("mitigate", "off") != "off" and groups >= 2) else None
        by_step = {s.step: s for s in inc.steps}

        def on_step(step: int, findings: list[Finding],
                    pol: PolicyReplay | None = pol, by_step: dict = by_step) -> bool:
            if pol is not None:
                return pol.step(by_step[step], findings)
            return False

        det = _replay_detector(inc, source, micro_total, groups, on_step, every, lag)
        out["incarnations"].append(_round({
            "world": inc.world, "first_step": inc.steps[0].step, "last_step": inc.steps[-1].step,
            "alarms": det["alarms"], "detect": det["events"], "hiccups": det["hiccups"],
            "policy": pol.decisions if pol is not None else []}))
    out["unmatched"] = source.unmatched
    return out


def summary(res: dict[str, Any]) -> list[str]:
    """One line per decision, for a terminal."""
    lines = [f"{res['run']}:"]
    for inc in res["incarnations"]:
        lines.append(f"  world {inc['world']}, steps {inc['first_step']}-{inc['last_step']}: "
                     f"{len(inc['alarms'])} alarms, {inc['hiccups']} let go as hiccups")
        for e in inc["detect"]:
            who = e.get("ranks") or e.get("link") or ""
            lines.append(f"    step {e.get('step')}: {e['event']} {e.get('kind', '')} {who} "
                         f"onset {e.get('onset_step')} x{e.get('severity')}")
        for d in inc["policy"]:
            lines.append(f"    step {d['step']}: {d['decision']} v{d['version']} from step "
                         f"{d['start_step']} {d['counts'] or d['hosts'] or d['target']}")
    return lines


def main(run_dirs: list[Path], json_out: Path | None = None, score: bool = False) -> int:
    """Replay (and with ``score``, score: stalwart.replayscore) each run; a folder that is no
    run directory but holds some (the corpus, one of its parts) stands for them."""
    from stalwart import replayscore

    dirs: list[Path] = []
    for p in run_dirs:
        p = Path(p)
        inner = sorted(q for q in p.rglob(CONFIG)) if p.is_dir() and not (p / CONFIG).is_file() \
            else []
        dirs += [q.parent for q in inner] or [p]
    results = [replay_run(p) for p in dirs]
    if not score:
        for res in results:
            print("\n".join(summary(res)))
        if json_out is not None:
            json_out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
            print(f"decisions written to {json_out}")
        return 0
    scores = [replayscore.score_run(p, r) for p, r in zip(dirs, results, strict=True)]
    for sc in scores:
        print("\n".join(replayscore.lines(sc)))
    total = replayscore.totals(scores)
    print("\n".join(replayscore.total_lines(total)))
    if json_out is not None:
        json_out.write_text(json.dumps({"runs": scores, "total": total, "decisions": results},
                                       indent=1, sort_keys=True) + "\n")
        print(f"scores written to {json_out}")
    return 0
