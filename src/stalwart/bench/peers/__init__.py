"""Other fault-tolerance systems measured beside stalwart in ``stalwart bench`` (the same
workload, testbed and faults, in the same invocation).

Each peer is an optional dependency (``pip install 'stalwart[peers]'``), imported only by the
modules of this package (an import-linter contract); without it a suite reports the peer's
figures as null and says so in one line. ``torchft_run`` / ``torchft_worker``: torchft's
replica groups (Lighthouse, Manager) in ``bench mitigate``; ``torchft_ddp``: the plain DDP
user script of ``bench elastic`` with torchft's Manager. ``nvrx`` / ``nvrx_reports``:
NVIDIA's straggler detector (nvidia-resiliency-ext) in ``bench detect``. ``install``: the
peers' extra installed without touching torch (``.ci/run``).
"""
