"""The built-in job on ``stalwart.elastic``: ``stalwart.train.worker`` under torchrun with
``STALWART_STORE`` set -- one ``torchrun --standalone`` per node, joined by stalwart's
membership store (docs/elastic.md) -- so that a node killed leaves the other nodes' ranks
training in place (none restarted, nothing redone but the step in flight) and a node started
again with the same line joins live.

The training is the built-in job's: the same model, corpus, learning-rate schedule, AdamW and
gradient clipping; each step's ``M`` micro-batches (the global batch) are split over the
generation's ranks by ``elastic.Job`` and each micro-batch's loss is weighted ``1 / M``, so a
step trains on the same samples at any world size. Rank 0 of each generation evaluates (the
fixed validation batches, no collective) and ``elastic.Job`` checkpoints
(``RUN_DIR/elastic-checkpoint.pt``, every ``--ckpt-every`` steps, resumed from when the job
starts again).

Data parallel only: ``--tp``, ``--comm lossy``, ``--overlap``, ``--mitigate`` and faults are
refused with one line (exit 2) -- those need ``stalwart run``; the straggler detector does not
run on this path (``--detect`` is ignored: a ``Monitor`` needs the default process group).
Output: ``metrics.jsonl`` (one line per rank per step: ``step``, ``rank``, ``world``,
``generation``, ``loss``, ``step_time``, ``samples``, ``tokens_per_s``, ``time``),
``events.jsonl`` (``run_started``, ``eval``, ``run_finished``)
and ``config.json`` in the run directory, which must be shared by the nodes to hold every
rank's lines.

Costs: ``elastic.Job``'s (one flat copy of the gradients and one all-reduce per step; a regroup
per membership change).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from stalwart import envknobs
from stalwart.config import ConfigError, RunConfig, resolve, with_environment
from stalwart.rundir import CONFIG, METRICS, EventLog, JsonlWriter
from stalwart.train.data import load_corpus, micro_batch, step_starts, val_batches
from stalwart.train.model import GPT, PRESETS
from stalwart.train.rank import lr_at

STORE_ENV = "STALWART_STORE"
CHECKPOINT = "elastic-checkpoint.pt"
# what the elastic path cannot do, and the flag that asks for it
_UNSUPPORTED = (("tp", 1, "--tp"), ("comm", "reliable", "--comm"),
                ("overlap", "off", "--overlap"), ("mitigate", "off", "--mitigate"))


def wanted(env: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """The worker runs on the membership store: ``STALWART_STORE`` set and no launcher of
    ours (``stalwart run`` gives its own ranks ``STALWART_RUN_DIR``)."""
    return bool(env.get(STORE_ENV)) and envknobs.run_dir(env) is None


def check(cfg: RunConfig) -> None:
    """One line (ConfigError) for an option this path cannot honour."""
    flat = cfg.to_dict()
    for name, plain, flag in _UNSUPPORTED:
        if flat[name] != plain:
            raise ConfigError(f"{flag} {flat[name]} is not available on the elastic "
                              f"membership store ({STORE_ENV} set): data parallel only; run "
                              "it under `stalwart run`, or without the store")
    if cfg.testbed.faults:
        raise ConfigError("--fault needs `stalwart run` (the launcher applies faults)")


class _Training:
    """The built-in job's pieces in this process: model, optimizer, corpus, validation set,
    and the step's micro-batches (``micro`` of ``mbs`` samples)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.corpus = load_corpus(cfg.train.data, cfg.train.max_data_bytes)
        self.m = PRESETS[cfg.train.preset]["model"]
        torch.manual_seed(cfg.train.seed)
        self.model = GPT(self.m)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.resolved_lr(),
                                     betas=(0.9, 0.95), weight_decay=cfg.train.weight_decay)
        self.micro, self.mbs = cfg.global_micro_batches(), cfg.resolved_micro_batch_size()
        self.gb = cfg.resolved_global_batch()
        self.val = val_batches(self.corpus, cfg.train.eval_batches, cfg.resolved_batch_size(),
                               self.m.block_size, cfg.train.seed)

    def forward_backward(self, job: Any, step: int, lr: float) -> tuple[float, int]:
        """This member's micro-batches of ``step`` at learning rate ``lr``, each loss weighted
        ``1 / M``; (the summed weighted loss, micro-batches computed)."""
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        starts = step_starts(self.corpus, self.gb, self.m.block_size, self.cfg.train.seed, step)
        total, n = 0.0, 0
        for idx in job.my_batch(step):
            for i in idx:  # the step's global micro-batch i - step * M (job.py's indices)
                _, loss = self.model(*micro_batch(self.corpus, starts, self.mbs,
                                                  self.m.block_size, i - step * self.micro))
                loss = loss * job.weight(1)
                loss.backward()
                total += float(loss.detach())
                n += 1
        return total, n

    def evaluate(self) -> float:
        """Mean loss over the fixed validation batches, in this process alone."""
        self.model.eval()
        with torch.no_grad():
            losses = [float(self.model(x, y)[1]) for x, y in self.val]
        self.model.train()
        return sum(losses) / len(losses)


