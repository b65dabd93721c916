"""Faults and the testbed: the ground truth of a fault switched on and off, the rank -> host
placement, the CPU cap and measured traffic; a fault the simulator drew."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from stalwart.events.base import Event


@dataclass(kw_only=True)
class _FaultFields(Event):
    """A fault of ``--fault`` (faultspec.Fault.event_fields), as the testbed applied it."""

    optional: ClassVar[tuple[str, ...]] = (
        "start_s", "end_s", "rank", "hosts", "rate", "back_s", "pid", "achieved_factor",
        "at_close", "elapsed_s")
    step: int  # the launcher's step count when it was switched
    testbed: str  # "local" | "netns"
    mechanism: str  # how it acts, e.g. the cgroup quota or the tc qdisc
    kind: str  # "compute" | "contention" | "link" | "pairlink" | "loss" | "kill" | ...
    target: str  # "rank2" | "host1" | "hosts1-2" | "all"
    magnitude: float  # factor, processes, bits per second, loss probability, or 1.0
    spec: str  # as given
    start: int  # its window in steps (end exclusive, null: to the end of the run)
    end: int | None
    start_s: float | None = None  # its window in seconds, when given so
    end_s: float | None = None
    rank: int | None = None  # a rank's fault; else ``hosts``
    hosts: list[int] | None = None
    rate: str | None = None  # link, pairlink: as given, e.g. "50mbit"
    back_s: float | None = None  # kill: seconds after which the rank is started again


@dataclass(kw_only=True)
class FaultApplied(_FaultFields):
    """The testbed switched a fault on."""

    name: ClassVar[str] = "fault_applied"
    pid: int | None = None  # a kill or hang: the process group signalled
    at_close: bool | None = None  # True: switched at the run's end (never False)
    elapsed_s: float | None = None  # a script run: seconds since the ranks started


@dataclass(kw_only=True)
class FaultRemoved(_FaultFields):
    """The testbed switched a fault off."""

    name: ClassVar[str] = "fault_removed"
    achieved_factor: float | None = None  # a CPU fault: the slowdown it achieved
    at_close: bool | None = None  # True: removed because the run ended (never False)
    elapsed_s: float | None = None


@dataclass(kw_only=True)
class TestbedPlacement(Event):
    """The rank -> host map of an incarnation (testbed.placement)."""

    name: ClassVar[str] = "testbed_placement"
    step: int
    testbed: str
    ranks_per_host: int
    slots: list[int]  # launch rank of each rank
    host_of_rank: list[int]  # emulated host of each rank


@dataclass(kw_only=True)
class TestbedCpuCap(Event):
    """Every rank's CPU share is capped (``--testbed-cpus``), once the ranks are known."""

    name: ClassVar[str] = "testbed_cpu_cap"
    step: int
    testbed: str
    cpus: float  # CPUs each rank may use
    hosts: list[int]  # the slots capped
    mechanism: str  # the cgroup quota written


@dataclass(kw_only=True)
class TestbedTraffic(Event):
    """Measured bytes per step between hosts over ``[from_step, to_step)`` (netns testbed)."""

    name: ClassVar[str] = "testbed_traffic"
    step: int
    from_step: int
    to_step: int
    hosts: list[int]  # rank -> host during the segment
    ranks_per_host: int
    bytes_per_step: dict[str, int]  # "a-b" (hosts) -> bytes per step


@dataclass(kw_only=True)
class FaultDrawn(Event):
    """``stalwart simulate``: a fault the simulator drew for a job size (simulate/faults.py)."""

    name: ClassVar[str] = "fault_drawn"
    optional: ClassVar[tuple[str, ...]] = ("rank", "host")
    job_ranks: int
    kind: str  # "compute" | "link" | "stop"
    rank: int | None = None  # compute: the rank; else ``host``
    host: int | None = None
    factor: float
    start_s: float
    end_s: float | None  # null: to the horizon
