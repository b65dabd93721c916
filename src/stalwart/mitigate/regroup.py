"""Regroup in place: a rank's side of a membership change (membership.py), without a restart.

Mechanism, per rank:
1. A background thread waits on the launch's membership store for the next generation's key
   (elastic/ranklink.py: the store wakes it the moment the key is written). When the
   launcher announces a new generation (a rank lost), the thread *shuts down this process's
   TCP connections* (gloo's pairs and the monitor's row links; not listening sockets, not the
   old rendezvous store's, not the membership store's) and calls ``on_abort`` (a lossy job
   interrupts its UDP collective there: a phase would otherwise wait for the dead owner up
   to its deadline cap, then train on without it). That is what wakes a rank blocked in a
   collective: in a ring all-reduce only the dead rank's two neighbours get "connection
   reset"; the others wait on a live
   neighbour that has given up, until gloo's timeout (measured, torch 2.13: 30 s of a 30 s
   timeout). gloo's own
   ``ProcessGroup.abort()`` does not wake them, and its pairs close only when the group is
   freed, which the DDP reducer's hooks on the parameters prevent.
2. The step loop catches the failed collective (``is_comm_error``) and calls ``regroup``:
   wait for the generation (already there when the thread woke us), destroy the old process
   groups, and ``init_process_group`` again on a TCPStore that the generation's rank 0 serves
   (a fresh store per generation, its address in the generation's ``pg/<n>`` record: the old
   TCPStore lived in launch rank 0, which may be the dead one), with rank
   ``alive.index(slot)`` in a world of ``len(alive)``.
3. ``agree_state``: every rank says how many optimizer steps it has applied; the most advanced
   rank's model and optimizer state go to everyone (a live transfer, not a checkpoint). A
   ``--comm lossy`` job re-shards its owners' optimizer state instead (train/inplace.py
   ``_regroup_lossy``; comm/optim.py ``gather_full_state``). Ranks
   of a data-parallel job that lost a peer mid-step usually all stopped before ``opt.step``
   of that step; but a shutdown can catch a rank still receiving the last chunk of an
   all-reduce its peers have finished (measured on the testbed), and then it adopts their
   state.
A planned change (S3's new rank order, S4 without a host, a host taken back) takes the same
path without step 1:
rank 0 announces it at the agreed step (agreement.py), when every rank has finished the step
before, and every rank calls ``regroup`` there by itself (``PlannedRegroup``); a rank the new
generation leaves out gets ``NotAMember`` and exits. To take a host back live, the launcher
starts its launch rank again beforehand (``joining``, its ``--rejoin`` argument): it builds
its model and data, says it is ready (its ``ready/<slot>`` record), and waits in ``regroup``
for the generation that has it;
``agree_state`` then gives it the current parameters and optimizer state from a peer.

In a tensor-parallel job (S3; and fail-stop, where the dead rank's TP group leaves whole:
membership.survivors) ``agree_shards`` replaces step 3: the trainer is rebound to the new
TP and DP groups and each TP index's shard moves to the ranks that now hold that index and
did not before.

The caller then re-wraps DDP, rebuilds its work plan (the same global batch, more
micro-batches per survivor) and its monitor, zeroes the gradients of the failed step and
redoes it: at most the step in flight is lost.

A member that dies during a regroup (a rank started to rejoin, killed as it is taken back)
breaks the others' new connections before the launcher's word of it arrives: their regroup
waits for that word (``await_change``, at most ``CHANGE_WAIT_S``) and regroups again to the
generation without it, rather than counting its own regroup failed.

Guarantees: no rank waits on a dead peer longer than the launcher's poll (0.1 s) plus two
store round trips when the process died; when it did not (a host cut off), gloo's timeout
bounds the wait. A rank that is not a member of the new generation gets ``NotAMember``. Cost in
steady state: the watching thread (one wait request on the store per ``WATCH_WAIT_S``, 60 s;
the store process runs in rank 0's host, so the other ranks' requests cross their link --
~100 bytes each, negligible beside the job's traffic, but queued behind it when host 0's
link is shaped).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from stalwart.mitigate import fallback, membership
from stalwart.mitigate.membership import Generation

if TYPE_CHECKING:
    from stalwart.elastic.ranklink import RankLink

POLL_S = 0.05
# one wait request on the store per this long while the membership stays (each wait that
# times out costs a request and a c10d warning line in the rank's log)
WATCH_WAIT_S = 60.0
WATCHER_THREAD = "stw-members"  # the watcher's thread name (``watching``)
WAIT_S = 60.0  # longest wait for the launcher's word after a failed collective
# a regroup that failed on a connection waits this long for the launcher's word that a member
# died (its poll, 0.1 s, plus this thread's, 0.05 s, on a loaded machine) before it is
# counted a failure of its own (then: checkpoint-and-relaunch, fallback.py)
CHANGE_WAIT_S = 5.0
_TCP_LISTEN = "0A"


def watching() -> bool:
    """Whether a membership watcher of this process is alive: a thread blocked in a c10d
    store wait, in C++, that interpreter finalization would end inside C++ frames (the
    process then aborts). Such a process leaves with ``os._exit`` (train/worker.py
    ``leave``). Cost: one walk over the process's threads."""
    return any(t.name == WATCHER_THREAD and t.is_alive() for t in threading.enumerate())


