"""The escalation policy: which strategy, when, and when to go back (FALCON's ski rental).

Mechanism (FALCON/Greyhound, ATC '25, section "multi-level mitigation"): the strategies are
ordered by cost -- S1 do nothing, S2 rebalance micro-batches (a plan switch), S4 restart
without the slow host (S3, re-mapping ranks around a slow link, plugs in between) -- and while
a straggler lasts the policy adds up the time it has cost, sum over steps of (slow step time -
healthy step time). Once that rent exceeds the next strategy's price the policy buys it.

What the prices are here:
- S2's price is what a wrong rebalance costs: the plan stays until the revert is decided
  (``revert_windows`` exchanges) and, on healthy ranks, the rebalanced plan's makespan
  exceeds the uniform one. A straggler that outlives that price is worth rebalancing; a blip
  that the detector confirmed but that is gone when the policy looks is never acted on
  (the rent only accrues while the rank's own per-micro-batch time still shows it).
- S3 (remap.py) re-maps ranks around one slow pair of hosts by a restart on a permuted host
  map: its price is the measured restart time, like S4's, and it is bought only when the new
  placement carries less traffic on the pair (a pair of non-neighbours costs nothing to keep).
- S4's price is the measured restart time (checkpoint, relaunch, rendezvous, first step);
  the way back is bought separately, when a probe finds the host healthy and the remaining
  steps repay another restart (probe.py). S4 is only a candidate while the best plan on N hosts
  is slower than the uniform plan on N-1 hosts (the capacity given up): a host whose own
  link is slow, or a rank so slow that the job is faster without it.

Verdicts come from the detector (``stalwart.detect``: validated, localised findings); the
policy's own evidence is each group's time per micro-batch, which -- unlike the step time or
a rank's compute time per step -- hardly changes when a plan moves work, so a rebalanced
straggler still looks slow and a recovered one looks healthy. Recovery needs
``revert_windows`` consecutive healthy exchanges (hysteresis); a new plan replaces the one in
force only when it is predicted ``replan_gain`` better. "Hardly" is not "never": a rank held
by a CPU quota and given one micro-batch runs that short burst at nearly full speed and looks
recovered. So a reverted straggler is watched for ``WATCH`` exchanges: slow again under the
uniform plan twice in a row, it is followed again (its rent carries over, so the plan comes
back at once) and its next revert needs twice the healthy exchanges -- one wrong revert costs
a few steps, and repeated ones back off instead of oscillating. With ``verified_recovery``
(the default) a compute straggler on a reduced share is not reverted on the policy's own
evidence at all: only the detector's recovery verdict, which its compute test at equal load
confirms (detect/decision.py), reverts the plan.

Pure logic on rank 0 (no torch.distributed): unit-tested with synthetic measurements.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from stalwart.detect.localize import Finding
from stalwart.mitigate import planner, remap
from stalwart.mitigate.decisions import EXCLUDE, REBALANCE, REMAP, REVERT, Decision

SLOW_RATIO = 1.15  # a group's per-micro-batch time this far above its peers' median is slow
RECOVERED_RATIO = 1.5  # below this, the detector's recovery verdict is believed
WATCH = 10  # exchanges a reverted straggler is watched for a wrong revert
FIT = 8  # exchanges of peers' (micro-batches, compute) behind the fixed-cost fit
MUTE = 25  # exchanges a rank's findings are ignored after its plan was undone


@dataclass
class Straggler:
    """One straggler the policy is following."""

    kind: str  # "compute" | "link" (a host's own link) | "pairlink" (one pair of ranks)
    group: int  # data-parallel group of the culprit rank
    rank: int
    onset_step: int
    detected_step: int
    rent_s: float = 0.0  # time it has cost since detection (seconds)
    healthy_windows: int = 0
    since: int = 0  # first exchange (index) measured under this straggler
    # healthy exchanges needed before a revert (0: the policy's default); doubled each time a
    # revert proves wrong (the rank is slow again under the uniform plan)
    revert_need: int = 0
    wrong_reverts: int = 0
    pair: tuple[int, int] | None = None  # pairlink: the two ranks
    # its time per micro-batch over its peers' when the plan was made: the slow/healthy line
    # while a plan is in force is the geometric midpoint between this level and 1 (see
    # ``recovery_ratio``)
    level: float = 0.0
    no_replan: bool = False  # a re-plan for it measured worse than the plan before
    remapped: bool = False
    # a host's link on a host of several ranks (the finding's ``host``): every rank of the
    # host, which S4 takes out together (their link is the straggler, not one rank)
    ranks: tuple[int, ...] = ()


def detector_recovered(s: Straggler, findings: Sequence[Finding]) -> bool:
    """The detector's own verdict: its latest finding on this straggler's rank (since the
    straggler was found) is reported recovered. Only the latest: a rank given one micro-batch
    can read healthy to the detector for a few steps and be found slow again (measured: a 3x
    rank "recovered" at step 32 and was found again at 34; the earlier verdict reverted its
    plan mid-fault and kept the wrong revert from being watched)."""
    own = [f for f in findings if f.step >= s.detected_step and s.rank in f.ranks]
    return bool(own) and own[-1].recovered_step is not None


def recovery_ratio(s: Straggler) -> float:
    """Above this ratio to its peers a rebalanced straggler still counts as slow: the
    geometric midpoint between its level when the plan was made and healthy (1.0), at least
    SLOW_RATIO. A fixed line would misjudge both ways: a rank given fewer micro-batches reads
    up to ~1.25x per micro-batch when healthy (the step's fixed cost spread over fewer), and
    under a CPU quota a short burst can read nearly healthy when it is not."""
    return max(SLOW_RATIO, s.level ** 0.5) if s.level > 1.0 else SLOW_RATIO


@dataclass
class Policy:
    """Rank 0's decision maker; ``observe`` once per exchange."""

    groups: int
    micro: int  # M: micro-batches per step
    tp: int = 1
    mode: str = "auto"  # "auto": S2 and S4; "rebalance": S2 only
    min_count: int = 1
    restart_s: float = 30.0  # S3/S4's price: a measured restart or regroup (the worker's)
    moves_by: str = "restart"  # how S3/S4 are applied ("regroup": in place), for the reasons
    min_gain: float = 0.05
    replan_gain: float = 0.25  # a plan in force is replaced only for this much more
    revert_windows: int = 2
    # a compute straggler on less than its share that reads healthy is reverted only on the
    # detector's recovery verdict (its compute test at equal load), not on the policy's own
    # per-micro-batch times (``_awaits_verdict``)
    verified_recovery: bool = True
    every: int = 2  # steps per exchange (the agreement channel's period)
    window: int = 4  # exchanges of per-micro-batch times behind each plan's estimate
    counts: list[int] = field(default_factory=list)
    version: int = 0
    active: Straggler | None = None
    healthy_step_s: float | None = None
    _unit_hist: list[list[float]] = field(default_factory=list)
    _count_hist: list[list[int]] = field(default_factory=list)  # the plan of each exchange
    _step_hist: list[float] = field(default_factory=list)
    _exch_steps: list[int] = field(default_factory=list)  # the step of each exchange
    _seen_findings: int = 0
    # S3: bytes per step on each rank pair (remap.pair_traffic) and the rank -> host map;
    # None = no re-mapping (the lossy transport's all-to-all is not a ring)
    traffic: dict[tuple[int, int], float] | None = None
    hosts: list[int] = field(default_factory=list)
    # the straggler last reverted, watched for WATCH exchanges: slow again under the uniform
    # plan -> the revert was wrong (e.g. a CPU quota lets a rank with little work run its
    # short burst at full speed, so it looked healthy); it is followed again with backoff
    _watch: Straggler | None = None
    _watch_until: int = 0
    _watch_slow: int = 0
    # a rebalance whose measured gain came out negative is undone, and its rank's findings
    # are ignored for MUTE exchanges (rank -> last muted exchange)
    _undo: str = ""
    _prev_counts: list[int] = field(default_factory=list)  # the plan before the one in force
    _muted: dict[int, int] = field(default_factory=dict)
    _need: int = 0  # healthy exchanges the straggler followed now needs before a revert
    # set by ``observe`` when a compute straggler reads healthy on a reduced share and only the
    # detector's verdict may revert it: the caller asks the detector for its compute test
    wants_recovery_test: bool = False

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = planner.uniform(self.micro, self.groups)

    @property
    def uniform(self) -> bool:
        return self.counts == planner.uniform(self.micro, self.groups)

    def unit_times(self) -> list[float]:
        """Each group's recent time per micro-batch: the median over the last few exchanges,
        none from before the straggler being followed was reported (they would dilute it)."""
        first = len(self._unit_hist) - self.window
        if self.active is not None:
            first = max(first, self.active.since)
        hist = self._unit_hist[max(first, 0):]
        return [statistics.median(h[g] for h in hist) for g in range(self.groups)]

    def _slow(self, units: list[float], g: int, ratio: float = SLOW_RATIO) -> bool:
        return self.groups > 1 and self.ratio_to_peers(units, g) > ratio

    def ratio_to_peers(self, units: list[float], g: int) -> float:
        """Group g's compute this exchange over what a healthy peer would take for the same
        number of micro-batches. A step's compute is a + b n, not b n: a fixed part (the
        last backward shares the rank's CPU with gloo's reduction threads) is spread over
        fewer micro-batches on a rank given less work, which then reads ~1.2x per
        micro-batch when healthy. With peers at two or more counts in the last FIT exchanges
        (any rebalanced plan), a and b are fitted to their (n, compute) points by least
        squares; otherwise (the uniform plan: every n equal) the ratio is per micro-batch."""
        counts = self._count_hist[-1] if self._count_hist else self.counts
        pts = [(h_n[i], h_u[i] * h_n[i])
               for h_u, h_n in zip(self._unit_hist[-FIT:], self._count_hist[-FIT:], strict=True)
               for i in range(self.groups) if i != g and h_n[i] > 0]
        peers = [u for i, u in enumerate(units) if i != g]
        if not peers:
            return 1.0
        ns = {n for n, _ in pts}
        if len(ns) >= 2:
            b, a = statistics.linear_regression([n for n, _ in pts], [c for _, c in pts])
            mc = statistics.fmean(c for _, c in pts)
            if b > 0 and 0 <= a <= 0.5 * mc:  # a plausible fixed part; else per micro-batch
                return units[g] * counts[g] / (a + b * counts[g])
        return units[g] / statistics.median(peers)

    @property
    def state(self) -> str:
        """healthy | watching (a reverted straggler, for a wrong revert) | following."""
        if self.active is not None:
            return "following"
        return "watching" if self._watch is not None else "healthy"

    def observe(self, step: int, units: list[float], step_s: float, steps: int,
                findings: Sequence[Finding], start_step: int) -> Decision | None:
        """One exchange: per-group seconds per micro-batch, the mean step time over the
        ``steps`` steps since the last exchange, the detector's findings so far (oldest
        first). ``start_step``: where a decision made now would start.

        Transitions: a plan measured to hurt is undone first (``measured``); healthy ->
        following on a finding; watching -> following when the reverted straggler is slow
        again, -> healthy after ``WATCH`` exchanges; following -> watching on recovery (the
        plan reverted); while following, the rent buys S2, S3 or S4 (``_escalate``)."""
        self.wants_recovery_test = False
        if any(not u > 0 for u in units):
            return None  # a group that computed nothing this window (excluded or idle)
        self._unit_hist.append(units)
        self._count_hist.append(list(self.counts))
        self._step_hist.append(step_s)
        self._exch_steps.append(step)
        for f in findings[self._seen_findings:]:
            self._on_finding(f)
        self._seen_findings = len(findings)
        if self._undo:
            return self._undo_plan(start_step)
        if self.active is None:
            self._rewatch(units, findings)
        s = self.active
        if s is None:
            if self.uniform and self._watch is None:  # the healthy level
                self.healthy_step_s = statistics.median(self._step_hist[-8:])
            return None
        if not self._still_slow(s, units, step_s, steps, findings):
            if self._awaits_verdict(s, findings):
                return None
            return self._on_healthy_window(s, start_step)
        if s.kind == "pairlink":
            return self._remap(s, step_s, start_step)
        return self._escalate(s, step_s, start_step)

    def _undo_plan(self, start_step: int) -> Decision | None:
        """A plan measured to make steps slower: a re-plan goes back to the plan before it
        (no more re-plans for this straggler: the first plan had measured a gain); a first
        plan goes back to uniform and the rank's findings are muted for ``MUTE`` exchanges."""
        reason, self._undo = self._undo, ""
        s = self.active
        uniform = planner.uniform(self.micro, self.groups)
        if s is not None and self._prev_counts and self._prev_counts != uniform:
            s.no_replan = True
            return self._decide(REBALANCE, list(self._prev_counts), start_step, s.group, 0.0,
                                reason + f"; back to {self._prev_counts}")
        if s is not None:
            self._muted[s.rank] = len(self._unit_hist) + MUTE
        self.active, self._watch = None, None
        if not self.uniform:
            return self._decide(REVERT, uniform, start_step, -1, 0.0, reason)
        return None

    def _healthy_windows_needed(self, s: Straggler, confirmed: bool) -> int:
        """Healthy exchanges in a row before a revert. While the detector (validated by its
        own compute test) still holds the rank slow, the policy's own evidence must last
        twice as long (a quota'd rank on 2 micro-batches read healthy for 2 exchanges
        mid-fault on a loaded machine); on a quarter of its share or less, twice as long
        again (its work fits the quota's burst: a 3x rank on 1 of 16 micro-batches read
        healthy for 4 exchanges just before its fault ended)."""
        need = s.revert_need or self.revert_windows
        if s.kind == "compute" and not confirmed:
            need = max(need, 2 * self.revert_windows)
            if 4 * self.counts[s.group] <= planner.uniform(self.micro, self.groups)[s.group]:
                need = max(need, 4 * self.revert_windows)
        return need

    def _still_slow(self, s: Straggler, units: list[float], step_s: float, steps: int,
                    findings: Sequence[Finding]) -> bool:
        """Judge the latest exchange alone (a median would lag the revert); a slow one adds
        to the rent, a healthy one counts towards the revert."""
        slow_now = self._slow(units, s.group, recovery_ratio(s)) if s.kind == "compute" else (
            self.healthy_step_s is not None and step_s > (1 + self.min_gain) * self.healthy_step_s)
        # the detector's recovery verdict (per-unit compute, its own change-point test) is
        # trusted below RECOVERED_RATIO: a rank given one micro-batch carries the per-step
        # fixed cost alone and reads up to ~1.3x per micro-batch when healthy
        confirmed = detector_recovered(s, findings)
        self._need = self._healthy_windows_needed(s, confirmed)
        if (confirmed and s.kind == "compute" and not s.wrong_reverts
                and not self._slow(units, s.group, RECOVERED_RATIO)):
            slow_now = False
            s.healthy_windows = self._need
        if slow_now:
            s.healthy_windows = 0
            if self.healthy_step_s is not None:
                s.rent_s += max(step_s - self.healthy_step_s, 0.0) * steps
        return slow_now

    def _awaits_verdict(self, s: Straggler, findings: Sequence[Finding]) -> bool:
        """Whether a healthy-looking exchange must not count towards a revert: a compute
        straggler on less than its uniform share reads healthy per micro-batch whether or
        not its fault is over (a CPU quota lets a short burst run at nearly full speed), so
        only the detector's recovery verdict -- confirmed by the compute test, the same work
        on every rank -- reverts its plan (``verified_recovery``)."""
        if not self.verified_recovery or s.kind != "compute" or detector_recovered(s, findings):
            return False
        if self.counts[s.group] >= planner.uniform(self.micro, self.groups)[s.group]:
            return False
        s.healthy_windows = 0
        self.wants_recovery_test = True
        return True

    def _on_healthy_window(self, s: Straggler, start_step: int) -> Decision | None:
        s.healthy_windows += 1
        if s.healthy_windows < self._need:
            return None
        self.active = None
        self._watch, self._watch_slow = s, 0
        self._watch_until = len(self._unit_hist) + WATCH
        if self.uniform:
            return None
        return self._decide(REVERT, planner.uniform(self.micro, self.groups), start_step, -1,
                            0.0, f"straggler recovered: rank {s.rank}'s time per micro-batch "
                            "back to its peers'")

    def _escalate(self, s: Straggler, step_s: float, start_step: int) -> Decision | None:
        """S2 (a plan that takes work off the straggler, once the rent covers a wrong plan's
        price), or a better plan for a straggler whose severity changed; else S4."""
        cur = self.unit_times()
        best = planner.plan(cur, self.micro, self.min_count)
        gain = 1.0 - planner.makespan(best, cur) / planner.makespan(self.counts, cur)
        needed = self.min_gain if self.uniform else self.replan_gain  # no flapping
        # a plan is about the straggler: one that does not take work off it is noise elsewhere
        about_it = best[s.group] < planner.uniform(self.micro, self.groups)[s.group] \
            and (self.uniform or not s.no_replan)
        if s.kind == "compute" and about_it and gain >= needed \
                and s.rent_s >= self.s2_price(cur):
            s.level = self.ratio_to_peers(cur, s.group)
            who = f"ranks {list(s.ranks)} (one host)" if s.ranks else f"rank {s.rank}"
            return self._decide(REBALANCE, best, start_step, s.group, gain,
                                f"{s.kind} straggler on {who}: "
                                f"{cur[s.group] / statistics.median(cur):.2f}x per micro-batch")
        if self.mode == "auto" and self.groups > 1 and (self.tp == 1 or s.ranks):
            return self._exclude(s, cur, best, gain, step_s, start_step)
        return None

    def leaving(self, s: Straggler) -> tuple[list[int], list[int]]:
        """(groups, ranks) S4 takes out: the straggler's data-parallel group, or for a host of
        several ranks every group with a rank on it -- whole groups, so at tp > 1 the ranks
        of those groups that sit on other hosts leave too."""
        groups = sorted({r // self.tp for r in s.ranks} or {s.group})
        return groups, [r for g in groups for r in range(g * self.tp, (g + 1) * self.tp)]

    def _exclude(self, s: Straggler, cur: list[float], best: list[int], gain: float,
                 step_s: float, start_step: int) -> Decision | None:
        """S4, restart without the host: only if N-1 hosts beat the best plan on N, and once
        the rent has paid for the restart."""
        groups, ranks = self.leaving(s)
        if len(groups) >= self.groups:
            return None  # nothing would be left
        without = [u for g, u in enumerate(cur) if g not in groups]
        mk_without = planner.makespan(planner.plan(without, self.micro, self.min_count),
                                      without)
        mk_best = planner.makespan(best, cur)
        if s.kind == "link":  # the host's link, not its compute, sets the step time
            mk_best = max(mk_best, step_s * (1 - gain))
            healthy = self.healthy_step_s or step_s
            mk_without = healthy * self.groups / (self.groups - len(groups))
        per_step = mk_best - mk_without
        if s.ranks and not s.remapped and s.rent_s >= self.restart_s:
            # a host of several ranks: S3 instead when a placement saves more (remap.py)
            s3 = self._remap_host(s, step_s, start_step, per_step / mk_best)
            if s3 is not None:
                return s3
        if per_step > self.min_gain * mk_best and s.rent_s >= self.restart_s:
            who = (f"the link of the host of ranks {list(s.ranks)}" if s.ranks else
                   f"{s.kind} straggler on rank {s.rank}")
            dec = self._decide(EXCLUDE, [], start_step, s.rank, per_step / mk_best,
                               f"{who}: the job is faster without its host ({s.rent_s:.1f} s "
                               f"lost so far, {self.moves_by} {self.restart_s:.1f} s)")
            if len(ranks) > 1:
                dec.hosts = ranks  # rank 0 only: every rank that leaves with the host
            return dec
        return None

    def _remap_host(self, s: Straggler, step_s: float, start_step: int,
                    s4_gain: float) -> Decision | None:
        """S3 for a slow host of several ranks: the placement with the least traffic across
        its link (``remap.host_placement``), priced as the slow link's share of the step
        times the traffic it takes off the link; chosen only over S4's ``s4_gain`` (both cost
        a restart, and S2 moves compute, which a link-bound step does not wait on)."""
        if self.mode != "auto" or self.traffic is None:
            return None
        hosts = self.hosts or list(range(self.groups * self.tp))
        slots = {hosts[r] for r in s.ranks if r < len(hosts)}
        new = remap.host_placement(self.traffic, hosts, slots)
        before = remap.traffic_off_host(self.traffic, hosts, slots)
        after = remap.traffic_off_host(self.traffic, new, slots)
        lost = 1.0 - (self.healthy_step_s or step_s) / step_s  # the slow link's share
        gain = lost * (1.0 - after / before) if before > 0 else 0.0
        if not before > after or gain <= max(s4_gain, self.min_gain):
            return None
        return self._remap_to(s, new, start_step, gain,
                              f"the link of the host of ranks {list(s.ranks)}: "
                              f"{before / 1e6:.2f} MB/step across it, {after / 1e6:.2f} after "
                              f"re-mapping (S4 would gain {s4_gain:.2f}; ")

    def _remap(self, s: Straggler, step_s: float, start_step: int) -> Decision | None:
        """S3: once the slow pair has cost a restart, restart on the placement that puts the
        least traffic on it (remap.py) -- if that is less than now."""
        if self.mode != "auto" or self.traffic is None or s.pair is None or s.remapped \
                or s.rent_s < self.restart_s:
            return None
        hosts = self.hosts or list(range(self.groups * self.tp))
        slow = (hosts[s.pair[0]], hosts[s.pair[1]])
        new = remap.placement(self.traffic, hosts, slow)
        before = remap.traffic_on(self.traffic, hosts, slow)
        after = remap.traffic_on(self.traffic, new, slow)
        if not before > after:
            return None
        lost = 1.0 - (self.healthy_step_s or step_s) / step_s  # the slow pair's share
        return self._remap_to(s, new, start_step, lost * (1.0 - after / before),
                              f"slow link between hosts {slow[0]} and {slow[1]} (ranks "
                              f"{s.pair[0]}-{s.pair[1]}): {before / 1e6:.2f} MB/step on it, "
                              f"{after / 1e6:.2f} after re-mapping (")

    def _remap_to(self, s: Straggler, hosts: list[int], start_step: int, gain: float,
                  why: str) -> Decision:
        """The S3 decision: restart on ``hosts``; `why` ends with its open parenthesis, the
        rent and the restart's price close it. Decided once per straggler: the restart ends
        this incarnation."""
        dec = self._decide(REMAP, [], start_step, -1, gain,
                           f"{why}{s.rent_s:.1f} s lost so far, {self.moves_by} "
                           f"{self.restart_s:.1f} s)")
        dec.hosts = hosts
        s.remapped = True
        return dec

    def s2_price(self, units: list[float]) -> float:
        """What a needless rebalance would cost (seconds): the plan for these times, run on
        healthy ranks until the revert, against the uniform plan's time."""
        healthy = [statistics.median(units)] * self.groups
        plan = planner.plan(units, self.micro, self.min_count)
        extra = planner.makespan(plan, healthy) - planner.makespan(
            planner.uniform(self.micro, self.groups), healthy)
        # steps a wrong plan stays: the healthy windows needed, plus the decision's latency
        steps = (self.revert_windows + 1) * self.every + 1
        return max(extra, 0.0) * steps

    def measured(self, strategy: str, version: int, gain: float) -> None:
        """The step-time gain measured after a switch (rebalance.py). A rebalance that made
        steps slower -- the verdict was wrong, or the plan was -- is undone at the next
        exchange: a re-plan goes back to the plan before it (and the straggler is not
        re-planned again); a first plan goes back to uniform and the rank's findings are
        ignored for a while (no action on a false positive twice in a row)."""
        if strategy == "rebalance" and version == self.version and gain < -self.min_gain \
                and not self.uniform:
            self._undo = (f"plan v{version} made steps slower (measured gain {gain:+.2f}): "
                          "undone")

    def _rewatch(self, units: list[float], findings: Sequence[Finding]) -> None:
        """Follow the last reverted straggler again if it is slow under the uniform plan for
        two exchanges in a row while the detector has not reported it recovered (its rent so
        far carries over; twice the healthy exchanges are needed before the next revert)."""
        w = self._watch
        if w is None:
            return
        if len(self._unit_hist) > self._watch_until or detector_recovered(w, findings):
            self._watch = None
            return
        slow = w.kind == "compute" and self.uniform and self._slow(units, w.group,
                                                                    recovery_ratio(w))
        self._watch_slow = self._watch_slow + 1 if slow else 0
        if self._watch_slow >= 2:
            self._resume(w)

    def _resume(self, w: Straggler) -> None:
        w.wrong_reverts += 1
        # twice what the last revert needed without the detector's verdict
        w.revert_need = min(2 * max(w.revert_need, 2 * self.revert_windows), 16)
        w.healthy_windows = 0
        w.since = max(len(self._unit_hist) - 2, 0)
        self.active, self._watch = w, None

    def _on_finding(self, f: Finding) -> None:
        if f.kind == "link" and not f.ranks and f.link is not None and len(f.link) == 2:
            pair = (f.link[0], f.link[1])  # one slow pair of ranks: S3
            if self.active is None or self.active.pair != pair:
                self.active = Straggler("pairlink", -1, -1, f.onset_step, f.step, pair=pair,
                                        since=len(self._unit_hist) - 1)
                self._healthy_before(f.onset_step)  # a pair is often found late, as a link
                self._healthy_from_peers(f)
            return
        if f.kind == "link" and len(f.ranks) > 1 and f.evidence.get("host") is not None:
            ranks = tuple(f.ranks)  # one host's link, the host holding several ranks
            if self.active is None or self.active.ranks != ranks:
                self.active = Straggler("link", ranks[0] // self.tp, ranks[0], f.onset_step,
                                        f.step, since=len(self._unit_hist) - 1, ranks=ranks)
                self._healthy_before(f.onset_step)
                self._healthy_from_peers(f)
            return
        if f.kind == "compute" and len(f.ranks) > 1 and f.evidence.get("group") is not None:
            self._on_group(f)
            return
        if f.kind not in ("compute", "link") or len(f.ranks) != 1:
            return  # unexplained slowdowns are not stragglers
        r = f.ranks[0]
        if self._muted.get(r, -1) >= len(self._unit_hist):
            return  # its last plan was undone: it made steps slower
        if self.active is not None and self.active.rank == r:
            return
        if self.active is None and self._watch is not None and self._watch.rank == r:
            self._resume(self._watch)  # the same episode: keep its rent and backoff
            return
        self.active = Straggler(f.kind, r // self.tp, r, f.onset_step, f.step,
                                since=len(self._unit_hist) - 1)
        self._healthy_before(self.active.onset_step)
        self._healthy_from_peers(f)

    def _on_group(self, f: Finding) -> None:
        """A host's ranks slowed alike (detect/localize.py ``slow_group``): one straggler
        whose ranks are all the host's. It is followed on its first rank's data-parallel
        group (its ranks are equally slow), S2's plan takes work off every slow group
        (``planner.plan`` balances all of them by their measured times), and S4 takes every
        group with a rank on the host out together (``leaving``)."""
        ranks = tuple(f.ranks)
        if self._muted.get(ranks[0], -1) >= len(self._unit_hist):
            return
        if self.active is not None and self.active.ranks == ranks:
            return
        self.active = Straggler("compute", ranks[0] // self.tp, ranks[0], f.onset_step,
                                f.step, since=len(self._unit_hist) - 1, ranks=ranks)
        self._healthy_before(f.onset_step)
        self._healthy_from_peers(f)

    def _healthy_from_peers(self, f: Finding) -> None:
        """A straggler that was never healthy (found by the detector's outlier test or audit:
        ``never_healthy``) has no healthy step time to measure: every step so far was slow.
        Its finding's severity is priced from its peers (the job's step time over the step
        time without it), so the healthy level is the recent step time over that."""
        if f.evidence.get("never_healthy") and f.severity > 1.0 and self._step_hist:
            self.healthy_step_s = statistics.median(self._step_hist[-8:]) / f.severity

    def _healthy_before(self, onset: int) -> None:
        """The healthy step time from the exchanges that ended before the straggler's onset.
        The level follows the latest exchanges while no straggler is active, so a verdict that
        comes many steps after its onset (a slow host link can be found late) would otherwise
        find the slow steps in it, read the straggler's steps as healthy and never pay the
        rent that buys the restart."""
        before = [t for st, t in zip(self._exch_steps, self._step_hist, strict=True)
                  if st < onset]
        if before:
            self.healthy_step_s = statistics.median(before[-8:])

    def _decide(self, kind: int, counts: list[int], start: int, target: int, gain: float,
                reason: str) -> Decision:
        self.version += 1
        if counts:
            self._prev_counts = list(self.counts)
            self.counts = list(counts)
        return Decision(kind, self.version, start, list(counts), target, gain, reason)
