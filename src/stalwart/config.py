"""Run configuration: one validated dataclass, and the one error type for bad user input.

Every entry point (``stalwart run``, the rank under torchrun, benchmarks, tests) builds a
``RunConfig`` and calls ``validate()``; a bad value raises ``ConfigError`` whose message is one
line naming the value. The CLI turns that into exit code 2 without a traceback.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from stalwart.devices import DEVICE_MODES
from stalwart.errors import ConfigError
from stalwart.faultspec import FAULT_KINDS, TESTBEDS, Fault, parse_fault
from stalwart.presets import PRESETS
from stalwart.rundir import atomic_write_text

__all__ = ["COMM_MODES", "CPU_CAP_MODES", "FAULT_KINDS", "MITIGATE_MODES", "OVERLAP_MODES",
           "TESTBEDS", "ConfigError", "DetectConfig", "PolicyConfig", "RunConfig",
           "check_script", "check_writable"]

COMM_MODES = ("reliable", "lossy")
MITIGATE_MODES = ("off", "auto", "rebalance")
OVERLAP_MODES = ("off", "si")
CPU_CAP_MODES = ("auto", "fair", "off")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

# options that change what stalwart's own workload does; a user's script decides that itself
_WORKLOAD_ONLY: tuple[tuple[str, str, Any], ...] = (
    ("tp", "--tp", 1), ("comm", "--comm", "reliable"), ("mitigate", "--mitigate", "off"),
    ("overlap", "--overlap", "off"), ("resume", "--resume", False),
    ("halt_at", "--halt-at", None),
)


@dataclass(frozen=True)
class DetectConfig:
    """The straggler monitor's settings in a run (``stalwart.detect.Monitor``'s arguments;
    the thresholds behind them: docs/calibration.md)."""

    warmup: int = 10  # samples the change detectors ignore at the start
    persist: int = 20  # samples an unexplained slowdown must last to be logged
    history: int = 1000  # samples kept per rank
    max_every: int = 1  # at most this many steps per exchange (reliable comm)
    # --comm lossy: a fixed exchange period and rows read this many exchanges later (the
    # monitor's TCP rows stall on retransmission timeouts under loss; training does not)
    lossy_check_every: int = 8
    lossy_lag: int = 2
    compute_reps: int = 64  # matmuls per round of the compute test
    link_bytes: int = 1 << 18  # bytes per transfer of the link test

    def problems(self) -> list[str]:
        return [f"detection.{k} must be >= 1, got {v}" for k, v in (
            ("warmup", self.warmup + 1), ("persist", self.persist), ("history", self.history),
            ("max_every", self.max_every), ("lossy_check_every", self.lossy_check_every),
            ("lossy_lag", self.lossy_lag), ("compute_reps", self.compute_reps),
            ("link_bytes", self.link_bytes)) if v < 1]


@dataclass(frozen=True)
class PolicyConfig:
    """The mitigation policy's settings in a run (``stalwart.mitigate.policy.Policy``)."""

    every: int = 2  # steps per exchange of the agreement channel
    min_gain: float = 0.05  # a first plan must be predicted this much faster
    replan_gain: float = 0.25  # a plan in force is replaced only for this much more
    revert_windows: int = 2  # healthy exchanges in a row before a revert

    def problems(self) -> list[str]:
        out = [f"policy.{k} must be >= 1, got {v}" for k, v in (
            ("every", self.every), ("revert_windows", self.revert_windows)) if v < 1]
        out += [f"policy.{k} must be in [0, 1), got {v}" for k, v in (
            ("min_gain", self.min_gain), ("replan_gain", self.replan_gain))
            if not 0.0 <= v < 1.0]
        return out


_NESTED = {"detection": DetectConfig, "policy": PolicyConfig}


