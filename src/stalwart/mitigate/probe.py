"""Keep probing a host the job left (S4), and say when taking it back pays for the restart.

FALCON restarts without a bad node and stops there; a fail-slow lasts tens of seconds to hours,
so a job that never takes the host back gives up a rank's worth of capacity for good. While a
host is excluded the launcher runs this probe every ``PROBE_EVERY_S`` seconds, in a thread so
progress and supervision go on:
- link: bulk TCP from the excluded host to a host of the job, against the same between two
  hosts of the job (ratio of measured rates: the detector's link test, on the same kernel
  path the training traffic takes);
- compute: a fixed Python loop in the excluded host's CPU cgroup (its slot's limits in force)
  against the same loop in a healthy host's cgroup.
The host is healthy after ``HEALTHY_ROUNDS`` consecutive rounds with its link at ``LINK_MIN`` of
its peers' rate or better and its compute within ``TOLERANCE``. It is taken back only when the
predicted gain over the remaining steps -- the step time with G-1 hosts against G -- exceeds its
price: the measured restart time, or, in a job that regroups in place, the last regroup's time
(the launcher starts the host's rank again first and asks only once it is ready to join live).
The request goes to rank 0 as a ``TakeBack`` record in the launch's membership store
(elastic/runlink.py), so the change itself is agreed and made at one step by every rank
(agreement.py). Only a job that regroups in place has that store and a rank 0 that reads it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

PROBE_EVERY_S = 6.0
HEALTHY_ROUNDS = 2
TOLERANCE = 0.25  # compute within 1.25x of a healthy host's loop
# a link at >= this fraction of its peers' rate. Noise model: both rates are bulk TCP that the
# 2-core machine's CPU bounds (~10 Gbit/s) while the job's ranks compete for it, so a healthy
# host read 0.48-1.51x of its peer in the 7 rounds recorded (log sd ~0.35; 0.75 rejected 2 of
# them); a shaped link (10-30 mbit) reads ~0.003. 0.25 is >= 3 sd below a
# healthy host and 80x above a shaped one (and stricter than the detector's 20x link test).
LINK_MIN = 0.25


def reference_pair(hosts: Any, host: int, peers: list[int]) -> tuple[int, int]:
    """Two peers (slots) to compare the probed host's link with: on hosts other than the
    probed one and than each other where the testbed puts several ranks on a host (their
    transfer would not cross a link), else the first two."""
    addr = hosts.addr
    a = next((p for p in peers if addr(p) != addr(host)), peers[0])
    b = next((p for p in peers if addr(p) not in (addr(host), addr(a))), None)
    return (a, b) if b is not None else (peers[0], peers[1])


class HostProbe:
    """Probes one excluded host in the background (see the module docstring)."""

    def __init__(self, testbed: Any, host: int, peers: list[int], link: Any = None) -> None:
        """``link``: the launch's records (elastic/runlink.py ``LauncherLink``), where the
        request to take the host back goes."""
        self.tb = testbed
        self.host = host
        self.peers = peers
        self.link = link
        self.rounds: list[dict[str, float | None]] = []
        self.healthy = 0
        self.declined = ""  # why a healthy host was not taken back (for the event log)
        self.tries = 0  # times its rank was started again to rejoin (launch.py)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="stw-probe")
        self._thread.start()

    def measure(self) -> dict[str, float | None]:
        from stalwart.testbed.probe import busy_loop_time, tcp_throughput

        out: dict[str, float | None] = {"link": None, "compute": None}
        hosts = getattr(self.tb, "hosts", None)
        if hosts is not None and len(self.peers) >= 2:
            a, b = reference_pair(hosts, self.host, self.peers)
            mine = tcp_throughput(hosts, self.host, a, seconds=0.4, port=47102)
            ref = tcp_throughput(hosts, b, a, seconds=0.4, port=47103)
            out["link"] = mine / max(ref, 1.0)
        groups = getattr(self.tb, "_groups", {})
        if self.host in groups:
            ref_group = next((groups[p] for p in self.peers if p in groups), None)
            mine_t = busy_loop_time(300_000, groups[self.host])
            ref_t = busy_loop_time(300_000, ref_group)
            out["compute"] = mine_t / max(ref_t, 1e-9)
        return out

    def ok(self, m: dict[str, float | None]) -> bool:
        link_ok = m["link"] is None or m["link"] >= LINK_MIN
        comp_ok = m["compute"] is None or m["compute"] <= 1.0 + TOLERANCE
        return link_ok and comp_ok

    def _loop(self) -> None:
        while not self._stop.wait(PROBE_EVERY_S):
            try:
                m = self.measure()
            except Exception:  # noqa: BLE001 -- a failed probe is not a healthy host
                m = {"link": 0.0, "compute": None}
            self.rounds.append(m)
            self.healthy = self.healthy + 1 if self.ok(m) else 0

    def restore_reason(self, remaining_steps: int, step_s: float, groups: int,
                       price_s: float, how: str = "restart") -> str | None:
        """Why taking the host back now pays off, or None: it is healthy and the remaining
        steps at G/(G+1) of today's step time save more than ``price_s`` (a restart's, or
        a regroup's when it rejoins live: ``how``)."""
        if self.healthy < HEALTHY_ROUNDS:
            return None
        gain_s = remaining_steps * step_s * (1.0 - groups / (groups + 1))
        if gain_s <= price_s:
            if not self.declined:  # say once why the host stays out
                self.declined = (f"host {self.host} healthy again, but taking it back would "
                                 f"save {gain_s:.1f} s over {remaining_steps} steps against a "
                                 f"{price_s:.1f} s {how}: staying at {groups} hosts")
            return None
        last = self.rounds[-1]
        return (f"host {self.host} healthy for {self.healthy} probes (link "
                f"{_fmt(last['link'])} of its peers' rate, compute {_fmt(last['compute'])}x); "
                f"predicted {gain_s:.1f} s saved over {remaining_steps} steps, {how} "
                f"{price_s:.1f} s")

    def request(self, reason: str, groups: int, live: bool = True) -> None:
        """Ask rank 0 (a ``TakeBack`` record) to take the host back, once; ``live``: its
        rank was started again and is ready to join in place."""
        from stalwart.elastic.runlink import TakeBack

        if self.link is None:
            raise RuntimeError("no membership store to ask rank 0 through")
        self.link.ask_take_back(TakeBack(self.host, 1.0 - groups / (groups + 1), reason, live))
        self.healthy = -10**9  # once

    def stop(self) -> None:
        """Stop probing (the host is back): no more load on it; ``close`` joins later."""
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(RuntimeError):
            self._thread.join(timeout=10)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"

