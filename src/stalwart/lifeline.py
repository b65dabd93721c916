"""Run a rank module tied to its launcher: ``python -m stalwart.lifeline PPID MODULE ARGS...``.

The launcher must not outlive-orphan its ranks: if it is killed (SIGKILL, OOM), the kernel
kills every rank (``prctl(PR_SET_PDEATHSIG, SIGKILL)``). The death signal used to be set in a
``preexec_fn``, which runs Python between fork and exec -- unsafe in a launcher that has
threads (rich's live display, the host probe): a lock held by another thread at fork time
stays held for ever in the child. Here the rank sets it on itself, after exec, then checks
that its parent is still the launcher (had the launcher died in between, the signal would
never come), and runs the module as ``__main__``. The new session (so that Ctrl-C reaches
only the launcher, which stops the ranks itself) comes from ``Popen(start_new_session=True)``.
With ``STALWART_HEARTBEAT`` set, the rank also beats to the launcher's liveness listener
(heartbeat.py) from its first line on, so that a rank that hangs or is cut off is found.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

from stalwart import heartbeat

_PR_SET_PDEATHSIG = 1


def tie_to(parent: int) -> None:
    """Die with ``parent``; exit at once if it is already gone."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def main() -> None:
    if len(sys.argv) < 3:
        print("usage: python -m stalwart.lifeline PARENT_PID MODULE [ARGS...]", file=sys.stderr)
        sys.exit(2)
    tie_to(int(sys.argv[1]))
    addr = os.environ.get(heartbeat.ENV)
    if addr:
        heartbeat.beat(addr)  # the launcher's liveness check (heartbeat.py)
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        heartbeat.leaving()


if __name__ == "__main__":
    main()
