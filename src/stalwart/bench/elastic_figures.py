"""``bench elastic``'s figures from the step records of a run: pure arithmetic, no torch.

Every arm of the suite (stalwart's API, torchrun's elastic restart, torchft) leaves per-process
JSON lines (examples/elastic_ddp.py's format), one per step a process finished: ``step``,
``t`` (wall clock at the step's end), ``samples`` (computed by this process in this step),
``world`` (members of the step's group), ``gen`` (the membership: stalwart's generation,
torchrun's restart round, torchft's quorum), ``member``, optional ``committed`` (torchft:
false when the step was discarded); a ``start`` line first and a ``final`` line with
``val_loss`` last. ``normalize`` maps them to ``time`` / ``generation`` / ``rank``. Faults
are times on the same clock (the harness's own records).

Definitions (what each figure means and what it does not show):

- an *execution* of a step: the records of one (step, generation); *complete* when it has a
  record from ``world`` distinct ranks (or as many records, where ranks are not named) and
  every one is committed. The *kept* executions are those on the final model's line
  (``kept``); every other one -- an earlier try of a step that a restart from a checkpoint
  redid, an uncommitted or incomplete one -- is *waste*.
- ``resume_s(fault)``: from the fault to the end of the first complete execution of a newer
  generation than the one in force at the fault (the survivors' first step in their new
  membership; a torchrun restart from a checkpoint counts at its first redone step).
- ``rejoin_s(back)``: from the node's restart to the end of the first complete execution at
  the full world size after it (its ranks' first step in the job); ``rejoin_split`` cuts it
  where the last process started reached its script's first line (start-up before it).
- ``samples_lost``: samples computed but not kept (waste) plus, over the kept steps, what
  each lacks of the healthy global batch (a job whose steps shrink with its world trains
  fewer samples in the same steps).
- ``time_to_samples_s(n)``: from the first record of the run (the end of its first step) to
  the end of the kept step at which the kept samples, summed in step order, reach ``n`` --
  wall time to train the same samples, slower steps and redone steps included. Startup is
  left out (it is not what a fault costs); so is the first step's duration (equal for all).
- ``workers_restarted``: worker processes that appeared after the fault on nodes other than
  the faulted one (from the harness's process watch, not from the records).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

Record = Mapping[str, Any]


@dataclass(frozen=True)
class Execution:
    step: int
    generation: int
    time: float  # the end of the step: its last record
    samples: int
    records: int
    world: int
    complete: bool
    committed: bool = True
    logged: int = -1  # samples in its lines, where ``samples`` credits shares not logged

    @property
    def logged_samples(self) -> int:
        return self.samples if self.logged < 0 else self.logged


_KEYS = {"t": "time", "gen": "generation", "member": "rank"}


def normalize(rec: Record) -> dict[str, Any]:
    """A script's line with the names used here (``t`` -> ``time``, ``gen`` ->
    ``generation``, ``member`` -> ``rank``); other keys kept."""
    return {_KEYS.get(k, k): v for k, v in rec.items()}


def step_records(records: Iterable[Record]) -> list[Record]:
    """The step lines (start and final lines left out), normalized."""
    out = []
    for r in records:
        n = normalize(r)
        if n.get("step") is not None and "time" in n and "samples" in n \
                and not n.get("start") and not n.get("final"):
            out.append(n)
    return out


MERGE_S = 2.0  # records of one step this close, at one world, are one execution (below)


def executions(records: Iterable[Record]) -> list[Execution]:
    """Every try of a step, in order of their end time: the records of one (step,
    generation) with no gap over ``MERGE_S`` between them; tries of one step at one world that
    are each short of members and ended within ``MERGE_S`` of each other are one execution
    under the newest generation. torchrun's ``TORCHELASTIC_RESTART_COUNT`` is per agent: a
    node that joins counts from 0 while the others count on, and an agent whose workers did
    not fail keeps its count across another's restart; no two tries of one step end that
    close (a try is redone only after a restart)."""
    groups: dict[tuple[int, int], list[Record]] = {}
    for r in step_records(records):
        groups.setdefault((int(r["step"]), int(r.get("generation", 0) or 0)), []).append(r)
    by_step: dict[int, list[tuple[int, list[Record]]]] = {}
    for (step, gen), rs in groups.items():
        for part in _tries(rs):
            by_step.setdefault(step, []).append((gen, part))
    out = []
    for step, parts in by_step.items():
        parts.sort(key=lambda p: max(float(r["time"]) for r in p[1]))
        merged: list[tuple[int, list[Record]]] = []
        for gen, rs in parts:
            if merged and _short(merged[-1][1]) and _short(rs) \
                    and _world(merged[-1][1]) == _world(rs) \
                    and _end(rs) - _end(merged[-1][1]) <= MERGE_S:
                g0, rs0 = merged[-1]
                merged[-1] = (max(g0, gen), rs0 + rs)
            else:
                merged.append((gen, rs))
        for gen, rs in merged:
            n = _members(rs)
            com = all(r.get("committed", True) for r in rs)
            out.append(Execution(step, gen, _end(rs), sum(int(r["samples"]) for r in rs),
                                 n, _world(rs), n >= _world(rs) and com, com))
    return sorted(out, key=lambda e: (e.time, e.step))


def _tries(rs: list[Record]) -> list[list[Record]]:
    """One generation's records of a step cut where ``MERGE_S`` passes without one: tries of
    the step that a restart separated but that carry the same generation (a torchrun agent
    that was not restarted keeps its count)."""
    rs = sorted(rs, key=lambda r: float(r["time"]))
    out = [[rs[0]]]
    for r in rs[1:]:
        if float(r["time"]) - float(out[-1][-1]["time"]) > MERGE_S:
            out.append([r])
        else:
            out[-1].append(r)
    return out


def _members(rs: list[Record]) -> int:
    return len({r["rank"] for r in rs}) if all("rank" in r for r in rs) else len(rs)


def _world(rs: list[Record]) -> int:
    return max(int(r.get("world", len(rs))) for r in rs)


def _end(rs: list[Record]) -> float:
    return max(float(r["time"]) for r in rs)


def _short(rs: list[Record]) -> bool:
    return _members(rs) < _world(rs)


def kept(records: Iterable[Record]) -> list[Execution]:
    """The executions whose updates are in the final model, in step order: the last step's
    complete execution at the largest world (the latest of equals), then back from it, for
    each earlier step its latest complete execution that ended before the one kept after it.
    Left out: a step's earlier tries (a restart from a checkpoint redoes steps), uncommitted
    and incomplete executions, and what a process trained by itself off the job's line (a
    torchft replica restarted after its peers finished forms a quorum of one). A step's
    latest execution that only some members logged, all committed, counts as applied with
    every member's share (a member died after contributing, before logging)."""
    by: dict[int, list[Execution]] = {}
    latest: dict[int, Execution] = {}
    for e in executions(records):  # in order of end time
        latest[e.step] = e
        if e.complete:
            by.setdefault(e.step, []).append(e)
    for step, e in latest.items():
        if not e.complete and e.committed and e.records:
            # the last word on a step, logged by only some members: a member died after
            # contributing and before logging (torchft: it committed; stalwart: survivors
            # that gave up waiting took the state after). Applied, with every share
            by.setdefault(step, []).append(replace(
                e, samples=round(e.samples * e.world / e.records), complete=True,
                logged=e.samples))
    if not by:
        return []
    last = max(by)
    cur = max(by[last], key=lambda e: (e.world, e.time))
    chain = [cur]
    for s in range(last - 1, min(by) - 1, -1):
        cands = [e for e in by.get(s, []) if e.time <= cur.time]
        if cands:
            cur = max(cands, key=lambda e: e.time)
            chain.append(cur)
    return chain[::-1]


