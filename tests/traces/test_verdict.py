"""The verdict on generated traces with known causes (written to disk and read back)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from stalwart.bench.traces import cases, judge, write_case
from stalwart.errors import ConfigError
from stalwart.traces.generate import Case, make_trace
from stalwart.traces.layout import Layout
from stalwart.traces.verdict import INPUT, SLOW_GROUP, SLOW_RANK, STAGE, decide

CASES = cases(1)
HAS_PYARROW = importlib.util.find_spec("pyarrow") is not None


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_generated_set_gets_its_ground_truth(case: Case, tmp_path: Path) -> None:
    # parquet needs the optional pyarrow (the dev extra has it); without it the case is CSV
    row = judge(case, write_case(case, tmp_path, parquet=HAS_PYARROW))
    assert row["correct"], row


def test_no_finding_on_clean_traces_of_many_layouts_and_seeds() -> None:
    """The false-alarm side: 36 clean traces (heavy-tailed noise: 1% outliers at 2x)."""
    layouts = [Layout(8), Layout(2, 4, 2), Layout(4, 2, 2), Layout(1, 4, 1), Layout(3, 2, 1),
               Layout(2, 2, 4)]
    found = []
    for i in range(36):
        lay = layouts[i % len(layouts)]
        steps = list(range(6 + (i % 4) * 6))
        v = decide(make_trace(Case(f"clean{i}", lay, steps=steps, seed=500 + i)), lay)
        if v.findings:
            found.append((i, lay.describe(), v.verdict))
    assert found == []


def test_a_stage_imbalance_names_no_rank_and_states_its_cost() -> None:
    lay = Layout(2, 2, 1)
    v = decide(make_trace(Case("s", lay, "stage", 1.5, stage=1, noise=0.002)), lay)
    assert [f.kind for f in v.findings] == [STAGE]
    f = v.findings[0]
    assert f.ranks == [] and f.stage == 1
    assert f.factor == pytest.approx(1.5 / 1.25, rel=0.02)  # slowest over the stages' mean
    assert f.cost_fraction == pytest.approx(1 - 1.25 / 1.5, abs=0.01)
    # 1F1B with M = 4 micro-batches, P = 2: (M + P - 1) slots of (max - mean) fwd+bwd time
    assert f.cost_s_per_step == pytest.approx(5 * (1.5 - 1.25) * 3e-3, rel=0.05)


def test_input_imbalance_names_no_rank() -> None:
    lay = Layout(2, 2, 2)
    v = decide(make_trace(Case("i", lay, "input", input_sigma=0.3)), lay)
    assert [f.kind for f in v.findings] == [INPUT]
    assert v.findings[0].ranks == [] and v.findings[0].cost_fraction > 0


def test_without_two_stages_the_input_test_says_it_cannot_be_made() -> None:
    lay = Layout(4)
    v = decide(make_trace(Case("i", lay, "input", input_sigma=0.3)), lay)
    assert INPUT not in v.verdict and "not testable" in v.coverage["input_test"]


def test_a_slow_rank_seen_through_megatron_timers_is_its_tp_group() -> None:
    """Megatron's timers hold the TP collectives: the group steps as one slow worker."""
    lay = Layout(2, 1, 4)
    v = decide(make_trace(Case("g", lay, "slow_rank", 1.4, rank=6)), lay)
    assert [(f.kind, f.ranks, f.group) for f in v.findings] == \
        [(SLOW_GROUP, [4, 5, 6, 7], {"dp": 1, "pp": 0})]


def test_a_group_seen_through_one_rank_says_so() -> None:
    lay = Layout(4, 1, 4)
    traced = [r for r in range(16) if lay.coord(r).tp == 0]
    v = decide(make_trace(Case("g", lay, "slow_group", 1.3, group=(2, 0), traced=traced)), lay)
    assert [(f.kind, f.ranks) for f in v.findings] == [(SLOW_GROUP, [8])]
    assert "look the same" in v.findings[0].notes[0]


def test_three_steps_still_give_a_verdict_with_its_confidence() -> None:
    lay = Layout(8)
    case = Case("few", lay, "slow_rank", 1.5, rank=3, steps=[7, 8, 9], micro=1)
    v = decide(make_trace(case), lay)
    assert [(f.kind, f.ranks) for f in v.findings] == [(SLOW_RANK, [3])]
    assert "approximate" in v.findings[0].confidence and v.coverage["steps"] == 3


def test_a_slowdown_below_the_minimum_factor_is_not_reported() -> None:
    lay = Layout(8)
    v = decide(make_trace(Case("mild", lay, "slow_rank", 1.05, rank=3, noise=0.002)), lay)
    assert v.findings == []


def test_a_rank_outside_the_layout_is_named() -> None:
    t = make_trace(Case("w", Layout(4)))
    with pytest.raises(ConfigError, match="rank 2 is outside"):
        decide(t, Layout(2))


def test_one_rank_alone_is_undecided_not_clean() -> None:
    lay = Layout(4)
    v = decide(make_trace(Case("one", lay, "slow_rank", 2.0, rank=1, traced=[1])), lay)
    assert v.verdict == "undecided" and v.findings == []


def test_a_trace_without_compute_names_says_which_names_it_saw() -> None:
    t = make_trace(Case("n", Layout(2)))
    t.name[:] = "my-region"
    with pytest.raises(ConfigError, match="my-region"):
        decide(t, Layout(2))


def test_more_peers_than_the_exact_limit_still_name_the_slow_rank() -> None:
    """96 replicas: above EXACT_PEERS the reference is the whole set's median."""
    lay = Layout(96)
    v = decide(make_trace(Case("wide", lay, "slow_rank", 1.2, rank=40, steps=list(range(6)),
                               micro=2)), lay)
    assert [(f.kind, f.ranks) for f in v.findings] == [(SLOW_RANK, [40])]


def test_the_sign_tail_is_the_binomial_tail() -> None:
    from scipy.stats import binom

    from stalwart.traces.verdict import sign_tail

    for n, k in [(1, 1), (12, 10), (30, 29), (200, 130), (3000, 1600)]:
        assert sign_tail(n, k) == pytest.approx(float(binom.sf(k - 1, n, 0.5)), rel=0.02)
    assert sign_tail(5, 0) == 1.0


def test_a_rank_slow_only_from_mid_trace_is_named_with_its_first_step() -> None:
    """Slow in the last 6 of 20 steps: the whole trace's median stays healthy; the split of
    its steps finds the slow segment."""
    lay = Layout(8)
    v = decide(make_trace(Case("mid", lay, "slow_rank", 1.4, rank=6, steps=list(range(20)),
                               onset=14, seed=3)), lay)
    assert [(f.kind, f.ranks, f.from_step) for f in v.findings] == [(SLOW_RANK, [6], 14)]
    assert "slow from step 14" in v.findings[0].confidence
    # its cost is priced over the slow steps: 0.4 x (M=4 micro-batches x 3 ms fwd+bwd)
    assert v.findings[0].cost_s_per_step == pytest.approx(0.4 * 12e-3, rel=0.25)
