"""``python -m stalwart.bench.peers.install``: the peers' extra (pyproject's ``peers``) installed
as the bench suites install each peer -- pinned, the package itself with ``--no-deps`` (its
``torch>=`` requirement must not be resolved against an index: that pulls a multi-GB CUDA
torch over the CPU one), then what it imports.

Guarantee: exit status 0 whatever the registry serves. A peer that cannot be installed is
named in one line with pip's exit status; its harness tests skip with the reason (they check
that the peer imports), so CI does not fail on a registry outage. Which peers are importable
afterwards is printed last. Used by ``.ci/run``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys


def _torchft() -> int:
    from stalwart.bench.peers import torchft_run

    return torchft_run.install()


def _nvrx() -> int:
    from stalwart.bench.detect import install_nvrx

    return install_nvrx()


PEERS = {"torchft": ("torchft", _torchft),
         "nvidia-resiliency-ext": ("nvidia_resiliency_ext", _nvrx)}


def main(argv: list[str] | None = None) -> int:
    names = list(sys.argv[1:] if argv is None else argv) or list(PEERS)
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        print(f"peers: unknown peer {unknown[0]!r} (choose from {', '.join(PEERS)})",
              file=sys.stderr)
        return 2
    for name in names:
        module, install = PEERS[name]
        if importlib.util.find_spec(module) is not None:
            print(f"peers: {name} already installed")
            continue
        try:
            rc = install()
        except Exception as e:  # noqa: BLE001 -- reported, never fatal
            rc = f"{type(e).__name__}: {e}"  # type: ignore[assignment]
        importlib.invalidate_caches()
        if rc != 0 or importlib.util.find_spec(module) is None:
            print(f"peers: {name} not installed (pip: {rc}); its harness tests skip")
    ok = [n for n, (m, _) in PEERS.items() if importlib.util.find_spec(m) is not None]
    print(f"peers: importable: {', '.join(ok) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
