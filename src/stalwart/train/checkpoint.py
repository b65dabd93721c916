"""Atomic, resumable checkpoints: one file per rank per saved step, and a LATEST pointer.

Layout: ``checkpoints/step-NNNNNN/rank-R.pt`` holding the model, the optimizer (for sharded
optimizers: this rank's shard), the RNG states and the step counter (the data position: batches
are a pure function of the step, see train/data.py), plus a fingerprint of everything that must
match for a resume to be meaningful. Each file is written to a temporary name, fsynced and
renamed; ``LATEST`` is rewritten the same way by rank 0 only after every rank has saved, so a
crash at any moment leaves the previous complete checkpoint as the one to resume from.
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


def fingerprint(cfg: RunConfig) -> dict[str, Any]:
    """What a checkpoint and the run resuming it must agree on."""
    return {
        "preset": cfg.preset, "nproc": cfg.nproc, "tp": cfg.tp, "comm": cfg.comm,
        "seed": cfg.seed, "batch_size": cfg.resolved_batch_size(),
        "model": PRESETS[cfg.preset]["model"].to_dict(),
    }


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:06d}"


def save_rank(run_dir: Path, step: int, rank: int, cfg: RunConfig, model: torch.nn.Module,
              optimizer: Any) -> Path:
    state = {
        "step": step,
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
    path = step_dir(run_dir, step) / f"rank-{rank}.pt"
    atomic_write_bytes(path, buf.getvalue())
    return path


def mark_latest(run_dir: Path, step: int) -> None:
    atomic_write_text(Path(run_dir) / CHECKPOINTS / LATEST, f"{step}\n")


def latest_step(run_dir: Path) -> int:
    """The step of the newest complete checkpoint; ConfigError when there is none or it is bad."""
    p = Path(run_dir) / CHECKPOINTS / LATEST
    if not p.exists():
        raise ConfigError(f"no checkpoint to resume in {Path(run_dir) / CHECKPOINTS}")
    try:
        return int(p.read_text().strip())
    except ValueError:
        raise ConfigError(f"corrupt checkpoint pointer: {p}") from None


def load_rank(run_dir: Path, rank: int, cfg: RunConfig) -> dict[str, Any]:
    """Load and check this rank's part of the latest checkpoint (ConfigError when unusable)."""
    step = latest_step(run_dir)
    path = step_dir(run_dir, step) / f"rank-{rank}.pt"
    if not path.exists():
        raise ConfigError(f"checkpoint is missing rank {rank}: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
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


def validate_resume(cfg: RunConfig) -> int:
    """Check every rank's file of the latest checkpoint before any rank starts; its step."""
    step = latest_step(cfg.run_dir)
    for rank in range(cfg.nproc):
        load_rank(cfg.run_dir, rank, cfg)
    return step


def restore_rng(state: dict[str, Any]) -> None:
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
