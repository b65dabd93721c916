"""The run directory and configuration of a rank started by torchrun (no launcher): rank 0
resolves the configuration and sets up the run directory as ``stalwart run`` would, and every
rank takes the configuration rank 0 resolved.

Guarantees: every rank ends with the same resolved ``RunConfig`` (the world size torchrun
gave, one global batch and micro-batch size, resume or not), or every rank raises the same
ConfigError (one line and exit 2 everywhere, no hang); an elastic incarnation trains on the
first incarnation's samples per step whatever its world size.

Cost: at start only, one all_gather_object and one broadcast_object_list; rank 0 reads and
writes config.json (and events.jsonl on a fresh start).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from stalwart import envknobs
from stalwart.config import ConfigError, RunConfig, check_writable, resolve, with_environment
from stalwart.rundir import CHECKPOINTS, CONFIG, EVENTS, METRICS, EventLog
from stalwart.train import checkpoint as ckpt


def prepare_run_dir_for_torchrun(raw: RunConfig, rank: int, world: int) -> RunConfig:
    """Under torchrun (no launcher), rank 0 resolves ``raw`` at this world size and sets up
    the run directory the launcher would; every rank returns the configuration it resolved.

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
    restarted = envknobs.torchelastic_restart_count()
    # a node that joins later starts at restart count 0 while the others restart: one rank's
    # restart makes the whole new world resume. all_gather_object works on gloo and NCCL.
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, raw.job.resume or restarted > 0)
    box: list[Any] = [None]
    if rank == 0:
        try:
            at_world = replace(raw, job=replace(raw.job, nproc=world))  # torchrun decides it
            box[0] = _torchrun_run_dir(at_world, any(flags), restarted).to_dict()
        except ConfigError as e:
            box[0] = str(e)  # every rank raises it: one line and exit 2 everywhere, no hang
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise ConfigError(box[0])
    return RunConfig.from_dict(box[0])


def _torchrun_run_dir(raw: RunConfig, resume: bool, restarted: int) -> RunConfig:
    """Rank 0's part: the resolved configuration (written to config.json)."""
    run_dir = raw.run_dir
    check_writable(run_dir)
    if resume and (run_dir / CONFIG).exists():
        first = RunConfig.load(run_dir / CONFIG).train
        # values given on this command line win (the checkpoint's fingerprint checks them)
        t = raw.train
        raw = replace(raw, train=replace(
            t, global_batch=first.global_batch if t.global_batch is None else t.global_batch,
            micro_batch_size=first.micro_batch_size if t.micro_batch_size is None
            else t.micro_batch_size))
    elif not resume and ((run_dir / METRICS).exists() or (run_dir / EVENTS).exists()):
        raise ConfigError(f"run directory already holds a run: {run_dir} "
                          "(pass --resume to continue it, or another --name)")
    from_ckpt = resume and ckpt.has_checkpoint(run_dir)
    cfg = resolve(with_environment(replace(raw, job=replace(raw.job, resume=from_ckpt))))
    cfg.save(run_dir / CONFIG)  # this incarnation's world size, the first one's global batch
    if not from_ckpt:
        if resume:
            print(f"stalwart: no checkpoint in {run_dir / CHECKPOINTS} yet: starting at step 0",
                  file=sys.stderr)
        events = EventLog(run_dir)
        events.log("run_started", nproc=cfg.job.nproc, launcher="torchrun", restart=restarted)
        events.close()
    return cfg
