"""The probe of an excluded host: what reads healthy, and when taking it back pays off."""

from __future__ import annotations

from pathlib import Path

from stalwart.mitigate.probe import HostProbe


def _probe(tmp_path: Path) -> HostProbe:
    p = HostProbe(object(), 1, [0, 2, 3])  # no hosts, no groups, no store: nothing measured
    p.stop()
    return p


def test_a_healthy_hosts_noisy_link_reads_healthy_and_a_shaped_one_does_not(
        tmp_path: Path) -> None:
    p = _probe(tmp_path)
    # a healthy host's link while the job trained (CPU-bound TCP): every recorded reading
    for link in (0.48, 0.65, 0.84, 0.86, 0.88, 1.42, 1.51):
        assert p.ok({"link": link, "compute": 1.0}), link
    # a 10-30 mbit link beside ~10 Gbit/s peers, and a probe that failed
    for link in (0.003, 0.0):
        assert not p.ok({"link": link, "compute": 1.0}), link
    assert not p.ok({"link": 1.0, "compute": 2.0})  # a 2x compute fault still in force
    assert p.ok({"link": None, "compute": None})  # nothing to measure on this testbed


def test_the_host_comes_back_only_after_two_healthy_rounds_that_pay_for_the_price(
        tmp_path: Path) -> None:
    p = _probe(tmp_path)
    p.rounds.append({"link": 0.9, "compute": 1.0})
    p.healthy = 1
    assert p.restore_reason(1000, 0.05, 3, 2.0) is None  # one round is not enough
    p.healthy = 2
    why = p.restore_reason(1000, 0.05, 3, 2.0, how="live rejoin")
    assert why is not None and "12.5 s saved" in why  # 1000 x 0.05 s x (1 - 3/4)
    assert p.restore_reason(100, 0.05, 3, 2.0) is None  # 1.25 s saved < 2 s price
    assert "staying at 3 hosts" in p.declined
