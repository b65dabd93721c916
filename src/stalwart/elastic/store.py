"""Where the membership lives: a c10d ``TCPStore`` under one key prefix, and the typed reads and
writes of the protocol's records on it (``protocol.py`` says what they mean).

Which store (``connect``):

- ``STALWART_STORE=host:port``: a store that outlives any node, started once with
  ``python -m stalwart.elastic.store --port PORT`` (this module's ``main``) on a host that is
  not a training node, or on the node you trust most. This is what live rejoin across
  torchrun agents needs: each node runs its own ``torchrun --standalone`` and the store joins
  them (see docs/elastic.md for why torchrun's own rendezvous cannot: its agents restart all
  workers when a node arrives). ``STALWART_JOB`` names the job in a shared store.
- else, under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``): the agent's store that the
  workers already use (``MASTER_ADDR:MASTER_PORT``), under the run id and restart count.
- else (``stalwart run --script``, a plain launcher): served by the process with ``RANK 0``
  at ``MASTER_ADDR:MASTER_PORT``, as ``init_process_group("env://")`` would serve it.

What happens when the store's node dies: every store call fails (at once on a reset
connection, after ``STORE_TIMEOUT_S`` on a silent one) and the job raises ``StoreLost`` on
every member, naming the store and the last checkpoint -- never a silent hang. With the
first two choices a store outlives any training node that does not host it.

Cost: one TCP connection per member and thread; a heartbeat is one ``add``; a generation is
one compare-and-set of a few hundred bytes.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from stalwart.elastic.errors import StoreLost
from stalwart.elastic.protocol import Ack, Generation, Member
from stalwart.errors import ConfigError

STORE_TIMEOUT_S = 10.0


def _parse(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"STALWART_STORE={addr!r} is not host:port")
    return host, int(port)


def locate(env: dict[str, str] | None = None) -> tuple[str, int, bool, str]:
    """(host, port, serve_it_here, key prefix) from the environment (the module docstring)."""
    env = dict(os.environ) if env is None else env
    given = env.get("STALWART_STORE")
    if given:
        host, port = _parse(given)
        return host, port, False, f"stalwart/{env.get('STALWART_JOB', 'job')}/"
    host = env.get("MASTER_ADDR", "127.0.0.1")
    port = int(env.get("MASTER_PORT", "0") or 0)
    if port == 0:
        return "127.0.0.1", 0, True, "stalwart/local/"
    run = f"{env.get('TORCHELASTIC_RUN_ID', 'run')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return host, port, False, f"stalwart/{run}/"
    return host, port, env.get("RANK", "0") == "0", f"stalwart/{run}/"


class Keys:
    """The protocol's records on one store (a client connection: one per thread)."""

    def __init__(self, store: Any, where: str) -> None:
        self.s = store
        self.where = where
        self._lost: str | None = None

    def _call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the store, in at most ``STORE_TIMEOUT_S``: a store that stopped
        answering (its host frozen or cut off) leaves a TCPStore call blocked for good, so
        the call runs in a helper thread and is given up; the connection is then dead."""
        if self._lost is not None:
            raise StoreLost(self._lost)
        try:
            return bounded(lambda: fn(*args), STORE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 -- any failure of the store is fatal here
            self._lost = (f"the membership store at {self.where} cannot be reached "
                          f"({str(e).splitlines()[0][:160]})")
            raise StoreLost(self._lost) from None

    # members
    def new_id(self) -> int:
        return int(self._call(self.s.add, "seq", 1))

    def last_id(self) -> int:
        return int(self._call(self.s.add, "seq", 0))

    def put_member(self, m: Member) -> None:
        self._call(self.s.set, f"member/{m.id}", m.to_json())

    def members(self, ids: list[int]) -> list[Member]:
        if not ids:
            return []
        keys = [f"member/{i}" for i in ids]
        if not self._call(self.s.check, keys):
            return [Member.from_json(self._call(self.s.get, k)) for k in keys
                    if self._call(self.s.check, [k])]
        return [Member.from_json(v) for v in self._call(self.s.multi_get, keys)]

    def claim_config(self, text: str) -> str:
        """The job's identity: this one if first, else the one already there."""
        got = self._call(self.s.compare_set, "config", "", text)
        return got.decode() if isinstance(got, bytes) else str(got)

    # liveness
    def beat(self, member: int) -> None:
        self._call(self.s.add, f"hb/{member}", 1)

    def beats(self, ids: list[int]) -> dict[int, int]:
        """Heartbeat counters (every member beats once before its record is written)."""
        if not ids:
            return {}
        vals = self._call(self.s.multi_get, [f"hb/{i}" for i in ids])
        return {i: int(v) for i, v in zip(ids, vals, strict=True)}

    def leave(self, member: int) -> None:
        """Mark ``member`` as left and return once the store holds the mark (c10d's ``set``
        has no reply; ``check`` is answered after it): a member that closes its sockets right
        after must not be taken for a death by a watcher that saw the close first."""
        self._call(self.s.set, f"left/{member}", "1")
        self._call(self.s.check, [f"left/{member}"])

    def left(self, ids: list[int]) -> set[int]:
        return {i for i in ids if self._call(self.s.check, [f"left/{i}"])}

    def park(self, node: str, on: bool) -> None:
        """Add ``node`` to (or remove it from) the parked set: one key, compare-and-set."""
        self._call(self.s.compare_set, "parked", "", "")  # exists from here on
        while True:
            cur = self._call(self.s.get, "parked").decode()
            nodes = {n for n in cur.split("\n") if n}
            nodes = nodes | {node} if on else nodes - {node}
            new = "\n".join(sorted(nodes))
            got = self._call(self.s.compare_set, "parked", cur, new)
            if (got.decode() if isinstance(got, bytes) else str(got)) == new:
                return

    def parked(self) -> set[str]:
        if not self._call(self.s.check, ["parked"]):
            return set()
        return {n for n in self._call(self.s.get, "parked").decode().split("\n") if n}

    def set_weights(self, text: str) -> None:
        self._call(self.s.set, "weights", text)

    def weights(self) -> str | None:
        if not self._call(self.s.check, ["weights"]):
            return None
        return self._call(self.s.get, "weights").decode()

    def set_progress(self, step: int) -> None:
        self._call(self.s.set, "progress", str(step))

    def progress(self) -> int:
        """The last step some member reported completed (-1: none)."""
        if not self._call(self.s.check, ["progress"]):
            return -1
        return int(self._call(self.s.get, "progress"))

    def finish(self, steps: int) -> None:
        self._call(self.s.set, "finished", str(steps))

    def finished(self) -> int | None:
        if not self._call(self.s.check, ["finished"]):
            return None
        return int(self._call(self.s.get, "finished"))

    # generations
    def has_gen(self, g: int) -> bool:
        return bool(self._call(self.s.check, [f"gen/{g}"]))

    def gen(self, g: int) -> Generation:
        return Generation.from_json(self._call(self.s.get, f"gen/{g}"))

    def propose(self, g: Generation) -> Generation:
        """Compare-and-set generation ``g.gen``: the winner (``g`` or an earlier proposal)."""
        got = self._call(self.s.compare_set, f"gen/{g.gen}", "", g.to_json())
        return Generation.from_json(got)

    def ack(self, g: int, member: int, a: Ack) -> None:
        self._call(self.s.set, f"ack/{g}/{member}", a.to_text())

    def acks(self, g: Generation, others: tuple[int, ...] = ()) -> dict[int, Ack]:
        """The acks of ``g`` by its members (and by ``others``: members it left out, which
        ack too, so that the ones still in a collective with them know they stopped)."""
        out = {}
        for m in dict.fromkeys([*g.members, *others]):
            k = f"ack/{g.gen}/{m}"
            if self._call(self.s.check, [k]):
                out[m] = Ack.from_text(self._call(self.s.get, k))
        return out

    def all_acked(self, g: Generation) -> bool:
        return bool(self._call(self.s.check, [f"ack/{g.gen}/{m}" for m in g.members]))


