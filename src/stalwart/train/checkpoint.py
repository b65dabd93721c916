"""Atomic, resumable checkpoints: one file per rank per saved step, and a LATEST pointer.

Layout: ``checkpoints/step-NNNNNN/rank-R.pt`` holding the model, the optimizer (for sharded
optimizers: this rank's shard), the RNG states, the world size and the step counter (the data
position: batches are a pure function of the step and the global micro-batch index, see
train/data.py), plus a fingerprint of everything that must match for a resume to be
meaningful -- the global batch, not the world size.

Another world size (mitigation's S4 restarts without a host, and back): with data parallelism
over reliable collectives every rank holds the same model and AdamW state, so a rank of the new
world reads the file of rank ``rank % tp`` of the saved world (tensor-parallel shards follow
their TP index; the DP replica does not matter). RNG states come with it: training draws no
random numbers after initialisation (batches are indexed, dropout is off). The lossy
optimizer's state is sharded by owner and a checkpoint holds each rank's shard only:
resuming it at another world size is refused with a clear error. A lossy job changes its
world in place instead (S4, a host taken back, a dead rank: the live ranks re-shard the
owners' state between them, comm/optim.py ``full_state``), and a lossy job whose in-place
regroup fails stops rather than relaunch (mitigate/fallback.py).

Each file is written to a temporary name, fsynced and renamed; ``LATEST`` is rewritten the same
way by rank 0 only after every rank has saved, so a crash at any moment leaves the previous
complete checkpoint as the one to resume from. Just before it, rank 0 records in the step's
folder how many ranks wrote it (``WORLD``): a job that died while saving a step at one world
size and saved the same step again at another (an elastic torchrun restart) leaves the dead
incarnation's extra rank files behind, so counting files would name the wrong world.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stalwart.config import ConfigError, RunConfig
from stalwart.rundir import CHECKPOINTS, atomic_write_bytes, atomic_write_text
from stalwart.train.model import PRESETS

LATEST = "LATEST"
WORLD = "WORLD"


def fingerprint(cfg: RunConfig) -> dict[str, Any]:
    """What a checkpoint and the run resuming it must agree on."""
    return {
        "preset": cfg.train.preset, "global_batch": cfg.resolved_global_batch(), "tp": cfg.train.tp,
        "comm": cfg.comm.mode, "seed": cfg.train.seed,
        "model": PRESETS[cfg.train.preset]["model"].to_dict(),
    }


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:06d}"


def save_rank(run_dir: Path, step: int, rank: int, cfg: RunConfig, model: torch.nn.Module,
              optimizer: Any) -> Path:
    path = step_dir(run_dir, step) / f"rank-{rank}.pt"
    save_state(path, step, cfg, model, optimizer)
    return path


def save_state(path: Path, step: int, cfg: RunConfig, model: torch.nn.Module,
               optimizer: Any) -> None:
    """One rank's file (atomic): what ``load_rank`` reads back."""
    state = {
        "step": step,
        "world": cfg.job.nproc,
        "fingerprint": fingerprint(cfg),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        },
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(path, buf.getvalue())


def mark_latest(run_dir: Path, step: int, world: int | None = None) -> None:
    """Point LATEST at ``step`` once all ``world`` ranks have saved it (rank 0 only)."""
    if world is not None:
        atomic_write_text(step_dir(run_dir, step) / WORLD, f"{world}\n")
    atomic_write_text(Path(run_dir) / CHECKPOINTS / LATEST, f"{step}\n")


def has_checkpoint(run_dir: Path) -> bool:
    """Whether a complete checkpoint exists (LATEST is written last)."""
    return (Path(run_dir) / CHECKPOINTS / LATEST).exists()


def latest_step(run_dir: Path) -> int:
    """The step of the newest complete checkpoint; ConfigError when there is none or it is bad."""
    p = Path(run_dir) / CHECKPOINTS / LATEST
    if not p.exists():
        raise ConfigError(f"no checkpoint to resume in {Path(run_dir) / CHECKPOINTS}")
    try:
        return int(p.read_text().strip())
    except ValueError:
        raise ConfigError(f"corrupt checkpoint pointer: {p}") from None


def load_rank(run_dir: Path, rank: int, cfg: RunConfig, device: Any = "cpu") -> dict[str, Any]:
    """Load and check this rank's part of the latest checkpoint (ConfigError when unusable),
    its tensors onto ``device`` (the rank's own: a checkpoint saved on another device loads)."""
    step = latest_step(run_dir)
    saved_world = _saved_world(step_dir(run_dir, step))
    if saved_world is not None and saved_world != cfg.job.nproc:
        if cfg.comm.mode == "lossy":
            raise ConfigError(f"checkpoint at step {step} was saved by {saved_world} ranks; "
                              f"the lossy optimizer's sharded state cannot resume at "
                              f"{cfg.job.nproc}")
        rank = rank % cfg.train.tp  # replicated over data parallelism: any replica's file
    path = step_dir(run_dir, step) / f"rank-{rank}.pt"
    if not path.exists():
        raise ConfigError(f"checkpoint is missing rank {rank}: {path}")
    try:
        state = torch.load(path, map_location=device, weights_only=False)
        assert isinstance(state, dict) and "model" in state and "fingerprint" in state
    except Exception:
        raise ConfigError(f"corrupt checkpoint: {path}") from None
    want, have = fingerprint(cfg), state["fingerprint"]
    for key in want:
        if want[key] != have.get(key):
            raise ConfigError(
                f"checkpoint {path} does not match this run: {key}={have.get(key)!r} in the "
                f"checkpoint, {key}={want[key]!r} now"
            )
    return state


def _saved_world(folder: Path) -> int | None:
    """How many ranks wrote this checkpoint (WORLD; older checkpoints: their rank files)."""
    try:
        return int((folder / WORLD).read_text().strip())
    except (OSError, ValueError):
        pass
    n = len(list(folder.glob("rank-*.pt")))
    return n or None


def validate_resume(cfg: RunConfig) -> int:
    """Check every rank's file of the latest checkpoint before any rank starts; its step."""
    step = latest_step(cfg.run_dir)
    for rank in range(cfg.job.nproc):
        load_rank(cfg.run_dir, rank, cfg)
    return step


def restore_rng(state: dict[str, Any]) -> None:
    rng = state["rng"]
    torch.set_rng_state(rng["torch"].cpu())  # a checkpoint loaded onto a GPU moved it there
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
