"""The rank side of the elastic membership, launcher-free: everything a training process does
to stay in the job -- register, beat, watch the others, propose and adopt generations, give up
collectives that can no longer finish, and rebuild its process group (``rebuild``).

Threads: the caller's (``Runtime``'s methods), one watcher thread per process, which every
``HEARTBEAT_S``: beats (one store ``add``), reads the others' beats (one ``multi_get``, and
the bytes waiting on its liveness connections), fetches new members and generations, and
proposes the next generation when the pure decision (``protocol.next_generation``) says so
(its first round at once: a joiner proposes its own admission when it registers); a
generation waiter, blocked on the store until the next generation's key is written, which
adopts it at once (every member hears of a change within a store round trip, not a watcher
period: members that heard at different times used to start a step the others had left);
and the peer beats' native thread (peerbeat.py: a byte per period on each connection the
others opened to this member, sent without the GIL).

Bounds: a member whose process exits is found at once (its liveness socket closes: every
member holds a TCP connection to every other one); a member whose beats all stop -- hung,
SIGSTOPped, cut off -- is taken for dead after ``DEAD_AFTER_S``. A member whose main thread
holds the GIL for seconds (a lazy import's dlopen under load) keeps its peer beats going and
is not taken for dead. Neither
relies on a collective failing: a collective in flight is given up (``wait``) as soon as a
generation that cannot complete it is known, and its process group is aborted once no
member uses it any more (``drop``: its TCP connections shut, sockets.py -- gloo's own abort
does not reach a collective in flight); at ``close`` every group not in use is aborted and
its threads waited for (at most ``CLOSE_WAIT_S``), so that none is left blocked on a hung
peer while the interpreter exits. A store that cannot be reached fails every call with
``StoreLost`` after at most ``STORE_TIMEOUT_S``.
"""

from __future__ import annotations

import contextlib
import io
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from stalwart.elastic import protocol as P
from stalwart.elastic import sockets
from stalwart.elastic.errors import StoreLost
from stalwart.elastic.peerbeat import PeerBeats
from stalwart.elastic.store import Keys, client

GROUP_TIMEOUT_S = 60.0  # gloo's own timeout: only ever reached by a group already given up
# a collective that fails (a peer's socket closed) waits this long for the generation that
# explains it before the failure is raised as is
EXPLAIN_S = P.DEAD_AFTER_S + 2.0


CLOSE_WAIT_S = 2.0  # at close, for given-up collectives and builds to end once aborted
GEN_WAIT_S = 600.0  # the generation waiter's request; renewed (c10d logs each expiry)
DECIDE_TRIES = 3  # proposals a watcher round makes at most (each after losing to another)


@dataclass
class _Build:
    """One generation's group: the sockets open before and after its build (the difference:
    its connections, sockets.py), whether the caller holds it, whether it was aborted."""

    gen: int
    peers: set[str]  # the members' and the store's addresses: where its connections go
    before: set[sockets.Sock]
    after: set[sockets.Sock] | None = None  # None while the build runs
    pg: Any = None
    thread: threading.Thread | None = None
    in_use: bool = False
    aborted: bool = False


class Superseded(Exception):  # noqa: N818 -- a control-flow signal, not an error
    """A newer generation makes the wait pointless: regroup."""


