"""Start N ranks on this machine (or inside testbed hosts), supervise them, stop them cleanly.

What it guarantees:
- every rank gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
  GROUP_RANK, ROLE_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID, ...), as torchrun
  would set it for this layout -- on ``netns`` every rank is alone on its emulated host
  (LOCAL_RANK 0, GROUP_RANK = the host), locally all ranks share one node -- plus
  STALWART_HOST_ADDR, the address its sockets should bind; so the same entry point also runs
  under torchrun for multi-node jobs, and a user's torchrun script (``--script``, script.py)
  runs here unchanged;
- if one rank dies, the others are stopped (SIGTERM, then SIGKILL after a grace period) and
  the launcher returns non-zero naming the rank and the last line of its error; nothing hangs.
  Except in a data-parallel job that regroups in place (``--mitigate auto``, reliable comm:
  mitigate/membership.py ``failstop_ok``): there the launcher logs ``rank_lost``, announces
  a new membership generation without the rank, and the survivors carry on
  (mitigate/regroup.py); and with ``launch(..., keep_going=True)`` (ranks that handle a
  lost peer themselves, e.g. a peer framework's replica groups in ``stalwart bench``): the
  launcher only logs ``rank_lost`` and supervises the rest, and the job succeeds when every
  rank still running exits 0;
- Ctrl-C stops every rank; if the launcher itself is killed -9, the kernel kills the ranks
  (PR_SET_PDEATHSIG) and the testbed's next start removes what it left behind;
- the testbed's fault schedule follows training progress, read from metrics.jsonl (for a
  script: the monitor's iterations, iterations.jsonl), and the clock: seconds since the ranks
  were first started.

Each rank's stdout/stderr go to logs/rank-R.log; the terminal shows one progress display.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.config import ConfigError, RunConfig, check_writable
from stalwart.mitigate import LEFT_EXIT, RESTART_EXIT
from stalwart.mitigate.fallback import FALLBACK_EXIT
from stalwart.mitigate.membership import failstop_ok
from stalwart.progress import Progress
from stalwart.rundir import CONFIG, EVENTS, LOGS, METRICS, EventLog, JsonlTail
from stalwart.script import ITERATIONS, ScriptProgress, first_errors

GRACE_S = 3.0
# When only aborted ranks (SIGABRT: how gloo peers of a dead rank end) have failed so far, how
# long to wait for the rank that caused it: it may still be unwinding its own error
ABORT_SETTLE_S = 3.0
POLL_S = 0.1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_name() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S")


def prepare_run_dir(cfg: RunConfig) -> Path:
    """Validate, create runs/<name>/ and write config.json; ConfigError on bad input."""
    cfg.validate()
    if cfg.name is None:
        if cfg.resume:
            raise ConfigError("--resume needs --name NAME of the run to continue")
        cfg.name = default_name()
    check_writable(Path(cfg.out))
    run_dir = cfg.run_dir
    # fixed for the whole run: a restart at another world size keeps the same training
    cfg.global_batch = cfg.resolved_global_batch()
    cfg.micro_batch_size = cfg.resolved_micro_batch_size()
    if cfg.resume:
        if not run_dir.is_dir():
            raise ConfigError(f"no run to resume at {run_dir}")
        from stalwart.train.checkpoint import validate_resume

        validate_resume(cfg)
    elif (run_dir / METRICS).exists() or (run_dir / EVENTS).exists():
        raise ConfigError(f"run directory already holds a run: {run_dir} "
                          "(pass --resume to continue it, or another --name)")
    check_writable(run_dir)
    (run_dir / LOGS).mkdir(exist_ok=True)
    cfg.save(run_dir / CONFIG)
    return run_dir


def _last_error_line(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def _describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def _blame_order(failure: tuple[int, int],
                 raised_at: float | None = None) -> tuple[bool, bool, float, int]:
    """Sort key over (rank, exit code): a rank killed by an outside signal first, then one that
    exited with an error -- the one whose script raised first when that is known (a script
    run's ranks record it) -- and last a SIGABRT, which is how peers of a dead rank usually
    end."""
    rank, code = failure
    return (code == -signal.SIGABRT, code > 0,
            raised_at if raised_at is not None else float("inf"), rank)


def culprit(procs: dict[int, subprocess.Popen], raised: Callable[[], dict[int, dict]],
            settle_s: float = ABORT_SETTLE_S) -> tuple[int, int] | None:
    """(rank, exit code) of the rank to blame for a failed job, or None while none failed.

    The peers of a rank that dies abort within milliseconds (gloo: "connection closed by
    peer"), often before the dead rank itself has exited: while every failure seen is such an
    abort, wait up to ``settle_s`` for another failure; a rank whose script recorded a raise
    (``raised()``: script runs) counts as failed even while it is still exiting."""
    def seen() -> list[tuple[int, int]]:
        return [(r, p.returncode) for r, p in procs.items()
                if p.poll() not in (None, 0, RESTART_EXIT, LEFT_EXIT, FALLBACK_EXIT)]

    failed = seen()
    if not failed:
        return None
    deadline = time.monotonic() + settle_s
    errs = raised()
    while all(code == -signal.SIGABRT for _, code in failed) and time.monotonic() < deadline:
        if any(r not in dict(failed) for r in errs):
            break
        time.sleep(0.05)
        failed, errs = seen(), raised()
    codes = dict(failed)
    for r in errs:  # raised, maybe still exiting: an error exit, by its own account
        codes.setdefault(r, procs[r].poll() or 1)
    return min(codes.items(), key=lambda f: _blame_order(f, errs.get(f[0], {}).get("time")))


def _stop_all(procs: dict[int, subprocess.Popen]) -> None:
    live = [p for p in procs.values() if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in live:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()


def launch(cfg: RunConfig, module: str = "stalwart.train.worker", args: list[str] | None = None,
           show_progress: bool = True, on_line: Callable[[str], None] | None = None,
           keep_going: bool = False) -> int:
    """Run one job; returns 0 on success, 1 when a rank failed, 2 on bad input, 130 on Ctrl-C.

    ConfigError is raised (not returned) for bad input found before any rank starts.
    """
    from stalwart.devices import DeviceError, check_request
    from stalwart.testbed import open_testbed

    cfg.validate()  # every value first (one pass), then what this machine can run
    try:
        check_request(cfg.device, cfg.nproc)
    except DeviceError as e:
        raise ConfigError(str(e)) from None
    run_dir = prepare_run_dir(cfg)
    events = EventLog(run_dir)
    say = on_line or (lambda s: print(s, flush=True))
    if cfg.script is not None:
        # a user's script as the ranks: its bootstrap reads the script from config.json
        module, args = "stalwart.scriptboot", None
        progress: Any = ScriptProgress(cfg, run_dir, enabled=show_progress)
    else:
        progress = Progress(cfg, run_dir, enabled=show_progress)
    procs: dict[int, subprocess.Popen] = {}
    rc = 1
    events.log("run_started", nproc=cfg.nproc, testbed=cfg.testbed, launcher="stalwart",
               resume=cfg.resume, **({"script": cfg.script} if cfg.script else {}))
    try:
        with open_testbed(cfg, events) as tb:
            incarnation, first_step, restart_t0 = 0, 0, None
            all_hosts = list(range(cfg.nproc))
            clock0 = time.monotonic()  # fault windows in seconds count from here
            tb.on_time(0.0)
            while True:
                port = 29500 + incarnation if cfg.testbed == "netns" else free_port()
                members = _announcer(cfg, run_dir, module)
                procs = _spawn(cfg, tb, run_dir, module, args, port, incarnation)
                rc = _supervise(cfg, run_dir, procs, tb, progress, events, say, first_step,
                                restart_t0, clock0, members, keep_going)
                if rc != RESTART_EXIT:
                    break
                # S4 (mitigate/): the ranks checkpointed and left; go on with other hosts
                restart_t0 = time.monotonic()
                cfg, first_step = _restart_config(cfg, run_dir, events, say)
                if cfg.hosts == all_hosts:
                    cfg.hosts = None
                tb.set_hosts(cfg.hosts)  # faults stay on their hosts; ranks move
                incarnation += 1
    except KeyboardInterrupt:
        _stop_all(procs)
        progress.close()
        say("stalwart: interrupted; all ranks stopped")
        events.log("run_finished", ok=False, reason="interrupted")
        rc = 130
    finally:
        _stop_all(procs)
        progress.close()
    if rc != 130:
        events.log("run_finished", ok=rc == 0, exit_code=rc)
    if module in ("stalwart.train.worker", "stalwart.scriptboot"):
        try:
            from stalwart.report import build_report

            html = build_report(run_dir)
            if rc == 0:
                say(f"report: {html}")
        except Exception as e:  # a report problem must not hide the run's own outcome
            say(f"stalwart: report not built: {e}")
    events.close()
    return rc


def torchrun_env(rank: int, nproc: int, one_host_per_rank: bool, master_addr: str,
                 port: int, run_id: str, restarts: int = 0) -> dict[str, str]:
    """The variables torchrun gives rank `rank` of `nproc`: with one host per rank (netns),
    as ``torchrun --nnodes N --nproc-per-node 1``; otherwise as ``--nproc-per-node N``."""
    return {
        "RANK": str(rank), "WORLD_SIZE": str(nproc),
        "LOCAL_RANK": "0" if one_host_per_rank else str(rank),
        "LOCAL_WORLD_SIZE": "1" if one_host_per_rank else str(nproc),
        "GROUP_RANK": str(rank) if one_host_per_rank else "0",
        "GROUP_WORLD_SIZE": str(nproc) if one_host_per_rank else "1",
        "ROLE_NAME": "default", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": str(restarts),
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }


def _spawn(cfg: RunConfig, tb: Any, run_dir: Path, module: str, args: list[str] | None,
           port: int, incarnation: int = 0) -> dict[int, subprocess.Popen]:
    """One process per rank, inside its host (the testbed's prefix), with torchrun's env."""
    procs = {r: _start_rank(cfg, tb, run_dir, module, args, port, incarnation, r)
             for r in range(cfg.nproc)}
    tb.attach_ranks({r: p.pid for r, p in procs.items()})
    return procs


def _start_rank(cfg: RunConfig, tb: Any, run_dir: Path, module: str, args: list[str] | None,
                port: int, incarnation: int, r: int,
                extra: dict[str, str] | None = None) -> subprocess.Popen:
    """Launch rank ``r``'s process inside its host, with torchrun's variables (``extra``:
    more, e.g. the rejoin switch)."""
    env = {
        **os.environ,
        **torchrun_env(r, cfg.nproc, tb.kind == "netns", tb.master_addr, port,
                       run_dir.name, incarnation),
        "STALWART_RUN_DIR": str(run_dir.resolve()),
        # a script's own Monitor() finds the run directory here (detect/monitor.py)
        **({"STALWART_MONITOR_RUN_DIR": str(run_dir.resolve())} if cfg.script else {}),
        "OMP_NUM_THREADS": str(cfg.threads),
        # the testbed's hosts are namespaces of this one machine: GPUs are assigned over
        # all its ranks, whatever LOCAL_RANK says (devices.py)
        "STALWART_DEVICE_SLOT": str(r), "STALWART_DEVICE_SLOTS": str(cfg.nproc),
        **tb.env(r),
        **(extra or {}),
    }
    cmd = [*tb.command_prefix(r), sys.executable, "-m", "stalwart.lifeline",
           str(os.getpid()), module, "--config", str((run_dir / CONFIG).resolve()),
           *(args or [])]
    log = open(run_dir / LOGS / f"rank-{r}.log", "ab")  # noqa: SIM115
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    return p


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
    ready: Path
    t0: float
    tries: int = 1  # this host's starts so far
    asked: bool = False


def _rejoin(cfg: RunConfig, tb: Any, run_dir: Path, probe: Any, members: Any,
            procs: dict[int, subprocess.Popen], reason: str, events: EventLog,
            say: Callable[[str], None], step: int) -> _Rejoin | None:
    """Start the excluded host's launch rank again, to join in place once rank 0 agrees (it
    asks only when the rank is ready: its start-up is off the job's critical path)."""
    from stalwart.mitigate import membership

    g = membership.read(run_dir)
    if g is None or probe.host not in g.home or probe.host in g.hosts:
        return None
    slot = g.home.index(probe.host)
    if slot in procs:
        return None
    probe.tries += 1
    if probe.tries > REJOIN_TRIES:
        return None
    ready = membership.ready_path(run_dir, g.token, slot)
    ready.unlink(missing_ok=True)  # an earlier try's: this start says it anew
    p = _start_rank(cfg, tb, run_dir, "stalwart.train.worker", None, 0, 0, slot,
                    {membership.JOIN_ENV: "1"})
    procs[slot] = p
    tb.attach_ranks({slot: p.pid})
    events.log("rank_rejoining", step=step, rank=slot, host=probe.host, reason=reason)
    say(f"stalwart: host {probe.host} is healthy again; its rank {slot} starts to rejoin live")
    return _Rejoin(slot, probe.host, reason, ready, time.monotonic(), probe.tries)


def _restart_config(cfg: RunConfig, run_dir: Path, events: EventLog,
                    say: Callable[[str], None]) -> tuple[RunConfig, int]:
    """The next incarnation after a planned restart: the hosts rank 0 asked for, resumed from
    the checkpoint it wrote, the same global batch (config.json is rewritten atomically)."""
    from stalwart.mitigate import RESTART_FILE

    try:
        req = json.loads((run_dir / RESTART_FILE).read_text())
        hosts = [int(h) for h in req["hosts"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"ranks left for a restart without a usable {RESTART_FILE}: {e}"
                           ) from None
    (run_dir / RESTART_FILE).unlink()
    new = RunConfig.from_dict({**cfg.to_dict(), "nproc": len(hosts), "hosts": hosts,
                               "resume": True})
    new.validate()
    new.save(run_dir / CONFIG)
    events.log("restart", step=int(req.get("step", 0)), nproc=len(hosts), hosts=hosts,
               strategy=req.get("strategy"), reason=req.get("reason", ""),
               predicted_gain=req.get("predicted_gain"),
               step_time_before=req.get("step_time_before"))
    say(f"stalwart: restarting on {len(hosts)} hosts {hosts} from step {req.get('step')}: "
        f"{req.get('reason', '')}")
    return new, int(req.get("step", 0))


def _announcer(cfg: RunConfig, run_dir: Path, module: str) -> Any:
    """The membership record of a job that regroups in place (mitigate/membership.py)."""
    from stalwart.mitigate.membership import Announcer, in_place_ok

    if module != "stalwart.train.worker" or cfg.nproc < 2 or not in_place_ok(cfg):
        return None
    return Announcer(run_dir, list(cfg.hosts) if cfg.hosts else list(range(cfg.nproc)))


def _supervise(cfg: RunConfig, run_dir: Path, procs: dict[int, subprocess.Popen], tb: object,
               progress: Progress, events: EventLog, say: Callable[[str], None],
               first_step: int = 0, restart_t0: float | None = None,
               clock0: float | None = None, members: Any = None,
               keep_going: bool = False) -> int:
    tb.on_step(first_step)  # type: ignore[attr-defined]
    probe = _start_probe(cfg, tb, run_dir)
    probes = [probe] if probe is not None else []  # and those _watch starts
    try:
        return _watch(cfg, run_dir, procs, tb, progress, events, say, first_step, restart_t0,
                      probe, time.monotonic() if clock0 is None else clock0, members, probes,
                      keep_going)
    finally:
        for p in probes:
            p.close()


def _lose(failed: list[tuple[int, int]], procs: dict[int, subprocess.Popen], members: Any,
          run_dir: Path, events: EventLog, say: Callable[[str], None], step: int) -> bool:
    """Ranks died in a job that regroups in place: log each (``rank_lost``), drop it, and
    announce the next generation to the survivors. False (the job stops as before) when no
    rank is left running, or a rank exited 2 (bad input: every rank would hit it)."""
    alive = [r for r, p in procs.items() if p.poll() is None]
    if not alive or any(code == 2 for _, code in failed):
        return False
    for r, code in failed:
        # a signal leaves no error of the rank's own (its last line is whatever came before)
        why = _last_error_line(run_dir / LOGS / f"rank-{r}.log") if code > 0 else ""
        host = members.current.hosts[members.current.alive.index(r)]
        events.log("rank_lost", step=step, rank=r, host=host, exit_code=code, error=why,
                   world_after=len(alive))
        say(f"stalwart: rank {r} (host {host}) lost ({_describe_exit(code)}); the other "
            f"{len(alive)} regroup in place")
        del procs[r]
    members.lose([r for r, _ in failed], step)
    return True


def _drop_lost(failed: list[tuple[int, int]], procs: dict[int, subprocess.Popen],
               run_dir: Path, events: EventLog, say: Callable[[str], None], step: int) -> bool:
    """``keep_going``: ranks died; log each (``rank_lost``, with its exit and last error line)
    and stop supervising it. False (the job stops as usual) when a rank exited 2: bad input,
    which every rank would hit."""
    if any(code == 2 for _, code in failed):
        return False
    for r, code in failed:
        why = _last_error_line(run_dir / LOGS / f"rank-{r}.log") if code > 0 else ""
        events.log("rank_lost", step=step, rank=r, host=r, exit_code=code, error=why,
                   world_after=len(procs) - 1)
        say(f"stalwart: rank {r} lost ({_describe_exit(code)}); the other {len(procs) - 1} go on")
        del procs[r]
    return True


def _left(procs: dict[int, subprocess.Popen], members: Any, tb: Any, run_dir: Path,
          events: EventLog, say: Callable[[str], None], step: int) -> Any:
    """Ranks that an in-place regroup left out (S4) exited: log each (``rank_left``) and
    probe its host for the way back (probe.py); returns the probe (or None)."""
    from stalwart.mitigate import membership
    from stalwart.mitigate.probe import HostProbe

    probe = None
    g = membership.read(run_dir)
    for r in [r for r, p in procs.items() if p.poll() == LEFT_EXIT]:
        host = tb.host(r)
        del procs[r]
        events.log("rank_left", step=step, rank=r, host=host)
        say(f"stalwart: rank {r} left; host {host} is out of the job and probed for the way "
            "back")
        if g is not None and probe is None and hasattr(tb, "hosts"):
            probe = HostProbe(tb, host, list(g.hosts), run_dir)
    if members is not None and g is not None and g.token == members.current.token:
        members.current = g if g.gen > members.current.gen else members.current
    return probe


def _fall_back(cfg: RunConfig, run_dir: Path, procs: dict[int, subprocess.Popen], members: Any,
               events: EventLog, say: Callable[[str], None], step: int) -> int:
    """A rank's in-place regroup failed (it saved its state and exited FALLBACK_EXIT): ask
    every rank to do the same, then relaunch from the most advanced state on the membership
    being built (mitigate/fallback.py). RESTART_EXIT, with restart.json written for
    ``_restart_config``; 1 when there is no usable state or no fallback left."""
    from stalwart.events import RegroupFailed
    from stalwart.mitigate import RESTART_FILE, fallback
    from stalwart.rundir import atomic_write_text, read_jsonl

    g = members.fall_back(step)
    say("stalwart: an in-place regroup failed; every rank saves its state for a relaunch")
    deadline = time.monotonic() + fallback.WAIT_S
    while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    crashed = {r for r, p in procs.items()
               if p.poll() not in (None, 0, LEFT_EXIT, FALLBACK_EXIT)}
    _stop_all(procs)  # the ranks that did not save in time
    hosts = [h for s, h in zip(g.alive, g.hosts, strict=True) if s not in crashed]
    since = [e for e in read_jsonl(run_dir / EVENTS) if e.get("event") in (
        "run_started", RegroupFailed.name)]
    starts = [i for i, e in enumerate(since) if e["event"] == "run_started"]
    done = sum(1 for e in since[(starts[-1] if starts else 0):]
               if e.get("fallback") == "restart")
    got = fallback.plan(run_dir, g.token, cfg.tp) \
        if done < fallback.MAX_FALLBACKS and hosts and len(hosts) % cfg.tp == 0 else None
    if got is None:
        reason, failed = fallback.first_reason(fallback.saved(run_dir, g.token))
        events.emit(RegroupFailed(step, g.gen - 1, reason, "none", hosts, failed))
        say(f"stalwart: in-place regroup failed ({reason}) and no relaunch is possible "
            f"({'no usable saved state' if done < fallback.MAX_FALLBACKS else 'too many'})")
        return 1
    events.emit(RegroupFailed(step, g.gen - 1, got["reason"], "restart", hosts, got["failed"],
                              got["step"]))
    atomic_write_text(run_dir / RESTART_FILE, json.dumps(
        {"hosts": hosts, "step": got["step"], "strategy": "fallback",
         "reason": f"in-place regroup failed: {got['reason']}"}) + "\n")
    return RESTART_EXIT


def _start_probe(cfg: RunConfig, tb: Any, run_dir: Path) -> Any:
    """While a host is excluded (S4), probe it for the way back (mitigate/probe.py)."""
    if cfg.mitigate != "auto" or not cfg.hosts:
        return None
    missing = [h for h in range(max(cfg.hosts) + 1) if h not in cfg.hosts]
    if not missing:
        return None
    from stalwart.mitigate.probe import HostProbe

    return HostProbe(tb, missing[0], list(cfg.hosts), run_dir)


def _watch(cfg: RunConfig, run_dir: Path, procs: dict[int, subprocess.Popen], tb: Any,
           progress: Progress, events: EventLog, say: Callable[[str], None],
           first_step: int, restart_t0: float | None, probe: Any, clock0: float,
           members: Any = None, probes: list[Any] | None = None,
           keep_going: bool = False) -> int:
    # a script's progress is the monitor's iteration lines (same keys as stalwart's metrics)
    metrics_tail = JsonlTail(run_dir / (ITERATIONS if cfg.script else METRICS))
    events_tail = JsonlTail(run_dir / EVENTS)
    next_step = first_step
    restart_s: float | None = None
    recent: list[float] = []
    declined_logged = False
    watch_t0 = time.monotonic()
    startup_s: float | None = None  # spawn to the first step: what a restart would cost
    rejoin: _Rejoin | None = None
    regroup_s: float | None = None  # the last in-place regroup's seconds: a rejoin's price
    while True:
        tb.on_time(time.monotonic() - clock0)
        for m in metrics_tail.poll():
            progress.on_metric(m)
            tb.observe(m)
            if m["step"] >= first_step and m.get("rank") == 0:
                recent = (recent + [float(m["step_time"])])[-20:]
                if startup_s is None:
                    startup_s = time.monotonic() - watch_t0
                if restart_s is None and restart_t0 is not None:
                    restart_s = time.monotonic() - restart_t0  # exit to first step back
            if m["step"] + 1 > next_step:
                next_step = m["step"] + 1
                tb.on_step(next_step)
        if members is not None and any(p.poll() == FALLBACK_EXIT for p in procs.values()):
            return _fall_back(cfg, run_dir, procs, members, events, say, next_step)
        if any(p.poll() == LEFT_EXIT for p in procs.values()):
            got = _left(procs, members, tb, run_dir, events, say, next_step)
            if got is not None and probes is not None:
                probes.append(got)  # closed by _supervise
            if got is not None and probe is None:
                probe = got
                restart_s = restart_s or startup_s  # taking it back is a restart
            if rejoin is not None and rejoin.slot not in procs:
                rejoin = None  # the rank started to rejoin was not taken back, and left
        if probe is not None and members is not None and recent and rejoin is None:
            # in place: the host's rank starts again and joins live (price: a regroup)
            why = probe.restore_reason(cfg.steps - next_step, sorted(recent)[len(recent) // 2],
                                       len(procs), max(regroup_s or 0.0, REJOIN_PRICE_S),
                                       how="live rejoin")
            if why is not None:
                rejoin = _rejoin(cfg, tb, run_dir, probe, members, procs, why, events, say,
                                 next_step)
                if rejoin is None and probe.tries > REJOIN_TRIES:
                    probe.stop()  # its rank failed to rejoin each time: the host stays out
                    probe = None
        elif probe is not None and members is None and recent and restart_s is not None \
                and probe.request_restore(cfg.steps - next_step,
                                          sorted(recent)[len(recent) // 2], len(procs),
                                          restart_s):
            say(f"stalwart: host {probe.host} is healthy again; asking the ranks to take it back")
        if rejoin is not None and not rejoin.asked and rejoin.ready.exists() and probe is not None:
            rejoin.asked = True
            probe.request(rejoin.reason, len(procs) - 1, live=True)
            probe.stop()  # the host is no longer probed: its rank is about to use it
            events.log("rank_ready", step=next_step, rank=rejoin.slot, host=rejoin.host,
                       start_s=round(time.monotonic() - rejoin.t0, 3))
            probe = None
        if probe is not None and probe.declined and not declined_logged:
            declined_logged = True
            events.log("host_probe", step=next_step, host=probe.host, restore=False,
                       reason=probe.declined)
        for e in events_tail.poll():
            progress.on_event(e)
            if e.get("event") == "regroup":
                regroup_s = float(e.get("regroup_s") or 1.0)
                if hasattr(tb, "regrouped"):
                    tb.regrouped(list(e.get("hosts") or []))  # traffic counted per membership
                if rejoin is not None and rejoin.slot in (e.get("joined") or []):
                    rejoin = None  # back in the job
        progress.refresh()
        failed = [(r, p.returncode) for r, p in procs.items()
                  if p.poll() not in (None, 0, RESTART_EXIT, LEFT_EXIT, FALLBACK_EXIT)]
        if rejoin is not None and any(r == rejoin.slot for r, _ in failed):
            # a rank started to rejoin failed before it was back: the job goes on without it
            # (once asked for, the others may be waiting for it in the regroup: a generation
            # without it wakes them)
            if rejoin.asked and members is not None:
                members.lose([rejoin.slot], next_step)
            code = procs.pop(rejoin.slot).returncode
            events.log("rejoin_failed", step=next_step, rank=rejoin.slot, host=rejoin.host,
                       exit_code=code, error=_last_error_line(
                           run_dir / LOGS / f"rank-{rejoin.slot}.log"))
            say(f"stalwart: rank {rejoin.slot} could not rejoin ({_describe_exit(code)}); "
                f"the job goes on without host {rejoin.host}")
            failed = [(r, c) for r, c in failed if r != rejoin.slot]
            if probe is None and rejoin.tries < REJOIN_TRIES and hasattr(tb, "hosts"):
                from stalwart.mitigate.probe import HostProbe

                probe = HostProbe(tb, rejoin.host, list(members.current.hosts), run_dir) \
                    if members is not None else None
                if probe is not None:
                    probe.tries = rejoin.tries  # probed again for the next try
                    if probes is not None:
                        probes.append(probe)
            rejoin = None
        if failed and members is not None and failstop_ok(cfg) and _lose(
                failed, procs, members, run_dir, events, say, next_step):
            if probe is None and hasattr(tb, "hosts"):
                # the dead rank's host is probed like a host left out: healthy (a process
                # crash, not a bad host), its rank is started again and rejoins live
                from stalwart.mitigate.probe import HostProbe

                probe = HostProbe(tb, tb.host(failed[0][0]), list(members.current.hosts),
                                  run_dir)
                if probes is not None:
                    probes.append(probe)
            continue  # the survivors regroup in place
        if failed and keep_going and _drop_lost(failed, procs, run_dir, events, say, next_step):
            continue  # the others go on by themselves
        if keep_going and not procs:
            return 1  # every rank died
        blamed = culprit(procs, lambda: first_errors(run_dir) if cfg.script else {})
        if blamed is not None:
            # name the likely cause, not the first rank seen dead (culprit)
            r, code = blamed
            raised = first_errors(run_dir) if cfg.script else {}
            _stop_all(procs)
            progress.close()
            why = raised.get(r, {}).get("error") or _last_error_line(
                run_dir / LOGS / f"rank-{r}.log")
            events.log("rank_failed", rank=r, exit_code=code, error=why, step=next_step)
            say(f"stalwart: rank {r} failed ({_describe_exit(code)}): {why or 'no output'} "
                f"[log: {run_dir / LOGS / f'rank-{r}.log'}]")
            # a rank that exited 2 hit a bad-input error (e.g. corrupt checkpoint)
            return 2 if code == 2 else 1
        if all(p.poll() == RESTART_EXIT for p in procs.values()):
            return RESTART_EXIT
        if all(p.poll() == 0 for p in procs.values()):
            for m in metrics_tail.poll():
                progress.on_metric(m)
            for e in events_tail.poll():
                progress.on_event(e)
            progress.finish()
            return 0
        time.sleep(POLL_S)
