"""Start N ranks on this machine (or inside testbed hosts), have them supervised, stop them
cleanly; start the next incarnation when they leave for a planned restart.

What it guarantees:
- every rank gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
  GROUP_RANK, ROLE_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID, ...), as torchrun
  would set it for this layout -- on ``netns`` every rank is alone on its emulated host
  (LOCAL_RANK 0, GROUP_RANK = the host), locally all ranks share one node -- plus
  STALWART_HOST_ADDR, the address its sockets should bind; so the same entry point also runs
  under torchrun for multi-node jobs, and a user's torchrun script (``--script``, script.py)
  runs here unchanged;
- while they run, supervise.py watches the ranks: if one rank dies, the others are stopped
  and the launcher returns non-zero naming the rank and the last line of its error; nothing
  hangs (except where a job regroups in place, ``launch(..., keep_going=True)``, or the
  rank had joined a script's elastic job -- ``--script`` runs get a membership store of their
  own, elastic/launcher.py --: the others carry on; see supervise.py);
- when the ranks checkpoint and leave for a restart (a failed in-place regroup's fallback,
  or an S3/S4 decision that takes one: the ranks' exit records, elastic/runlink.py), the job
  goes on from that checkpoint on the hosts the supervisor's ``Relaunch`` names, at the same
  global batch;
- Ctrl-C stops every rank; if the launcher itself is killed -9, the kernel kills the ranks
  (PR_SET_PDEATHSIG) and the testbed's next start removes what it left behind;
- the testbed's fault schedule follows training progress, read from metrics.jsonl (for a
  script: the monitor's iterations, iterations.jsonl), and the clock: seconds since the ranks
  were first started.

Cost: a process per rank (``python -m stalwart.lifeline``); a restart pays the ranks'
start-up again. Each rank's stdout/stderr go to logs/rank-R.log; the terminal shows one
progress display.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from stalwart.config import ConfigError, RunConfig, check_writable, resolve, with_environment
from stalwart.elastic.launcher import LauncherStore
from stalwart.events import Restart, RunFinished, RunStarted
from stalwart.progress import Progress
from stalwart.rankexits import stop_all
from stalwart.rundir import CONFIG, EVENTS, LOGS, METRICS, EventLog
from stalwart.script import ScriptProgress
from stalwart.supervise import Relaunch, supervise


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_name() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S")


def prepare_run_dir(cfg: RunConfig) -> Path:
    """Create ``cfg.run_dir`` and write config.json for a resolved ``cfg``; ConfigError on bad
    input (a run already there, or none to resume)."""
    check_writable(Path(cfg.job.out))
    run_dir = cfg.run_dir
    if cfg.job.resume:
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


def resolve_launch(raw: RunConfig) -> RunConfig:
    """The launch's one ``resolve``: a run name picked when none is given, then every value
    filled and checked (config.py); ConfigError on bad input."""
    if raw.job.name is None:
        if raw.job.resume:
            raise ConfigError("--resume needs --name NAME of the run to continue")
        raw = replace(raw, job=replace(raw.job, name=default_name()))
    return resolve(with_environment(raw))



def launch(cfg: RunConfig, module: str = "stalwart.train.worker", args: list[str] | None = None,
           show_progress: bool = True, on_line: Callable[[str], None] | None = None,
           keep_going: bool = False) -> int:
    """Run one job; returns 0 on success, 1 when a rank failed, 2 on bad input, 130 on Ctrl-C.

    ConfigError is raised (not returned) for bad input found before any rank starts.
    """
    from stalwart.devices import DeviceError, check_request

    cfg = resolve_launch(cfg)  # every value first (one pass), then what this machine can run
    try:
        check_request(cfg.job.device, cfg.job.nproc)
    except DeviceError as e:
        raise ConfigError(str(e)) from None
    run_dir = prepare_run_dir(cfg)
    events = EventLog(run_dir)
    say = on_line or (lambda s: print(s, flush=True))
    if cfg.job.script is not None:
        # a user's script as the ranks: its bootstrap reads the script from config.json
        module, args = "stalwart.scriptboot", None
        progress: Any = ScriptProgress(cfg, run_dir, enabled=show_progress)
    else:
        progress = Progress(cfg, run_dir, enabled=show_progress)
    procs: dict[int, subprocess.Popen] = {}
    events.emit(RunStarted(nproc=cfg.job.nproc, testbed=cfg.testbed.kind, launcher="stalwart",
                           resume=cfg.job.resume, script=cfg.job.script or None))
    holder: list[LauncherStore | None] = [None]
    try:
        rc = _run_incarnations(cfg, run_dir, module, args, events, progress, say, keep_going,
                               procs, holder)
    except KeyboardInterrupt:
        stop_all(procs)
        progress.close()
        say("stalwart: interrupted; all ranks stopped")
        events.emit(RunFinished(ok=False, reason="interrupted"))
        rc = 130
    finally:
        stop_all(procs)
        progress.close()
        if holder[0] is not None:
            holder[0].close()
    if rc != 130:
        events.emit(RunFinished(ok=rc == 0, exit_code=rc))
    if module in ("stalwart.train.worker", "stalwart.scriptboot"):
        _report(run_dir, rc, say)
    events.close()
    return rc


def _run_incarnations(cfg: RunConfig, run_dir: Path, module: str, args: list[str] | None,
                      events: EventLog, progress: Any, say: Callable[[str], None],
                      keep_going: bool, procs: dict[int, subprocess.Popen],
                      store_out: list[LauncherStore | None]) -> int:
    """The job's incarnations on one testbed until the ranks end (a restart without a host
    or on a new placement starts the next). ``procs`` always holds the live incarnation's
    processes and ``store_out[0]`` the membership store (the caller stops and closes them,
    also on Ctrl-C). Returns the job's exit code."""
    from stalwart.testbed import open_testbed

    with open_testbed(cfg, events) as tb:
        incarnation, first_step, restart_t0 = 0, 0, None
        # the membership store of a script's ranks, or of a job that regroups in place
        # (elastic/launcher.py, elastic/runlink.py)
        store = store_out[0] = _membership_store(cfg, tb, run_dir, module)
        tb.start_liveness()  # ranks beat to it: a hung or cut-off rank is found (heartbeat.py)
        clock0 = time.monotonic()  # fault windows in seconds count from here
        tb.on_time(0.0)
        while True:
            port = 29500 + incarnation if cfg.testbed.kind == "netns" else free_port()
            members = _announcer(cfg, run_dir, module, store)
            # the ranks of a job that regroups in place find this launch's records
            run_args = args if members is None else [*(args or []), "--link", members.token]
            procs.clear()
            procs.update(_spawn(cfg, tb, run_dir, module, run_args, port, incarnation, store))
            # a rank started again to rejoin live (supervise.py): the training worker, or a
            # script's rank with its membership store
            again = _restarter(cfg, tb, run_dir, module, run_args, port, incarnation, store)
            got = supervise(cfg, run_dir, procs, tb, progress, events, say, again,
                            first_step, restart_t0, clock0, members, keep_going, store)
            if not isinstance(got, Relaunch):
                return got
            # the ranks checkpointed and left for a restart; go on with other hosts
            restart_t0 = time.monotonic()
            cfg, first_step = _restart_config(cfg, run_dir, events, say, got)
            # faults stay on their hosts; ranks move
            tb.set_hosts(list(cfg.job.hosts) if cfg.job.hosts else None)
            incarnation += 1