class NotAMember(RuntimeError):
    """This rank is not in the new generation (left out by a plan, or counted lost)."""


class FallbackRequested(RuntimeError):
    """The launcher gave up the in-place regroup (a rank's failed): save and exit
    (fallback.py)."""


class PlannedRegroup(RuntimeError):
    """Raised by the step loop at a planned change's step: handled like a failed
    collective, by ``regroup`` (nothing is redone: the change comes between two steps)."""


def is_comm_error(e: BaseException) -> bool:
    """A failed collective (gloo raises RuntimeError, DistBackendError is one; the monitor's
    row link raises RowLinkError, also one) or a socket error from a peer that is gone."""
    return isinstance(e, RuntimeError | ConnectionError | OSError)


def _tcp_sockets() -> dict[int, tuple[int, int, str]]:
    """inode -> (local port, remote port, state) of this network namespace's TCP sockets."""
    out: dict[int, tuple[int, int, str]] = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/self/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            f = ln.split()
            if len(f) < 10:
                continue
            lport = int(f[1].rsplit(":", 1)[1], 16)
            rport = int(f[2].rsplit(":", 1)[1], 16)
            out[int(f[9])] = (lport, rport, f[3])
    return out


def shutdown_tcp(keep_ports: set[int]) -> int:
    """Shut down (both directions) every connected TCP socket of this process whose local or
    remote port is not in ``keep_ports``; returns how many. A shutdown acts on the socket, so
    a duplicate of the descriptor is enough and the owner's descriptor stays valid (gloo
    then sees an error on it, not a reused number)."""
    socks = _tcp_sockets()
    n = 0
    for entry in os.scandir("/proc/self/fd"):
        try:
            target = os.readlink(entry.path)
        except OSError:
            continue
        if not target.startswith("socket:["):
            continue
        inode = int(target[8:-1])
        info = socks.get(inode)
        if info is None or info[2] == _TCP_LISTEN or info[0] in keep_ports \
                or info[1] in keep_ports:
            continue
        try:
            fd = os.dup(int(entry.name))
        except OSError:
            continue
        try:
            if os.fstat(fd).st_ino != inode:  # the number was reused meanwhile
                continue
            s = socket.socket(fileno=fd)
            fd = -1  # the socket object owns the duplicate now
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
                n += 1
            s.close()
        finally:
            if fd >= 0:
                os.close(fd)
    return n


