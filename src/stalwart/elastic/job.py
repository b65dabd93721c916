"""``elastic.Job``: fail-stop survival, live rejoin and rebalancing for a user's own training
loop, in a handful of changed lines (docs/elastic.md)::

    job = elastic.Job(model, optimizer, global_batch=64)
    for step in job.steps(num_steps):         # a step whose world changed is given again
        optimizer.zero_grad()
        for idx in job.my_batch(step):        # this rank's sample indices of the step
            loss = loss_fn(model(x[idx]), y[idx]) * job.weight(len(idx))
            loss.backward()
        job.commit()                          # sum the weighted gradients, optimizer.step()

Guarantees: every step trains on the same global batch -- sample indices
``step * global_batch + 0 .. global_batch - 1``, split over the ranks of the step's generation
(contiguous, by weight) -- whatever the world; ``weight(n) = n / global_batch`` makes the sum
of the ranks' gradients that of the mean loss over the global batch when ``loss_fn`` is a mean
over its samples. A step is applied on every member or on none: when a member is lost, the
step in flight is given up and trained again by the survivors (nothing else redone, nothing
skipped); a joiner (a node started again) gets the model and optimizer state of a member and
trains from the next step. The user's model is a plain module (no DDP wrapper): ``commit``
does the gradient all-reduce, over the generation's gloo group.

Costs: one flat copy of the gradients and one all-reduce per step; a regroup costs one
round of store acks, one group built, and -- only for members behind or fresh -- one
broadcast of the model and optimizer state.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from stalwart import heartbeat
from stalwart.elastic import launcher
from stalwart.elastic import protocol as P
from stalwart.elastic.errors import ElasticError, Refused, StoreLost, UsageError
from stalwart.elastic.rank import Runtime, Superseded
from stalwart.elastic.store import Keys, client, locate, serve
from stalwart.hostaddr import route_source

JOIN_TIMEOUT_S = 600.0
# test hook (tests/elastic): a member with this set to G exits right after acking a generation
# >= G, i.e. dies in the middle of a regroup
TEST_EXIT_ENV = "STALWART_ELASTIC_TEST_EXIT_AFTER_ACK"


class Job:
    """This process's membership in an elastic data-parallel job (module docstring).

    ``min_world``: members the first generation waits for (default: ``STALWART_MIN_WORLD``,
    else torchrun's ``WORLD_SIZE``). ``micro_batch``: the most samples ``my_batch`` yields at
    once. ``config``: the run's configuration; a process whose config, global batch, model
    shapes or script differ from the job's is refused. ``checkpoint``: a file the job saves to
    every ``checkpoint_every`` steps (atomically, by the generation's rank 0) and resumes
    from; named in the error when the store is lost. ``grad_clip``: the summed gradients'
    total norm is clipped to it before ``optimizer.step()`` (every member clips the same
    sum, so they stay equal).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 global_batch: int, *, micro_batch: int | None = None,
                 min_world: int | None = None, config: Mapping[str, Any] | None = None,
                 checkpoint: str | os.PathLike[str] | None = None, checkpoint_every: int = 0,
                 grad_clip: float | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        if global_batch < 1:
            raise ValueError(f"global_batch={global_batch} must be at least 1")
        self.model, self.optimizer = model, optimizer
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.checkpoint = Path(checkpoint) if checkpoint else None
        self.checkpoint_every = checkpoint_every
        self.grad_clip = grad_clip
        e = dict(os.environ if env is None else env)
        host, port, serve_here, prefix = locate(e)
        self._server = serve(host, port) if serve_here else None
        if self._server is not None:
            port = self._server.port
        self.store_addr = f"{host}:{port}"
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._identity = self._identity_of(config)
        self._claim(host, port, prefix)
        world = int(e.get("STALWART_MIN_WORLD") or e.get("WORLD_SIZE") or 1)
        bind = e.get("STALWART_HOST_ADDR") or (host if host.startswith("127.")
                                               else route_source(host, port))
        node = e.get("STALWART_NODE") or (f"host{e['STALWART_HOST']}" if e.get("STALWART_HOST")
                                          else f"{socket.gethostname()}/{os.getppid()}")
        self.rt = Runtime(host, port, prefix, node, int(e.get("LOCAL_RANK", "0")), bind,
                          min_world if min_world is not None else world)
        self.step = 0
        self.gen: P.Generation | None = None
        self.pg: Any = None
        self.loss: float | None = None  # the global batch's loss of the last commit
        self.samples = 0  # samples this member computed in the last step it gave out
        self._has_state = False
        self._phase = P.IDLE
        self._resume()
        self._regroup()
        heartbeat.ready()  # under `stalwart run`: judged at SILENT_S from now (heartbeat.py)
        # under `stalwart run`: the launcher goes on without this process if it dies, and
        # follows its steps (elastic/launcher.py)
        run_dir = launcher.run_dir_of(e)
        self._iters: launcher.IterationLog | None = None
        if run_dir is not None:
            launch_rank = int(e.get("RANK", "0"))
            launcher.announce(run_dir, launch_rank, self.rt.me.id)
            self._iters = launcher.IterationLog(run_dir, launch_rank)

    # ---- identity ----------------------------------------------------------------------------
    def _identity_of(self, config: Mapping[str, Any] | None) -> dict[str, str]:
        script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
        code = hashlib.sha256(script.read_bytes()).hexdigest()[:12] \
            if script is not None and script.is_file() else "interactive"
        shapes = hashlib.sha256(str([tuple(p.shape) for p in self._params]).encode()
                                ).hexdigest()[:12]
        cfg = hashlib.sha256(json.dumps(dict(config or {}), sort_keys=True, default=str)
                             .encode()).hexdigest()[:12]
        return {"code version": code, "run configuration": cfg,
                "global batch": str(self.global_batch), "model shapes": shapes}

    def _claim(self, host: str, port: int, prefix: str) -> None:
        keys = Keys(client(host, port, prefix), f"{host}:{port}")
        job = json.loads(keys.claim_config(json.dumps(self._identity)))
        why = P.mismatch(self._identity, job)
        if why is not None:
            raise Refused(f"stalwart elastic: refused to join the job at {host}:{port}: {why}")
        done = keys.finished()
        if done is not None:
            raise ElasticError(f"stalwart elastic: the job at {host}:{port} already finished "
                               f"({done} steps); nothing to join")

    # ---- the user's calls --------------------------------------------------------------------
    def steps(self, num_steps: int) -> Iterator[int]:
        """The steps still to train, from where the job is; a step given up (a member lost
        while it was in flight) is given again. Leaves the job cleanly at the end."""
        if self._phase != P.IDLE:
            raise UsageError("job.steps() called again (iterate it once per job)")
        try:
            while True:
                self._check()
                if self.step >= num_steps:  # done: a change now (a member left) is moot
                    break
                if self._newer():
                    self._regroup()
                if self.step >= num_steps:
                    break
                self._phase = P.COMPUTE
                at = self.step
                yield at
                if self._phase == P.COMPUTE:
                    raise UsageError(f"job.commit() was not called in step {at} (call it "
                                     "once at the end of every step)")
        except GeneratorExit:
            return
        self._phase = P.FINISHED
        with contextlib.suppress(StoreLost):
            self.rt.keys.finish(num_steps)
        self.close()

    def my_batch(self, step: int) -> Iterator[list[int]]:
        """This member's sample indices of ``step``'s global batch, in micro-batches. Stops
        early when a member was lost meanwhile (``commit`` then returns False)."""
        self._order("my_batch", asked=step)
        assert self.gen is not None
        mine = P.shares(self.global_batch, self.gen)[self.rt.me.id]
        chunks = P.micro_batches(mine, step, self.global_batch, self.micro_batch)
        self.samples = len(mine)
        for c in chunks:
            if self._lost_member():
                return
            yield c

    def weight(self, n: int) -> float:
        """The factor that makes a mean loss over ``n`` of this step's samples its exact share
        of the global batch's mean loss: ``n / global_batch``."""
        self._order("weight")
        return n / self.global_batch

    def commit(self, loss: float | torch.Tensor | None = None) -> bool:
        """Sum the members' (weighted) gradients and apply ``optimizer.step()``. ``loss``: this
        member's weighted loss, summed into ``job.loss``. False: the step was given up (a
        member was lost) and will be given again; the gradients are then not applied."""
        self._order("commit")
        assert self.gen is not None
        if self._lost_member():
            self._phase = P.REDO
            return False
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                 for p in self._params]
        lv = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss or 0.0)
        flat = torch.cat([g.detach().to("cpu", torch.float32) for g in grads]
                         + [torch.tensor([lv])])
        step = self.step
        work = self.pg.allreduce([flat])
        try:
            self.rt.wait_work(work, lambda: self._must_abandon(step))
        except Superseded:
            if not _succeeded(work):  # (it may have finished meanwhile: then apply it)
                self._phase = P.REDO
                return False
        except StoreLost as e:
            raise self._store_lost(e) from None
        off = 0
        for p in self._params:
            n = p.numel()
            g = flat[off:off + n].view_as(p).to(p.device, p.dtype)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.copy_(g)
            off += n
        self.loss = float(flat[-1])
        if self.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self._params, self.grad_clip)
        self.optimizer.step()
        self.rt.progress = self.step
        self.step += 1
        self._has_state = True
        self._phase = P.COMMITTED
        self._save()
        if self._iters is not None:
            self._iters.step(step, self.rank, self.world, self.generation)
        return True

    # ---- what the user may read --------------------------------------------------------------
    @property
    def world(self) -> int:
        return len(self.gen.members) if self.gen else 0

    @property
    def generation(self) -> int:
        return self.gen.gen if self.gen else -1

    @property
    def rank(self) -> int:
        return self.gen.rank_of(self.rt.me.id) if self.gen else -1

    @property
    def member(self) -> int:
        return self.rt.me.id

    @property
    def node(self) -> str:
        return self.rt.node

    # ---- S2 / S4: calls a mitigation policy drives -------------------------------------------
    def rebalance(self, weights: Mapping[str, float]) -> None:
        """S2: per-node weights of the batch split (a node not named: 1.0), from the next
        generation on (one regroup without state transfer)."""
        bad = [n for n, w in weights.items() if not w > 0]
        if bad:
            raise ValueError(f"rebalance: the weight of node {bad[0]!r} must be above 0")
        self.rt.keys.set_weights(",".join(f"{n}={w}" for n, w in weights.items()))

    def park(self, node: str, on: bool = True) -> None:
        """S4: keep ``node``'s members out of the job (``on=False``: let them back in; they
        rejoin live and receive the state). The others train on in place."""
        self.rt.keys.park(node, on)

    # ---- membership changes ------------------------------------------------------------------
    def _newer(self) -> bool:
        n = self.rt.newest
        return n is not None and (self.gen is None or n.gen > self.gen.gen)

    def _parked(self) -> set[int]:
        """Members of this generation whose node is parked (alive: S4)."""
        assert self.gen is not None
        known, nodes = self.rt.known, self.rt.parked_nodes
        return {m for m in self.gen.members if m in known and known[m].node in nodes}

    def _lost_member(self) -> bool:
        n = self.rt.newest
        if self.gen is None or n is None or n.gen <= self.gen.gen:
            return False
        parked = self._parked()
        return any(m not in n.members and m not in parked for m in self.gen.members)

    def _must_abandon(self, step: int) -> bool:
        n = self.rt.newest
        if self.gen is None or n is None or n.gen <= self.gen.gen:
            return False
        return P.must_abandon(self.gen, n, step, self.rt.keys.acks(n, self.gen.members),
                              self._parked())

    def _regroup(self) -> None:
        """Move to the newest generation that holds this member: ack, settle, rebuild the
        group, take the state when behind. Repeats while newer generations come."""
        rt = self.rt
        while True:
            try:
                self._check()
                g = rt.newest
                if g is None or rt.me.id not in g.members:
                    if g is not None and self.gen is not None and rt.me.id in self.gen.members:
                        # left out (parked, or found hung): say where it stopped, so that
                        # members still in a collective with it give that up
                        rt.keys.ack(g.gen, rt.me.id, P.Ack(self.step - 1, False))
                    self._wait_admitted()
                    continue
                newer = self._newer_than(g.gen)
                rt.keys.ack(g.gen, rt.me.id, P.Ack(self.step - 1, not self._has_state))
                if g.gen >= int(os.environ.get(TEST_EXIT_ENV, "1000000000")):
                    os._exit(17)
                rt.wait_until(lambda g=g: rt.keys.all_acked(g), newer, poll_s=0.005)
                acks = rt.keys.acks(g)
                st = P.settle(g, acks)
                if all(a.fresh for a in acks.values()) and rt.keys.progress() >= 0:
                    raise self._state_lost(rt.keys.progress())
                pg = rt.rebuild(g, newer)
                if st.receivers:
                    state = rt.broadcast_state(pg, g, st, self._state, newer)
                    if state is not None:
                        self._load(state)
            except Superseded:
                continue
            except StoreLost as e:
                raise self._store_lost(e) from None
            rt.drop(self.pg)
            self.pg, self.gen, self.step = pg, g, st.start_step
            self._has_state = True
            return

    def _newer_than(self, gen: int) -> Any:
        return lambda: self.rt.newest is not None and self.rt.newest.gen > gen

    def _wait_admitted(self) -> None:
        """Wait to be in the newest generation. An id that a generation held and the newest
        does not is buried for good (dropped: found hung, parked, or lost while joining): come
        back under a new id, once the node is not parked."""
        rt = self.rt

        def buried() -> bool:
            return rt.buried(rt.me.id)

        while True:
            if buried():
                while rt.me.node in rt.keys.parked():
                    rt.check()
                    time.sleep(rt.heartbeat_s)
                rt.reregister()
            me = rt.me.id
            try:
                rt.wait_until(lambda me=me: rt.newest is not None and me in rt.newest.members,
                              buried, JOIN_TIMEOUT_S, "waiting to be admitted to the job")
                return
            except Superseded:
                continue

    def _state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def _load(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    # ---- checkpoints and errors --------------------------------------------------------------
    def _resume(self) -> None:
        if self.checkpoint is None or not self.checkpoint.is_file():
            return
        ck = torch.load(self.checkpoint, weights_only=False)
        self._load(ck)
        self.step = int(ck["step"])
        self._has_state = True

    def _save(self) -> None:
        if (self.checkpoint is None or self.checkpoint_every <= 0
                or self.step % self.checkpoint_every or self.rank != 0):
            return
        tmp = self.checkpoint.with_suffix(self.checkpoint.suffix + f".tmp{os.getpid()}")
        torch.save({**self._state(), "step": self.step}, tmp)
        os.replace(tmp, self.checkpoint)

    def _check(self) -> None:
        try:
            self.rt.check()
        except StoreLost as e:
            raise self._store_lost(e) from None

    def _state_lost(self, last: int) -> ElasticError:
        ck = (f"restart it from the checkpoint {self.checkpoint}" if self.checkpoint
              else "no checkpoint to restart from (pass checkpoint= to elastic.Job)")
        return ElasticError(f"stalwart elastic: every member that held the job's state is "
                            f"gone (it had completed step {last}): {ck}")

    def _store_lost(self, e: StoreLost) -> StoreLost:
        ck = (f"restart it from the checkpoint {self.checkpoint}" if self.checkpoint
              else "no checkpoint to restart from (pass checkpoint= to elastic.Job)")
        return StoreLost(f"stalwart elastic: {e}; the job cannot change its members any more "
                         f"(step {self.step}): {ck}")

    def _order(self, call: str, asked: int | None = None) -> None:
        why = P.order_error(call, self._phase, self.step, asked)
        if why is not None:
            raise UsageError(why)

    def close(self) -> None:
        """Leave the job (``steps()`` does it at its end). The member serving the store waits
        (at most a few seconds) for the others to leave first."""
        self.rt.close()
        if self._iters is not None:
            self._iters.close()
            self._iters = None
        if self._server is not None and self.gen is not None:
            keys = self.rt.keys
            deadline = time.monotonic() + 5.0
            with contextlib.suppress(StoreLost):
                while time.monotonic() < deadline and \
                        len(keys.left(list(self.gen.members))) < len(self.gen.members):
                    time.sleep(0.05)


def _succeeded(work: Any) -> bool:
    """Whether a collective given up has finished after all, without error."""
    if not work.is_completed():
        return False
    try:
        work.wait()
    except Exception:  # noqa: BLE001
        return False
    return True
