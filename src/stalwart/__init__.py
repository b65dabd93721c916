"""stalwart: distributed training that stays fast and correct on imperfect clusters.

Capabilities, one sub-package each (import them explicitly; importing ``stalwart`` is cheap):
``stalwart.testbed`` (emulated hosts with real faults), ``stalwart.detect`` (straggler
detection), ``stalwart.comm`` (training over lossy networks), ``stalwart.overlap``
(communication hiding by strand interleaving). ``stalwart run`` ties them together.
"""

__version__ = "0.1.0"
