"""The run directory of a rank started by torchrun (no launcher): rank 0 sets it up as
``stalwart run`` would, and every rank takes the same decisions -- resume or not, the global
batch and micro-batch size.

Guarantees: every rank ends with the same (global batch, micro-batch size, resume), or every
rank raises the same ConfigError (one line and exit 2 everywhere, no hang); an elastic
incarnation trains on the first incarnation's samples per step whatever its world size.

Cost: at start only, one all_gather_object and one broadcast_object_list; rank 0 reads and
writes config.json (and events.jsonl on a fresh start).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from stalwart.config import ConfigError, RunConfig
from stalwart.rundir import METRICS, EventLog
from stalwart.train import checkpoint as ckpt


def prepare_run_dir_for_torchrun(cfg: RunConfig, rank: int) -> Path:
    """Under torchrun (no launcher), rank 0 sets up the run directory the launcher would, and
    every rank takes its decisions (resume or not, global batch) so that none can differ.

    Elastic jobs (``torchrun --nnodes MIN:MAX``): when a node leaves or joins, torchrun stops
    every worker and starts them again at the new WORLD_SIZE with TORCHELASTIC_RESTART_COUNT
    > 0. Such an incarnation, like one started with --resume, continues from the latest
    checkpoint -- or starts at step 0 when there is none yet (the first incarnation may die
    before its first checkpoint; failing would only burn torchrun's restarts). The global
    batch and micro-batch size are resolved once, by the first incarnation, and kept in
    config.json: every later incarnation trains on the same samples per step whatever its
    world size (more or fewer micro-batches per rank), which is what the checkpoint's
    fingerprint requires.
    """
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    # a node that joins later starts at restart count 0 while the others restart: one rank's
    # restart makes the whole new world resume. all_gather_object works on gloo and NCCL.
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, cfg.resume or restarted > 0)
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = _torchrun_run_dir(cfg, any(flags), restarted)
        except ConfigError as e:
            box[0] = str(e)  # every rank raises it: one line and exit 2 everywhere, no hang
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise ConfigError(box[0])
    cfg.global_batch, cfg.micro_batch_size, cfg.resume = box[0]
    cfg.validate()  # e.g. too few micro-batches for a larger new world
    return cfg.run_dir


def _torchrun_run_dir(cfg: RunConfig, resume: bool, restarted: int) -> tuple[int, int, bool]:
    """Rank 0's part: (global batch, micro-batch size, resume from a checkpoint)."""
    from stalwart.config import check_writable
    from stalwart.rundir import CHECKPOINTS, CONFIG, EVENTS

    run_dir = cfg.run_dir
    check_writable(run_dir)
    if resume and (run_dir / CONFIG).exists():
        first = RunConfig.load(run_dir / CONFIG)
        # values given on this command line win (the checkpoint's fingerprint checks them)
        if cfg.global_batch is None:
            cfg.global_batch = first.global_batch
        if cfg.micro_batch_size is None:
            cfg.micro_batch_size = first.micro_batch_size
    elif not resume and ((run_dir / METRICS).exists() or (run_dir / EVENTS).exists()):
        raise ConfigError(f"run directory already holds a run: {run_dir} "
                          "(pass --resume to continue it, or another --name)")
    cfg.global_batch = cfg.resolved_global_batch()
    cfg.micro_batch_size = cfg.resolved_micro_batch_size()
    cfg.validate()
    from_ckpt = resume and ckpt.has_checkpoint(run_dir)
    cfg.resume = from_ckpt
    cfg.save(run_dir / CONFIG)  # this incarnation's world size, the first one's global batch
    if not from_ckpt:
        if resume:
            print(f"stalwart: no checkpoint in {run_dir / CHECKPOINTS} yet: starting at step 0",
                  file=sys.stderr)
        events = EventLog(run_dir)
        events.log("run_started", nproc=cfg.nproc, launcher="torchrun", restart=restarted)
        events.close()
    return cfg.global_batch, cfg.micro_batch_size, from_ckpt