def bounded(fn: Callable[[], Any], timeout_s: float) -> Any:
    """``fn()`` in a daemon thread, waited for at most ``timeout_s`` (TimeoutError after;
    the thread is left blocked). Cost: one thread handoff, ~0.1 ms."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["v"] = fn()
        except BaseException as e:  # noqa: BLE001 -- handed to the caller
            box["e"] = e
        done.set()

    threading.Thread(target=run, name="stalwart-store-call", daemon=True).start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"no answer in {timeout_s:.0f} s")
    if "e" in box:
        raise box["e"]
    return box.get("v")


def client(host: str, port: int, prefix: str) -> Any:
    """A new client connection to the store, under the job's prefix."""
    try:
        tcp = bounded(lambda: dist.TCPStore(host, port, None, is_master=False,
                                            timeout=timedelta(seconds=STORE_TIMEOUT_S)),
                      STORE_TIMEOUT_S + 1)
    except Exception as e:  # noqa: BLE001
        raise StoreLost(f"the membership store at {host}:{port} cannot be reached "
                        f"({str(e).splitlines()[0][:160]})") from None
    return dist.PrefixStore(prefix, tcp)


def serve(host: str, port: int) -> Any:
    """A store server in this process (kept alive by the returned object)."""
    return dist.TCPStore(host, port, None, is_master=True,
                         timeout=timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False)