def _report(run_dir: Path, rc: int, say: Callable[[str], None]) -> None:
    """report.html from the run directory; a problem building it is said, never raised (it
    must not hide the run's own outcome)."""
    try:
        from stalwart.report import build_report

        html = build_report(run_dir)
        if rc == 0:
            say(f"report: {html}")
    except Exception as e:
        say(f"stalwart: report not built: {e}")


def torchrun_env(rank: int, nproc: int, one_host_per_rank: bool, master_addr: str,
                 port: int, run_id: str, restarts: int = 0,
                 ranks_per_host: int = 1) -> dict[str, str]:
    """The variables torchrun gives rank `rank` of `nproc`: on the netns testbed
    (``one_host_per_rank``) as ``torchrun --nnodes N/K --nproc-per-node K`` with K =
    ``ranks_per_host`` (1: one host per rank); otherwise as ``--nproc-per-node N``."""
    k = max(ranks_per_host, 1) if one_host_per_rank else nproc
    return {
        "RANK": str(rank), "WORLD_SIZE": str(nproc),
        "LOCAL_RANK": str(rank % k), "LOCAL_WORLD_SIZE": str(min(k, nproc)),
        "GROUP_RANK": str(rank // k), "GROUP_WORLD_SIZE": str(-(-nproc // k)),
        "ROLE_NAME": "default", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": str(restarts),
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }


def _spawn(cfg: RunConfig, tb: Any, run_dir: Path, module: str, args: list[str] | None,
           port: int, incarnation: int = 0,
           store: LauncherStore | None = None) -> dict[int, subprocess.Popen]:
    """One process per rank, inside its host (the testbed's prefix), with torchrun's env (and
    a script's membership store: ``_script_store``)."""
    extra = store.env if store is not None else None
    procs = {r: _start_rank(cfg, tb, run_dir, module, args, port, incarnation, r, extra)
             for r in range(cfg.job.nproc)}
    tb.attach_ranks({r: p.pid for r, p in procs.items()})
    return procs


def _restarter(cfg: RunConfig, tb: Any, run_dir: Path, module: str, args: list[str] | None,
               port: int, incarnation: int, store: LauncherStore | None
               ) -> Callable[[int, dict[str, str]], subprocess.Popen]:
    """How the supervisor starts one rank again: a script's rank as it was started (its
    store's address included, so it joins the elastic job live); stalwart's own rank as the
    training worker that rejoins in place (``--rejoin``: mitigate/membership.py)."""
    if cfg.job.script is not None and store is not None:
        return lambda r, extra: _start_rank(cfg, tb, run_dir, module, args, port, incarnation,
                                            r, {**store.env, **extra})
    env = store.env if store is not None else {}
    return lambda r, extra: _start_rank(cfg, tb, run_dir, "stalwart.train.worker",
                                        [*(args or []), "--rejoin"], 0, 0, r,
                                        {**env, **extra})


def _membership_store(cfg: RunConfig, tb: Any, run_dir: Path,
                      module: str) -> LauncherStore | None:
    """The job's membership store, in rank 0's host (elastic/launcher.py), for the whole
    launch: a ``--script`` job's elastic membership (a rank of a script that joins it may die
    without stopping the job), or the records of a built-in job that regroups in place
    (elastic/runlink.py: the launcher keeps them through the store process's pipe)."""
    in_place = _regroups_in_place(cfg, module)
    if cfg.job.script is None and not in_place:
        return None
    port = 29400 if cfg.testbed.kind == "netns" else free_port()  # (MASTER_PORT: 29500 + k)
    return LauncherStore(tb.command_prefix(0), tb.master_addr, port, run_dir.name, run_dir,
                         commands=in_place)


def _regroups_in_place(cfg: RunConfig, module: str) -> bool:
    from stalwart.mitigate.membership import in_place_ok

    return module == "stalwart.train.worker" and cfg.job.nproc >= 2 and in_place_ok(cfg)


def _start_rank(cfg: RunConfig, tb: Any, run_dir: Path, module: str, args: list[str] | None,
                port: int, incarnation: int, r: int,
                extra: dict[str, str] | None = None) -> subprocess.Popen:
    """Launch rank ``r``'s process inside its host, with torchrun's variables (``extra``:
    more, e.g. the rejoin switch)."""
    env = {
        **os.environ,
        **torchrun_env(r, cfg.job.nproc, tb.kind == "netns", tb.master_addr, port,
                       run_dir.name, incarnation, cfg.testbed.ranks_per_host),
        "STALWART_RUN_DIR": str(run_dir.resolve()),
        # a script's own Monitor() finds the run directory here (detect/monitor.py)
        **({"STALWART_MONITOR_RUN_DIR": str(run_dir.resolve())} if cfg.job.script else {}),
        "OMP_NUM_THREADS": str(cfg.job.threads),
        # the testbed's hosts are namespaces of this one machine: GPUs are assigned over
        # all its ranks, whatever LOCAL_RANK says (devices.py)
        "STALWART_DEVICE_SLOT": str(r), "STALWART_DEVICE_SLOTS": str(cfg.job.nproc),
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


def _restart_config(cfg: RunConfig, run_dir: Path, events: EventLog,
                    say: Callable[[str], None], req: Relaunch) -> tuple[RunConfig, int]:
    """The next incarnation after a restart: the hosts ``req`` names, resumed from the
    checkpoint at its step, the same global batch (config.json is rewritten atomically).
    Only membership changes (``job``: nproc, hosts, resume); hosts 0..n-1 are written as
    None (the same: rank r on host r)."""
    hosts = list(req.hosts)
    new = replace(cfg, job=replace(cfg.job, nproc=len(hosts), resume=True,
                                   hosts=None if hosts == list(range(len(hosts)))
                                   else tuple(hosts)))
    new = resolve(new)  # the new world's micro-batches per rank (the global batch is kept)
    new.save(run_dir / CONFIG)
    events.emit(Restart(step=req.step, nproc=len(hosts), hosts=hosts, strategy=req.strategy,
                        reason=req.reason, predicted_gain=req.predicted_gain,
                        step_time_before=req.step_time_before))
    say(f"stalwart: restarting on {len(hosts)} hosts {hosts} from step {req.step}: "
        f"{req.reason}")
    return new, req.step


def _announcer(cfg: RunConfig, run_dir: Path, module: str,
               store: LauncherStore | None) -> Any:
    """The membership generations of a job that regroups in place, one launch's
    (mitigate/membership.py), on the store's records."""
    from stalwart.mitigate.membership import Announcer

    if store is None or store.pipe is None or not _regroups_in_place(cfg, module):
        return None
    return Announcer(store.pipe, run_dir.name,
                     list(cfg.job.hosts) if cfg.job.hosts else list(range(cfg.job.nproc)))


