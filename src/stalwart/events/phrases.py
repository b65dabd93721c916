"""The one phrasing of an event for a person: the live progress line, a script run's display
and the report use it. Reads a JSON line's fields as they are (a partial line still reads).
Torch-free, no I/O."""

from __future__ import annotations

from typing import Any

from stalwart.events.detection import (
    RecoveryRejected,
    SlowdownUnexplained,
    StragglerDetected,
    StragglerRecovered,
)
from stalwart.events.membership import RankUnresponsive, RegroupFailed


def _who(ranks: list[int], link: list[int] | None) -> str:
    if ranks:
        who = f"rank {','.join(map(str, ranks))}"
        return who + (f" (link {link[0]}-{link[1]})" if link and len(link) == 2 else "")
    return f"{link[0]}-{link[1]}" if link and len(link) == 2 else f"{link}"


def describe_regroup_failed(rec: dict[str, Any]) -> str:
    """The line for a failed in-place regroup and the fallback taken."""
    hosts = " ".join(str(h) for h in rec.get("hosts") or [])
    if rec.get("fallback") == "restart":
        done = (f"fell back to a checkpoint-and-relaunch on hosts [{hosts}] from step "
                f"{rec.get('resume_step')}")
    else:
        done = "no fallback left: the job stops"
    return (f"in-place regroup failed at step {rec.get('step')} ({rec.get('reason')}); "
            f"{done}")


def describe(rec: dict[str, Any], unit: str = "step") -> str | None:
    """One line for a detector event (``unit``: "step", or "iteration" for a script run whose
    steps are the monitor's iterations); None for the others. Reads the line's fields as they
    are, so a partial line (an older version's) still reads."""
    ev = rec.get("event")
    if ev == SlowdownUnexplained.name:
        return f"job slowed at {unit} {rec.get('step')}, no culprit rank or link found"
    if ev == StragglerDetected.name:
        return (f"straggler: {rec.get('kind')} {_who(rec.get('ranks') or [], rec.get('link'))} "
                f"x{rec.get('severity', 0):.2f} since {unit} {rec.get('onset_step')}")
    if ev == StragglerRecovered.name:
        return f"straggler recovered at {unit} {rec.get('step')}"
    if ev == RegroupFailed.name:
        return describe_regroup_failed(rec)
    if ev == RankUnresponsive.name:
        return (f"rank {rec.get('rank')} sent no heartbeat for {rec.get('silent_s', 0):.1f} s "
                "(hung or cut off); the launcher killed it")
    if ev == RecoveryRejected.name:
        return (f"rank {','.join(map(str, rec.get('ranks') or []))} reads healthy at {unit} "
                f"{rec.get('step')} but is still x{rec.get('compute_test_ratio', 0):.2f} "
                "in the compute test")
    return None
