"""The step-time model's closed forms (model.py)."""

from __future__ import annotations

import numpy as np
import pytest

from stalwart.simulate.model import Job, Link, StepModel


def test_data_parallel_step_is_slowest_replica_plus_ring_plus_fixed() -> None:
    job = Job(dp=4, micro=16, mb_compute_s=0.01, grad_bytes=1e6, fixed_s=0.005,
              inter=Link(1e-4, 1e8))
    m = StepModel(job)
    comp = np.full(4, 0.01)
    comp[2] = 0.02
    r = m.step(np.array([4, 4, 4, 4]), comp, np.ones(job.hosts))
    ring = 2 * 3 * 1e-4 + 2 * 3 / 4 * 1e6 / 1e8
    assert r.allreduce_s == pytest.approx(ring)
    assert r.step_s == pytest.approx(4 * 0.02 + ring + 0.005)
    assert r.unit_s.tolist() == pytest.approx([0.01, 0.01, 0.02, 0.01])


def test_the_all_reduces_cpu_work_is_paid_only_where_it_outlasts_the_wire() -> None:
    job = Job(dp=4, micro=16, mb_compute_s=0.01, grad_bytes=1e6, comm_cpu_s=0.02,
              inter=Link(0.0, 1e9))
    m = StepModel(job)
    counts, comp = np.array([4, 4, 4, 4]), np.full(4, 0.01)
    wire = 2 * 3 / 4 * 1e6 / 1e9  # 1.5 ms: the CPU work is the longer
    assert m.step(counts, comp, np.ones(4)).step_s == pytest.approx(0.04 + 0.02)
    slow = np.ones(4)
    slow[2] = 100.0  # 150 ms on the wire: the CPU work is under it
    assert m.step(counts, comp, slow).step_s == pytest.approx(0.04 + 100 * wire)
    alone = m.step(np.array([4, 0, 0, 0]), comp, np.ones(4))  # no ring, no all-reduce
    assert alone.step_s == pytest.approx(0.04)


def test_pipeline_1f1b_fill_drain_and_tp_max() -> None:
    job = Job(dp=2, tp=2, pp=3, micro=8, mb_compute_s=0.1, grad_bytes=0.0,
              gpus_per_host=2)
    comp = np.full(job.ranks, 0.1)
    comp[1] = 0.3  # replica 0, stage 0, tp rank 1: its stage waits for it
    r = StepModel(job).step(np.array([4, 4]), comp, np.ones(job.hosts))
    # replica 0: stages 0.3, 0.1, 0.1 -> 0.5 + 3 x 0.3; replica 1: 0.3 + 3 x 0.1
    assert r.step_s == pytest.approx(0.5 + 3 * 0.3)


def test_excluded_replica_leaves_the_ring_and_a_slow_link_slows_it() -> None:
    job = Job(dp=4, micro=12, mb_compute_s=0.01, grad_bytes=1e6, inter=Link(0.0, 1e8))
    m = StepModel(job)
    healthy = m.step(np.array([3, 3, 3, 3]), np.full(4, 0.01), np.ones(4))
    slow = np.ones(4)
    slow[1] = 10.0
    slowed = m.step(np.array([3, 3, 3, 3]), np.full(4, 0.01), slow)
    assert slowed.allreduce_s == pytest.approx(10 * healthy.allreduce_s)
    out = m.step(np.array([4, 0, 4, 4]), np.full(4, 0.01), slow)  # replica 1 excluded
    assert out.allreduce_s == pytest.approx(2 * 2 / 3 * 1e6 / 1e8)
    assert np.isnan(out.unit_s[1])


def test_bad_job_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="dp"):
        Job(dp=0)
    with pytest.raises(ValueError, match="micro"):
        Job(dp=4, micro=2)
    with pytest.raises(ValueError, match="collective"):
        Job(dp=2, collective="mesh")