def generation_at(records: Iterable[Record], t: float) -> int | None:
    """The newest generation among the records written at or before ``t``."""
    gens = [int(r.get("generation", 0) or 0) for r in step_records(records)
            if float(r["time"]) <= t]
    return max(gens) if gens else None


def resume_s(records: Iterable[Record], t_fault: float) -> float | None:
    """From ``t_fault`` to the first complete execution of a newer generation (None: none)."""
    recs = list(records)
    g0 = generation_at(recs, t_fault)
    if g0 is None:
        return None
    after = [e.time for e in executions(recs)
             if e.complete and e.generation > g0 and e.time > t_fault]
    return min(after) - t_fault if after else None


def rejoin_s(records: Iterable[Record], t_back: float, full_world: int) -> float | None:
    """From ``t_back`` to the first complete execution at ``full_world`` ranks after it."""
    after = [e.time for e in executions(records)
             if e.complete and e.world >= full_world and e.time > t_back]
    return min(after) - t_back if after else None


def rejoin_split(records: Iterable[Record], t_back: float, full_world: int
                 ) -> dict[str, float] | None:
    """What ``rejoin_s`` is made of: ``startup_s``, from ``t_back`` to the last process
    started since then reaching its script's first line (``t_start`` of its ``start`` line:
    interpreter, launcher and ``import torch``), and ``after_start_s``, from there to the
    first complete execution at ``full_world`` (the script's set-up, joining, the state
    received). None without such start lines."""
    starts = [float(r["t_start"]) for r in records
              if r.get("start") and float(r.get("t_start", 0)) > t_back]
    total = rejoin_s(records, t_back, full_world)
    if not starts or total is None:
        return None
    return {"startup_s": max(starts) - t_back, "after_start_s": t_back + total - max(starts)}


