"""Every ``STALWART_*`` environment variable, in one table, and the readers of the overrides.

Three kinds:

- ``override``: a knob a user (or a benchmark) may set to change how a rank runs; read here
  and only here (``engine()``, ``fec()``, ...), so that the whole list is this file.
  ``STALWART_GHASH`` is the one read elsewhere: by the native engine's C code at load time.
- ``wiring``: set by stalwart's launcher, testbed or elastic store for the processes it
  starts (where the run directory is, the store's address, the rank's device slot); the
  modules that set and read them name them through this table's constants.
- ``test``: hooks for tests and benchmarks (a forced failure, a tag on processes).

Guarantees: a name not in ``KNOBS`` cannot be read through ``get`` (KeyError): a new knob is
listed before it is used, and tests/test_config.py checks that every ``STALWART_*`` name in
src/ is listed. Cost: a dict look-up per read; nothing is cached, so a test may set a
variable between calls. Torch-free, imports nothing of stalwart.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["KNOBS", "Knob", "engine", "fec", "fec_numpy", "get", "min_world", "mtu",
           "require_native", "run_dir", "torchelastic_restart_count", "udp_gso"]


@dataclass(frozen=True)
class Knob:
    name: str
    kind: str  # override | wiring | test
    default: str | None  # the value meant when unset (None: unset means "absent")
    doc: str


KNOBS: dict[str, Knob] = {k.name: k for k in (
    # ---- overrides: comm (the lossy collective's data plane) ---------------------------------
    Knob("STALWART_ENGINE", "override", None,
         "the lossy collective's data plane: native | python (default: native when it built)"),
    Knob("STALWART_FEC", "override", None,
         "the lossy collective's loss coding: rs (Reed-Solomon parity) | copies (default: rs "
         "when copies is auto, else copies)"),
    Knob("STALWART_FEC_NUMPY", "override", "0",
         "1: Reed-Solomon coding in numpy even when the native coder is there (a check)"),
    Knob("STALWART_UDP_GSO", "override", "1",
         "0: send one datagram per syscall instead of UDP segmentation offload"),
    Knob("STALWART_MTU", "override", "1500",
         "the lossy collective's datagram budget in bytes (the testbed sets its link MTU)"),
    Knob("STALWART_GHASH", "override", None,
         "the native engine's GHASH implementation (read by engine.c at load; a check)"),
    Knob("STALWART_REQUIRE_NATIVE", "override", "0",
         "1: a native part that did not build is an error, not a fallback (CI)"),
    # ---- wiring: the launcher, the testbed and the elastic store to the processes they start
    Knob("STALWART_RUN_DIR", "wiring", None,
         "the run directory; set by `stalwart run` for its ranks (absent: plain torchrun)"),
    Knob("STALWART_MONITOR_RUN_DIR", "wiring", None,
         "where a --script run's own Monitor() writes (detect/monitor.py)"),
    Knob("STALWART_DEVICE_SLOT", "wiring", None,
         "the rank's index among the ranks of this machine (devices.py)"),
    Knob("STALWART_DEVICE_SLOTS", "wiring", None, "the ranks of this machine (devices.py)"),
    Knob("STALWART_HOST", "wiring", None, "the emulated host's name (netns testbed)"),
    Knob("STALWART_HOST_ADDR", "wiring", None, "the address this rank's sockets bind"),
    Knob("STALWART_HEARTBEAT", "wiring", None,
         "HOST:PORT of the launcher's liveness listener (heartbeat.py)"),
    Knob("STALWART_STORE", "wiring", None,
         "HOST:PORT of the elastic membership store (elastic/store.py)"),
    Knob("STALWART_JOB", "wiring", "job", "the job's name in a shared membership store"),
    Knob("STALWART_NODE", "wiring", None, "this node's name in an elastic job"),
    Knob("STALWART_NODE_ADDR", "wiring", "127.0.0.1", "a peer harness node's address (bench)"),
    Knob("STALWART_MIN_WORLD", "wiring", None,
         "members an elastic job's first generation waits for (default: WORLD_SIZE)"),
    # ---- test and benchmark hooks ----------------------------------------------------------
    Knob("STALWART_ELASTIC_TEST_EXIT_AFTER_ACK", "test", None,
         "an elastic member exits after acknowledging this generation (elastic/job.py)"),
    Knob("STALWART_TEST_REGROUP_FAIL", "test", None,
         "the slot whose in-place regroup fails (mitigate/fallback.py)"),
    Knob("STALWART_BENCH_NVRX", "test", None,
         "1: the bench scripts run NVIDIA's straggler detector beside stalwart's"),
    Knob("STALWART_EBENCH", "test", None, "a tag on the elastic bench's processes"),
    Knob("STALWART_OVERHEAD_PHASES", "test", None,
         "folder for the detect-overhead bench's per-phase timings"),
    Knob("STALWART_OVERHEAD_PROFILE", "test", None,
         "folder for the detect-overhead bench's cProfile dumps"),
)}


def get(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The variable ``name`` (listed in ``KNOBS``), or its listed default when unset or
    empty."""
    knob = KNOBS[name]  # KeyError: list it first
    value = (os.environ if env is None else env).get(name)
    return value if value else knob.default


# ---- overrides ---------------------------------------------------------------------------------
def engine() -> str:
    """STALWART_ENGINE ('' when unset: the caller's default)."""
    return get("STALWART_ENGINE") or ""


def fec() -> str | None:
    """STALWART_FEC, or None when unset."""
    return get("STALWART_FEC")


def fec_numpy() -> bool:
    return get("STALWART_FEC_NUMPY") == "1"


def udp_gso() -> bool:
    return get("STALWART_UDP_GSO") != "0"


def mtu() -> int:
    return int(get("STALWART_MTU") or 1500)


def require_native() -> bool:
    return get("STALWART_REQUIRE_NATIVE") == "1"


# ---- wiring ------------------------------------------------------------------------------------
def run_dir(env: Mapping[str, str] | None = None) -> str | None:
    """STALWART_RUN_DIR: set when ``stalwart run`` started this process."""
    return get("STALWART_RUN_DIR", env)


def min_world(env: Mapping[str, str] | None = None) -> int:
    """STALWART_MIN_WORLD, else torchrun's WORLD_SIZE, else 1."""
    e = os.environ if env is None else env
    return int(get("STALWART_MIN_WORLD", env) or e.get("WORLD_SIZE") or 1)


def torchelastic_restart_count(env: Mapping[str, str] | None = None) -> int:
    """torchrun's TORCHELASTIC_RESTART_COUNT (0 when unset): > 0 in a restarted incarnation."""
    return int((os.environ if env is None else env).get("TORCHELASTIC_RESTART_COUNT") or 0)
