"""The readers: the columnar schema (CSV, parquet) and Kineto Chrome-trace JSON."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stalwart.errors import ConfigError
from stalwart.traces.generate import Case, make_trace, write_kineto
from stalwart.traces.layout import Layout
from stalwart.traces.opnames import OpMap
from stalwart.traces.read import read_trace, write_csv, write_parquet


def _trace():
    return make_trace(Case("t", Layout(2, 2, 1), steps=[3, 4, 9], micro=2))


def test_csv_keeps_every_column(tmp_path: Path) -> None:
    t = _trace()
    write_csv(t, tmp_path / "t.csv")
    back = read_trace(tmp_path / "t.csv")
    assert len(back) == len(t) and back.fmt == "csv"
    assert (back.rank == t.rank).all() and (back.step == t.step).all()
    assert (back.micro == t.micro).all() and list(back.name) == list(t.name)
    assert np.allclose(back.duration, t.duration) and np.allclose(back.start, t.start)


def test_csv_times_in_milliseconds(tmp_path: Path) -> None:
    f = tmp_path / "ms.csv"
    f.write_text("rank,step,name,start,duration\n0,1,forward-compute,10,2.5\n")
    assert read_trace(f, unit="ms").duration[0] == pytest.approx(2.5e-3)
    assert read_trace(f).micro[0] == -1  # no micro column: none


def test_parquet_keeps_every_column(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    t = _trace()
    write_parquet(t, tmp_path / "t.parquet")
    back = read_trace(tmp_path / "t.parquet")
    assert len(back) == len(t) and back.fmt == "parquet"
    assert (back.micro == t.micro).all() and np.allclose(back.duration, t.duration)


@pytest.mark.parametrize(("text", "needle"), [
    ("rank,step,name,start\n", "missing column 'duration'"),
    ("rank,step,name,start,duration,gpu\n", "unknown column 'gpu'"),
    ("rank,step,name,start,duration\n0,1,x,0,fast\n", "not a number"),
])
def test_bad_csv_is_named(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "bad.csv"
    f.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        read_trace(f)


def test_missing_file_and_unknown_suffix_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.csv"):
        read_trace(tmp_path / "nope.csv")
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(ConfigError, match="unknown format"):
        read_trace(tmp_path / "t.txt")


def test_kineto_kernels_are_placed_in_the_step_of_their_launch(tmp_path: Path) -> None:
    t = _trace()
    write_kineto(t, tmp_path, style="kernels")
    back = read_trace(tmp_path)
    assert back.fmt == "kineto" and sorted(set(back.rank.tolist())) == [0, 1, 2, 3]
    assert sorted(set(back.step.tolist())) == [3, 4, 9]
    m = OpMap()
    comp = np.array([m.kind(n) == "compute" for n in back.name])
    want = sum(d for n, d in zip(t.name, t.duration, strict=True)
               if n in ("forward-compute", "backward-compute", "optimizer"))
    assert back.duration[comp].sum() == pytest.approx(want)


def test_kineto_cpu_ops_count_the_outermost_and_leave_out_nested_comm(tmp_path: Path) -> None:
    ev = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#7", "pid": 1, "tid": 1,
           "ts": 0, "dur": 1000},
          # backward: 300 us of which 100 us is an all-reduce issued inside it
          {"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: MmB",
           "pid": 1, "tid": 1, "ts": 10, "dur": 300},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 20,
           "dur": 100},
          {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "pid": 1, "tid": 1,
           "ts": 150, "dur": 100},
          # a user annotation that maps to nothing is transparent: its ops count
          {"ph": "X", "cat": "user_annotation", "name": "DistributedDataParallel.forward",
           "pid": 1, "tid": 1, "ts": 400, "dur": 200},
          {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "pid": 1, "tid": 1, "ts": 410,
           "dur": 150},
          {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "pid": 1, "tid": 1, "ts": 420,
           "dur": 100},
          # outside every step: dropped
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 5000,
           "dur": 100}]
    f = tmp_path / "worker_rank3.json"
    f.write_text(json.dumps({"traceEvents": ev}))
    t = read_trace(f)
    assert set(t.rank.tolist()) == {3} and set(t.step.tolist()) == {7}
    got = dict(zip(t.name.tolist(), (t.duration * 1e6).round().tolist(), strict=True))
    assert got == {"autograd::engine::evaluate_function: MmB": 200.0, "aten::linear": 150.0}


def test_kineto_without_steps_or_rank_is_named(tmp_path: Path) -> None:
    f = tmp_path / "trace.json"
    f.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm",
                                              "ts": 0, "dur": 1, "pid": 1, "tid": 1}],
                             "distributedInfo": {"rank": 0}}))
    with pytest.raises(ConfigError, match="ProfilerStep"):
        read_trace(f)
    f.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ConfigError, match="which rank"):
        read_trace(f)
