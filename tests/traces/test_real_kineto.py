"""A genuine Kineto trace: 2 gloo ranks under torch.profiler, rank 1 slowed (marked)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.bench.kineto_job import profile_job
from stalwart.traces.layout import Layout
from stalwart.traces.opnames import COMM, COMPUTE, OpMap
from stalwart.traces.read import read_trace
from stalwart.traces.verdict import SLOW_RANK, decide


@pytest.mark.slow
def test_the_reader_and_the_verdict_on_a_real_profiler_trace(tmp_path: Path) -> None:
    d = profile_job(tmp_path, slow_rank=1, factor=3.0)
    t = read_trace(d)
    assert t.fmt == "kineto" and sorted(set(t.rank.tolist())) == [0, 1]  # distributedInfo
    assert len(set(t.step.tolist())) == 30  # ProfilerStep#2..#31
    kinds = {OpMap().kind(str(n)) for n in t.name}
    assert {COMPUTE, COMM} <= kinds  # aten ops and gloo collectives both recognised
    v = decide(t, Layout(2))
    assert [(f.kind, f.ranks) for f in v.findings] == [(SLOW_RANK, [1])], v.coverage
