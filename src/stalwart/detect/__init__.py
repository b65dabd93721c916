"""Straggler detection (FALCON/Greyhound-style): which rank or link is slow, since when, why.

``Monitor`` is the entry point; the algorithms are usable on their own:
tracking (collective interception), period (iteration period by autocorrelation),
changepoint (BOCD with verification), validate (compute and link micro-benchmarks),
localize (verdicts), baseline (the hand-written threshold detector used as a comparison).
"""

from __future__ import annotations

from typing import Any

from stalwart.detect.localize import Finding

__all__ = ["Finding", "Monitor"]


def __getattr__(name: str) -> Any:
    # the Monitor needs torch; the decision modules (changepoint, cusum, localize, ...) do not,
    # and importing them must not import it (replay, simulation)
    if name == "Monitor":
        from stalwart.detect.monitor import Monitor

        return Monitor
    raise AttributeError(f"module 'stalwart.detect' has no attribute {name!r}")