class Runtime:
    """One training process's membership: its id, the generations it knows, its group."""

    def __init__(self, host: str, port: int, prefix: str, node: str, local_rank: int,
                 bind_addr: str, min_world: int, heartbeat_s: float = P.HEARTBEAT_S,
                 dead_after_s: float = P.DEAD_AFTER_S) -> None:
        self.where = f"{host}:{port}"
        self._conn = (host, port, prefix)
        self.keys = Keys(client(host, port, prefix), self.where)
        before = sockets.open_sockets()
        self._gen_store = client(host, port, prefix)  # the generation waiter's own connection
        self._gen_socks = sockets.open_sockets() - before  # shut at close: ends its wait
        self.node, self.local_rank, self.bind_addr = node, local_rank, bind_addr
        self.min_world = min_world
        self.heartbeat_s, self.dead_after_s = heartbeat_s, dead_after_s
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.fatal: StoreLost | None = None
        self.newest: P.Generation | None = None
        self.known: dict[int, P.Member] = {}
        self.dead: set[int] = set()
        self.gone: set[int] = set()  # left cleanly
        self.parked_nodes: set[str] = set()  # as last read by the watcher
        self.ever: set[int] = set()  # every id some generation held: never a joiner again
        self._pending_ids: set[int] = set()
        self._seen_last = 0
        self._socks: dict[int, socket.socket] = {}
        self._sel = selectors.DefaultSelector()
        self._liveness = P.Liveness(dead_after_s)
        self._stop = threading.Event()
        self._listener = socket.create_server((bind_addr, 0))
        self._listener.setblocking(False)
        self._accepted: list[socket.socket] = []
        self._beats = PeerBeats(heartbeat_s)  # on the accepted connections: peerbeat.py
        self._sock_beats: dict[int, int] = {}  # bytes read from each member's connection
        self.me = self._register()
        self.progress = -1  # the last step this member completed (the caller sets it)
        self._progress_sent = -1
        self._abandoned: list[Any] = []  # groups and works given up: never destroyed, never waited
        self._builds: list[_Build] = []  # every group built or being built, oldest first
        self._thread = threading.Thread(target=self._watch, name="stalwart-elastic",
                                        daemon=True)
        self._thread.start()
        self._waiter = threading.Thread(target=self._await_generations,
                                        name="stalwart-elastic-gen", daemon=True)
        self._waiter.start()

    # ---- registration ------------------------------------------------------------------------
    def _register(self) -> P.Member:
        mid = self.keys.new_id()
        self.keys.beat(mid)
        port = self._listener.getsockname()[1]
        m = P.Member(mid, self.node, self.local_rank, f"{self.bind_addr}:{port}")
        self.keys.put_member(m)
        return m

    def reregister(self) -> None:
        """Come back under a new id after being dropped (found dead while hung or cut off):
        the others never take back an id they buried."""
        self.me = self._register()

    # ---- the watcher thread ------------------------------------------------------------------
    def _watch(self) -> None:
        """Rounds every ``heartbeat_s``, the first at once: a joiner proposes its own
        admission as soon as it is registered, not a period later."""
        try:
            keys = Keys(client(*self._conn), self.where)
            while True:
                self._round(keys)
                if self._stop.wait(self.heartbeat_s):
                    return
        except StoreLost as e:
            self.fatal = e
            self.wake.set()
        except Exception as e:  # noqa: BLE001 -- the watcher must report, never die mute
            self.fatal = StoreLost(f"the membership watcher failed: {e}")
            self.wake.set()

    def _round(self, keys: Keys) -> None:
        keys.beat(self.me.id)
        if self.progress != self._progress_sent and self.newest is not None \
                and self.newest.members and self.newest.members[0] == self.me.id:
            keys.set_progress(self.progress)  # by the newest generation's rank 0
            self._progress_sent = self.progress
        self._accept()
        self._advance(keys)
        self._fetch_members(keys)
        now = time.monotonic()
        closed = self._read_sockets()
        watch = [m for m in self.known if m not in self.dead and m not in self.gone]
        for m, c in keys.beats(watch).items():
            # alive while either its store counter (this watcher's thread) or its peer beats
            # (a native thread: peerbeat.py) move
            self._liveness.beat(m, (c, self._sock_beats.get(m, 0)), now)
        lost = closed | (self._liveness.silent(now) - {self.me.id})
        if lost:
            left = keys.left(sorted(lost))
            with self.lock:
                self.gone |= left
                self.dead |= lost - left
            for m in lost:
                self._liveness.forget(m)
        self._advance(keys)
        self._decide(keys)

    def _accept(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while True:
                s, _ = self._listener.accept()
                self._accepted.append(s)
                self._beats.add(s)

    def _fetch_members(self, keys: Keys) -> None:
        last = keys.last_id()
        self._pending_ids |= set(range(self._seen_last + 1, last + 1))
        self._seen_last = max(self._seen_last, last)
        if not self._pending_ids:
            return
        got = [m for m in keys.members(sorted(self._pending_ids))]
        for m in got:
            self._pending_ids.discard(m.id)
            self.known[m.id] = m
            if m.id == self.me.id:
                continue
            if self.buried(m.id):
                self.dead.add(m.id)  # buried: never taken back, no connection to wait on
            else:
                self._connect(m)

    def _connect(self, m: P.Member) -> None:
        host, _, port = m.addr.rpartition(":")
        try:
            s = socket.create_connection((host, int(port)), timeout=1.0)
        except ConnectionRefusedError:
            self.dead.add(m.id)  # its listener is gone: so is its process
            return
        except OSError:
            return  # unreachable for now: its heartbeats decide
        s.setblocking(False)
        self._socks[m.id] = s
        self._sel.register(s, selectors.EVENT_READ, m.id)

    def _read_sockets(self) -> set[int]:
        """Read the peer beats waiting on this member's connections (counted per member);
        return the members whose connection closed (their process exited)."""
        out = set()
        for key, _ in self._sel.select(timeout=0):
            s: socket.socket = key.fileobj  # type: ignore[assignment]
            try:
                data = s.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                m = int(key.data)
                self._sock_beats[m] = self._sock_beats.get(m, 0) + len(data)
            else:
                out.add(int(key.data))
                self._sel.unregister(s)
                s.close()
                self._socks.pop(int(key.data), None)
        return out

    def _advance(self, keys: Keys) -> None:
        cur = self.newest
        g = cur.gen + 1 if cur else 0
        changed = False
        while keys.has_gen(g):
            self._adopt(keys.gen(g))
            g += 1
            changed = True
        if changed:
            self.wake.set()

    def _decide(self, keys: Keys) -> None:
        """Propose the next generation when the pure decision says so. A proposal that lost
        the compare-and-set is decided again at once on top of the winner (at most
        ``DECIDE_TRIES`` times a round), so that a joiner registered while another change
        was proposed is not left for the next round."""
        for _ in range(DECIDE_TRIES):
            prop = self._proposal(keys)
            if prop is None:
                return
            won = keys.propose(prop)
            self._adopt(won)
            self.wake.set()
            if won == prop:
                return
            self._advance(keys)

    def _proposal(self, keys: Keys) -> P.Generation | None:
        cur = self.newest  # (the generation waiter may adopt a newer one meanwhile)
        in_gen = set(cur.members) if cur else set()
        if not in_gen <= set(self.known):
            # a generation adopted since this round fetched the members holds one this
            # watcher does not know yet: without its record it would look dead -- fetch
            # again, and decide nothing until every member is known
            self._fetch_members(keys)
            if not in_gen <= set(self.known):
                return None
        with self.lock:
            dead = self.dead | self.gone
        alive = [m for m in self.known if m not in dead]
        joiners = [m for m in alive if m not in in_gen and m not in self.ever]
        parked_nodes = keys.parked()
        self.parked_nodes = parked_nodes
        parked = [m for m in alive if self.known[m].node in parked_nodes]
        weights = None
        wtext = keys.weights()
        if wtext:
            by_node = dict(item.split("=") for item in wtext.split(",") if "=" in item)
            weights = {m: float(by_node.get(self.known[m].node, 1.0)) for m in alive}
        return P.next_generation(cur, alive, joiners, self.min_world, parked, weights)

    def buried(self, member: int) -> bool:
        """Whether ``member`` was held by a generation and the newest does not hold it: an id
        never taken back (read together, under the lock ``_adopt`` writes them under)."""
        with self.lock:
            n = self.newest
            return member in self.ever and (n is None or member not in n.members)

    def _adopt(self, g: P.Generation) -> None:
        """Take ``g`` as the newest generation unless one as new is known (the watcher and
        the generation waiter both adopt; each adopts the one after the newest it read, so
        no generation's members are missed in ``ever``)."""
        with self.lock:
            if self.newest is not None and g.gen <= self.newest.gen:
                return
            self.ever |= set(g.members)
            self.newest = g

    def _await_generations(self) -> None:
        """Adopt each generation as soon as it is written: a wait on its key that the store
        answers when the key is set (~0.2 ms on loopback), then wake the caller -- so that
        every member hears of a change at once, not at its watcher's next round (up to
        ``HEARTBEAT_S`` later, and at different times on different members: a member that
        heard late started a step the others had left, and gave it up). Cost: one pending
        request on the store per ``GEN_WAIT_S`` while nothing changes, and a ``get`` per
        generation. ``close`` ends the wait by shutting this thread's connection; a store
        that fails is the watcher's to report (this thread then retries every
        ``heartbeat_s``)."""
        s = self._gen_store
        while not self._stop.is_set():
            cur = self.newest
            n = cur.gen + 1 if cur is not None else 0
            try:
                s.wait([f"gen/{n}"], timedelta(seconds=GEN_WAIT_S))
                g = P.Generation.from_json(s.get(f"gen/{n}"))
            except Exception:  # noqa: BLE001 -- the wait's timeout, close, or the store gone
                if self._stop.is_set() or self.fatal is not None:
                    return
                self._stop.wait(self.heartbeat_s)
                continue
            self._adopt(g)
            self.wake.set()

    # ---- waiting, for the caller's thread ----------------------------------------------------
    def check(self) -> None:
        if self.fatal is not None:
            raise self.fatal

    def wait_until(self, ready: Callable[[], bool], superseded: Callable[[], bool],
                   timeout_s: float | None = None, what: str = "",
                   poll_s: float | None = None) -> None:
        """Wait until ``ready()`` (asked at every wake-up, at least every ``poll_s``); raise
        ``Superseded`` once ``superseded()``, ``StoreLost`` once the store is gone,
        TimeoutError after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        poll = self.heartbeat_s / 2 if poll_s is None else poll_s
        while True:
            if ready():
                return
            self.check()
            if superseded():
                raise Superseded()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{what}: nothing in {timeout_s:.0f} s")
            self.wake.clear()
            if ready():
                return
            self.wake.wait(poll)

    def wait_work(self, work: Any, superseded: Callable[[], bool]) -> None:
        """Wait for a collective; give it up (``Superseded``) when a newer generation means
        it cannot finish. A failed collective (a peer's socket closed) waits up to
        ``EXPLAIN_S`` for the generation that explains it, then raises as is."""
        done = threading.Event()
        wake = self.wake

        def fin(_f: Any) -> None:
            done.set()
            wake.set()

        work.get_future().add_done_callback(fin)
        try:
            self.wait_until(done.is_set, superseded)
        except Superseded:
            self._abandoned.append(work)
            raise
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001
            self._abandoned.append(work)
            with contextlib.suppress(TimeoutError):
                self.wait_until(lambda: False, superseded, EXPLAIN_S, "a failed collective")
            raise RuntimeError(f"a collective failed and no member was found dead in "
                               f"{EXPLAIN_S:.0f} s: {str(e).splitlines()[0]}") from None

    # ---- the process group factory -----------------------------------------------------------
    def rebuild(self, gen: P.Generation, superseded: Callable[[], bool]) -> Any:
        """The gloo process group of ``gen`` (this member's rank: its index), built on the
        store under the generation's prefix. Built in a helper thread: a member lost while
        the group connects makes this raise ``Superseded`` instead of waiting gloo out."""
        box: dict[str, Any] = {}
        wake = self.wake
        host, port, prefix = self._conn
        peers = {self.known[m].addr.rpartition(":")[0] for m in gen.members if m in self.known}
        b = _Build(gen.gen, peers | {host}, sockets.open_sockets())
        self._builds.append(b)

        def build() -> None:
            try:
                store = client(host, port, f"{prefix}pg/{gen.gen}/")
                opts = dist.ProcessGroupGloo._Options()
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.bind_addr)]
                opts._timeout = timedelta(seconds=GROUP_TIMEOUT_S)
                b.pg = box["pg"] = dist.ProcessGroupGloo(store, gen.rank_of(self.me.id),
                                                         len(gen.members), opts)
            except Exception as e:  # noqa: BLE001
                box["err"] = e
            b.after = sockets.open_sockets()
            wake.set()

        t = b.thread = threading.Thread(target=build, name=f"stalwart-pg-{gen.gen}",
                                        daemon=True)
        t.start()
        self.wait_until(lambda: bool(box), superseded)
        if "err" in box:  # a peer gone while connecting: wait for the generation that says so
            with contextlib.suppress(TimeoutError):
                self.wait_until(lambda: False, superseded, EXPLAIN_S, "a failed group build")
            raise RuntimeError(f"cannot build the group of generation {gen.gen}: "
                               f"{str(box['err']).splitlines()[0]}")
        b.in_use = True
        return box["pg"]

    def broadcast_state(self, pg: Any, gen: P.Generation, st: P.Settlement,
                        state: Callable[[], Any], superseded: Callable[[], bool]) -> Any:
        """Every receiver of ``st`` gets ``state()`` (a picklable object) of its source: two
        broadcasts over ``gen``'s group, the size then the bytes, serialized once on the
        source. Returns the state received on a receiver, None elsewhere: a member already
        at the start step takes the bytes (gloo has no one-to-some collective and its
        point-to-point work has no completion callback) but neither unpickles nor loads
        them."""
        root = gen.rank_of(st.source)
        if self.me.id == st.source:
            buf = io.BytesIO()
            torch.save(state(), buf)
            data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.wait_work(pg.broadcast([size], _bopts(root)), superseded)
        if self.me.id != st.source:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.wait_work(pg.broadcast([data], _bopts(root)), superseded)
        if self.me.id not in st.receivers:
            return None
        return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)

    def drop(self, pg: Any) -> None:
        """The group of a generation left behind (every member of the new one has acked: none
        uses it any more): aborted -- its connections shut, so that a collective still in
        flight on it fails at once -- and kept referenced (destroying a gloo group joins its
        threads)."""
        if pg is None:
            return
        self._abandoned.append(pg)
        for b in self._builds:
            if b.pg is pg:
                b.in_use = False
                self._abort(b, self._liveness_socks())

    def _store_addrs(self) -> set[str]:
        """The store's host as given and every address it resolves to (as a peer's address
        reads: an IPv4-mapped one without its ``::ffff:``)."""
        host = self._conn[0]
        try:
            infos = socket.getaddrinfo(host, None)
        except OSError:
            return {host}
        return {host} | {str(ai[4][0]).removeprefix("::ffff:") for ai in infos}

    def _liveness_socks(self) -> set[sockets.Sock]:
        out = set()
        for s in [*self._socks.values(), *self._accepted, self._listener]:
            ino = sockets.inode(s)
            if ino is not None:
                out.add((s.fileno(), ino))
        return out

    def _abort(self, b: _Build, keep: set[sockets.Sock]) -> None:
        """Shut a group's connections: exactly those its build opened once it is done; for a
        build still running (blocked on a member that is gone), every socket opened since it
        began that goes to one of its members or the store."""
        if b.aborted:
            return
        port = self._conn[1]  # a store this process serves: its accepted connections stay
        if b.after is not None:
            sockets.shut(b.after - b.before - keep, spare_port=port)
            b.aborted = True
        else:
            sockets.shut(sockets.open_sockets() - b.before - keep, b.peers, port)

    def _abort_abandoned(self) -> None:
        """At close: abort every group not in use (given up, superseded while it was built),
        then wait up to ``CLOSE_WAIT_S`` for their collectives and builds to end -- so that
        no gloo thread is left blocked on a hung peer while the interpreter exits (one that
        woke then, at gloo's timeout, crashed the process with SIGSEGV)."""
        in_use = set()
        for b in self._builds:
            if b.in_use and b.after is not None:
                in_use |= b.after - b.before
        for b in self._builds:
            if not b.in_use:
                self._abort(b, in_use)
        deadline = time.monotonic() + CLOSE_WAIT_S
        works = [w for w in self._abandoned if hasattr(w, "is_completed")]
        threads = [b.thread for b in self._builds if b.thread is not None]
        while time.monotonic() < deadline and (
                any(not w.is_completed() for w in works) or any(t.is_alive() for t in threads)):
            for b in self._builds:
                if not b.in_use and b.after is not None and not b.aborted:
                    self._abort(b, in_use)  # a build that ended meanwhile
            time.sleep(0.01)

    # ---- leaving -----------------------------------------------------------------------------
    def close(self) -> None:
        """Leave cleanly (the others do not take it for a death) and stop the watcher."""
        with contextlib.suppress(StoreLost):
            self.keys.leave(self.me.id)
        self._stop.set()
        # ends the waiter's wait (only a connection to the store: a socket another thread
        # opened meanwhile is left alone)
        sockets.shut(self._gen_socks, self._store_addrs(), spare_port=self._conn[1])
        self._thread.join(timeout=2.0)
        self._waiter.join(timeout=2.0)
        self._beats.close()  # before the sockets close: a reused descriptor is never written
        for s in [*self._socks.values(), *self._accepted, self._listener]:
            with contextlib.suppress(OSError):
                s.close()
        self._abort_abandoned()


def _bopts(root: int) -> Any:
    o = dist.BroadcastOptions()
    o.rootRank = root
    o.rootTensor = 0
    return o
