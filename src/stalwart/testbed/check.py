"""``stalwart testbed check``: try every fault mechanism briefly on throwaway hosts.

Each row is (fault kind, works?, mechanism and what was measured -- or why it does not work).
Nothing is assumed from the presence of a tool: each mechanism is switched on and its effect is
measured with real packets or a real CPU loop (see probe.py), then everything is removed.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from stalwart.errors import ConfigError
from stalwart.testbed._sys import TestbedError
from stalwart.testbed.cpu import CpuGroup, find_backend
from stalwart.testbed.hosts import Hosts
from stalwart.testbed.probe import busy_loop_time, loop_for, tcp_throughput, udp_loss

Row = tuple[str, bool, str]


def _hosts(h: Hosts) -> Row:
    sent, got = udp_loss(h, 0, 1, count=200)
    return ("hosts (netns + bridge)", got == sent,
            f"{h.n} namespaces on bridge {h.bridge}, 10.213.0.0/24; {got}/{sent} datagrams")


def _loss(h: Hosts) -> Row:
    p = 0.2
    mech = h.set_loss(1, p)
    try:
        sent, got = udp_loss(h, 0, 1, count=3000)
    finally:
        h.clear_loss(1)
    rate = 1 - got / sent
    return "loss", abs(rate - p) < 0.04, f"{mech}; measured {rate:.1%} at p={p:.0%}"


def _link(h: Hosts) -> Row:
    rate = 20_000_000
    h.set_link(1, rate)
    try:
        bps = tcp_throughput(h, 0, 1, seconds=1.0)
    finally:
        h.clear_link(1)
    return ("link", abs(bps / rate - 1) < 0.25,
            f"tc tbf on eth0 + bridge port; measured {bps / 1e6:.1f} Mbit/s at 20mbit")


def _pairlink(h: Hosts) -> Row:
    rate = 20_000_000
    h.set_pair(0, 1, rate)
    try:
        pair = tcp_throughput(h, 0, 1, seconds=1.0)
        other = tcp_throughput(h, 0, 2, seconds=0.3)
    finally:
        h.clear_pair(0, 1)
    ok = abs(pair / rate - 1) < 0.25 and other > 3 * rate
    return ("pairlink", ok, f"tc htb + u32 dst filter; pair {pair / 1e6:.1f} Mbit/s at 20mbit, "
                            f"other pair {other / 1e6:.0f} Mbit/s")


def _cpu(kind: str, factor: float, procs: int) -> Row:
    backend = find_backend()
    g = CpuGroup(backend, f"stw-{os.getpid()}-99-r0", boost=64)
    try:
        n = loop_for(0.4, g)
        base = busy_loop_time(n, g)
        mech = g.set_limit(factor, procs)
        slow = busy_loop_time(n, g)
    finally:
        g.close()
    r = slow / base
    want = factor * (procs + 1)
    ok = 0.75 * want <= r <= 1.35 * want
    return kind, ok, f"{mech}; busy loop {r:.2f}x slower (expected ~{want:g}x)"


def _guard(kind: str, fn: Callable[[], Row]) -> Row:
    try:
        return fn()
    except (ConfigError, TestbedError, OSError, RuntimeError, ValueError) as e:
        return kind, False, str(e).splitlines()[0] if str(e) else type(e).__name__


def run_check() -> list[Row]:
    """Try every mechanism; a few seconds; leaves nothing behind."""
    rows: list[Row] = [
        _guard("compute", lambda: _cpu("compute", 2.0, 0)),
        _guard("contention", lambda: _cpu("contention", 1.0, 1)),
    ]
    net = ("hosts (netns + bridge)", "loss", "link", "pairlink")
    try:
        h = Hosts(3)
    except (ConfigError, TestbedError) as e:
        return rows + [(k, False, str(e)) for k in net]
    with h:
        rows += [_guard(net[0], lambda: _hosts(h)), _guard("loss", lambda: _loss(h)),
                 _guard("link", lambda: _link(h)), _guard("pairlink", lambda: _pairlink(h))]
    return rows


def print_check(rows: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="stalwart testbed check")
    table.add_column("fault kind")
    table.add_column("works")
    table.add_column("mechanism / why", overflow="fold")
    for kind, ok, why in rows:
        table.add_row(kind, "[green]yes[/]" if ok else "[red]no[/]", why)
    Console().print(table)
