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

from stalwart.train.model import PRESETS

COMM_MODES = ("reliable", "lossy")
TESTBEDS = ("local", "netns")
MITIGATE_MODES = ("off", "auto", "rebalance")
OVERLAP_MODES = ("off", "si")
CPU_CAP_MODES = ("auto", "fair", "off")
FAULT_KINDS = ("compute", "contention", "link", "pairlink", "loss")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class ConfigError(ValueError):
    """Bad user input. The message is one line that names the bad value."""


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
        need(self.comm == "reliable" or self.tp == 1, "--comm lossy needs --tp 1")
        from stalwart.devices import DEVICE_MODES

        need(self.device in DEVICE_MODES,
             f"unknown --device {self.device!r} (choose from {', '.join(DEVICE_MODES)})")
        from stalwart.testbed.faults import parse_fault

        hosts = max(self.hosts) + 1 if self.hosts else self.nproc  # faults name hosts
        for spec in self.faults:
            parse_fault(spec, hosts, self.testbed)  # ConfigError naming the bad part
        if self.script is not None or self.script_args:
            from stalwart.script import validate_script_run

            validate_script_run(self)
        return self

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: Path) -> None:
        from stalwart.rundir import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, d: dict) -> RunConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown config keys: {', '.join(sorted(unknown))}")
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
