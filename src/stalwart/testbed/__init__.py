"""stalwart.testbed: an emulated multi-host cluster on one machine, with real kernel faults.

Hosts are network namespaces on a private bridge; faults are produced by the kernel (cgroup CPU
quotas, busy processes, tc tbf/htb shaping, nftables random drops), switched on and off on a
step schedule, and every switch is written to events.jsonl as ground truth for detection.
See docs/testbed.md (user page) and docs/CONTRACTS.md (API).
"""

from stalwart.faultspec import Fault, parse_fault, parse_rate
from stalwart.testbed._sys import TestbedError
from stalwart.testbed.cleanup import cleanup_stale
from stalwart.testbed.cpu import CpuGroup, fair_share, find_backend
from stalwart.testbed.hosts import Hosts
from stalwart.testbed.testbed import LocalTestbed, NetnsTestbed, Testbed, open_testbed

__all__ = [
    "CpuGroup", "Fault", "Hosts", "LocalTestbed", "NetnsTestbed", "Testbed", "TestbedError",
    "cleanup_stale", "fair_share", "find_backend", "open_testbed", "parse_fault", "parse_rate",
]