def train_elastic(cfg: RunConfig) -> int:
    """Train ``cfg``'s job as a member of the elastic job at ``STALWART_STORE``; 0 when it
    trained to the end, 2 when refused (another configuration or code), 1 on the job's loss
    (the store gone: the message names the checkpoint)."""
    from stalwart import elastic

    check(cfg)
    # the global batch is the job's, whatever this node's share: sized for the first
    # generation's world (STALWART_MIN_WORLD), as `stalwart run --nproc N` would. No launcher
    # and no rank 0 yet: each node resolves the same options alike, and the store refuses a
    # node whose job identity (below) differs
    cfg = resolve(with_environment(replace(cfg, job=replace(cfg.job,
                                                             nproc=envknobs.min_world()))))
    torch.set_num_threads(cfg.job.threads)
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / CONFIG).exists():
        cfg.save(run_dir / CONFIG)
    t = _Training(cfg)
    # the job's identity: everything that changes the training (not where it writes)
    ident = {k: v for k, v in cfg.to_dict().items()
             if k not in ("out", "name", "threads", "resume", "nproc")}
    try:
        job = elastic.Job(t.model, t.opt, global_batch=t.micro, config=ident,
                          checkpoint=run_dir / CHECKPOINT, checkpoint_every=cfg.train.ckpt_every,
                          grad_clip=cfg.train.grad_clip)
    except elastic.ElasticError as e:  # Refused: another configuration or code version
        print(e, file=sys.stderr)
        return 2 if isinstance(e, elastic.Refused) else 1
    events, metrics = EventLog(run_dir), JsonlWriter(run_dir / METRICS)
    if job.rank == 0 and job.step == 0:
        events.log("run_started", nproc=job.world, launcher="torchrun+elastic",
                   store=envknobs.get(STORE_ENV))
    try:
        for step in job.steps(cfg.train.steps):
            t0 = time.perf_counter()
            lr = lr_at(step, cfg)
            total, n = t.forward_backward(job, step, lr)
            if not job.commit(total):
                continue  # a member was lost mid-step: the step comes again
            dt = time.perf_counter() - t0
            tokens = n * t.mbs * t.m.block_size
            metrics.write({"step": step, "rank": job.rank, "world": job.world,
                           "generation": job.generation, "time": time.time(),
                           "loss": job.loss, "lr": lr, "step_time": dt,
                           "samples": n * t.mbs, "tokens": tokens, "tokens_per_s": tokens / dt,
                           "host": job.node})
            if job.rank == 0 and ((step + 1) % cfg.train.eval_every == 0
                                  or step + 1 == cfg.train.steps):
                events.log("eval", step=step + 1, val_loss=t.evaluate())
    except elastic.ElasticError as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        metrics.close()
    if job.rank == 0:
        events.log("run_finished", ok=True, exit_code=0)
    events.close()
    return 0
