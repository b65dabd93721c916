"""The layout's rank numbering and the default op-name rules (Megatron-LM and Kineto)."""

from __future__ import annotations

import pytest

from stalwart.errors import ConfigError
from stalwart.traces.layout import Coord, Layout
from stalwart.traces.opnames import COMM, COMPUTE, OTHER, STEP, OpMap, parse_rule


def test_megatron_order_puts_tp_fastest_then_dp_then_pp() -> None:
    lay = Layout.parse("dp=2,pp=2,tp=4")
    assert lay.world == 16
    assert lay.coord(0) == Coord(0, 0, 0)
    assert lay.coord(3) == Coord(0, 0, 3)
    assert lay.coord(4) == Coord(1, 0, 0)
    assert lay.coord(8) == Coord(0, 1, 0)
    assert all(lay.rank_of(lay.coord(r)) == r for r in range(16))


def test_another_order_and_hosts() -> None:
    lay = Layout.parse("tp=2,pp=2,dp=2", order="tp-pp-dp", ranks_per_host=4)
    assert lay.coord(2) == Coord(0, 1, 0) and lay.coord(4) == Coord(1, 0, 0)
    assert lay.host(3) == 0 and lay.host(4) == 1


@pytest.mark.parametrize("bad", ["dp=2,pp", "dp=two", "dp=0", "xp=2", "dp=2,dp=3", ""])
def test_a_bad_layout_string_is_named(bad: str) -> None:
    with pytest.raises(ConfigError, match="--layout"):
        Layout.parse(bad)


def test_a_bad_rank_order_and_a_rank_outside_the_layout_are_named() -> None:
    with pytest.raises(ConfigError, match="tp-dp"):
        Layout.parse("dp=2", order="tp-dp")
    with pytest.raises(ConfigError, match="rank 9"):
        Layout.parse("dp=4,tp=2").coord(9)


@pytest.mark.parametrize(("name", "kind"), [
    ("forward-compute", COMPUTE), ("backward-compute", COMPUTE), ("optimizer", COMPUTE),
    ("optimizer-inner-step", COMPUTE), ("forward-send", COMM), ("backward-send", COMM),
    ("forward-recv", COMM), ("backward-recv", COMM), ("forward-send-backward-recv", COMM),
    ("params-all-gather", COMM), ("grads-reduce-scatter", COMM), ("all-grads-sync", COMM),
    ("embedding-grads-all-reduce", COMM), ("batch-generator", OTHER),
    ("forward-backward", OTHER),
    ("ProfilerStep#12", STEP), ("ncclKernel_AllReduce_RING_LL_Sum_float", COMM),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", COMM), ("nccl:all_reduce", COMM),
    ("gloo:all_reduce", COMM), ("c10d::allreduce_", COMM), ("aten::mm", COMPUTE),
    ("autograd::engine::evaluate_function: AddmmBackward0", COMPUTE),
    ("ampere_sgemm_128x64_tn", COMPUTE), ("void at::native::elementwise_kernel<128, 2>", COMPUTE),
    ("Memcpy HtoD (Pageable -> Device)", OTHER), ("my_custom_region", OTHER),
])
def test_default_rules(name: str, kind: str) -> None:
    assert OpMap().kind(name) == kind


def test_user_rules_come_before_the_defaults() -> None:
    m = OpMap([parse_rule("forward-compute=other"), parse_rule("my_*=compute")])
    assert m.kind("forward-compute") == OTHER
    assert m.kind("my_custom_region") == COMPUTE
    assert m.kind("backward-compute") == COMPUTE


@pytest.mark.parametrize("bad", ["forward-compute", "x=fast", "=compute"])
def test_a_bad_rule_is_named(bad: str) -> None:
    with pytest.raises(ConfigError, match="--map"):
        parse_rule(bad)
