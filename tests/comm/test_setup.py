"""Setup and liveness of the UDP collective across hosts: where a rank binds, and that a peer
whose packets never arrive (or stop arriving) stops the job with one line instead of letting
each rank train on its own gradient."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
from inproc import make_group, run_threads

from stalwart.comm.collective import PeerLost, check_addresses
from stalwart.comm.transport import default_host, is_loopback, route_source


def _routable_local_address() -> str:
    try:
        addr = route_source("10.255.255.1")  # any non-local address: the default route's source
    except OSError:
        pytest.skip("this machine has no route off loopback")
    if is_loopback(addr):
        pytest.skip("this machine has no non-loopback interface")
    return addr


pytestmark = pytest.mark.usefixtures("engine")


def test_without_host_addr_the_socket_binds_the_interface_that_reaches_master(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun across machines sets MASTER_ADDR but not STALWART_HOST_ADDR: binding 127.0.0.1
    # there made every peer's packets land on its own loopback
    addr = _routable_local_address()
    monkeypatch.delenv("STALWART_HOST_ADDR", raising=False)
    monkeypatch.setenv("MASTER_ADDR", addr)
    assert default_host() == addr
    group = make_group(2, 5000, host=None)
    try:
        assert [c.transport.addr[0] for c in group] == [addr, addr]
        xs = [np.full(5000, float(r), np.float32) for r in range(2)]
        outs = run_threads([lambda c=c, x=x: c.allreduce(x)[0]
                            for c, x in zip(group, xs, strict=True)])
        for o in outs:
            np.testing.assert_allclose(o, 0.5)  # it still works over that address
    finally:
        for c in group:
            c.close()


def test_a_job_across_hosts_with_a_loopback_rank_fails_at_setup() -> None:
    check_addresses([("127.0.0.1", 1), ("127.0.0.1", 2)], ["a", "a"])  # one host: fine
    check_addresses([("10.0.0.1", 1), ("10.0.0.2", 2)], ["a", "b"])
    with pytest.raises(RuntimeError, match="rank 1 on host 'b' bound loopback"):
        check_addresses([("10.0.0.1", 1), ("127.0.0.1", 2)], ["a", "b"])


def test_a_peer_whose_packets_never_arrive_stops_the_job() -> None:
    # rank 1 advertises an address it does not send from (what a wrong bind address does on
    # another host): rank 0 never authenticates one of its packets and must say so
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]

    def rewrite(rank: int, obj: tuple) -> tuple:
        (host, _port), name = obj
        return ((host, dead_port), name) if rank == 1 else obj

    group = make_group(2, 3000, rewrite=rewrite, cap=0.5, floor=0.25, give_up_s=2.0)
    stop = threading.Event()

    def rank(c, x: np.ndarray) -> int:
        rounds = 0
        try:
            while not stop.is_set() and rounds < 60:  # 60 rounds >> the 2 s bound
                c.allreduce(x)
                rounds += 1
            return rounds
        finally:
            stop.set()

    try:
        out = run_threads([lambda c=c: rank(c, np.ones(3000, np.float32)) for c in group])
    finally:
        for c in group:
            c.close()
    assert isinstance(out[0], PeerLost), out
    assert "never received a packet from rank 1" in str(out[0])
    assert "\n" not in str(out[0])
