"""Host-link faults in the simulation: the product's verdict names the host (8 GPUs per host),
once per fault, with the validation tests' noise resampled from the testbed's at the scale
runs' default (0.25 of the testbed's spread: a GPU fleet's)."""

from __future__ import annotations

from stalwart.simulate.scenarios import hostlink_figures, scale_job


def test_host_link_faults_are_named_as_their_host_once() -> None:
    job = scale_job(320)  # 8 replicas of tp 8 x pp 5, 40 hosts of 8
    fig = hostlink_figures(job, seed=3, trials=12, verdicts=3, scale=0.25)
    assert fig["hostlink_localization_320"] >= 0.9
    assert fig["hostlink_findings_per_fault_320"] == 1.0
    assert fig["hostlink_findings_per_fault"] == 1.0