def commands(srv: Any, lines: Any, out: Any) -> int:
    """Answer store operations, one JSON line ``{"op", "key", "args"}`` each, until ``lines``
    ends (the launcher's side closed it: the launcher is gone or done). Operations: ``set
    KEY VALUE``, ``get KEY`` (null when absent), ``cas KEY EXPECTED DESIRED`` (the value
    after it), ``delete KEY``; each answered ``{"value": ...}`` or ``{"error": "..."}``, in
    order; ``"prefix"``: the key is under that prefix, as a rank's ``PrefixStore`` puts it.
    Cost: one in-process store call per line."""
    import json

    prefixed: dict[str, Any] = {}
    for raw in lines:
        try:
            req = json.loads(raw)
            op, key, args = req["op"], req["key"], list(req.get("args") or [])
            pre = req.get("prefix")
            srv_ = srv if not pre else prefixed.setdefault(pre, dist.PrefixStore(pre, srv))
            if op == "set":
                srv_.set(key, args[0])
                value: Any = None
            elif op == "get":
                value = srv_.get(key).decode() if srv_.check([key]) else None
            elif op == "cas":
                got = srv_.compare_set(key, args[0], args[1])
                value = got.decode() if isinstance(got, bytes) else str(got)
            elif op == "delete":
                value = bool(srv_.delete_key(key))
            else:
                raise ValueError(f"unknown operation {op!r}")
            reply = {"value": value}
        except Exception as e:  # noqa: BLE001 -- answered, the loop goes on
            first = (str(e).splitlines() or [""])[0][:200]
            reply = {"error": f"{type(e).__name__}: {first}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m stalwart.elastic.store [--host H] [--port P]``: serve a membership store
    until SIGTERM/SIGINT; prints ``STALWART_STORE=host:port`` when ready."""
    p = argparse.ArgumentParser(prog="python -m stalwart.elastic.store")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=29400)
    p.add_argument("--commands", action="store_true",
                   help="also take store operations as JSON lines on stdin, answered on "
                        "stdout, until stdin closes (the launcher's side: elastic/runlink.py)")
    a = p.parse_args(argv)
    try:
        srv = serve(a.host, a.port)
    except Exception as e:  # noqa: BLE001
        print(f"stalwart: cannot serve a store on {a.host}:{a.port} ({e})", file=sys.stderr)
        return 2
    shown = a.host if a.host != "0.0.0.0" else "HOST"
    print(f"STALWART_STORE={shown}:{srv.port}", flush=True)
    if a.commands:
        return commands(srv, sys.stdin.buffer, sys.stdout)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
