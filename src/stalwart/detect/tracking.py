"""Collective tracking: every torch.distributed collective and DDP bucket all-reduce, timed.

Mechanism (FALCON/Greyhound tracking stage): FALCON preloads a shim under NCCL and logs every
collective's op type, communicator and timestamps into a ring buffer. Here the same record is
taken from Python, framework-agnostic and for any backend:
- the module functions of ``torch.distributed`` (all_reduce, reduce_scatter(_tensor),
  all_gather(_into_tensor), broadcast, reduce, all_to_all_single, send/recv/isend/irecv,
  barrier) are wrapped; an asynchronous op's completion is taken from its Work's future
  (``get_future().then``), so it is the time the op finished, not when someone waited;
- DDP calls the process group from C++, out of sight of Python wrappers, so each
  DistributedDataParallel built while a tracker is installed gets a communication hook that
  wraps the default all-reduce hook (or the user's own hook, if they register one) and
  records each gradient bucket's issue (bucket ready) and completion (reduced) times;
- tensors on a GPU get CUDA events around the op, resolved lazily to a completion time when
  the end event has been reached (code path present; this project's machines have no GPU, so
  it is untested here).

Guarantees: bounded memory (a ring buffer of ``capacity`` records); the wrappers change no
argument or return value; with tracking disabled -- ``enabled`` off, or ``recording`` off
because the training loop reports its own compute and communication times so no record
would be read -- a wrapped call or DDP bucket costs one flag test (no record, no completion
callback, hence no wake-up of a Python callback on the backend's thread); the tracker's own
collectives (``Tracker.internal()``) are never recorded.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

OPS = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather",
       "all_gather_into_tensor", "broadcast", "reduce", "all_to_all_single", "send", "recv",
       "isend", "irecv", "barrier")
# argument that carries the data volume; all others take it from their first argument
_DATA_ARG = {"all_gather": 1, "all_gather_into_tensor": 1, "reduce_scatter_tensor": 1,
             "all_to_all_single": 1, "barrier": -1}
_ASYNC_ALWAYS = ("isend", "irecv")


@dataclass(slots=True)
class OpRecord:
    """One collective call on this rank."""

    op: str
    group: tuple[int, ...] | None  # global ranks of the group; None = the default group
    numel: int
    nbytes: int
    issue: float  # time.perf_counter() when issued
    complete: float | None = None  # when finished (None: not yet, or unknown)
    source: str = "python"  # "python" (module function) or "ddp" (bucket hook)
    cuda: tuple[Any, Any] | None = None  # (start, end) CUDA events for GPU tensors
    # the end event was recorded (a synchronous op); an asynchronous op's completion comes
    # from its Work's future instead, and its end event is never recorded -- which CUDA's
    # query reports as reached, so the flag, not the query, says whether it can be read
    cuda_end: bool = False

    def finish(self) -> float | None:
        """Completion time, resolving CUDA events if the GPU has reached them."""
        if self.complete is None and self.cuda is not None and self.cuda_end:
            start, end = self.cuda
            if end.query():
                self.complete = self.issue + start.elapsed_time(end) / 1e3
        return self.complete


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for t in x if isinstance(t, torch.Tensor)]
    return []


class Tracker:
    """Ring buffer of OpRecords plus the patches that fill it.

    ``on_issue(record)`` is called on the issuing thread just before the op is issued -- a
    collective boundary, where the Monitor may pause training for validation.
    """

    def __init__(self, capacity: int = 8192,
                 on_issue: Callable[[OpRecord], None] | None = None) -> None:
        self.records: deque[OpRecord] = deque(maxlen=capacity)
        self.enabled = True
        # off when nothing reads the records: the Monitor turns it off while the loop's step
        # hints carry compute and communication times (the records would only re-derive them)
        self.recording = True
        self.on_issue = on_issue
        self._local = threading.local()
        self._group_keys: dict[int, tuple[int, ...] | None] = {}

    # ---- recording ----------------------------------------------------------------------
    @property
    def suppressed(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    @contextlib.contextmanager
    def internal(self) -> Iterator[None]:
        """Collectives issued inside are not recorded (the monitor's own traffic)."""
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def group_key(self, group: Any) -> tuple[int, ...] | None:
        if group is None or group is dist.group.WORLD:
            return None
        key = self._group_keys.get(id(group), ())
        if key == ():
            try:
                key = tuple(dist.get_process_group_ranks(group))
            except Exception:  # a group this rank is not part of, or an unusual backend
                key = None
            self._group_keys[id(group)] = key
        return key

    def begin(self, op: str, group: Any, tensors: list[torch.Tensor],
              source: str = "python") -> OpRecord:
        numel = sum(t.numel() for t in tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        rec = OpRecord(op, self.group_key(group), numel, nbytes, 0.0, source=source)
        if self.on_issue is not None:
            # the callback may run validation collectives: never record those
            with self.internal():
                self.on_issue(rec)
        if tensors and tensors[0].is_cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            rec.cuda = (start, end)
        rec.issue = time.perf_counter()
        self.records.append(rec)
        return rec

    @staticmethod
    def end(rec: OpRecord) -> None:
        if rec.cuda is not None:
            rec.cuda[1].record()  # resolved in finish(): no device sync on the hot path
            rec.cuda_end = True
        else:
            rec.complete = time.perf_counter()

    def end_when_done(self, rec: OpRecord, work: Any) -> None:
        """Record completion of an asynchronous op from its Work's future, when it has one."""
        try:
            fut = work.get_future()
        except Exception:  # e.g. gloo send/recv have no future: completion stays unknown
            return

        def _done(_f: Any) -> None:
            rec.complete = time.perf_counter()

        fut.then(_done)

    def recent(self, since: float) -> list[OpRecord]:
        """Records issued at or after ``since`` (perf_counter seconds)."""
        out = []
        for rec in reversed(self.records):
            if rec.issue < since:
                break
            out.append(rec)
        out.reverse()
        return out

    # ---- the wrappers -------------------------------------------------------------------
    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        params = list(inspect.signature(fn).parameters)
        g_idx = params.index("group") if "group" in params else None
        a_idx = params.index("async_op") if "async_op" in params else None
        d_idx = _DATA_ARG.get(name, 0)
        d_name = params[d_idx] if d_idx >= 0 else None
        tracker = self

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not (tracker.enabled and tracker.recording) or tracker.suppressed:
                return fn(*args, **kwargs)
            group = kwargs.get("group", args[g_idx] if g_idx is not None and len(args) > g_idx
                               else None)
            data = kwargs.get(d_name) if d_name in kwargs else (
                args[d_idx] if d_name is not None and len(args) > d_idx else None)
            is_async = name in _ASYNC_ALWAYS or bool(
                kwargs.get("async_op", args[a_idx] if a_idx is not None and len(args) > a_idx
                           else False))
            rec = tracker.begin(name, group, _tensors(data))
            out = fn(*args, **kwargs)
            if is_async and out is not None:
                tracker.end_when_done(rec, out)
            else:
                tracker.end(rec)
            return out

        wrapper.__stalwart_original__ = fn  # type: ignore[attr-defined]
        return wrapper

    def ddp_hook(self, inner: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """A DDP comm hook that times ``inner`` (a bucket's all-reduce) per bucket."""
        tracker = self

        def hook(state: Any, bucket: Any) -> Any:
            if not (tracker.enabled and tracker.recording):
                return inner(state, bucket)
            rec = tracker.begin("ddp_allreduce", state if not isinstance(state, dict) else None,
                                [bucket.buffer()], source="ddp")
            with tracker.internal():  # the default hook calls dist.all_reduce: count it once
                fut = inner(state, bucket)

            def _done(f: Any) -> Any:
                rec.complete = time.perf_counter()
                return f.value()

            return fut.then(_done)

        hook.__annotations__ = {}  # DDP rejects annotations other than the real classes
        return hook


# ---- installing the patches (process-wide) ---------------------------------------------------
_lock = threading.Lock()
_installed: list[Tracker] = []
_saved: dict[tuple[Any, str], Any] = {}
_MODULES = (dist, dist.distributed_c10d)


def _active() -> Tracker | None:
    return _installed[-1] if _installed else None


def _dispatch(name: str) -> Callable[..., Any]:
    """A module-level stand-in that routes to the newest installed tracker's wrapper."""
    original = getattr(dist.distributed_c10d, name)
    wrappers: dict[int, Callable[..., Any]] = {}

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        tr = _active()
        if tr is None:
            return original(*args, **kwargs)
        w = wrappers.get(id(tr))
        if w is None:
            w = wrappers[id(tr)] = tr.wrap(name, original)
        return w(*args, **kwargs)

    return call


def _patch_ddp() -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    orig_init = DDP.__init__
    orig_register = DDP.register_comm_hook
    _saved[(DDP, "__init__")] = orig_init
    _saved[(DDP, "register_comm_hook")] = orig_register

    def register_comm_hook(self: Any, state: object, hook: Callable) -> None:
        tr = _active()
        if tr is not None and getattr(self, "_stalwart_track", False):
            self._stalwart_hooked = True  # the user's hook, timed; ours is not added later
            hook = tr.ddp_hook(hook)
        orig_register(self, state, hook)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        tr = _active()
        if tr is None or not getattr(tr, "track_ddp", True):
            return
        self._stalwart_track = True
        self._stalwart_hooked = False

        # Registered at the first forward, not here: DDP allows one comm hook, and a user who
        # registers their own right after construction must still be able to.
        def _first_forward(module: Any, _inputs: Any) -> None:
            handle.remove()
            if not module._stalwart_hooked and _active() is not None:
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
                    allreduce_hook,
                )

                module._stalwart_hooked = True
                orig_register(module, module.process_group, _active().ddp_hook(allreduce_hook))

        handle = self.register_forward_pre_hook(_first_forward)

    DDP.__init__ = __init__
    DDP.register_comm_hook = register_comm_hook


def install(tracker: Tracker) -> None:
    """Route torch.distributed's collectives (and new DDP models) through ``tracker``."""
    with _lock:
        if not _saved:
            for name in OPS:
                if not hasattr(dist.distributed_c10d, name):
                    continue
                stand_in = _dispatch(name)
                for mod in _MODULES:
                    _saved[(mod, name)] = getattr(mod, name)
                    setattr(mod, name, stand_in)
            _patch_ddp()
        _installed.append(tracker)


def uninstall(tracker: Tracker) -> None:
    """Stop routing to ``tracker``; the last uninstall restores the original functions."""
    with _lock:
        if tracker in _installed:
            _installed.remove(tracker)
        if not _installed and _saved:
            for (obj, name), fn in _saved.items():
                setattr(obj, name, fn)
            _saved.clear()
