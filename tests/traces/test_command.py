"""`stalwart replay --trace`: the documented example, the JSON it writes, bad input."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from stalwart.cli import main
from tests.helpers import stalwart

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples/traces/megatron_dp2_pp2_tp2.csv"


def _documented_command() -> list[str]:
    """The command docs/detect.md shows under 'Traces from a past job'."""
    text = (ROOT / "docs/detect.md").read_text()
    section = text[text.index("## Traces from a past job"):]
    m = re.search(r"^stalwart (replay --trace examples/traces/\S+.*)$", section, re.M)
    assert m, "docs/detect.md shows no runnable stalwart replay --trace command"
    return shlex.split(m.group(1))


def test_the_documented_command_names_the_slow_group(tmp_path: Path) -> None:
    args = _documented_command()
    proc = stalwart(*args, "--json", str(tmp_path / "v.json"), cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "verdict: slow_group" in proc.stdout and "dp=1,pp=1" in proc.stdout
    shown = (ROOT / "docs/detect.md").read_text()
    assert all(line in shown for line in proc.stdout.splitlines()[:6]), \
        "docs/detect.md shows another output than the command prints"
    v = json.loads((tmp_path / "v.json").read_text())
    assert [(f["kind"], f["ranks"]) for f in v["findings"]] == [("slow_group", [6, 7])]
    assert v["coverage"]["layout"].startswith("dp=2,pp=2,tp=2")  # from the sidecar


def test_the_command_line_layout_wins_over_the_sidecar(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    # tp=1: every rank its own worker; the slow TP group's two ranks are named as ranks
    assert main(["replay", "--trace", str(EXAMPLE), "--layout", "dp=4,pp=2,tp=1"]) == 0
    out = capsys.readouterr().out
    assert "layout dp=4,pp=2,tp=1" in out and "slow_rank" in out


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> None:
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err


@pytest.mark.parametrize(("extra", "needles"), [
    (["--layout", "dp=2,pp=x"], ["--layout", "pp=x"]),
    (["--layout", "dp=1,pp=2,tp=2"], ["rank 4", "outside"]),
    (["--rank-order", "tp-dp"], ["--rank-order", "tp-dp"]),
    (["--map", "forward-compute=fast"], ["--map", "forward-compute=fast"]),
    (["--ranks-per-host", "0"], ["--ranks-per-host", "0"]),
])
def test_bad_options_are_named(capsys: pytest.CaptureFixture[str], extra: list[str],
                               needles: list[str]) -> None:
    _one_line_error(capsys, ["replay", "--trace", str(EXAMPLE), *extra], *needles)


def test_bad_files_are_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _one_line_error(capsys, ["replay", "--trace", str(tmp_path / "gone.csv")], "gone.csv")
    bad = tmp_path / "t.csv"
    bad.write_text("rank,step,op,start,duration\n")
    _one_line_error(capsys, ["replay", "--trace", str(bad)], "unknown column 'op'")
    _one_line_error(capsys, ["replay"], "RUN_DIR", "--trace")


def test_a_trace_is_judged_where_torch_cannot_be_imported() -> None:
    import subprocess
    import sys

    from tests.test_layers import _NO_TORCH

    code = _NO_TORCH + (
        "from stalwart.cli import main\n"
        f"assert main(['replay', '--trace', {str(EXAMPLE)!r}]) == 0\n"
        "assert 'torch' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "slow_group" in r.stdout
