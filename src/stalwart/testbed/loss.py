"""Random packet loss with nftables inside a host's network namespace.

``tc netem`` is missing from these kernels, so loss is a drop rule on the netfilter INPUT hook:
``iifname "eth0" numgen random mod 100000 < N drop`` with N = round(p * 100000). Each incoming
IPv4/IPv6 packet on eth0 (TCP, UDP, ICMP alike; ARP is not in the inet family and keeps working)
is dropped independently with probability N/100000. A drop on the input hook is a real loss for
the sender: it sees no error (a drop on the output hook would make sendto fail with EPERM).

The table ``inet stw_loss`` lives inside the host's namespace, so it can never affect traffic of
the machine itself and disappears with the namespace. Replacing it is atomic (one nft
transaction), so the drop rate changes without a window of no rule.
"""

from __future__ import annotations

from stalwart.testbed._sys import quiet, run

TABLE = "stw_loss"
SCALE = 100_000


def threshold(p: float) -> int:
    return int(round(p * SCALE))


def set_loss(netns: str, p: float, dev: str = "eth0") -> str:
    """Drop incoming packets on `dev` in `netns` with probability p (0 removes the rule)."""
    if p <= 0:
        clear_loss(netns)
        return "none"
    n = threshold(p)
    ruleset = (
        f"table inet {TABLE}\n"
        f"delete table inet {TABLE}\n"
        f"table inet {TABLE} {{\n"
        f"  chain input {{\n"
        f"    type filter hook input priority 0; policy accept;\n"
        f"    iifname \"{dev}\" numgen random mod {SCALE} < {n} counter drop\n"
        f"  }}\n"
        f"}}\n"
    )
    run(["ip", "netns", "exec", netns, "nft", "-f", "-"], input=ruleset)
    return f"nftables inet {TABLE} input: numgen random mod {SCALE} < {n} drop on {dev}"


def clear_loss(netns: str) -> None:
    quiet(["ip", "netns", "exec", netns, "nft", "delete", "table", "inet", TABLE])


def dropped(netns: str) -> int:
    """Packets the loss rule has dropped so far (0 when there is no rule)."""
    cp = run(["ip", "netns", "exec", netns, "nft", "list", "table", "inet", TABLE], check=False)
    if cp.returncode != 0:
        return 0
    for line in cp.stdout.splitlines():
        if "counter packets" in line:
            words = line.split()
            return int(words[words.index("packets") + 1])
    return 0