class Regrouper:
    """One per rank of a job that regroups in place (see the module docstring)."""

    def __init__(self, link: RankLink, slot: int, keep_ports: set[int] | None = None,
                 joining: bool = False) -> None:
        """``link``: the launch's records (its connection is this thread's; the watcher
        makes its own). ``joining``: this process is a launch rank started again to rejoin
        (a host taken back live): its first ``regroup`` waits for the generation that
        includes it. The store's connections are kept by the shutdown that wakes a
        collective (``keep_ports``)."""
        g = link.newest(link.first())
        self.link = link
        self.slot = slot
        self.joining = joining
        self.current = g
        self.keep_ports = set(keep_ports or ()) | {link.port}
        self.last_parts: dict[str, float] = {}  # seconds of the last regroup's phases
        self._seen = g
        self._building = g.gen  # the generation this rank is in, or is building groups for
        self._aborted = threading.Event()
        self._fallback = threading.Event()  # the launcher gave up regrouping in place
        if joining and g.rank_of(slot) is not None:
            self._aborted.set()  # the generation taking it back is already announced
        self._stop = threading.Event()
        # called (from the watcher thread) when a member is lost: what else this rank may
        # wait in and must stop waiting in -- the lossy transport's phases (UDP: no
        # connection to shut)
        self.on_abort: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._watch, daemon=True, name=WATCHER_THREAD)
        self._thread.start()

    def _watch(self) -> None:
        link = self.link.clone()  # a connection of this thread's own
        while not self._stop.is_set():
            t0 = time.monotonic()
            # woken by the store when the next generation is written (no poll interval)
            nxt = link.wait_generation(self._seen.gen + 1, WATCH_WAIT_S)
            if self._stop.is_set():
                break  # closed meanwhile: the rank is finishing or leaving
            if nxt is None:
                if time.monotonic() - t0 < WATCH_WAIT_S / 2:  # the store did not answer
                    self._stop.wait(POLL_S)  # (it is gone: the launcher stops the job)
                continue
            try:
                g = link.newest(nxt)  # and any written since
            except Exception:  # noqa: BLE001 -- as above
                g = nxt
            self._seen = g
            if g.fallback:
                self._fallback.set()
            if not g.planned:  # a rank lost: wake whatever collective this rank is in
                for fn in list(self.on_abort):
                    with contextlib.suppress(Exception):
                        fn()
                shutdown_tcp(self.keep_ports)
            self._aborted.set()
            if g.fallback:
                break
        while self._fallback.is_set() and not self._stop.wait(POLL_S):
            # a connection made after the first shutdown (a regroup's store, a group's
            # pairs) must not block the rank either: it is saving its state and leaving
            shutdown_tcp(self.keep_ports)

    def plan(self, hosts: list[int], step: int,
             basis: dict[str, Any] | None = None) -> Generation:
        """Rank 0, at a planned change's step: announce the generation on ``hosts``; every
        rank regroups there. ``basis``: what its gain is measured against afterwards."""
        g = membership.with_hosts(self.current, hosts, step, basis)
        return self.link.propose(g)  # the launcher's, when a rank was lost meanwhile

    def falling_back(self) -> bool:
        """The launcher asked every rank to save its state and exit (fallback.py)."""
        return self._fallback.is_set()

    def changed(self) -> bool:
        """A generation newer than the one this rank is in (or is building) has been
        announced. True from the moment the watcher reads it -- before it shuts this
        process's connections, whose errors are how the step loop hears of it."""
        return self._seen.gen > self._building or self._aborted.is_set()

    def await_change(self, timeout_s: float = CHANGE_WAIT_S) -> bool:
        """After a regroup failed on a connection: whether a newer generation comes within
        ``timeout_s`` (a member died -- one started to rejoin, say -- and the launcher has
        not announced it yet). The caller then regroups again, to that generation."""
        deadline = time.monotonic() + timeout_s
        while not self.changed():
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True

    def regroup(self, backend: str, timeout_s: float = WAIT_S) -> Generation:
        """After a failed collective: wait for the next generation, rebuild the default
        process group on its store. Raises the caller's error's stand-in (TimeoutError)
        when no generation comes (the failure was not a lost rank), NotAMember when this
        rank is not in it (a rank ``joining`` waits on for the generation that has it)."""
        t_in = time.monotonic()
        deadline = t_in + timeout_s
        while not self._aborted.wait(POLL_S):
            if time.monotonic() > deadline:
                raise TimeoutError(f"a collective failed and no new membership came in "
                                   f"{timeout_s:.0f} s")
        self._aborted.clear()
        g = self._seen
        if g.fallback:
            raise FallbackRequested(f"generation {g.gen}: the launcher falls back to a restart")
        rank = g.rank_of(self.slot)
        if rank is None and self.joining:  # a generation before the one taking it back
            return self.regroup(backend, max(deadline - time.monotonic(), POLL_S))
        if rank is None:
            raise NotAMember(f"launch rank {self.slot} is not in generation {g.gen}")
        self.joining = False
        self._building = g.gen
        t0 = time.monotonic()
        with contextlib.suppress(Exception):  # the old groups are broken: free what we can
            dist.destroy_process_group()
        t1 = time.monotonic()
        self.last_parts = {"wait": round(t0 - t_in, 3), "destroy": round(t1 - t0, 3)}
        if os.environ.get(fallback.TEST_FAIL_ENV) == str(self.slot) and g.gen >= 1:
            raise RuntimeError(f"launch rank {self.slot} cannot build the groups of generation "
                               f"{g.gen} ({fallback.TEST_FAIL_ENV} test hook)")
        dist.init_process_group(backend, store=self._store(g, rank, timeout_s), rank=rank,
                                world_size=g.world, timeout=timedelta(seconds=timeout_s))
        self.last_parts["init"] = round(time.monotonic() - t1, 3)
        self.current = g
        return g

    def _store(self, g: Generation, rank: int, timeout_s: float) -> Any:
        """The generation's store: a TCPStore served by its rank 0 on this host's address,
        found through the generation's ``pg/<n>`` record. Not the launch's store itself:
        its connections are kept by the shutdown that wakes a rank (``keep_ports``), and a
        rendezvous with a member that died must be broken off by that shutdown."""
        timeout = timedelta(seconds=timeout_s)
        if rank == 0:
            host = os.environ.get("STALWART_HOST_ADDR", "127.0.0.1")
            tcp = dist.TCPStore(host, 0, g.world, is_master=True, timeout=timeout,
                                wait_for_workers=False)
            self.link.put_pg_addr(g.gen, host, tcp.port)
        else:
            host, port = self._wait_addr(g.gen, timeout_s)
            tcp = dist.TCPStore(host, port, g.world, is_master=False, timeout=timeout)
        return dist.PrefixStore(f"gen{g.gen}", tcp)

    def _wait_addr(self, gen: int, timeout_s: float) -> tuple[str, int]:
        """Wait for generation ``gen``'s rendezvous address in short slices: a fallback (or
        a newer generation) ends the wait at once (the launch store's connection is not
        shut)."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.link.pg_addr(gen, 0.2)
            if got is not None:
                return got
            if self._fallback.is_set():
                raise FallbackRequested("the launcher falls back to a restart")
            if self._aborted.is_set():
                raise RuntimeError("a newer generation came during the regroup")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no store for the new generation in {timeout_s:.0f} s")

    def close(self) -> None:
        """Stop watching. The thread may stay blocked in its wait on the store (at most
        ``WATCH_WAIT_S``): it acts on nothing once stopped, so it is not waited for."""
        self._stop.set()
        self._thread.join(timeout=0.05)


def agree_state(model: torch.nn.Module, opt: Any, applied: int) -> tuple[int, int]:
    """Make every rank's model and optimizer state that of the rank with the most optimizer
    steps applied (lowest rank on a tie); returns (steps applied, the rank they came from).
    One all-gather of a number; the state moves only when the ranks differ."""
    world = dist.get_world_size()
    mine = torch.tensor([applied], dtype=torch.int64)
    got = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(got, mine)
    steps = [int(t.item()) for t in got]
    best = max(steps)
    src = steps.index(best)
    if min(steps) != best:
        box: list[Any] = [(model.state_dict(), opt.state_dict())] if dist.get_rank() == src \
            else [None]
        dist.broadcast_object_list(box, src=src)
        if dist.get_rank() != src:
            model.load_state_dict(box[0][0])
            opt.load_state_dict(box[0][1])
    return best, src


def agree_boundary(done: int, held: set, neutral: bool = False) -> set:
    """The work at step boundary ``done`` (its evaluation and checkpoint, ``("eval" |
    "ckpt", done)``) counted done on every rank only when every rank did it; ``held``: this
    rank's record, returned with those two entries agreed. ``neutral``: a rank that joins
    (it did nothing yet) leaves the choice to the others. One all-gather of two numbers.
    Each rank deciding alone would split the ranks when a member's loss broke the boundary's
    collective on some ranks only (one in the evaluation's all-reduce, another in the next
    step's gradient all-reduce); redoing an evaluation or checkpoint is harmless."""
    keys = [("eval", done), ("ckpt", done)]
    mine = torch.tensor([int(neutral or k in held) for k in keys], dtype=torch.int64)
    got = [torch.zeros(len(keys), dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(got, mine)
    agreed = {k for i, k in enumerate(keys) if all(int(t[i]) for t in got)}
    return (held - set(keys)) | agreed


def agree_shards(model: torch.nn.Module, opt: Any, applied: int, held: int,
                 tp: int) -> tuple[int, list[int]]:
    """Tensor parallel: make every rank hold the shard of its new TP index (``rank % tp``) at
    the most optimizer steps applied, from a rank that held that index before (``held``: this
    rank's old index; data-parallel replicas of a shard are identical, so any of them is a
    source). Returns (steps applied, the source rank of each index). One all-gather of two
    numbers; a shard moves (one broadcast of its model and optimizer state) only when some
    rank needs it. Raises RuntimeError when no rank holds an index at that step (the caller
    falls back to a relaunch)."""
    world, me = dist.get_world_size(), dist.get_rank()
    got = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(got, torch.tensor([applied, held], dtype=torch.int64))
    steps, idx = [int(t[0]) for t in got], [int(t[1]) for t in got]
    best = max(steps)
    srcs: list[int] = []
    incoming = None
    for i in range(tp):
        holders = [r for r in range(world) if idx[r] == i and steps[r] == best]
        if not holders:
            raise RuntimeError(f"no live rank holds TP shard {i} at step {best}")
        srcs.append(holders[0])
        need = [r for r in range(world) if r % tp == i and (idx[r] != i or steps[r] != best)]
        if not need:
            continue
        # every source sends the state it held before this agreement: loads come after
        box: list[Any] = [(model.state_dict(), opt.state_dict())] if me == holders[0] \
            else [None]
        dist.broadcast_object_list(box, src=holders[0])
        if me in need:
            incoming = box[0]
    if incoming is not None:
        model.load_state_dict(incoming[0])
        opt.load_state_dict(incoming[1])
    return best, srcs