@dataclass
class RunConfig:
    nproc: int = 4
    tp: int = 1
    steps: int = 200
    seed: int = 0
    preset: str = "tiny"
    data: str | None = None
    comm: str = "reliable"
    testbed: str = "local"
    faults: list[str] = field(default_factory=list)
    mitigate: str = "off"
    overlap: str = "off"
    out: str = "runs"
    name: str | None = None
    resume: bool = False
    # training knobs (None = the preset's value)
    batch_size: int | None = None
    lr: float | None = None
    micro_batches: int = 1  # gradient-accumulation micro-batches per step and rank
    # The step's global batch in samples (None: batch_size x micro_batches x data-parallel
    # ranks at launch). Fixed for the whole run: a restart at another world size (mitigation's
    # S4) keeps it and changes only how many micro-batches each rank computes.
    global_batch: int | None = None
    # samples per micro-batch, the unit of work that mitigation moves between ranks (None:
    # batch_size, or batch_size / 4 with --mitigate so that plans have room to move work)
    micro_batch_size: int | None = None
    # host (testbed namespace / slot) of each rank; None = rank r on host r. Set by the
    # launcher when it restarts a job without a host (S4), so faults follow hosts.
    hosts: list[int] | None = None
    warmup: int = 20
    grad_clip: float = 1.0
    weight_decay: float = 0.1
    eval_every: int = 50
    eval_batches: int = 8
    ckpt_every: int = 100
    halt_at: int | None = None  # stop after this step as if preempted (to exercise --resume)
    mtu: int = 1500  # testbed link MTU
    # ranks on one emulated host (netns testbed): slot s (``hosts``) runs on host s // this,
    # so a host's link faults slow all its ranks and its ranks talk inside it
    ranks_per_host: int = 1
    # CPU budget of each emulated host (testbed): "fair" caps every host at its fair share of
    # the cores (min(1, cores / hosts)) so that a compute fault of factor F gives about F;
    # "auto" caps when CPU faults are scheduled; "off" never (hosts borrow idle cores)
    cpu_cap: str = "auto"
    detect: bool = True  # run the straggler monitor inside each rank
    # a user's own torchrun script run as the ranks instead of stalwart's workload
    # (``stalwart run --script PATH -- ARGS``; see stalwart.script)
    script: str | None = None
    script_args: list[str] = field(default_factory=list)
    threads: int = 1  # torch threads per rank (ranks share the machine's cores)
    # auto | cpu | cuda: where each rank computes and which backend it uses (devices.py)
    device: str = "auto"
    max_data_bytes: int = 16 * 1024 * 1024
    detection: DetectConfig = field(default_factory=DetectConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)

    # ---- derived -------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        return Path(self.out) / (self.name or "run")

    def resolved_batch_size(self) -> int:
        if self.batch_size is not None:
            return self.batch_size
        return PRESETS[self.preset]["batch_size"]

    def dp_size(self) -> int:
        return self.nproc // self.tp

    def micro_per_rank(self) -> int:
        """Gradient-accumulation micro-batches per rank at launch (TP interleaving needs 2)."""
        return self.micro_batches if self.tp == 1 else max(self.micro_batches, 2)

    def resolved_global_batch(self) -> int:
        if self.global_batch is not None:
            return self.global_batch
        return self.resolved_batch_size() * self.micro_per_rank() * self.dp_size()

    def resolved_micro_batch_size(self) -> int:
        if self.micro_batch_size is not None:
            return self.micro_batch_size
        bs = self.resolved_batch_size()
        if self.mitigate != "off" and self.micro_batches == 1:
            # the largest split into <= 4 equal micro-batches: room for plans, same batch
            for k in (4, 3, 2):
                if bs % k == 0:
                    return bs // k
        return bs

    def global_micro_batches(self) -> int:
        """M: identical micro-batches per step, spread over the data-parallel ranks by a plan."""
        return self.resolved_global_batch() // self.resolved_micro_batch_size()

    def resolved_lr(self) -> float:
        return self.lr if self.lr is not None else PRESETS[self.preset]["lr"]

    # ---- validation ----------------------------------------------------------------------
    def validate(self) -> RunConfig:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(self.nproc >= 1, f"--nproc must be >= 1, got {self.nproc}")
        need(self.tp >= 1, f"--tp must be >= 1, got {self.tp}")
        need(self.nproc % self.tp == 0,
             f"--nproc {self.nproc} is not a multiple of --tp {self.tp}")
        need(self.steps >= 0, f"--steps must be >= 0, got {self.steps}")
        need(self.preset in PRESETS,
             f"unknown preset {self.preset!r} (choose from {', '.join(PRESETS)})")
        need(self.comm in COMM_MODES,
             f"unknown --comm {self.comm!r} (choose from {', '.join(COMM_MODES)})")
        need(self.testbed in TESTBEDS,
             f"unknown --testbed {self.testbed!r} (choose from {', '.join(TESTBEDS)})")
        need(self.mitigate in MITIGATE_MODES,
             f"unknown --mitigate {self.mitigate!r} (choose from {', '.join(MITIGATE_MODES)})")
        need(self.cpu_cap in CPU_CAP_MODES,
             f"unknown --cpu-cap {self.cpu_cap!r} (choose from {', '.join(CPU_CAP_MODES)})")
        need(self.overlap in OVERLAP_MODES,
             f"unknown --overlap {self.overlap!r} (choose from {', '.join(OVERLAP_MODES)})")
        need(self.overlap == "off" or self.tp > 1, "--overlap si needs --tp >= 2")
        need(self.data is None or Path(self.data).exists(),
             f"data path does not exist: {self.data}")
        need(self.name is None or bool(_NAME_RE.match(self.name)),
             f"invalid run name {self.name!r} (letters, digits, '.', '_', '-')")
        bs = self.resolved_batch_size()
        need(bs >= 1, f"--batch-size must be >= 1, got {bs}")
        lr = self.resolved_lr()
        need(lr > 0, f"--lr must be > 0, got {lr}")
        need(self.micro_batches >= 1, f"--micro-batches must be >= 1, got {self.micro_batches}")
        mbs = self.resolved_micro_batch_size()
        need(mbs >= 1, f"--micro-batch-size must be >= 1, got {mbs}")
        gb = self.resolved_global_batch()
        need(gb >= 1, f"--global-batch must be >= 1, got {gb}")
        need(gb % mbs == 0,
             f"--micro-batch-size {mbs} does not divide the global batch of {gb} samples")
        floor = 2 if self.tp > 1 else 1
        need(gb // mbs >= floor * self.dp_size(),
             f"--micro-batch-size {mbs}: {gb // mbs} micro-batches per step is fewer than "
             f"{floor} per data-parallel rank ({self.dp_size()} ranks)")
        need(self.hosts is None or (len(self.hosts) == self.nproc
                                    and len(set(self.hosts)) == self.nproc
                                    and all(h >= 0 for h in self.hosts)),
             f"hosts must name {self.nproc} distinct hosts, got {self.hosts}")
        need(self.warmup >= 0, f"--warmup must be >= 0, got {self.warmup}")
        need(self.eval_every >= 1, f"--eval-every must be >= 1, got {self.eval_every}")
        need(self.eval_batches >= 1, f"--eval-batches must be >= 1, got {self.eval_batches}")
        need(self.ckpt_every >= 1, f"--ckpt-every must be >= 1, got {self.ckpt_every}")
        need(self.halt_at is None or 0 <= self.halt_at <= self.steps,
             f"--halt-at must be in [0, steps={self.steps}], got {self.halt_at}")
        need(self.mtu in range(576, 65536), f"--mtu must be in [576, 65535], got {self.mtu}")
        need(self.threads >= 1, f"--threads must be >= 1, got {self.threads}")
        need(1 <= self.ranks_per_host <= 64,
             f"--ranks-per-host must be in [1, 64], got {self.ranks_per_host}")
        need(self.ranks_per_host == 1 or self.testbed == "netns",
             f"--ranks-per-host {self.ranks_per_host} needs --testbed netns (the local "
             "testbed runs every rank on this one machine)")
        need(self.comm == "reliable" or self.tp == 1, "--comm lossy needs --tp 1")
        need(self.device in DEVICE_MODES,
             f"unknown --device {self.device!r} (choose from {', '.join(DEVICE_MODES)})")
        for problem in self.detection.problems() + self.policy.problems():
            raise ConfigError(problem)
        for spec in self.faults:
            fault = self.parse_fault(spec)  # ConfigError naming the bad part
            need(fault.back_s is None or self.script is not None,
                 f"back= in fault {spec!r} needs --script (stalwart's own trainer takes a "
                 "lost rank's host back by itself: docs/mitigate.md)")
        if self.script is not None or self.script_args:
            self._validate_script_run()
        return self

    def _validate_script_run(self) -> None:
        """A user's own torchrun script as the ranks (``--script PATH -- ARGS``)."""
        if self.script is None:
            raise ConfigError(f"script arguments {' '.join(self.script_args)!r} after -- need "
                              "--script PATH")
        check_script(self.script)
        for attr, flag, default in _WORKLOAD_ONLY:
            value = getattr(self, attr)
            if value != default:
                shown = "" if isinstance(value, bool) else f" {value}"
                raise ConfigError(f"{flag}{shown} does not apply to --script runs (it "
                                  "configures stalwart's own training workload)")
        if not self.detect:
            for spec in self.faults:
                if self.parse_fault(spec).uses_steps:
                    raise ConfigError(
                        f"fault {spec!r} counts steps, and a script's steps are the monitor's "
                        "iterations: add --detect, or give the window in seconds (start=20s)")

    def slots(self) -> int:
        """Rank slots of the launch (``hosts`` names slots; faults' ``rank=`` counts them)."""
        return max(self.hosts) + 1 if self.hosts else self.nproc

    def parse_fault(self, spec: str) -> Fault:
        """One ``--fault`` value validated for this run's ranks and hosts (faultspec.py)."""
        return parse_fault(spec, self.slots(), self.testbed, self.ranks_per_host)

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, d: dict) -> RunConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown config keys: {', '.join(sorted(unknown))}")
        d = dict(d)
        for key, kind in _NESTED.items():
            if isinstance(d.get(key), dict):
                sub = d[key]
                bad = set(sub) - {f.name for f in fields(kind)}
                if bad:
                    raise ConfigError(f"unknown config keys: "
                                      f"{', '.join(f'{key}.{k}' for k in sorted(bad))}")
                d[key] = kind(**sub)
        return cls(**d)

    @classmethod
    def load(cls, path: Path) -> RunConfig:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from None


def check_writable(folder: Path) -> None:
    """Raise ConfigError unless `folder` exists or can be created, and is writable."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"output folder is not writable: {folder} ({e.strerror})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"output folder is not writable: {folder}")
    probe = folder / f".stalwart-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"output folder is not writable: {folder} ({e.strerror})") from None


def check_script(path: str) -> Path:
    """The script as an absolute path, if it is a Python source file that compiles."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"script not found: {path}")
    if p.is_dir():
        raise ConfigError(f"--script must be a Python file, got a folder: {path}")
    try:
        source = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read script {path}: {e.strerror}") from None
    try:
        # compile() honours a PEP 263 coding line, as the interpreter will
        compile(source, str(p), "exec", dont_inherit=True)
    except SyntaxError as e:
        raise ConfigError(f"not a Python script: {path} (line {e.lineno}: {e.msg})") from None
    except ValueError as e:  # e.g. null bytes: a binary file
        raise ConfigError(f"not a Python script: {path} ({e})") from None
    return p.resolve()
