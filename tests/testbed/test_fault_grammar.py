"""parse_fault: the --fault grammar and its one-line errors (no root needed)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stalwart.config import ConfigError, RunConfig
from stalwart.testbed import parse_fault, parse_rate


def test_each_kind_parses_to_its_target_and_magnitude() -> None:
    f = parse_fault("compute:rank=2,factor=2,start=20,end=60", 4, "local")
    assert (f.kind, f.rank, f.factor, f.start, f.end) == ("compute", 2, 2.0, 20, 60)
    assert f.event_fields()["rank"] == 2 and f.target == "rank2"
    f = parse_fault("contention:rank=0,procs=3", 4, "local")
    assert (f.procs, f.start, f.end, f.magnitude) == (3, 0, None, 3.0)
    f = parse_fault("link:host=1,rate=50mbit", 4, "netns")
    assert (f.hosts, f.rate_bps, f.target) == ((1,), 50_000_000, "host1")
    f = parse_fault("pairlink:hosts=3-1,rate=2mbps", 4, "netns")
    assert (f.hosts, f.rate_bps, f.event_fields()["hosts"]) == ((3, 1), 16_000_000, [3, 1])
    f = parse_fault("loss:host=all,p=0.05,end=9", 3, "netns")
    assert (f.hosts, f.p, f.target, f.end) == ((0, 1, 2), 0.05, "all", 9)
    f = parse_fault("loss:host=2,p=0", 3, "netns")
    assert f.hosts == (2,) and f.p == 0.0


def test_schedule_window_is_end_exclusive() -> None:
    f = parse_fault("compute:rank=0,factor=3,start=5,end=7", 1, "local")
    assert [s for s in range(10) if f.active_at(s)] == [5, 6]
    g = parse_fault("compute:rank=0,factor=3", 1, "local")
    assert all(g.active_at(s) for s in (0, 10**9))


@pytest.mark.parametrize("text,bits", [("50mbit", 50_000_000), ("1gbit", 10**9),
                                       ("500kbit", 500_000), ("10mbps", 80_000_000),
                                       ("1.5Mbit", 1_500_000)])
def test_rates_use_tc_units(text: str, bits: int) -> None:
    assert parse_rate(text) == bits


@pytest.mark.parametrize("spec,testbed,names", [
    ("slow:rank=1", "local", "'slow'"),
    ("compute", "local", "no parameters"),
    ("compute:rank=1", "local", "factor"),
    ("compute:rank=1,factor=2,speed=3", "local", "'speed'"),
    ("compute:rank=4,factor=2", "local", "rank=4"),
    ("compute:rank=-1,factor=2", "local", "rank=-1"),
    ("compute:rank=x,factor=2", "local", "rank='x'"),
    ("compute:rank=1,factor=0.5", "local", "factor=0.5"),
    ("compute:rank=1,factor=nan", "local", "factor='nan'"),
    ("compute:rank=1,rank=2,factor=2", "local", "'rank' given twice"),
    ("compute:rank=1,factor", "local", "'factor'"),
    ("contention:rank=1,procs=0", "local", "procs=0"),
    ("link:host=1,rate=50", "netns", "'50'"),
    ("link:host=1,rate=fastmbit", "netns", "'fastmbit'"),
    ("link:host=9,rate=50mbit", "netns", "host=9"),
    ("link:host=1,rate=50mbit", "local", "needs --testbed netns"),
    ("pairlink:hosts=1,rate=5mbit", "netns", "hosts='1'"),
    ("pairlink:hosts=1-1,rate=5mbit", "netns", "same host"),
    ("pairlink:hosts=0-7,rate=5mbit", "netns", "hosts=7"),
    ("loss:host=all,p=1", "netns", "p=1"),
    ("loss:host=all,p=-0.1", "netns", "p=-0.1"),
    ("loss:host=all,p=0.1", "local", "needs --testbed netns"),
    ("loss:host=every,p=0.1", "netns", "host='every'"),
    ("compute:rank=1,factor=2,start=10,end=5", "local", "end=5"),
    ("compute:rank=1,factor=2,start=5,end=5", "local", "end=5"),
    ("compute:rank=1,factor=2,start=-3", "local", "start=-3"),
    ("compute:rank=1,factor=2", "cloud", "'cloud'"),
    ("kill:rank=1,at=5,back=0", "local", "back=0"),
    ("kill:rank=1,at=5,back=-2s", "local", "back='-2s'"),
    ("kill:rank=1,at=5,back=soon", "local", "back='soon'"),
    ("compute:rank=1,factor=2,back=3s", "local", "'back'"),
    ("hang:rank=1", "local", "missing at="),
    ("hang:rank=1,at=5,end=9", "local", "'end'"),
    ("hang:rank=1,at=5,back=2s", "local", "'back'"),
    ("hang:host=1,at=5", "local", "use rank=R"),
    ("cut:host=1", "local", "needs --testbed netns"),
    ("cut:rank=1", "netns", "use host=H"),
    ("cut:host=4", "netns", "host=4"),
])
def test_bad_specs_raise_one_line_naming_the_value(spec: str, testbed: str, names: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_fault(spec, 4, testbed)
    msg = str(e.value)
    assert names in msg and "\n" not in msg


def test_runconfig_validate_rejects_a_bad_fault() -> None:
    cfg = RunConfig(nproc=2, testbed="local", faults=["loss:host=0,p=0.1"])
    with pytest.raises(ConfigError, match="needs --testbed netns"):
        cfg.validate()
    cfg = RunConfig(nproc=2, testbed="local", faults=["kill:rank=1,at=5,back=3s"])
    with pytest.raises(ConfigError, match=r"back= in fault 'kill:rank=1,at=5,back=3s' needs "
                                          r"--script"):
        cfg.validate()


def test_a_hang_is_one_moment_on_a_rank_and_a_cut_a_window_on_a_host() -> None:
    f = parse_fault("hang:rank=2,at=12", 4, "local")
    assert (f.kind, f.rank, f.start, f.end, f.target) == ("hang", 2, 12, None, "rank2")
    assert parse_fault("hang:rank=0,at=3.5s", 4, "local").start_s == 3.5
    g = parse_fault("cut:host=1,start=10,end=30", 4, "netns")
    assert (g.hosts, g.start, g.end, g.target) == ((1,), 10, 30, "host1")
    assert g.active_at(10) and not g.active_at(30)


def test_a_kill_with_back_names_when_the_rank_starts_again() -> None:
    f = parse_fault("kill:rank=2,at=12,back=4.5s", 4, "local")
    assert (f.rank, f.start, f.back_s) == (2, 12, 4.5)
    assert parse_fault("kill:rank=2,at=3s,back=4", 4, "local").back_s == 4.0
    assert parse_fault("kill:rank=2,at=3s", 4, "local").back_s is None
    assert f.event_fields()["back_s"] == 4.5


# ---- properties ------------------------------------------------------------------------------

@given(nproc=st.integers(1, 16), data=st.data())
def test_valid_specs_round_trip(nproc: int, data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, nproc - 1))
    start = data.draw(st.integers(0, 1000))
    end = data.draw(st.one_of(st.none(), st.integers(start + 1, start + 1000)))
    window = f",start={start}" + ("" if end is None else f",end={end}")
    factor = data.draw(st.floats(1.0, 100.0, allow_nan=False))
    f = parse_fault(f"compute:rank={rank},factor={factor!r}{window}", nproc, "local")
    assert (f.rank, f.factor, f.start, f.end) == (rank, factor, start, end)
    p = data.draw(st.floats(0.0, 0.999, allow_nan=False))
    g = parse_fault(f"loss:host={rank},p={p!r}{window}", nproc, "netns")
    assert (g.hosts, g.p, g.start, g.end) == ((rank,), p, start, end)
    assert all(g.active_at(s) == (start <= s and (end is None or s < end))
               for s in (start - 1, start, start + 1, (end or 0) - 1, end or 10**6))


@given(st.text(max_size=60))
def test_arbitrary_text_is_parsed_or_rejected_with_config_error(text: str) -> None:
    for testbed in ("local", "netns"):
        try:
            parse_fault(text, 4, testbed)
        except ConfigError as e:
            assert "\n" not in str(e)
