"""Run configuration: one frozen ``RunConfig`` of sections, resolved once, and the one error
type for bad user input.

A run's options arrive flat (the command line's ``--tp``, a bench's ``RunConfig(tp=2)``,
config.json's keys) and are kept in seven frozen sections, one per component: ``job`` (which
ranks run, where they write), ``train`` (the built-in workload), ``detect`` (the straggler
monitor), ``policy`` (mitigation), ``comm`` (the data-parallel collective), ``overlap``
(tensor-parallel overlap) and ``testbed`` (the emulated hosts and their faults). Every field
carries its documentation (sections.py; docs/config.md is rendered from it).

``resolve(raw)`` is the one place that fills defaults (the preset's batch size and learning
rate, the global batch, the micro-batch size, whether the monitor runs) and checks every
value; it is pure (no clock, no environment; it reads only the data path and script it
checks) and idempotent. The launcher calls it once (under plain torchrun: rank 0), writes the
result to config.json, and ranks load that file without rewriting or re-checking it; a change
of membership (the launcher's restart on other hosts) is a ``dataclasses.replace`` of the
``job`` section. A bad value raises ``ConfigError`` whose message is one line naming the
value; the CLI turns that into exit code 2 without a traceback.

config.json keeps the flat layout of the options (``detection`` and ``policy`` nested), so
the run directories of older versions load, and readers of the file as plain JSON (replay,
reports) need no sections.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from stalwart import envknobs
from stalwart.devices import DEVICE_MODES
from stalwart.errors import ConfigError
from stalwart.faultspec import FAULT_KINDS, TESTBEDS, Fault, parse_fault
from stalwart.presets import PRESETS
from stalwart.rundir import atomic_write_text
from stalwart.sections import (
    FLAT,
    NESTED,
    SECTIONS,
    TUPLES,
    CommConfig,
    DetectConfig,
    JobConfig,
    OverlapConfig,
    PolicyConfig,
    TestbedConfig,
    TrainConfig,
    field_docs,
)

__all__ = ["COMM_MODES", "CPU_CAP_MODES", "FAULT_KINDS", "FEC_MODES", "FLAT", "MITIGATE_MODES",
           "OVERLAP_MODES", "SECTIONS", "TESTBEDS", "CommConfig", "ConfigError",
           "DetectConfig", "JobConfig", "OverlapConfig", "PolicyConfig", "RunConfig",
           "TestbedConfig", "TrainConfig", "check_script", "check_writable", "field_docs",
           "resolve", "with_environment"]

COMM_MODES = ("reliable", "lossy")
FEC_MODES = ("copies", "rs", "none")  # comm/collective.py's (tests/test_config.py checks)
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


@dataclass(frozen=True, init=False)
class RunConfig:
    """A run's configuration: seven frozen sections (see the module docstring).

    Built from sections (``RunConfig(train=TrainConfig(tp=2))``) or from flat options
    (``RunConfig(tp=2, comm="lossy")``: the command line's and config.json's names, table
    ``FLAT``); a flat name that is not a section's is also readable as an attribute
    (``cfg.tp`` is ``cfg.train.tp``). Immutable: ``dataclasses.replace`` makes a changed one.
    """

    job: JobConfig
    train: TrainConfig
    detect: DetectConfig
    policy: PolicyConfig
    comm: CommConfig
    overlap: OverlapConfig
    testbed: TestbedConfig

    def __init__(self, job: JobConfig | None = None, train: TrainConfig | None = None,
                 detect: DetectConfig | bool | None = None, policy: PolicyConfig | None = None,
                 comm: CommConfig | str | None = None, overlap: OverlapConfig | str | None = None,
                 testbed: TestbedConfig | str | None = None, **flat: Any) -> None:
        given: dict[str, Any] = {"job": job, "train": train, "detect": detect, "policy": policy,
                                 "comm": comm, "overlap": overlap, "testbed": testbed}
        for sec, value in list(given.items()):
            if value is not None and not isinstance(value, SECTIONS[sec]):
                # a flat value under a section's name: comm="lossy", testbed="netns", ...
                if sec not in FLAT:
                    raise TypeError(f"RunConfig({sec}=...) needs a {SECTIONS[sec].__name__}")
                flat[sec] = value
                given[sec] = None
        per: dict[str, dict[str, Any]] = {sec: {} for sec in SECTIONS}
        for key, value in flat.items():
            if key not in FLAT:
                raise TypeError(f"RunConfig() got an unexpected option {key!r}")
            sec, name = FLAT[key]
            per[sec][name] = tuple(value) if name in TUPLES and value is not None else value
        for sec, kind in SECTIONS.items():
            base = given[sec] if given[sec] is not None else kind()
            object.__setattr__(self, sec, replace(base, **per[sec]) if per[sec] else base)

    # ---- derived -------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        return Path(self.job.out) / (self.job.name or "run")

    def resolved_batch_size(self) -> int:
        t = self.train
        return t.batch_size if t.batch_size is not None else PRESETS[t.preset]["batch_size"]

    def dp_size(self) -> int:
        return self.job.nproc // self.train.tp

    def micro_per_rank(self) -> int:
        """Gradient-accumulation micro-batches per rank at launch (TP interleaving needs 2)."""
        t = self.train
        return t.micro_batches if t.tp == 1 else max(t.micro_batches, 2)

    def resolved_global_batch(self) -> int:
        if self.train.global_batch is not None:
            return self.train.global_batch
        return self.resolved_batch_size() * self.micro_per_rank() * self.dp_size()

    def resolved_micro_batch_size(self) -> int:
        if self.train.micro_batch_size is not None:
            return self.train.micro_batch_size
        bs = self.resolved_batch_size()
        if self.policy.mode != "off" and self.train.micro_batches == 1:
            # the largest split into <= 4 equal micro-batches: room for plans, same batch
            for k in (4, 3, 2):
                if bs % k == 0:
                    return bs // k
        return bs

    def global_micro_batches(self) -> int:
        """M: identical micro-batches per step, spread over the data-parallel ranks by a plan."""
        return self.resolved_global_batch() // self.resolved_micro_batch_size()

    def resolved_lr(self) -> float:
        t = self.train
        return t.lr if t.lr is not None else PRESETS[t.preset]["lr"]

    def slots(self) -> int:
        """Rank slots of the launch (``hosts`` names slots; faults' ``rank=`` counts them)."""
        return max(self.job.hosts) + 1 if self.job.hosts else self.job.nproc

    def parse_fault(self, spec: str) -> Fault:
        """One ``--fault`` value validated for this run's ranks and hosts (faultspec.py)."""
        return parse_fault(spec, self.slots(), self.testbed.kind, self.testbed.ranks_per_host)

    def validate(self) -> RunConfig:
        """``resolve(self)``: the resolved configuration (a new value; ``self`` is frozen)."""
        return resolve(self)

    # ---- (de)serialisation: config.json's flat layout -------------------------------------
    def to_dict(self) -> dict:
        out: dict[str, Any] = {}
        for key, (sec, name) in FLAT.items():
            value = getattr(getattr(self, sec), name)
            out[key] = list(value) if isinstance(value, tuple) else value
        for key, sec in NESTED.items():
            section = getattr(self, sec)
            out[key] = {f.name: getattr(section, f.name) for f in fields(section)
                        if "flat" not in f.metadata}
        return out

    def save(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, d: dict) -> RunConfig:
        unknown = set(d) - set(FLAT) - set(NESTED)
        if unknown:
            raise ConfigError(f"unknown config keys: {', '.join(sorted(unknown))}")
        per: dict[str, dict[str, Any]] = {sec: {} for sec in SECTIONS}
        for key, sec in NESTED.items():
            sub = d.get(key)
            if isinstance(sub, SECTIONS[sec]):
                sub = {f.name: getattr(sub, f.name) for f in fields(sub)
                       if "flat" not in f.metadata}
            if not isinstance(sub, dict):
                continue
            own = {f.name for f in fields(SECTIONS[sec]) if "flat" not in f.metadata}
            bad = set(sub) - own
            if bad:
                raise ConfigError(f"unknown config keys: "
                                  f"{', '.join(f'{key}.{k}' for k in sorted(bad))}")
            per[sec].update(sub)
        for key, value in d.items():
            if key in FLAT:
                sec, name = FLAT[key]
                per[sec][name] = tuple(value) if name in TUPLES and value is not None \
                    else value
        return cls(**{sec: kind(**per[sec]) for sec, kind in SECTIONS.items()})

    @classmethod
    def load(cls, path: Path) -> RunConfig:
        """A run directory's config.json, as written (a resolved one: nothing is re-checked)."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from None


def _flat_reader(sec: str, name: str) -> property:
    return property(lambda self: getattr(getattr(self, sec), name),
                    doc=f"``{sec}.{name}`` (a flat option's name)")


for _key, (_sec, _name) in FLAT.items():
    if _key not in SECTIONS:
        setattr(RunConfig, _key, _flat_reader(_sec, _name))


def with_environment(raw: RunConfig) -> RunConfig:
    """``raw`` with the environment's overrides that belong to the run written in
    (``STALWART_FEC`` -> ``comm.fec`` when not given): called by the one resolving process
    before ``resolve``, so that config.json records them and ranks need not read them."""
    fec = envknobs.fec()
    if raw.comm.fec is None and fec:
        return replace(raw, comm=replace(raw.comm, fec=fec))
    return raw


# ---- resolve: defaults filled, every value checked, once --------------------------------------
def resolve(raw: RunConfig) -> RunConfig:
    """``raw`` with its defaults filled and every value checked: the run's configuration.

    Pure and idempotent (``resolve(resolve(c)) == resolve(c)``); reads the file system only to
    check ``data`` and ``script``. ConfigError (one line naming the value) on the first bad
    one. Cost: microseconds, plus compiling a ``--script``.
    """
    _check_job(raw)
    cfg = _filled(raw)
    _check_train(cfg)
    _check_testbed(cfg)
    for problem in cfg.detect.problems() + cfg.policy.problems():
        raise ConfigError(problem)
    for spec in cfg.testbed.faults:
        fault = cfg.parse_fault(spec)  # ConfigError naming the bad part
        _need(fault.back_s is None or cfg.job.script is not None,
              f"back= in fault {spec!r} needs --script (stalwart's own trainer takes a "
              "lost rank's host back by itself: docs/mitigate.md)")
    if cfg.job.script is not None or cfg.job.script_args:
        _check_script_run(cfg)
    return cfg


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _choice(value: str, flag: str, modes: tuple[str, ...]) -> None:
    _need(value in modes, f"unknown {flag} {value!r} (choose from {', '.join(modes)})")


def _check_job(cfg: RunConfig) -> None:
    """What the defaults are computed from: sizes and modes."""
    j, t = cfg.job, cfg.train
    _need(j.nproc >= 1, f"--nproc must be >= 1, got {j.nproc}")
    _need(t.tp >= 1, f"--tp must be >= 1, got {t.tp}")
    _need(j.nproc % t.tp == 0, f"--nproc {j.nproc} is not a multiple of --tp {t.tp}")
    _need(t.steps >= 0, f"--steps must be >= 0, got {t.steps}")
    _need(t.preset in PRESETS,
          f"unknown preset {t.preset!r} (choose from {', '.join(PRESETS)})")
    _choice(cfg.comm.mode, "--comm", COMM_MODES)
    if cfg.comm.fec is not None:
        _choice(cfg.comm.fec, "fec", FEC_MODES)
    _choice(cfg.testbed.kind, "--testbed", TESTBEDS)
    _choice(cfg.policy.mode, "--mitigate", MITIGATE_MODES)
    _choice(cfg.testbed.cpu_cap, "--cpu-cap", CPU_CAP_MODES)
    _choice(cfg.overlap.mode, "--overlap", OVERLAP_MODES)
    _need(cfg.overlap.mode == "off" or t.tp > 1, "--overlap si needs --tp >= 2")
    _need(t.data is None or Path(t.data).exists(), f"data path does not exist: {t.data}")
    _need(j.name is None or bool(_NAME_RE.match(j.name)),
          f"invalid run name {j.name!r} (letters, digits, '.', '_', '-')")
    _need(t.micro_batches >= 1, f"--micro-batches must be >= 1, got {t.micro_batches}")
    _need(j.hosts is None or (len(j.hosts) == j.nproc and len(set(j.hosts)) == j.nproc
                              and all(h >= 0 for h in j.hosts)),
          f"hosts must name {j.nproc} distinct hosts, got {j.hosts}")
    _need(j.threads >= 1, f"--threads must be >= 1, got {j.threads}")
    _choice(j.device, "--device", DEVICE_MODES)


def _filled(cfg: RunConfig) -> RunConfig:
    """The preset's and the launch's defaults written in (the batch sizes fixed for the run)."""
    bs = cfg.resolved_batch_size()
    _need(bs >= 1, f"--batch-size must be >= 1, got {bs}")
    mbs = cfg.resolved_micro_batch_size()
    _need(mbs >= 1, f"--micro-batch-size must be >= 1, got {mbs}")
    train = replace(cfg.train, batch_size=bs, lr=cfg.resolved_lr(), micro_batch_size=mbs,
                    global_batch=cfg.resolved_global_batch())
    enabled = cfg.detect.enabled
    detect = replace(cfg.detect, enabled=cfg.job.script is None if enabled is None
                     else bool(enabled))
    return replace(cfg, train=train, detect=detect)


def _check_train(cfg: RunConfig) -> None:
    t = cfg.train
    assert t.lr is not None and t.global_batch is not None and t.micro_batch_size is not None
    _need(t.lr > 0, f"--lr must be > 0, got {t.lr}")
    gb, mbs = t.global_batch, t.micro_batch_size
    _need(gb >= 1, f"--global-batch must be >= 1, got {gb}")
    _need(gb % mbs == 0,
          f"--micro-batch-size {mbs} does not divide the global batch of {gb} samples")
    floor = 2 if t.tp > 1 else 1
    _need(gb // mbs >= floor * cfg.dp_size(),
          f"--micro-batch-size {mbs}: {gb // mbs} micro-batches per step is fewer than "
          f"{floor} per data-parallel rank ({cfg.dp_size()} ranks)")
    _need(t.warmup >= 0, f"--warmup must be >= 0, got {t.warmup}")
    _need(t.eval_every >= 1, f"--eval-every must be >= 1, got {t.eval_every}")
    _need(t.eval_batches >= 1, f"--eval-batches must be >= 1, got {t.eval_batches}")
    _need(t.ckpt_every >= 1, f"--ckpt-every must be >= 1, got {t.ckpt_every}")
    _need(t.halt_at is None or 0 <= t.halt_at <= t.steps,
          f"--halt-at must be in [0, steps={t.steps}], got {t.halt_at}")
    _need(cfg.comm.mode == "reliable" or t.tp == 1, "--comm lossy needs --tp 1")


def _check_testbed(cfg: RunConfig) -> None:
    tb = cfg.testbed
    _need(tb.mtu in range(576, 65536), f"--mtu must be in [576, 65535], got {tb.mtu}")
    _need(1 <= tb.ranks_per_host <= 64,
          f"--ranks-per-host must be in [1, 64], got {tb.ranks_per_host}")
    _need(tb.ranks_per_host == 1 or tb.kind == "netns",
          f"--ranks-per-host {tb.ranks_per_host} needs --testbed netns (the local "
          "testbed runs every rank on this one machine)")


def _check_script_run(cfg: RunConfig) -> None:
    """A user's own torchrun script as the ranks (``--script PATH -- ARGS``)."""
    j = cfg.job
    if j.script is None:
        raise ConfigError(f"script arguments {' '.join(j.script_args)!r} after -- need "
                          "--script PATH")
    check_script(j.script)
    for key, flag, default in _WORKLOAD_ONLY:
        sec, name = FLAT[key]
        value = getattr(getattr(cfg, sec), name)
        if value != default:
            shown = "" if isinstance(value, bool) else f" {value}"
            raise ConfigError(f"{flag}{shown} does not apply to --script runs (it "
                              "configures stalwart's own training workload)")
    if not cfg.detect.enabled:
        for spec in cfg.testbed.faults:
            if cfg.parse_fault(spec).uses_steps:
                raise ConfigError(
                    f"fault {spec!r} counts steps, and a script's steps are the monitor's "
                    "iterations: add --detect, or give the window in seconds (start=20s)")
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
