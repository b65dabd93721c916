"""Who is in the job now: the membership generations of a job that regroups in place, kept
in the launch's membership store (elastic/runlink.py says where, who writes, who reads).

The launcher is the one witness of a rank's death that cannot be wrong or late: it holds the
rank's process and sees its exit within one poll (0.1 s). When a rank dies in a job that
regroups in place (``in_place_ok``), the launcher does not stop the others; it writes a new
*generation* (``Generation``, record ``gen/<n>`` of the launch):

    {"token": "...", "gen": 1, "alive": [0, 1, 2], "hosts": [0, 1, 2], "lost": [3],
     "step": 60, "time": 1712345678.9, ...}

``alive`` are launch ranks (a rank's number when the job started: its *slot*), ``hosts`` the
host under each of them. A rank of generation g has the new rank ``alive.index(slot)`` and
the world ``len(alive)``. The survivors rebuild their process groups on a TCPStore that the
generation's own rank 0 serves, found through the generation's ``pg/<n>`` record, so nothing
from the dead generation -- its TCPStore, which lived in launch rank 0, included -- is
needed (regroup.py does the rebuilding).

Guarantees: a generation is one record, written whole; generation n + 1 is written by
compare-and-set only after n (the launcher for a lost rank, rank 0 for a planned change:
the first writer wins, the other builds on it), so generations only grow; ``token`` is new
for every launch and prefixes its records, so a relaunch or a resumed run never reads an
older launch's. Cost: on the ranks, one wait on the store per 60 s in a background thread
(the store wakes it when a generation is written), nothing per step; on the launcher, one
round trip per generation it writes.

Torch-free: the launcher imports it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Generation:
    """One membership: the launch ranks alive, their hosts, why it changed."""

    token: str
    gen: int
    alive: tuple[int, ...]
    hosts: tuple[int, ...]
    lost: tuple[int, ...] = ()
    step: int = 0  # the launcher's step count when it changed (informational)
    time: float = field(default=0.0, compare=False)
    # decided by the job (S3/S4) at a step every rank reaches by itself: nobody is blocked
    # on a dead peer, so no connection needs shutting (regroup.py)
    planned: bool = False
    # a planned change's basis for measuring its gain afterwards (strategy, predicted_gain,
    # step_time_before): the new rank 0 may be another process than the one that decided
    basis: dict[str, Any] | None = field(default=None, compare=False)
    # the host of each launch rank (a process stays on its host): how a host taken back
    # finds its launch rank again
    home: tuple[int, ...] = ()
    # the launcher gave up on building this membership in place (a rank's regroup failed):
    # every rank saves its state and exits; the job is relaunched on ``hosts`` (fallback.py)
    fallback: bool = False

    def rank_of(self, slot: int) -> int | None:
        """The rank of launch rank ``slot`` in this generation (None: not a member)."""
        return self.alive.index(slot) if slot in self.alive else None

    @property
    def world(self) -> int:
        return len(self.alive)

    def to_json(self) -> str:
        return json.dumps({"token": self.token, "gen": self.gen, "alive": list(self.alive),
                           "hosts": list(self.hosts), "lost": list(self.lost),
                           "step": self.step, "time": self.time, "planned": self.planned,
                           "basis": self.basis, "home": list(self.home),
                           "fallback": self.fallback})

    @staticmethod
    def from_json(text: str | bytes) -> Generation:
        return Generation.from_dict(json.loads(text))

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Generation:
        return Generation(str(d["token"]), int(d["gen"]), tuple(int(x) for x in d["alive"]),
                          tuple(int(x) for x in d["hosts"]), tuple(int(x) for x in d["lost"]),
                          int(d.get("step", 0)), float(d.get("time", 0.0)),
                          bool(d.get("planned", False)), d.get("basis"),
                          tuple(int(x) for x in d.get("home") or ()),
                          bool(d.get("fallback", False)))


def in_place_ok(cfg: Any) -> bool:
    """Whether a job regroups in place (S3/S4, a host taken back): ``--mitigate auto`` and
    stalwart's own worker (a user's script owns its process groups). Tensor-parallel jobs
    included: their shards move between live ranks (train/inplace.py); and ``--comm lossy``
    ones: the owners' optimizer state is re-sharded between the live ranks
    (comm/optim.py ``full_state``)."""
    return cfg.mitigate == "auto" and cfg.script is None


def failstop_ok(cfg: Any) -> bool:
    """Whether a dead rank is left behind in place: every in-place job. A tensor-parallel
    job leaves the dead rank's whole TP group (``survivors``); its hosts are not taken back
    (a rank rejoins one at a time, and a TP group needs all of its ranks). In a lossy job
    the dead owner's shard of the optimizer state is lost: its per-element state restarts
    from zero (the ``regroup`` event's ``state_reset``)."""
    return in_place_ok(cfg)


def survivors(g: Generation, slots: list[int], tp: int = 1) -> tuple[list[int], list[int]]:
    """The launch ranks that go on when ``slots`` die, and those left out with them. With
    tensor parallelism (TP groups are runs of ``tp`` consecutive ranks of ``g``) a group that
    lost a rank cannot compute its shards' share: its other ranks leave too, and the rest
    stay whole TP groups, so no shard has to move. (kept, left); kept may be empty."""
    gone = set(slots)
    kept: list[int] = []
    left: list[int] = []
    for i in range(0, len(g.alive), tp):
        group = list(g.alive[i:i + tp])
        if gone.isdisjoint(group):
            kept += group
        else:
            left += [s for s in group if s not in gone]
    return kept, left


def with_hosts(g: Generation, hosts: list[int], step: int,
               basis: dict[str, Any] | None = None) -> Generation:
    """The next generation on ``hosts`` (a rank -> host map, in any order): a planned change,
    S4 (a host left out), S3 (the same hosts, ranks in another order) or a host taken back
    live (a host of the launch that is not in ``g``: its launch rank, started again by the
    launcher, joins). Processes stay on their hosts; their ranks follow the map."""
    slot_of = dict(zip(g.hosts, g.alive, strict=True))
    for slot, h in enumerate(g.home):  # hosts out of the job: their launch rank rejoins
        slot_of.setdefault(h, slot)
    missing = [h for h in hosts if h not in slot_of]
    if missing or len(set(hosts)) != len(hosts) or not hosts:
        raise ValueError(f"hosts {hosts} are not distinct hosts of generation {g.gen} "
                         f"({list(g.hosts)}) or of the launch ({list(g.home)})")
    alive = tuple(slot_of[h] for h in hosts)
    return Generation(g.token, g.gen + 1, alive, tuple(hosts),
                      tuple(s for s in g.alive if s not in alive), step, time.time(), True,
                      basis, g.home)


def joined(before: Generation, after: Generation) -> list[int]:
    """Launch ranks in ``after`` that were not in ``before`` (taken back)."""
    return [s for s in after.alive if s not in before.alive]


class Announcer:
    """The launcher's side: generation 0 at launch, one more per lost rank, on the launch's
    records (``link``: elastic/runlink.py ``LauncherLink``, made here with a new token)."""

    def __init__(self, pipe: Any, job: str, hosts: list[int]) -> None:
        from stalwart.elastic.runlink import LauncherLink

        token = f"{os.getpid()}-{time.time_ns()}"
        self.link = LauncherLink(pipe, job, token)
        self.current = Generation(token, 0, tuple(range(len(hosts))), tuple(hosts), (), 0,
                                  time.time(), home=tuple(hosts))
        # not waited for: the store process may still be importing torch (the ranks wait)
        self.link.put_generation(self.current, wait=False)

    @property
    def token(self) -> str:
        return self.current.token

    def newest(self) -> Generation:
        """The newest generation (rank 0 may have made planned changes since the last one
        the launcher wrote or read)."""
        while True:
            text = self.link.generation_text(self.current.gen + 1)
            if text is None:
                return self.current
            self.current = Generation.from_json(text)

    def _write(self, make: Any) -> Generation:
        """``make(current)`` written as the next generation; built again on the one rank 0
        wrote first when it did (a planned change). One store round trip when nobody did."""
        while True:
            g = make(self.current)
            won = Generation.from_json(self.link.propose_generation(g))
            if won == g:
                self.current = g
                return g
            self.current = won  # rank 0's: build on it (and on any after it)

    def lose(self, slots: list[int], step: int, tp: int = 1) -> Generation:
        """The next generation without launch ranks ``slots`` (and, with tensor parallelism,
        without the rest of their TP groups: ``survivors``)."""
        def make(cur: Generation) -> Generation:
            kept, _ = survivors(cur, slots, tp)
            keep = [(s, h) for s, h in zip(cur.alive, cur.hosts, strict=True) if s in kept]
            return Generation(cur.token, cur.gen + 1, tuple(s for s, _ in keep),
                              tuple(h for _, h in keep), tuple(sorted(slots)), step,
                              time.time(), home=cur.home)
        return self._write(make)

    def fall_back(self, step: int) -> Generation:
        """Give up the in-place regroup: the newest generation's members, marked
        ``fallback`` (every rank saves its state and exits; fallback.py)."""
        return self._write(lambda cur: Generation(cur.token, cur.gen + 1, cur.alive,
                                                  cur.hosts, (), step, time.time(),
                                                  home=cur.home, fallback=True))