def healthy_batch(records: Iterable[Record]) -> int | None:
    """The global batch of a healthy run: the most common samples of its kept steps."""
    counts: dict[int, int] = {}
    for e in kept(records):
        counts[e.samples] = counts.get(e.samples, 0) + 1
    return max(counts, key=lambda s: (counts[s], s)) if counts else None


def samples_lost(records: Iterable[Record], global_batch: int) -> int | None:
    """Samples computed and not kept, plus what the kept steps lack of ``global_batch``."""
    recs = step_records(records)
    if not recs:
        return None
    ks = kept(recs)
    computed = sum(int(r["samples"]) for r in recs)
    waste = computed - sum(e.logged_samples for e in ks)
    short = sum(max(global_batch - e.samples, 0) for e in ks)
    return waste + short


def samples_trained(records: Iterable[Record]) -> int:
    return sum(e.samples for e in kept(records))


def time_to_samples_s(records: Iterable[Record], n: int) -> float | None:
    """From the run's first record to the kept step at which ``n`` samples are trained."""
    recs = step_records(records)
    if not recs or n <= 0:
        return None
    t0 = min(float(r["time"]) for r in recs)
    total = 0
    for e in sorted(kept(recs), key=lambda e: e.step):
        total += e.samples
        if total >= n:
            return e.time - t0
    return None


def final_val_loss(records: Iterable[Record]) -> float | None:
    """The trained model's validation loss: the median over the processes that wrote one
    (every member holds the same model)."""
    vals = sorted(float(r["val_loss"]) for r in records if r.get("val_loss") is not None)
    return vals[len(vals) // 2] if vals else None


def rel_change(value: float | None, reference: float | None) -> float | None:
    if value is None or not reference:
        return None
    return abs(value - reference) / abs(reference)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def workers_restarted(seen: Mapping[int, tuple[int, float]], t_fault: float,
                      faulted_node: int) -> int:
    """Worker processes (pid -> (node, first seen)) that appeared after ``t_fault`` on nodes
    other than ``faulted_node``."""
    return sum(1 for node, t in seen.values() if t > t_fault and node != faulted_node)


def common_samples(runs: Iterable[Iterable[Record]]) -> int | None:
    """The samples every run trained (the smallest total): the N of ``time_to_samples_s``."""
    totals = [samples_trained(r) for r in runs]
    totals = [t for t in totals if t > 0]
    return min(totals) if totals else None
