"""Small system helpers for the testbed: running kernel tools, naming, owner liveness.

Every resource the testbed creates (network namespace, bridge, bridge port, cgroup) carries the
project prefix ``stw`` and the pid of the process that created it, so that concurrent testbeds
never collide and a leftover from a killed run can be recognised as stale (its owner pid is no
longer alive) without ever touching a live run's resources.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Sequence

from stalwart.errors import ConfigError

PREFIX = "stw"
IFNAMSIZ = 15  # Linux interface names are at most 15 characters

# how to install each tool we call, for the one-line "missing" message
_INSTALL = {
    "ip": "apt-get install -y iproute2",
    "tc": "apt-get install -y iproute2",
    "nft": "apt-get install -y nftables",
}

# one counter per process: several testbeds (or Hosts) in one process get distinct names
_instance = itertools.count()


class TestbedError(RuntimeError):
    """A kernel tool failed while building or changing the testbed (not a user mistake)."""

    __test__ = False  # not a pytest test class despite the name


def next_tag() -> str:
    """``<pid>-<k>``: unique among this process's testbeds, parseable back to the owner pid."""
    return f"{os.getpid()}-{next(_instance)}"


def b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (a killed, unreaped owner counts as dead)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            # state is the field after the parenthesised command name
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        return False


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise ConfigError(f"{what} needs root (run as root, e.g. with sudo)")


def require_tool(tool: str, what: str) -> None:
    if shutil.which(tool) is None:
        how = _INSTALL.get(tool, f"install {tool}")
        raise ConfigError(f"{tool} not found (needed for {what}): {how}")


def run(args: Sequence[str], *, check: bool = True, input: str | None = None,
        timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run a kernel tool; on failure raise TestbedError carrying its stderr (one line)."""
    try:
        cp = subprocess.run(list(args), capture_output=True, text=True, input=input,
                            timeout=timeout)
    except FileNotFoundError:
        raise TestbedError(f"{args[0]} not found") from None
    if check and cp.returncode != 0:
        msg = (cp.stderr or cp.stdout).strip().replace("\n", " | ")
        raise TestbedError(f"`{' '.join(args)}` failed: {msg}")
    return cp


def quiet(args: Sequence[str]) -> bool:
    """Run a cleanup command, ignoring failure (the resource may already be gone)."""
    try:
        return run(args, check=False, timeout=15.0).returncode == 0
    except (TestbedError, subprocess.TimeoutExpired):
        return False
