"""Replay of the recorded corpus: the decisions equal the ones recorded before the decision
code was restructured (expected.json), and they say what a user would expect of each run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.replay import replay_run

HERE = Path(__file__).parent
CORPUS = sorted(p for p in (HERE / "corpus").iterdir() if p.is_dir())


def test_the_corpus_is_large_and_varied() -> None:
    assert len(CORPUS) >= 20
    configs = [json.loads((p / "config.json").read_text()) for p in CORPUS]
    assert {c["nproc"] for c in configs} >= {2, 3, 4}
    faulted = sum(bool(c["faults"]) for c in configs)
    assert faulted >= 10 and len(configs) - faulted >= 5
    assert {c["comm"] for c in configs} == {"reliable", "lossy"}


@pytest.mark.parametrize("run", CORPUS, ids=[p.name for p in CORPUS])
def test_replay_makes_the_recorded_decisions(run: Path) -> None:
    expected = {r["run"]: r for r in json.loads((HERE / "expected.json").read_text())}
    assert replay_run(run) == expected[run.name]


def test_a_faulted_run_names_its_rank_and_a_mitigated_one_rebalances_then_reverts() -> None:
    res = replay_run(HERE / "corpus" / "compute3x-n4-mitigate-ends")
    (inc,) = res["incarnations"]
    found = [e for e in inc["detect"] if e["event"] == "straggler_detected"]
    assert found and found[0]["kind"] == "compute" and found[0]["ranks"] == [2]
    kinds = [d["decision"] for d in inc["policy"]]
    assert kinds[0] == "rebalance" and "revert" in kinds
    first = inc["policy"][0]
    assert first["counts"][2] < min(c for g, c in enumerate(first["counts"]) if g != 2)


def test_a_clean_run_logs_no_straggler() -> None:
    for name in ("clean-n3", "clean-n4-seed1"):
        (inc,) = replay_run(HERE / "corpus" / name)["incarnations"]
        assert not [e for e in inc["detect"] if e["event"] == "straggler_detected"]
        assert inc["policy"] == []


def test_the_command_prints_and_writes_the_decisions(tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    r = subprocess.run([sys.executable, "-m", "stalwart.cli", "replay", str(CORPUS[0]),
                        "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert CORPUS[0].name in r.stdout
    assert json.loads(out.read_text()) == [replay_run(CORPUS[0])]
    bad = subprocess.run([sys.executable, "-m", "stalwart.cli", "replay", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "not a run directory" in bad.stderr


def test_runs_slow_from_the_start_are_found_since_the_first_sample_and_acted_on() -> None:
    # issue 24: no change point exists; the audit (or the outlier test) names the culprit
    for name, kind, ranks in (("born-compute2x-n4", "compute", [2]),
                              ("born-link-n4-netns", "link", [1]),
                              ("born-pairlink-n4-netns", "link", []),
                              ("script-born-compute2x-n2", "compute", [0])):
        (inc,) = replay_run(HERE / "corpus" / name)["incarnations"]
        found = [e for e in inc["detect"] if e["event"] == "straggler_detected"]
        assert found, name
        first = found[0]
        assert (first["kind"], first["ranks"]) == (kind, ranks), (name, first)
        assert first["onset_step"] == 0 and first["evidence"]["never_healthy"], (name, first)
    # the policy prices it from its peers (it never saw a healthy step) and rebalances
    (inc,) = replay_run(HERE / "corpus" / "born-compute2x-n3-mitigate")["incarnations"]
    first = inc["policy"][0]
    assert first["decision"] == "rebalance" and first["counts"][1] < min(
        first["counts"][0], first["counts"][2])
