"""Bytes between each pair of emulated hosts, counted by the kernel (nftables counters).

Each host's namespace gets a table ``inet stw_bytes`` with one rule per peer on the output hook:
``oifname "eth0" ip daddr <peer> counter``. The counters see every IP packet the host sends
to that peer (TCP for gloo, UDP for the lossy transport; headers included), so the traffic
matrix is measured, not modelled -- mitigate/remap.py's model of which rank pairs carry bytes
is checked against it (docs/mitigate.md). The rules only count (no verdict), and live inside
the namespace, so they cannot affect the machine's own traffic and vanish with the host.
"""

from __future__ import annotations

import json

from stalwart.testbed._sys import quiet, run
from stalwart.testbed.hosts import Hosts

TABLE = "stw_bytes"


def start(hosts: Hosts) -> None:
    """Install (or reset) the per-peer byte counters on every host."""
    for i in range(hosts.n):
        rules = "".join(f'    oifname "eth0" ip daddr {hosts.addr(j)} counter\n'
                        for j in range(hosts.n) if j != i)
        ruleset = (f"table inet {TABLE}\ndelete table inet {TABLE}\n"
                   f"table inet {TABLE} {{\n  chain out {{\n"
                   f"    type filter hook output priority 0; policy accept;\n{rules}  }}\n}}\n")
        run([*hosts.exec_prefix(i), "nft", "-f", "-"], input=ruleset)


def read(hosts: Hosts) -> dict[tuple[int, int], int]:
    """Bytes sent so far from host a to host b, for every ordered pair with a counter."""
    out: dict[tuple[int, int], int] = {}
    by_addr = {hosts.addr(j): j for j in range(hosts.n)}
    for i in range(hosts.n):
        cp = run([*hosts.exec_prefix(i), "nft", "-j", "list", "table", "inet", TABLE],
                 check=False)
        if cp.returncode != 0:
            continue
        for item in json.loads(cp.stdout).get("nftables", []):
            rule = item.get("rule")
            if not rule:
                continue
            dst, nbytes = None, None
            for expr in rule.get("expr", []):
                m = expr.get("match", {})
                if m.get("left", {}).get("payload", {}).get("field") == "daddr":
                    dst = by_addr.get(m.get("right"))
                if "counter" in expr:
                    nbytes = int(expr["counter"]["bytes"])
            if dst is not None and nbytes is not None:
                out[(i, dst)] = nbytes
    return out


def per_pair(sent: dict[tuple[int, int], int]) -> dict[tuple[int, int], int]:
    """Both directions of each unordered host pair added up."""
    out: dict[tuple[int, int], int] = {}
    for (a, b), n in sent.items():
        key = (min(a, b), max(a, b))
        out[key] = out.get(key, 0) + n
    return out


def stop(hosts: Hosts) -> None:
    for i in range(hosts.n):
        quiet([*hosts.exec_prefix(i), "nft", "delete", "table", "inet", TABLE])
