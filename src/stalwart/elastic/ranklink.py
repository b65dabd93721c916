"""The built-in trainer's link between ``stalwart run`` and its ranks, the rank's side: the
records of elastic/runlink.py (which says what each is, who writes it and who reads it) read
and written over a TCP connection to the launch's membership store.

The store's address comes as for a ``--script`` run (``STALWART_STORE``, ``STALWART_JOB``),
the launch's token on the worker's command line (``--link TOKEN``). A ``RankLink`` is one
client connection: a thread of its own takes its own (``clone``), as a c10d store client is
not shared between threads here.

Cost: each operation is one store round trip (0.1-0.3 ms on the testbed's loopback or veth);
the membership watcher (mitigate/regroup.py) waits on the next generation's key, so the store
wakes it when the key is written (0.2 ms measured), at one request a minute while nothing
changes. A call to a store that does
not answer fails after ``STORE_TIMEOUT_S`` (c10d's client timeout); the launcher stops the job
when the store process dies (runlink.py).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

from stalwart.elastic.runlink import STORE_TIMEOUT_S, ExitRecord, Ready, TakeBack, run_prefix
from stalwart.mitigate.membership import Generation


class RankLink:
    """One rank's connection to its launch's records (the module docstring)."""

    def __init__(self, host: str, port: int, job: str, token: str) -> None:
        import torch.distributed as dist

        self.host, self.port, self.job, self.token = host, port, job, token
        deadline = time.monotonic() + 120.0  # the store process may still be starting
        while True:
            try:
                tcp = dist.TCPStore(host, port, None, is_master=False,
                                    timeout=timedelta(seconds=STORE_TIMEOUT_S))
                break
            except Exception:  # noqa: BLE001 -- not serving yet: retried until the deadline
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.s = dist.PrefixStore(run_prefix(job, token), tcp)

    @staticmethod
    def from_env(token: str, env: dict[str, str] | None = None) -> RankLink:
        """The link to launch ``token``'s records at ``STALWART_STORE`` (``host:port``)."""
        env = dict(os.environ) if env is None else env
        where = env.get("STALWART_STORE", "")
        host, _, port = where.rpartition(":")
        if not host or not port.isdigit():
            raise RuntimeError(f"--link {token} needs STALWART_STORE=host:port (got {where!r})")
        return RankLink(host, int(port), env.get("STALWART_JOB", "job"), token)

    def clone(self) -> RankLink:
        """Another connection to the same records (for another thread)."""
        return RankLink(self.host, self.port, self.job, self.token)

    # generations
    def generation(self, n: int) -> Generation | None:
        """Generation ``n``, or None while it has not been written."""
        key = f"gen/{n}"
        if not self.s.check([key]):
            return None
        return Generation.from_json(self.s.get(key))

    def wait_generation(self, n: int, timeout_s: float) -> Generation | None:
        """Generation ``n`` as soon as it is written (the store wakes the waiter: no poll
        interval), or None after ``timeout_s`` (or when the store did not answer)."""
        try:
            self.s.wait([f"gen/{n}"], timedelta(seconds=timeout_s))
            return Generation.from_json(self.s.get(f"gen/{n}"))
        except Exception:  # noqa: BLE001 -- the wait's timeout (or the store gone)
            return None

    def first(self, timeout_s: float = 120.0) -> Generation:
        """Generation 0 (the launcher writes it before starting the ranks, possibly before
        the store serves: waited for)."""
        self.s.wait(["gen/0"], timedelta(seconds=timeout_s))
        return Generation.from_json(self.s.get("gen/0"))

    def newest(self, g: Generation) -> Generation:
        """The newest generation from ``g`` on (generations are written in order, never
        rewritten: walk up until the next is missing)."""
        while True:
            nxt = self.generation(g.gen + 1)
            if nxt is None:
                return g
            g = nxt

    def propose(self, g: Generation) -> Generation:
        """Compare-and-set generation ``g.gen``: ``g`` if first, else the one written
        before it (by the launcher: a rank lost meanwhile)."""
        got = self.s.compare_set(f"gen/{g.gen}", "", g.to_json())
        return Generation.from_json(got)

    # a rank started again to rejoin
    def ready(self, slot: int) -> None:
        self.s.set(f"ready/{slot}", Ready(slot, os.getpid(), time.time()).to_json())

    # why this rank exits 0 before the job's end (read by the launcher when it sees the exit)
    def exiting(self, rec: ExitRecord) -> None:
        """Write the record and return once the store holds it. c10d's ``set`` does not wait
        for the server (it has no reply): a rank that exited right after it could be seen
        exited by the launcher before its record arrived -- on a host whose link is
        throttled (S4 of a slow host link, lossy job) the launcher read no record 3 times in
        5 and took the rank that left for one that finished. ``check`` is answered after the
        server processed the ``set`` before it on this connection."""
        key = f"exit/{rec.slot}"
        self.s.set(key, rec.to_json())
        if not self.s.check([key]):
            raise RuntimeError(f"the membership store lost this rank's exit record ({key})")

    # the launcher's request to take a host back (rank 0)
    def take_back(self) -> TakeBack | None:
        """The launcher's request, removed as it is read (one round trip when none)."""
        if not self.s.check(["takeback"]):
            return None
        got = TakeBack.from_json(self.s.get("takeback"))
        self.s.delete_key("takeback")
        return got

    # a generation's process-group rendezvous: where its rank 0 serves a TCPStore
    def put_pg_addr(self, gen: int, host: str, port: int) -> None:
        self.s.set(f"pg/{gen}", f"{host} {port}")

    def pg_addr(self, gen: int, slice_s: float) -> tuple[str, int] | None:
        """Generation ``gen``'s rendezvous address, waited for at most ``slice_s``."""
        try:
            self.s.wait([f"pg/{gen}"], timedelta(seconds=slice_s))
        except Exception:  # noqa: BLE001 -- the wait's timeout: not there yet
            return None
        host, port = self.s.get(f"pg/{gen}").decode().split()
        return host, int(port)

    @property
    def store(self) -> Any:
        return self.s
