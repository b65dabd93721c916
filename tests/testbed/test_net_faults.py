"""Network faults on real namespaces: random loss (nftables), link and pair limits (tc).

Every figure is measured with real sockets between emulated hosts; the bounds are the issue's
(loss within +-2 percentage points on >= 5,000 datagrams, throughput within +-20% of the rate).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from stalwart.testbed import Hosts, loss
from stalwart.testbed.probe import tcp_throughput, udp_loss

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    with Hosts(3) as h:
        yield h


def test_hosts_are_connected_and_isolated(hosts: Hosts) -> None:
    assert udp_loss(hosts, 0, 2, count=200) == (200, 200)
    inner = subprocess.run([*hosts.exec_prefix(1), "ip", "-o", "-4", "addr", "show", "eth0"],
                           capture_output=True, text=True, check=True).stdout
    assert "10.213.0.2/24" in inner
    # the bridge has no address of any family in the root namespace
    root = subprocess.run(["ip", "-o", "addr", "show", "dev", hosts.bridge],
                          capture_output=True, text=True, check=True).stdout
    assert root.strip() == ""


@pytest.mark.parametrize("p", [0.1, 0.03])
def test_loss_rate_matches_p(hosts: Hosts, p: float) -> None:
    hosts.set_loss(1, p)
    try:
        before = loss.dropped(hosts.ns(1))
        sent, received = udp_loss(hosts, 0, 1, count=10_000)
        by_rule = loss.dropped(hosts.ns(1)) - before
    finally:
        hosts.clear_loss(1)
    assert sent == 10_000
    rate = 1 - received / sent
    assert abs(rate - p) <= 0.02, f"measured drop rate {rate:.4f} for p={p}"
    # every missing datagram was dropped by our rule (not by a full socket buffer); the rule may
    # also have dropped some TCP segments of the control connection
    assert by_rule >= sent - received
    # and the rule is gone once cleared
    assert udp_loss(hosts, 0, 1, count=500) == (500, 500)


def test_link_limit_shapes_both_directions(hosts: Hosts) -> None:
    rate = 30_000_000
    hosts.set_link(1, rate)
    try:
        into = tcp_throughput(hosts, 0, 1, seconds=2.0)
        out_of = tcp_throughput(hosts, 1, 0, seconds=2.0)
    finally:
        hosts.clear_link(1)
    assert 0.8 * rate <= into <= 1.2 * rate, f"into host1 {into / 1e6:.1f} Mbit/s"
    assert 0.8 * rate <= out_of <= 1.2 * rate, f"out of host1 {out_of / 1e6:.1f} Mbit/s"
    assert tcp_throughput(hosts, 0, 1, seconds=0.5) > 3 * rate  # cleared


def test_pair_limit_slows_only_that_pair(hosts: Hosts) -> None:
    rate = 20_000_000
    hosts.set_pair(0, 1, rate)
    try:
        pair = tcp_throughput(hosts, 1, 0, seconds=2.0)
        other = tcp_throughput(hosts, 0, 2, seconds=0.5)
        other_of_1 = tcp_throughput(hosts, 1, 2, seconds=0.5)
    finally:
        hosts.clear_pair(0, 1)
    assert 0.8 * rate <= pair <= 1.2 * rate, f"pair {pair / 1e6:.1f} Mbit/s"
    assert other > 3 * rate and other_of_1 > 3 * rate, (other, other_of_1)


def test_pair_under_link_cap_composes(hosts: Hosts) -> None:
    # a link fault and a pair fault on the same host: the pair class sits under the link cap
    hosts.set_link(0, 40_000_000)
    hosts.set_pair(0, 2, 200_000_000)
    try:
        capped = tcp_throughput(hosts, 0, 2, seconds=1.5)
    finally:
        hosts.clear_pair(0, 2)
        hosts.clear_link(0)
    assert 0.8 * 40e6 <= capped <= 1.2 * 40e6, f"{capped / 1e6:.1f} Mbit/s"
