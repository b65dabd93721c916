"""Cleanup guarantees: close on exit and on SIGTERM/SIGHUP, and removal of stale leftovers.

* Every open Hosts/Testbed registers here; ``atexit`` and a chained SIGTERM/SIGHUP handler close
  whatever is still open, then let the signal do what it did before (previous handler, or the
  default action re-delivered), so the caller's exit behaviour does not change.
* A process killed with -9 cannot clean up. Its resources keep its pid in their names, and
  ``cleanup_stale()`` (run at every testbed start and by ``stalwart testbed cleanup``) removes
  exactly those whose owner pid is no longer alive -- never a live run's resources, so
  concurrent testbeds of other users and CI jobs on the same machine are safe.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import threading
from pathlib import Path
from typing import Any, Protocol

from stalwart.testbed._sys import PREFIX, pid_alive, quiet, run

_NETNS_RE = re.compile(rf"^{PREFIX}-(\d+)-\d+-(?:h\d+|ctl)$")
_BRIDGE_RE = re.compile(rf"^{PREFIX}b(\d+)-\d+$")
_PORT_RE = re.compile(rf"^{PREFIX}p([0-9a-z]+)-[0-9a-z]+-[0-9a-z]+$")
_CGROUP_RE = re.compile(rf"^{PREFIX}-(\d+)-\d+-r\d+$")


class Closable(Protocol):
    def close(self) -> None: ...


_open: list[Closable] = []
_lock = threading.Lock()
_prev: dict[int, Any] = {}
_installed = False


def register(obj: Closable) -> None:
    global _installed
    with _lock:
        _open.append(obj)
        if not _installed:
            _installed = True
            atexit.register(close_all)
            _install_signals()


def unregister(obj: Closable) -> None:
    with _lock:
        if obj in _open:
            _open.remove(obj)


def close_all() -> None:
    while True:
        with _lock:
            if not _open:
                return
            obj = _open.pop()
        try:
            obj.close()
        except Exception:  # noqa: BLE001 -- best effort at exit; stale cleanup is the backstop
            pass


def _install_signals() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit still covers us
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            _prev[sig] = signal.getsignal(sig)
            signal.signal(sig, _on_signal)
        except (ValueError, OSError):
            pass


def _on_signal(signum: int, frame: Any) -> None:
    close_all()
    prev = _prev.get(signum, signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)
    elif prev != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


# ---- stale leftovers ---------------------------------------------------------------------
def _owner(name: str, pattern: re.Pattern[str], base: int = 10) -> int | None:
    m = pattern.match(name)
    return int(m.group(1), base) if m else None


def _stale(name: str, pattern: re.Pattern[str], base: int = 10) -> bool:
    pid = _owner(name, pattern, base)
    return pid is not None and not pid_alive(pid)


def list_netns() -> list[str]:
    cp = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in cp.stdout.splitlines() if line.strip()]


def list_links() -> list[str]:
    cp = run(["ip", "-o", "link", "show"], check=False)
    out = []
    for line in cp.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            out.append(parts[1].strip().split("@")[0])
    return out


def cgroup_dirs() -> list[Path]:
    """Our cgroups in every CPU hierarchy (v1 cpu, v2 unified), stale or not."""
    roots = [Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpu,cpuacct"),
             Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")]
    seen: set[Path] = set()
    out = []
    for root in roots:
        try:
            entries = list(root.iterdir())
        except OSError:
            continue
        for d in entries:
            if d.is_dir() and d.name.startswith(PREFIX + "-") and d.resolve() not in seen:
                seen.add(d.resolve())
                out.append(d)
    return out


def ours(include_live: bool = False) -> dict[str, list[str]]:
    """Resources of ours on this machine (only stale ones unless include_live)."""
    def keep(name: str, pat: re.Pattern[str], base: int = 10) -> bool:
        return _owner(name, pat, base) is not None and (include_live or _stale(name, pat, base))

    return {
        "netns": [n for n in list_netns() if keep(n, _NETNS_RE)],
        "links": [n for n in list_links()
                  if keep(n, _BRIDGE_RE) or keep(n, _PORT_RE, 36)],
        "cgroups": [str(d) for d in cgroup_dirs() if keep(d.name, _CGROUP_RE)],
    }


def owned_by(pid: int) -> dict[str, list[str]]:
    """Every resource whose name carries owner `pid` (for tests and diagnostics)."""
    found = ours(include_live=True)
    return {
        "netns": [n for n in found["netns"] if _owner(n, _NETNS_RE) == pid],
        "links": [n for n in found["links"]
                  if _owner(n, _BRIDGE_RE) == pid or _owner(n, _PORT_RE, 36) == pid],
        "cgroups": [c for c in found["cgroups"] if _owner(Path(c).name, _CGROUP_RE) == pid],
    }


def stale_busy_processes() -> list[tuple[int, str]]:
    """(pid, group) of contention busy processes whose testbed owner is dead. They exit by
    themselves when their parent changes; this is the backstop if one ever does not."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        # [python, -S, -c, "# stw-<pid>-<k>-r<rank> busy\n...", owner pid, ""]
        if len(argv) >= 4 and argv[2] == b"-c" and argv[3].startswith(b"# " + PREFIX.encode()):
            group = argv[3][2:].split(b" ", 1)[0].decode(errors="replace")
            if _stale(group, _CGROUP_RE):
                out.append((int(entry), group))
    return out


def cleanup_stale() -> list[str]:
    """Remove namespaces, bridges/ports and cgroups whose owner process is dead.

    Returns what was removed, e.g. ``["netns stw-812-0-h0", "link stwb812-0"]``. Safe to run
    concurrently with live testbeds and with another cleanup (a resource that vanished
    meanwhile is simply skipped).
    """
    from stalwart.testbed.cpu import remove_group

    stale = ours(include_live=False)
    removed: list[str] = []
    for ns in stale["netns"]:
        # deleting the namespace destroys its eth0, hence the veth peer on the bridge, and
        # every nftables table and qdisc inside it
        if quiet(["ip", "netns", "del", ns]):
            removed.append(f"netns {ns}")
    if stale["links"]:
        present = set(list_links())
        for link in stale["links"]:
            if link in present and quiet(["ip", "link", "del", link]):
                removed.append(f"link {link}")
    for pid, group in stale_busy_processes():
        try:
            os.kill(pid, signal.SIGKILL)
            removed.append(f"process {pid} ({group} busy)")
        except ProcessLookupError:
            pass
    for path in stale["cgroups"]:
        # processes still inside (ranks orphaned by a killed launcher) go to the parent group;
        # busy processes exit by themselves once their owner is gone
        if remove_group(Path(path)):
            removed.append(f"cgroup {path}")
    return removed
