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
"""

from __future__ import annotations

import threading
import weakref
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
        self.live = 0
        self.peak = 0

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.live

    def _pack(self, t: torch.Tensor) -> object:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in self._skip or ptr == 0:
            return t
        holder = _Saved(t)
        with self._lock:
            n = self._refs.get(ptr, 0)
            if n == 0:
                self._sizes[ptr] = st.nbytes()
                self.live += st.nbytes()
                self.peak = max(self.peak, self.live)
            self._refs[ptr] = n + 1
        weakref.finalize(holder, self._release, ptr)
        return holder

    def _release(self, ptr: int) -> None:
        with self._lock:
            n = self._refs[ptr] - 1
            if n:
                self._refs[ptr] = n
            else:
                del self._refs[ptr]
                self.live -= self._sizes.pop(ptr)

    @staticmethod
    def _unpack(obj: object) -> torch.Tensor:
        return obj.tensor if isinstance(obj, _Saved) else obj  # type: ignore[return-value]

    @contextmanager
    def tracking(self) -> Iterator[None]:
        """Count the tensors autograd saves on this thread while inside the block."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield
