"""Straggler detection (FALCON/Greyhound-style): which rank or link is slow, since when, why.

``Monitor`` is the entry point; the algorithms are usable on their own:
tracking (collective interception), period (iteration period by autocorrelation),
changepoint (BOCD with verification), validate (compute and link micro-benchmarks),
localize (verdicts), baseline (the hand-written threshold detector used as a comparison).
"""

from stalwart.detect.localize import Finding
from stalwart.detect.monitor import Monitor

__all__ = ["Finding", "Monitor"]
