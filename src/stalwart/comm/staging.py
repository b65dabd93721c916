"""Host staging: the flat gradient and parameter vectors between the model's device and the
lossy transport, which reads and writes host memory through numpy.

* CPU parameters: the flat vectors are plain host tensors (``torch.cat`` + ``.numpy()``).
* CUDA parameters: gradients are flattened on the device (one ``cat``), copied into a pinned
  host buffer by a non-blocking copy on a side stream that first waits for the stream which
  produced them; the host waits for that copy only. Updated parameters go back the same way:
  into a pinned buffer, one non-blocking host-to-device copy and the scatter into the
  parameters on the side stream, and the compute stream waits for it by an event -- no host
  sync -- so the next forward reads the new values.

Guarantee: copies only, so the transport sees bit for bit what the CPU path would and the
parameters receive exactly what it produced (training without loss is exact, as on CPU).
Checked: the CPU path by the comm suite; the CUDA path by ``tests/comm/test_devices.py``'s
round trip, which needs a GPU and is skipped without one (no GPU has run it in this project;
docs/comm.md says the same).

Cost (CUDA): per step one device ``cat`` and one D2H copy of 4 bytes per parameter, one H2D
copy of the same size, and 8 bytes per parameter of pinned host memory. At ~20 GB/s over PCIe
a 100 M-parameter model stages in ~20 ms each way, against ~320 ms to send its 400 MB over a
10 Gbit/s link: the copy is not overlapped with the sending (the collective takes its input
whole), which would need the transport to consume the vector chunk by chunk.
"""

from __future__ import annotations

import numpy as np
import torch


def check_devices(params: list[torch.Tensor]) -> torch.device:
    """The one device all ``params`` live on (CPU or CUDA); ValueError in one line otherwise."""
    devs = sorted({str(p.device) for p in params})
    if len(devs) > 1:
        raise ValueError(f"stalwart.comm needs all parameters on one device (got "
                         f"{', '.join(devs)})")
    dev = torch.device(devs[0]) if devs else torch.device("cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"stalwart.comm works on CPU or CUDA parameters (got {dev})")
    return dev


class HostStaging:
    """Moves the flat gradient / parameter vector of ``params`` to and from host memory."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.device = check_devices(params)
        self.cuda = self.device.type == "cuda"
        self.numel = sum(p.numel() for p in params)
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)
            self._grads = torch.empty(self.numel, dtype=torch.float32, pin_memory=True)
            self._values = torch.empty(self.numel, dtype=torch.float32, pin_memory=True)
            self._h2d: torch.cuda.Event | None = None  # the last copy out of _values

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.zeros(0, dtype=torch.float32, device=self.device)
        return torch.cat([t.detach().reshape(-1).float() for t in tensors])

    def _to_host(self, flat: torch.Tensor, buf: torch.Tensor) -> np.ndarray:
        """``flat`` (on the device) into the pinned ``buf``; returns its numpy view."""
        producer = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(producer)
        with torch.cuda.stream(self.stream):
            buf[: flat.numel()].copy_(flat, non_blocking=True)
        flat.record_stream(self.stream)  # its memory is not reused before the copy ran
        self.stream.synchronize()
        return buf[: flat.numel()].numpy()

    def grads(self) -> np.ndarray:
        """The local gradients, flat float32 in host memory (zeros where a grad is None).
        On CUDA the array is a view of a buffer that the next call overwrites."""
        with torch.no_grad():
            flat = self._flat([p.grad if p.grad is not None else torch.zeros_like(p)
                               for p in self.params])
            return flat.numpy() if not self.cuda else self._to_host(flat, self._grads)

    def values(self) -> np.ndarray:
        """A host copy of the parameters, flat float32 (owned by the caller)."""
        with torch.no_grad():
            flat = self._flat(self.params)
            return flat.numpy().copy() if not self.cuda else flat.cpu().numpy()

    def slice_values(self, lo: int, hi: int) -> np.ndarray:
        """A host copy of elements [lo, hi) of the flat parameter vector."""
        with torch.no_grad():
            i, out = 0, []
            for p in self.params:
                n = p.numel()
                a, b = max(lo, i), min(hi, i + n)
                if a < b:
                    out.append(p.detach().reshape(-1)[a - i: b - i].float())
                i += n
            if not out:
                return np.zeros(0, np.float32)
            flat = torch.cat(out)
            return flat.numpy() if not self.cuda else flat.cpu().numpy()

    def put_values(self, flat: np.ndarray) -> None:
        """Write the flat vector into the parameters (CUDA: ordered before the next kernel
        of the compute stream, without a host sync)."""
        with torch.no_grad():
            if not self.cuda:
                self._scatter(torch.from_numpy(flat))
                return
            if self._h2d is not None:
                self._h2d.synchronize()  # the previous copy has left the buffer (long ago)
            self._values.numpy()[:] = flat
            compute = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(compute)  # nothing still reads the old values
            with torch.cuda.stream(self.stream):
                dev = self._values.to(self.device, non_blocking=True)
                self._scatter(dev)
                self._h2d = torch.cuda.Event()
                self._h2d.record(self.stream)
            compute.wait_stream(self.stream)

    def _scatter(self, src: torch.Tensor) -> None:
        i = 0
        for p in self.params:
            n = p.numel()
            p.copy_(src[i: i + n].view_as(p))
            i += n
