"""Peak activation memory, measured as the bytes autograd keeps alive for backward.

Why this measure: on CPU there is no device allocator to ask, and the process RSS is dominated
by the allocator's caching and by other processes' noise. What strand interleaving changes is
how many activations are alive at once (DHelix: the backward strand frees while the forward
strand allocates, < 3% extra). Autograd's saved tensors *are* those activations: every tensor
packed through ``torch.autograd.graph.saved_tensors_hooks`` is counted once per storage (a
tensor saved by two nodes costs once), and uncounted when the last node holding it is freed
(autograd drops saved tensors as soon as their node has run backward). Parameters are not
counted (they exist once whatever the schedule).

Guarantee: ``peak`` is the maximum over the step of the live saved bytes, over all strands of
this process (the hooks are thread-local, so each strand enters ``tracking()`` on its thread).

Safe under garbage collection: a release runs in a ``weakref.finalize`` callback, which can
fire on any thread at any allocation -- including inside this meter's own locked region, when
the cyclic collector runs there. A finalizer that took the (non-reentrant) lock deadlocked
then; it now only appends the storage to a queue (``deque.append`` is atomic), and the queue
is drained under the lock by the next pack or read. The meter costs a hook call per saved
tensor, so ``Interleaved`` tracks only while profiling a plan or when asked to measure
(``measure_memory=True``).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedTensorMeter:
    def __init__(self, exclude: list[torch.Tensor] | None = None) -> None:
        self._lock = threading.Lock()
        self._refs: dict[int, int] = {}  # storage pointer -> number of live packs
        self._sizes: dict[int, int] = {}
        self._skip = {t.untyped_storage().data_ptr() for t in (exclude or [])}
        self._released: deque[int] = deque()  # appended by finalizers, without the lock
        self._live = 0
        self._peak = 0

    def _drain(self) -> None:
        """Apply the releases the finalizers queued (caller holds the lock)."""
        while self._released:
            ptr = self._released.popleft()
            n = self._refs[ptr] - 1
            if n:
                self._refs[ptr] = n
            else:
                del self._refs[ptr]
                self._live -= self._sizes.pop(ptr)

    @property
    def live(self) -> int:
        """Bytes autograd holds for backward now."""
        with self._lock:
            self._drain()
            return self._live

    @property
    def peak(self) -> int:
        with self._lock:
            self._drain()
            return self._peak

    def reset_peak(self) -> None:
        with self._lock:
            self._drain()
            self._peak = self._live

    def _pack(self, t: torch.Tensor) -> object:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in self._skip or ptr == 0:
            return t
        holder = _Saved(t)
        with self._lock:
            self._drain()  # frees first, so the peak is not overstated
            n = self._refs.get(ptr, 0)
            if n == 0:
                self._sizes[ptr] = st.nbytes()
                self._live += st.nbytes()
                self._peak = max(self._peak, self._live)
            self._refs[ptr] = n + 1
        weakref.finalize(holder, self._release, ptr)
        return holder

    def hold(self, t: torch.Tensor) -> object:
        """Count `t` as live (once per storage) until the returned token is dropped -- for
        tensors kept for backward outside autograd (deferred weight gradients, wgrad.py)."""
        return self._pack(t)

    def _release(self, ptr: int) -> None:
        # a finalizer: may run inside our own locked region (GC), so it must not take the lock
        self._released.append(ptr)

    @staticmethod
    def _unpack(obj: object) -> torch.Tensor:
        return obj.tensor if isinstance(obj, _Saved) else obj  # type: ignore[return-value]

    @contextmanager
    def tracking(self) -> Iterator[None]:
        """Count the tensors autograd saves on this thread while inside the block."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield
