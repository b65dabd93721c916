"""Slow links with Linux traffic control: tbf for a host's link, htb + u32 for one pair.

Each emulated host has eth0 (inside its namespace) and a bridge port (the veth peer in the root
namespace). Shaping eth0's egress limits what the host sends; shaping the bridge port's egress
limits what it receives, so ``link:host=H,rate=R`` slows both directions of H's link.
``pairlink:hosts=A-B,rate=R`` shapes only packets whose destination is the peer, on both hosts'
eth0, so traffic of A and B with everyone else keeps its speed.

``shape(...)`` rebuilds a host's qdiscs from the complete desired state (link rate, per-peer
rates), so overlapping faults compose: with both, the pair classes sit under a root class capped
at the link rate (htb borrows only up to its parent's ceiling).
"""

from __future__ import annotations

from collections.abc import Mapping

from stalwart.testbed._sys import quiet, run

UNLIMITED_BPS = 10 * 10**9  # "no limit" for htb's default class: far above what veth moves here


BURST_S = 0.001  # tbf's bucket: 1 ms of traffic at the link's rate


def tbf_args(rate_bps: int, mtu: int) -> list[str]:
    """tbf parameters: a bucket of ``BURST_S`` of traffic (at least 2 packets and 8 KiB), 50 ms
    of queue.

    Why so small a bucket: a link of rate R moves every transfer at R, however long it idled
    before; tbf's bucket lets a transfer that follows an idle period go faster by the bucket's
    size. With 10 ms of credit (what this testbed used until 2026-12-04) a 393 KB all-reduce
    at 120 Mbit/s took 18 ms after an idle gap and 27 ms (the rate) right behind another one:
    a schedule that leaves the link idle (sequential, compute then communicate) ran up to 1.5x
    faster than the link allowed, which made a slow link look faster to the very schedules it
    is meant to slow. The bucket is not made smaller still: tbf's timer and GSO segments
    larger than the bucket (veth's offloads) are split in the qdisc, which costs CPU.
    """
    burst = max(int(rate_bps / 8 * BURST_S), 2 * (mtu + 64), 8 * 1024)
    return ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "latency", "50ms"]


def _quantum(rate_bps: int, mtu: int) -> str:
    # htb's default quantum (rate / r2q) is absurd at very low or high rates and it warns;
    # one to a few packets per round keeps the pair classes fair and silent
    return str(min(max(rate_bps // 8 // 10, mtu + 64), 200_000))


def clear(dev: str, netns: str | None = None) -> None:
    quiet(["tc", *(["-n", netns] if netns else []), "qdisc", "del", "dev", dev, "root"])


def shape(dev: str, *, netns: str | None, mtu: int, link_bps: int | None,
          peers: Mapping[str, int] | None = None) -> str:
    """Install the qdisc tree on `dev`: nothing, tbf (link only) or htb (pairs, maybe under a
    link cap). `peers` maps a destination address to its rate. Returns a one-line description
    of the mechanism in force."""
    tc = ["tc", *(["-n", netns] if netns else [])]
    clear(dev, netns)
    peers = dict(peers or {})
    if not peers:
        if link_bps is None:
            return "none"
        run([*tc, "qdisc", "add", "dev", dev, "root", *tbf_args(link_bps, mtu)])
        return f"tc tbf rate {link_bps}bit on {dev}"
    cap = link_bps or UNLIMITED_BPS
    run([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"])
    run([*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
         "rate", f"{cap}bit", "ceil", f"{cap}bit", "quantum", _quantum(cap, mtu)])
    run([*tc, "class", "add", "dev", dev, "parent", "1:1", "classid", "1:10", "htb",
         "rate", f"{cap}bit", "ceil", f"{cap}bit", "quantum", _quantum(cap, mtu)])
    for j, (addr, bps) in enumerate(sorted(peers.items())):
        bps = min(bps, cap)
        cls = f"1:{100 + j}"
        run([*tc, "class", "add", "dev", dev, "parent", "1:1", "classid", cls, "htb",
             "rate", f"{bps}bit", "ceil", f"{bps}bit", "quantum", _quantum(bps, mtu)])
        run([*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
             "u32", "match", "ip", "dst", f"{addr}/32", "flowid", cls])
    pairs = ", ".join(f"dst {a} {b}bit" for a, b in sorted(peers.items()))
    link = f" under link cap {link_bps}bit" if link_bps else ""
    return f"tc htb + u32 on {dev}: {pairs}{link}"
