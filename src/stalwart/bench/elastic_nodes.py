"""Emulated nodes for ``bench elastic``: each node a netns host (root) or a group of local
processes (not root), running launcher processes the suite gives it, with real faults.

- ``start(i, cmd)``: a node's launcher (a torchrun agent) in host i, tagged in its
  environment (``STALWART_EBENCH=<tag>-n<i>``) so that it and everything it starts (workers
  in sessions of their own included) can be found in ``/proc``;
- ``kill(i)``: SIGKILL to every process of node i (a node that dies);
- ``hang(i)``: SIGSTOP to node i's ranks -- its processes that carry ``LOCAL_RANK`` (the
  workers and what they start), not its torchrun agent (a frozen rank whose node stays up);
- ``cut(i)``: node i's link cut both ways without an error to anyone: nftables drops every
  packet arriving at its ``eth0`` and, in every other host, every packet arriving from it
  (input hooks only: a drop on an output hook would tell the sender with EPERM). Root only;
- a watch thread notes every worker process (a child of a node's agent) and when it was
  first seen (every 0.1 s): ``workers_restarted`` counts the ones that came after a fault.

Every process started here is killed, and the hosts removed, by ``close()``.
Cost: one ``/proc`` scan per 0.1 s (stat files only; environments only when signalling).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

TAG_ENV = "STALWART_EBENCH"


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _environ(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


class Nodes:
    """``n`` emulated nodes; ``netns`` False runs them all on 127.0.0.1 (no cut)."""

    def __init__(self, n: int, workdir: Path, netns: bool) -> None:
        self.n, self.workdir, self.netns = n, workdir, netns
        self.tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.hosts: Any = None
        if netns:
            from stalwart.testbed.hosts import Hosts

            self.hosts = Hosts(n)
        self.agents: dict[int, list[subprocess.Popen[bytes]]] = {i: [] for i in range(n)}
        self.others: list[subprocess.Popen[bytes]] = []
        self.seen: dict[int, tuple[int, float]] = {}  # worker pid -> (node, first seen)
        self._cut: set[int] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        from stalwart.testbed import cleanup

        cleanup.register(self)  # closed at exit and on SIGTERM/SIGHUP as well
        self._watch = threading.Thread(target=self._watch_workers, daemon=True)
        self._watch.start()

    # -- addressing -------------------------------------------------------------------------
    def addr(self, i: int) -> str:
        return self.hosts.addr(i) if self.hosts is not None else "127.0.0.1"

    def prefix(self, i: int) -> list[str]:
        return self.hosts.exec_prefix(i) if self.hosts is not None else []

    def node_tag(self, i: int | str) -> str:
        return f"{self.tag}-n{i}"

    # -- processes --------------------------------------------------------------------------
    def start(self, i: int, cmd: list[str], log: str, env: dict[str, str] | None = None,
              agent: bool = True, host: int | None = None) -> subprocess.Popen[bytes]:
        """Start ``cmd`` on node ``i`` (tagged as node ``i``; ``agent`` False: a process of
        its own, e.g. torchft's Lighthouse, tagged apart and run in host ``host``)."""
        h = i if host is None else host
        full = {**os.environ, **(env or {}), TAG_ENV: self.node_tag(i if agent else "x"),
                "STALWART_NODE_ADDR": self.addr(h), "OMP_NUM_THREADS": "1"}
        if self.netns:  # gloo's interface: the host's own (its name resolves outside)
            full["GLOO_SOCKET_IFNAME"] = "eth0"
        full.pop("LOCAL_RANK", None)
        with open(self.workdir / log, "ab") as f:
            p = subprocess.Popen([*self.prefix(h), *cmd], stdout=f, stderr=subprocess.STDOUT,
                                 env=full, cwd=self.workdir, start_new_session=True)
        with self._lock:
            (self.agents[i] if agent else self.others).append(p)
        return p

    def tagged(self, i: int | str, ranks_only: bool = False) -> list[int]:
        want = f"{TAG_ENV}={self.node_tag(i)}".encode()
        me = os.getpid()
        out = []
        for pid in _pids():
            if pid == me:
                continue
            env = _environ(pid)
            if want in env and (not ranks_only or any(e.startswith(b"LOCAL_RANK=")
                                                      for e in env)):
                out.append(pid)
        return out

    def _signal(self, pids: list[int], sig: signal.Signals) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def kill(self, i: int) -> float:
        """SIGKILL every process of node i; the time it was sent."""
        pids = self.tagged(i)  # (a /proc scan: the clock starts when the signals go)
        t = time.time()
        self._signal(pids, signal.SIGKILL)
        for p in self.agents[i]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        return t

    def hang(self, i: int) -> float:
        """SIGSTOP node i's ranks (not its agent); the time."""
        pids = self.tagged(i, ranks_only=True)
        t = time.time()
        self._signal(pids, signal.SIGSTOP)
        return t

    def cut(self, i: int) -> float:
        """Drop every packet to and from node i (root; testbed/hosts.py ``set_cut``); the
        time."""
        if self.hosts is None:
            raise RuntimeError("a cut link needs the netns testbed (root)")
        t = time.time()
        self.hosts.set_cut(i)
        self._cut.add(i)
        return t

    def uncut(self) -> None:
        if self.hosts is None:
            return
        for i in sorted(self._cut):
            self.hosts.set_cut(i, False)
        self._cut.clear()

    def live_agents(self) -> list[subprocess.Popen[bytes]]:
        with self._lock:
            return [p for ps in self.agents.values() for p in ps if p.poll() is None]

    def wait(self, timeout: float, done: Any = None) -> bool:
        """Until every agent has exited (True), ``done()`` holds (True), or the timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.live_agents() or (done is not None and done()):
                return True
            time.sleep(0.2)
        return False

    # -- the watch ---------------------------------------------------------------------------
    def _watch_workers(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                parents = {p.pid: i for i, ps in self.agents.items() for p in ps}
            now = time.time()
            for pid in _pids():
                if pid in self.seen:
                    continue
                pp = _ppid(pid)
                if pp in parents:
                    self.seen[pid] = (parents[pp], now)
            self._stop.wait(0.1)

    # -- teardown ---------------------------------------------------------------------------
    def stop_all(self) -> None:
        """Kill every process started here (agents, their workers, the others)."""
        for i in [*range(self.n), "x"]:
            pids = self.tagged(i)
            self._signal(pids, signal.SIGCONT)
            self._signal(pids, signal.SIGKILL)
        with self._lock:
            procs = [p for ps in self.agents.values() for p in ps] + self.others
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        try:
            self.stop_all()
            self.uncut()
        finally:
            if self.hosts is not None:
                self.hosts.close()
            from stalwart.testbed import cleanup

            cleanup.unregister(self)

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
