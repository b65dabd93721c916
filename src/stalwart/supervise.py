"""Supervise a job's running ranks until they all finish, one fails, or they leave to restart.

Mechanism: one poll loop (``Supervisor.run``), every POLL_S seconds, one method per concern.
It reads what metrics.jsonl (for a script: the monitor's iterations, iterations.jsonl) and
events.jsonl gained, for the progress display and for the testbed's fault schedule, which
follows training progress and the clock (seconds since launch.py first started the ranks);
then each rank's exit status, whose meaning rankexits.py gives.

What it guarantees:
- if one rank dies, the others are stopped and the job returns non-zero, naming the rank
  to blame (rankexits.py ``culprit``) and the last line of its error: 2 when that rank hit
  bad input, else 1; nothing hangs. Except in a job that regroups in place (``--mitigate
  auto``, stalwart's own worker: mitigate/membership.py ``failstop_ok``): there it logs
  ``rank_lost``, announces a new membership generation without the rank (with tensor
  parallelism, without its whole TP group), and the survivors carry on
  (mitigate/regroup.py); and with ``keep_going`` (ranks that handle a
  lost peer themselves, e.g. a peer framework's replica groups in ``stalwart bench``): it
  only logs ``rank_lost`` and supervises the rest, and the job succeeds when every rank
  still running exits 0; the same for a ``--script`` rank that had joined an elastic job
  (stalwart.elastic: its peers regroup without it, elastic/launcher.py);
- a host an in-place regroup left out (S4), or the host of a rank lost in place (data
  parallel only: a TP group would need all its ranks back at once), is probed
  for the way back (mitigate/probe.py); once healthy and worth it, its rank is started
  again (``--rejoin``) and joins live (at most REJOIN_TRIES starts);
- a rank that hangs or is cut off (no heartbeat: heartbeat.py, within ``SILENT_S`` = 3 s
  once it is set up, ``START_SILENT_S`` before) is SIGKILLed and logged
  ``rank_unresponsive``: from there it is a dead rank as above, and a failed job's error
  names the silence;
- a rank of a job that regroups in place that exits 0 before the end says why in its exit
  record (elastic/runlink.py ``ExitRecord``), read once when the exit is seen: ``left`` (S4:
  its host is probed), ``fallback`` (a failed in-place regroup: checkpoint and relaunch,
  mitigate/fallback.py) or ``restart`` (every rank: the next incarnation on rank 0's host
  map); either relaunch is returned as a ``Relaunch`` (launch.py starts it); 0 when every
  rank exited 0 without a record (finished);
- the membership store process of such a job dying stops the job (1, ``store_lost``).

Cost: a poll reads only what the two files gained and each rank's exit status, then sleeps
POLL_S; a rank's death is seen within POLL_S (plus rankexits.py's settle time while only
peers that aborted have exited); one store round trip per rank that exits 0, and one per
poll while a rank started to rejoin is not ready yet.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.config import RunConfig
from stalwart.elastic.launcher import registered
from stalwart.elastic.runlink import FALLBACK, LEFT, RESTART
from stalwart.events import (
    HostProbed,
    RankFailed,
    RankReady,
    RankRejoining,
    RankRestarted,
    RankUnresponsive,
    Regroup,
    RegroupFailed,
    RejoinFailed,
    RunStarted,
    StoreLost,
    describe,
)
from stalwart.mitigate.membership import failstop_ok
from stalwart.progress import Progress
from stalwart.rankexits import (
    culprit,
    describe_exit,
    drop_lost,
    failures,
    last_error_line,
    lose_ranks,
    rank_log,
    ranks_left,
    stop_all,
)
from stalwart.rundir import EVENTS, METRICS, EventLog, JsonlTail, read_jsonl
from stalwart.script import ITERATIONS, first_errors

POLL_S = 0.1

# starts a rank again inside its host: (rank, extra environment) -> its process (launch.py)
StartRank = Callable[[int, dict[str, str]], subprocess.Popen]


# the least a live rejoin is priced at (seconds): its regroup moves the model and optimizer
# state to the joining rank and rebuilds the monitor (measured ~0.3-3 s on the testbed)
REJOIN_PRICE_S = 2.0
REJOIN_TRIES = 2  # starts of a host's rank to rejoin before the job stops trying


@dataclass
class _Rejoin:
    """A launch rank started again to take its excluded host back live (membership.py)."""

    slot: int
    host: int
    reason: str
    t0: float
    tries: int = 1  # this host's starts so far
    asked: bool = False


def _rejoin(start_rank: StartRank, tb: Any, members: Any, probe: Any,
            procs: dict[int, subprocess.Popen], reason: str, events: EventLog,
            say: Callable[[str], None], step: int) -> _Rejoin | None:
    """Start the excluded host's launch rank again (``--rejoin``), to join in place once rank
    0 agrees (it asks only when the rank's ``ready`` record is there: its start-up is off
    the job's critical path)."""
    g = members.newest()
    if probe.host not in g.home or probe.host in g.hosts:
        return None
    slot = g.home.index(probe.host)
    if slot in procs:
        return None
    probe.tries += 1
    if probe.tries > REJOIN_TRIES:
        return None
    members.link.clear_ready(slot)  # an earlier try's: this start says it anew
    members.link.clear_exit(slot)  # its earlier process's (it left): not this one's
    p = start_rank(slot, {})
    procs[slot] = p
    tb.attach_ranks({slot: p.pid})
    events.emit(RankRejoining(step=step, rank=slot, host=probe.host, reason=reason))
    say(f"stalwart: host {probe.host} is healthy again; its rank {slot} starts to rejoin live")
    return _Rejoin(slot, probe.host, reason, time.monotonic(), probe.tries)


@dataclass(frozen=True)
class Relaunch:
    """The ranks left for a restart: launch.py starts the next incarnation on ``hosts`` from
    the checkpoint at ``step`` (a failed in-place regroup's fallback, or an S3/S4 decision
    that takes a restart: rank 0's exit record); the rest is the ``restart`` event's."""

    hosts: tuple[int, ...]
    step: int
    strategy: str
    reason: str
    predicted_gain: float | None = None
    step_time_before: float | None = None


def _fall_back(cfg: RunConfig, run_dir: Path, procs: dict[int, subprocess.Popen], members: Any,
               events: EventLog, say: Callable[[str], None], step: int) -> Relaunch | int:
    """A rank's in-place regroup failed (it saved its state and exited 0 with a ``fallback``
    exit record): ask every rank to do the same, then relaunch from the most advanced state
    on the membership being built (mitigate/fallback.py): a ``Relaunch``; 1 when there is
    no usable state or no fallback left."""
    from stalwart.mitigate import fallback

    g = members.fall_back(step)
    say("stalwart: an in-place regroup failed; every rank saves its state for a relaunch")
    deadline = time.monotonic() + fallback.WAIT_S
    while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    crashed = {r for r, p in procs.items() if p.poll() not in (None, 0)}
    stop_all(procs)  # the ranks that did not save in time
    records = [members.link.exit_of(r) for r, p in procs.items() if p.poll() == 0]
    states = [x.saved for x in records if x is not None and x.why == FALLBACK and x.saved]
    hosts = [h for s, h in zip(g.alive, g.hosts, strict=True) if s not in crashed]
    since = [e for e in read_jsonl(run_dir / EVENTS) if e.get("event") in (
        RunStarted.name, RegroupFailed.name)]
    starts = [i for i, e in enumerate(since) if e["event"] == RunStarted.name]
    done = sum(1 for e in since[(starts[-1] if starts else 0):]
               if e.get("fallback") == "restart")
    got = fallback.plan(run_dir, g.token, cfg.train.tp, states) \
        if done < fallback.MAX_FALLBACKS and hosts and len(hosts) % cfg.train.tp == 0 else None
    if got is None:
        reason, failed = fallback.first_reason(states)
        events.emit(RegroupFailed(step, g.gen - 1, reason, "none", hosts, failed))
        say(f"stalwart: in-place regroup failed ({reason}) and no relaunch is possible "
            f"({'no usable saved state' if done < fallback.MAX_FALLBACKS else 'too many'})")
        return 1
    events.emit(RegroupFailed(step, g.gen - 1, got["reason"], "restart", hosts, got["failed"],
                              got["step"]))
    return Relaunch(tuple(hosts), got["step"], "fallback",
                    f"in-place regroup failed: {got['reason']}")


def _start_probe(cfg: RunConfig, tb: Any, members: Any) -> Any:
    """While a host is excluded (a relaunch without it), probe it for the way back
    (mitigate/probe.py): in a job that regroups in place (``members``), whose rank 0 takes a
    request to take it back."""
    if cfg.policy.mode != "auto" or not cfg.job.hosts or members is None:
        return None
    missing = [h for h in range(max(cfg.job.hosts) + 1) if h not in cfg.job.hosts]
    if not missing:
        return None
    from stalwart.mitigate.probe import HostProbe

    return HostProbe(tb, missing[0], list(cfg.job.hosts), members.link)


def supervise(cfg: RunConfig, run_dir: Path, procs: dict[int, subprocess.Popen], tb: Any,
              progress: Progress, events: EventLog, say: Callable[[str], None],
              start_rank: StartRank, first_step: int = 0, restart_t0: float | None = None,
              clock0: float | None = None, members: Any = None,
              keep_going: bool = False, store: Any = None) -> Relaunch | int:
    """Supervise the started ranks ``procs`` until the job's outcome is known: 0, 1, 2 (a
    rank hit bad input) or a ``Relaunch`` (launch.py starts the next incarnation)."""
    tb.on_step(first_step)
    sv = Supervisor(cfg, run_dir, procs, tb, progress, events, say, start_rank, first_step,
                    restart_t0, time.monotonic() if clock0 is None else clock0, members,
                    keep_going, store)
    try:
        return sv.run()
    finally:
        sv.close()


class Supervisor:
    """The poll loop over one incarnation's ranks, and what it keeps between polls."""

    def __init__(self, cfg: RunConfig, run_dir: Path, procs: dict[int, subprocess.Popen],
                 tb: Any, progress: Progress, events: EventLog, say: Callable[[str], None],
                 start_rank: StartRank, first_step: int, restart_t0: float | None,
                 clock0: float, members: Any, keep_going: bool, store: Any = None) -> None:
        self.cfg, self.run_dir, self.procs, self.tb = cfg, run_dir, procs, tb
        self.progress, self.events, self.say = progress, events, say
        self.start_rank, self.members, self.keep_going = start_rank, members, keep_going
        self.store = store  # the membership store process (elastic/launcher.py) or None
        # launch rank -> its exit record (None: it finished), read once when it exits 0
        self.exits: dict[int, Any] = {}
        self.first_step, self.restart_t0, self.clock0 = first_step, restart_t0, clock0
        self.probe = _start_probe(cfg, tb, members)  # the host probed for the way back
        self.probes = [self.probe] if self.probe is not None else []  # closed at the end
        # a script's progress is the monitor's iteration lines (same keys as stalwart's metrics)
        self.metrics_tail = JsonlTail(run_dir / (ITERATIONS if cfg.job.script else METRICS))
        self.events_tail = JsonlTail(run_dir / EVENTS)
        self.next_step = first_step
        self.restart_s: float | None = None  # a restart's exit to its first step back
        self.recent: list[float] = []  # rank 0's last step times
        self.declined_logged = False
        self.watch_t0 = time.monotonic()
        self.startup_s: float | None = None  # spawn to the first step: what a restart would cost
        self.rejoin: _Rejoin | None = None
        self.regroup_s: float | None = None  # the last in-place regroup's seconds: a rejoin's price
        self.back: list[int] = []  # ranks a kill fault's back= starts again, once dropped
        self.liveness = tb.liveness  # heartbeat.Listener (None: not started)
        # the processes the listener judges (weak: a dropped rank's Popen may go)
        self.expected: weakref.WeakSet[subprocess.Popen] = weakref.WeakSet()
        self.silenced: dict[int, float] = {}  # rank -> seconds silent when it was killed

    def run(self) -> Relaunch | int:
        while True:
            self.tb.on_time(time.monotonic() - self.clock0)
            self._judge_liveness()
            if self.members is not None and self.store is not None and self.store.died():
                return self._store_lost(self.store.died())
            self._read_metrics()
            if self._exited_for(FALLBACK):
                return _fall_back(self.cfg, self.run_dir, self.procs, self.members, self.events,
                                  self.say, self.next_step)
            left = self._exited_for(LEFT)
            if left:
                self._take_leavers(left)
            self._take_back()  # a probed host is healthy again: its rank rejoins, or a restart
            self._ask_for_rejoin()  # the rank started to rejoin is ready
            self._log_declined()
            self._read_events()
            self.progress.refresh()
            failed = self._rejoin_failed(failures(self.procs))
            if failed and (self._lose_in_place(failed) or self._go_on_without(failed)):
                continue  # the survivors regroup in place, or go on by themselves
            self._start_again()  # a kill fault's back=: its rank starts again
            if (self.keep_going or self.cfg.job.script) and not self.procs:
                return 1  # every rank died
            code = self._blame()
            if code is not None:
                return code
            if all(p.poll() == 0 for p in self.procs.values()):
                again = self._relaunch()
                if again is not None:
                    return again
                self._finish()
                return 0
            time.sleep(POLL_S)

    def close(self) -> None:
        for p in self.probes:
            p.close()

    def _exit_record(self, r: int) -> Any:
        """Launch rank ``r``'s exit record (it exited 0; None: it finished the job). Read
        once: one store round trip per rank that exits 0."""
        if r not in self.exits:
            self.exits[r] = self.members.link.exit_of(r) if self.members is not None else None
        return self.exits[r]

    def _exited_for(self, why: str) -> list[int]:
        """The ranks that exited 0 early for ``why`` (elastic/runlink.py ``ExitRecord``)."""
        return [r for r, p in self.procs.items() if p.poll() == 0
                and getattr(self._exit_record(r), "why", None) == why]

    def _relaunch(self) -> Relaunch | None:
        """Every rank exited 0 for a restart (their ``restart`` exit records): the next
        incarnation, on the host map rank 0's record carries; None when they finished."""
        recs = [self._exit_record(r) for r in self.procs]
        if not recs or not all(x is not None and x.why == RESTART for x in recs):
            return None
        lead = next((x for x in recs if x.hosts), None)
        if lead is None:
            raise RuntimeError("the ranks left for a restart and none said on which hosts")
        return Relaunch(lead.hosts, lead.step, lead.strategy, lead.reason, lead.predicted_gain,
                        lead.step_time_before)

    def _judge_liveness(self) -> None:
        """SIGKILL each live rank that is silent past its bound (heartbeat.py ``overdue``):
        the next poll sees it dead, as any other death."""
        if self.liveness is None:
            return
        live = {p.pid: r for r, p in self.procs.items() if p.poll() is None}
        for p in (self.procs[r] for r in live.values()):
            if p not in self.expected:  # a process, not a pid: a reused pid starts afresh
                self.liveness.expect(p.pid)
                self.expected.add(p)
        for s in self.liveness.overdue(list(live)):
            r = live[s.pid]
            self.liveness.forget(s.pid)
            self.silenced[r] = s.silent_s
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(s.pid, signal.SIGKILL)  # the rank leads its session (launch.py)
            ev = RankUnresponsive(self.next_step, r, round(s.silent_s, 3), s.bound_s, s.heard)
            self.events.emit(ev)
            self.say(f"stalwart: {describe({'event': ev.name, **ev.fields()})}")

    def _read_metrics(self) -> None:
        """Progress, the testbed's view and fault schedule, rank 0's step times."""
        for m in self.metrics_tail.poll():
            self.progress.on_metric(m)
            self.tb.observe(m)
            if m["step"] >= self.first_step and m.get("rank") == 0:
                self._timed(float(m["step_time"]))
            if m["step"] + 1 > self.next_step:
                self.next_step = m["step"] + 1
                self.tb.on_step(self.next_step)

    def _timed(self, step_time: float) -> None:
        self.recent = (self.recent + [step_time])[-20:]
        if self.startup_s is None:
            self.startup_s = time.monotonic() - self.watch_t0
        if self.restart_s is None and self.restart_t0 is not None:
            self.restart_s = time.monotonic() - self.restart_t0  # exit to first step back

    def _step_time(self) -> float:
        return sorted(self.recent)[len(self.recent) // 2]

    def _take_leavers(self, left: list[int]) -> None:
        """Ranks an in-place regroup left out (S4) exited: the first host's probe starts."""
        got = ranks_left(left, self.procs, self.members, self.tb, self.events, self.say,
                         self.next_step, probe_hosts=self.cfg.train.tp == 1 and self.probe is None)
        if got is not None:
            self.probes.append(got)
            if self.probe is None:
                self.probe = got
                self.restart_s = self.restart_s or self.startup_s  # taking it back is a restart
        if self.rejoin is not None and self.rejoin.slot not in self.procs:
            self.rejoin = None  # the rank started to rejoin was not taken back, and left

    def _take_back(self) -> None:
        """The probed host is healthy again and taking it back pays: its rank starts again and
        joins live (price: a regroup). Probes run only in jobs that regroup in place."""
        probe = self.probe
        if probe is None or not self.recent or self.members is None:
            return
        if self.rejoin is None:
            self._start_rejoin(probe)

    def _start_rejoin(self, probe: Any) -> None:
        why = probe.restore_reason(self.cfg.train.steps - self.next_step, self._step_time(),
                                   len(self.procs), max(self.regroup_s or 0.0, REJOIN_PRICE_S),
                                   how="live rejoin")
        if why is None:
            return
        self.rejoin = _rejoin(self.start_rank, self.tb, self.members, probe, self.procs, why,
                              self.events, self.say, self.next_step)
        if self.rejoin is not None:
            self.exits.pop(self.rejoin.slot, None)  # its earlier process's (it left)
        if self.rejoin is None and probe.tries > REJOIN_TRIES:
            probe.stop()  # its rank failed to rejoin each time: the host stays out
            self.probe = None

    def _start_again(self) -> None:
        """A ``--script`` rank killed by a fault with ``back=`` (faultspec.py), once the
        launcher has dropped it (``_go_on_without``), is started again as it was first
        started, as a node restarted after a crash: a script that uses stalwart.elastic
        joins the job live (elastic/job.py); ``rank_restarted`` is logged."""
        self.back += self.tb.restarts_due()
        for r in [r for r in self.back if r not in self.procs]:
            self.back.remove(r)
            p = self.start_rank(r, {})
            self.procs[r] = p
            self.tb.attach_ranks({r: p.pid})
            self.events.emit(RankRestarted(step=self.next_step, rank=r,
                                           reason="kill fault's back="))
            self.say(f"stalwart: rank {r} started again (its kill fault's back=)")

    def _ask_for_rejoin(self) -> None:
        """The rank started to rejoin is ready: rank 0 is asked to take it in."""
        rj, probe = self.rejoin, self.probe
        if rj is None or rj.asked or probe is None or self.members.link.ready(rj.slot) is None:
            return
        rj.asked = True
        probe.request(rj.reason, len(self.procs) - 1, live=True)
        probe.stop()  # the host is no longer probed: its rank is about to use it
        self.events.emit(RankReady(step=self.next_step, rank=rj.slot, host=rj.host,
                                   start_s=round(time.monotonic() - rj.t0, 3)))
        self.probe = None

    def _log_declined(self) -> None:
        if self.probe is not None and self.probe.declined and not self.declined_logged:
            self.declined_logged = True
            self.events.emit(HostProbed(step=self.next_step, host=self.probe.host,
                                       restore=False, reason=self.probe.declined))

    def _read_events(self) -> None:
        for e in self.events_tail.poll():
            self.progress.on_event(e)
            if e.get("event") == Regroup.name:
                self.regroup_s = float(e.get("regroup_s") or 1.0)
                if hasattr(self.tb, "regrouped"):
                    self.tb.regrouped(list(e.get("hosts") or []))  # traffic per membership
                if self.rejoin is not None and self.rejoin.slot in (e.get("joined") or []):
                    self.rejoin = None  # back in the job

    def _rejoin_failed(self, failed: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """A rank started to rejoin failed before it was back: the job goes on without it
        (once asked for, the others may be waiting for it in the regroup: a generation without
        it wakes them); its host is probed again for the next try. The other failures."""
        rj = self.rejoin
        if rj is None or not any(r == rj.slot for r, _ in failed):
            return failed
        if rj.asked and self.members is not None:
            self.members.lose([rj.slot], self.next_step)
        code = self.procs.pop(rj.slot).returncode
        self.events.emit(RejoinFailed(
            step=self.next_step, rank=rj.slot, host=rj.host, exit_code=code,
            error=last_error_line(rank_log(self.run_dir, rj.slot))))
        self.say(f"stalwart: rank {rj.slot} could not rejoin ({describe_exit(code)}); "
                 f"the job goes on without host {rj.host}")
        if self.probe is None and rj.tries < REJOIN_TRIES and hasattr(self.tb, "hosts") \
                and self.members is not None:
            self.probe = self._new_probe(rj.host)
            self.probe.tries = rj.tries  # probed again for the next try
        self.rejoin = None
        return [(r, c) for r, c in failed if r != rj.slot]

    def _lose_in_place(self, failed: list[tuple[int, int]]) -> bool:
        """Fail-stop in a job that regroups in place (``lose_ranks``); the dead rank's host is
        probed like a host left out: healthy (a process crash, not a bad host), its rank is
        started again and rejoins live."""
        if self.members is None or not failstop_ok(self.cfg) or not lose_ranks(
                failed, self.procs, self.members, self.run_dir, self.events, self.say,
                self.next_step, self.cfg.train.tp):
            return False
        if self.probe is None and hasattr(self.tb, "hosts") and self.cfg.train.tp == 1:
            self.probe = self._new_probe(self.tb.host(failed[0][0]))
        return True

    def _go_on_without(self, failed: list[tuple[int, int]]) -> bool:
        """``keep_going``, or every failed rank is a member of a script's elastic job
        (elastic/launcher.py ``registered``: its peers regroup by themselves)."""
        if not self.keep_going and not (self.cfg.job.script and all(
                r in registered(self.run_dir) for r, _ in failed)):
            return False
        return drop_lost(failed, self.procs, self.run_dir, self.events, self.say,
                         self.next_step)

    def _new_probe(self, host: int) -> Any:
        from stalwart.mitigate.probe import HostProbe

        probe = HostProbe(self.tb, host, list(self.members.current.hosts), self.members.link)
        self.probes.append(probe)
        return probe

    def _store_lost(self, why: str) -> int:
        """The membership store process of a job that regroups in place died: no membership
        change can be announced any more, so the job stops (1), saying so."""
        stop_all(self.procs)
        self.progress.close()
        self.events.emit(StoreLost(step=self.next_step, error=why))
        self.say(f"stalwart: {why}; the job stops (resume it from its last checkpoint)")
        return 1

    def _blame(self) -> int | None:
        """A failed job: stop every rank and name the likely cause, not the first rank seen
        dead (``culprit``); 2 when it hit a bad-input error (e.g. corrupt checkpoint), else 1."""
        script = self.cfg.job.script
        blamed = culprit(self.procs, lambda: first_errors(self.run_dir) if script else {})
        if blamed is None:
            return None
        r, code = blamed
        raised = first_errors(self.run_dir) if script else {}
        stop_all(self.procs)
        self.progress.close()
        log = rank_log(self.run_dir, r)
        why = raised.get(r, {}).get("error") or last_error_line(log)
        if r in self.silenced:
            why = (f"no heartbeat for {self.silenced[r]:.1f} s (hung or cut off), killed by "
                   f"the launcher; its last output: {why or 'none'}")
        self.events.emit(RankFailed(rank=r, exit_code=code, error=why, step=self.next_step))
        self.say(f"stalwart: rank {r} failed ({describe_exit(code)}): {why or 'no output'} "
                 f"[log: {log}]")
        return 2 if code == 2 else 1

    def _finish(self) -> None:
        for m in self.metrics_tail.poll():
            self.progress.on_metric(m)
        for e in self.events_tail.poll():
            self.progress.on_event(e)
        self.progress.finish()

