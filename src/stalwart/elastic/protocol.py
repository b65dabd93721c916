"""The elastic membership protocol's decisions: pure functions over typed records, no torch,
no sockets, no clocks of their own (time is an argument), so that tests and replay drive them.

The records (kept in the store as JSON by ``store.py``):

- ``Member``: one training process (a rank) -- its id (unique for the job, never reused: a
  node started again gets new ids), its node, the address of its liveness socket.
- ``Generation``: the members that train together from some step on, in rank order (sorted
  ids), with per-member weights for the batch split (S2) and why it was made. Generation
  ``g + 1`` is proposed by any member with a compare-and-set on its key: the first proposal
  wins, and everyone adopts it.
- ``Ack``: what a member of a generation brings to it -- the last step it completed
  (optimizer applied) and whether its model state is fresh (a joiner's, never trained here).

A change takes effect at the step ``settle`` computes from the acks of all members of the new
generation: one past the most advanced member's last completed step, so nothing completed is
redone and nothing is skipped; every member behind it (or fresh) receives the model and
optimizer state of the source, the lowest-id member at that step.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field

# The bounds (docs/calibration.md, "elastic"): a member beats every HEARTBEAT_S (through the
# store from its watcher thread, and on its liveness connections from a native thread) and is
# taken for dead (hung, frozen, cut off) when neither beat of it was seen moving for
# DEAD_AFTER_S; a process that exits is found at once through its liveness socket.
HEARTBEAT_S = 0.1
DEAD_AFTER_S = 3.0


@dataclass(frozen=True)
class Member:
    id: int
    node: str
    local_rank: int
    addr: str  # host:port of its liveness socket

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "node": self.node, "local_rank": self.local_rank,
                           "addr": self.addr})

    @staticmethod
    def from_json(text: str | bytes) -> Member:
        d = json.loads(text)
        return Member(int(d["id"]), str(d["node"]), int(d["local_rank"]), str(d["addr"]))


@dataclass(frozen=True)
class Generation:
    gen: int
    members: tuple[int, ...]  # sorted ids; a member's rank in the generation is its index
    weights: tuple[float, ...] = ()  # per member (same order), () = equal
    why: str = ""

    def rank_of(self, member: int) -> int:
        return self.members.index(member)

    def weight_of(self, member: int) -> float:
        return self.weights[self.rank_of(member)] if self.weights else 1.0

    def to_json(self) -> str:
        return json.dumps({"gen": self.gen, "members": list(self.members),
                           "weights": list(self.weights), "why": self.why})

    @staticmethod
    def from_json(text: str | bytes) -> Generation:
        d = json.loads(text)
        return Generation(int(d["gen"]), tuple(int(m) for m in d["members"]),
                          tuple(float(w) for w in d.get("weights", [])), str(d.get("why", "")))


@dataclass(frozen=True)
class Ack:
    done: int  # last completed step, -1 for none
    fresh: bool  # its model state never trained in this job (a joiner's)

    def to_text(self) -> str:
        return f"{self.done} {int(self.fresh)}"

    @staticmethod
    def from_text(text: str | bytes) -> Ack:
        done, fresh = (text.decode() if isinstance(text, bytes) else text).split()
        return Ack(int(done), fresh == "1")


@dataclass(frozen=True)
class Settlement:
    start_step: int  # the first step the generation trains
    source: int  # the member whose state everyone takes
    receivers: tuple[int, ...]  # the members that must receive it


def settle(gen: Generation, acks: Mapping[int, Ack]) -> Settlement:
    """Where generation ``gen`` starts, once every member acked: at the step after the most
    advanced member's last completed one; the lowest-id trained member there is the source
    (all fresh: the lowest id, as DDP broadcasts rank 0's initial weights); every member behind
    it or fresh receives its state."""
    missing = [m for m in gen.members if m not in acks]
    if missing:
        raise ValueError(f"generation {gen.gen}: no ack from members {missing}")
    trained = [m for m in gen.members if not acks[m].fresh]
    best = max((acks[m].done for m in trained), default=max(acks[m].done for m in gen.members))
    at_best = [m for m in trained if acks[m].done == best]
    source = min(at_best) if at_best else min(gen.members)
    receivers = tuple(m for m in gen.members if m != source
                      and (acks[m].fresh or acks[m].done != best))
    return Settlement(best + 1, source, receivers)


def next_generation(current: Generation | None, alive: Iterable[int], joiners: Iterable[int],
                    min_world: int, parked: Iterable[int] = (),
                    weights: Mapping[int, float] | None = None) -> Generation | None:
    """The generation that should follow ``current`` (None: keep it).

    ``alive``: the members not found dead or gone; ``joiners``: live registered members that
    are in no generation yet (or were dropped and came back); ``parked``: members kept out on
    purpose (S4). Before the first generation, it forms once ``min_world`` joiners are there.
    A generation with no member left is never proposed (the job is over).
    """
    alive_s, parked_s = set(alive), set(parked)
    if current is None:
        ready = sorted(set(joiners) - parked_s)
        if len(ready) < min_world:
            return None
        return Generation(0, tuple(ready), (), "initial")
    stay = [m for m in current.members if m in alive_s and m not in parked_s]
    new = sorted(set(joiners) - set(current.members) - parked_s)
    members = tuple(sorted(set(stay) | set(new)))
    old_w = dict(zip(current.members, current.weights, strict=True)) if current.weights else {}
    w_map = dict(weights) if weights is not None else old_w
    new_w = tuple(float(w_map.get(m, 1.0)) for m in members) if w_map else ()
    if all(w == 1.0 for w in new_w):
        new_w = ()
    if members == current.members and new_w == current.weights:
        return None
    if not members:
        return None
    gone = [m for m in current.members if m not in members]
    parts = []
    if gone:
        parts.append("lost " + ",".join(map(str, gone)))
    if new:
        parts.append("joined " + ",".join(map(str, new)))
    if not parts:
        parts.append("reweighted")
    return Generation(current.gen + 1, members, new_w, "; ".join(parts))


def must_abandon(current: Generation, newer: Generation, step: int,
                 acks: Mapping[int, Ack], parked: Iterable[int] = ()) -> bool:
    """Whether a member in the collective of ``step`` in ``current`` must give it up because
    ``newer`` exists: when a member of ``current`` left out of ``newer`` for another reason
    than being parked (dead, hung, gone: it may never contribute), or when a member of
    ``current`` acked ``newer`` before starting ``step`` (it will not). A parked member is
    alive: it finishes the step in flight with the others, then leaves."""
    kept_alive = set(parked)
    if any(m not in newer.members and m not in kept_alive for m in current.members):
        return True
    return any(acks[m].done < step for m in current.members if m in acks)


def shares(global_batch: int, gen: Generation) -> dict[int, range]:
    """Each member's sample positions ``0..global_batch-1`` of a step's global batch:
    contiguous, in rank order, sized by weight (largest remainder; equal weights: the first
    ``global_batch % world`` ranks get one more). Every position is given exactly once."""
    world = len(gen.members)
    w = list(gen.weights) if gen.weights else [1.0] * world
    total = sum(w)
    if total <= 0:
        raise ValueError("the weights of a generation must add up to more than 0")
    exact = [global_batch * x / total for x in w]
    sizes = [int(e) for e in exact]
    order = sorted(range(world), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[:global_batch - sum(sizes)]:
        sizes[i] += 1
    out, start = {}, 0
    for m, n in zip(gen.members, sizes, strict=True):
        out[m] = range(start, start + n)
        start += n
    return out


def micro_batches(positions: range, step: int, global_batch: int,
                  micro_batch: int | None) -> list[list[int]]:
    """A member's sample indices of ``step``: ``step * global_batch + position``, in chunks of
    at most ``micro_batch`` (None: one chunk). A data loader maps these global sample indices
    to samples (e.g. ``dataset[i % len(dataset)]``): the union over the members of a step is
    the same whatever the world, so the step trains on the same samples."""
    idx = [step * global_batch + p for p in positions]
    if not idx:
        return []
    n = micro_batch or len(idx)
    return [idx[i:i + n] for i in range(0, len(idx), n)]


@dataclass
class Liveness:
    """Which members beat recently: ``beat(member, counter, now)`` records a heartbeat
    counter (any comparable value: an int, or a tuple of counters that each move) read at
    ``now``; a member whose counter did not move for ``dead_after`` seconds is dead. Watching
    starts at a member's first reading, so a member never seen is not dead."""

    dead_after: float = DEAD_AFTER_S
    _last: dict[int, tuple[Hashable, float]] = field(default_factory=dict)

    def beat(self, member: int, counter: Hashable, now: float) -> None:
        prev = self._last.get(member)
        if prev is None or counter != prev[0]:
            self._last[member] = (counter, now)

    def silent(self, now: float) -> set[int]:
        return {m for m, (_, t) in self._last.items() if now - t > self.dead_after}

    def forget(self, member: int) -> None:
        self._last.pop(member, None)


def fingerprint(parts: Mapping[str, str]) -> str:
    """A short digest of a run's identity (code version, run configuration): members whose
    fingerprints differ must not train together."""
    h = hashlib.sha256(json.dumps(dict(sorted(parts.items()))).encode()).hexdigest()
    return h[:16]


def mismatch(mine: Mapping[str, str], job: Mapping[str, str]) -> str | None:
    """One line naming what differs between a joiner's identity and the job's, or None."""
    keys = sorted(set(mine) | set(job))
    diff = [k for k in keys if mine.get(k) != job.get(k)]
    if not diff:
        return None
    k = diff[0]
    return (f"this process's {k} ({mine.get(k, 'unset')}) differs from the job's "
            f"({job.get(k, 'unset')})" + (f" and {len(diff) - 1} more" if len(diff) > 1 else ""))


# ---- the order of a user's calls (Job's state machine) --------------------------------------

IDLE, COMPUTE, COMMITTED, REDO, FINISHED = "idle", "compute", "committed", "redo", "finished"
_ALLOWED = {
    "my_batch": {COMPUTE},
    "weight": {COMPUTE},
    "commit": {COMPUTE},
}


def order_error(call: str, phase: str, step: int | None = None,
                asked: int | None = None) -> str | None:
    """The one-line error for calling ``call`` in ``phase`` (None: allowed). ``asked``: the
    step a ``my_batch(step)`` call named, checked against the step in flight."""
    if call in _ALLOWED and phase not in _ALLOWED[call]:
        where = {IDLE: "outside a step (iterate job.steps(n) first)",
                 COMMITTED: "after job.commit() of this step (the next step starts when the "
                            "job.steps() loop goes on)",
                 REDO: "after job.commit() returned False (the step is redone when the "
                       "job.steps() loop goes on)",
                 FINISHED: "after job.steps() finished"}.get(phase, phase)
        return f"job.{call}() called {where}"
    if call == "my_batch" and asked is not None and step is not None and asked != step:
        return f"job.my_batch({asked}) called in step {step} (pass the step job.steps() gave)"
    return None
