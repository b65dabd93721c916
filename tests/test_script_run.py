"""`stalwart run --script`: a user's own DDP script as the ranks, locally (no root needed).

The script (tests/scripts/plain_ddp.py) imports nothing from stalwart. Checked: it runs as
`python script.py ARGS` would under torchrun (environment, argv, __main__, sys.path), the
monitor started by --detect counts its iterations, the report is built without metrics.jsonl,
a crash on one rank ends the job with that rank named, and bad input is one line + exit 2.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from stalwart.cli import main
from stalwart.rundir import read_jsonl
from tests.helpers import stalwart

SCRIPT = Path(__file__).resolve().parent / "scripts" / "plain_ddp.py"


@pytest.mark.slow
def test_a_plain_ddp_script_runs_as_the_ranks_with_torchruns_environment(tmp_path: Path) -> None:
    envs = tmp_path / "envs"
    envs.mkdir()
    p = stalwart("run", "--script", str(SCRIPT), "--nproc", "2", "--detect", "--out",
                 str(tmp_path), "--name", "s", "--", "--seconds", "4", "--env-out", str(envs),
                 timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[rank 0] trained" in p.stdout  # rank 0's own output reaches the terminal
    run = tmp_path / "s"
    ports = set()
    for r in (0, 1):
        got = json.loads((envs / f"rank-{r}.json").read_text())
        env = got["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
            str(r), "2", str(r), "2")
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["STALWART_HOST_ADDR"] == "127.0.0.1"
        assert env["TORCHELASTIC_RUN_ID"] == "s"
        ports.add(env["MASTER_PORT"])
        assert got["argv"] == [str(SCRIPT), "--seconds", "4", "--env-out", str(envs)]
        assert got["name"] == "__main__" and got["path0"] == str(SCRIPT.parent)
        assert (run / "logs" / f"rank-{r}.log").exists()
    assert len(ports) == 1
    # the monitor counted the script's iterations on every rank, without any hint
    its = read_jsonl(run / "iterations.jsonl")
    assert {m["rank"] for m in its} == {0, 1}
    assert len([m for m in its if m["rank"] == 0]) >= 20
    assert all(m["step_time"] > 0 for m in its)
    events = [e["event"] for e in read_jsonl(run / "events.jsonl")]
    assert events[0] == "run_started" and events[-1] == "run_finished"
    page = (run / "report.html").read_text()
    assert "plain_ddp.py" in page and "timeline.png" in page and (run / "timeline.png").exists()
    assert "outcome</th><td>ok" in page


@pytest.mark.slow
def test_a_crash_on_one_rank_ends_the_job_naming_that_rank(tmp_path: Path) -> None:
    p = stalwart("run", "--script", str(SCRIPT), "--nproc", "3", "--out", str(tmp_path),
                 "--name", "c", "--", "--seconds", "600", "--crash-rank", "1", "--crash-at",
                 "8", timeout=120)  # the guard against a hang: the script alone runs 600 s
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "rank 1 failed" in out and "injected crash on rank 1 at step 8" in out, out
    failed = [e for e in read_jsonl(tmp_path / "c" / "events.jsonl")
              if e["event"] == "rank_failed"]
    assert [e["rank"] for e in failed] == [1]
    assert "rank 1 failed" in (tmp_path / "c" / "report.html").read_text()
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "c")], capture_output=True,
                              text=True).stdout
    assert leftover == "", leftover


@pytest.mark.slow
def test_a_hung_rank_of_a_plain_script_ends_the_job_naming_its_silence(tmp_path: Path) -> None:
    """SIGSTOP at an iteration the monitor counted: the launcher finds the rank silent (it
    said it was set up when the script's init_process_group returned) and stops the job with
    one line, instead of the peers waiting in gloo's collective for its timeout."""
    p = stalwart("run", "--script", str(SCRIPT), "--nproc", "2", "--detect", "--out",
                 str(tmp_path), "--name", "h", "--fault", "hang:rank=1,at=10", "--",
                 "--seconds", "600", timeout=240)  # the script alone runs 600 s
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    events = read_jsonl(tmp_path / "h" / "events.jsonl")
    silent = [e for e in events if e["event"] == "rank_unresponsive"]
    assert [(e["rank"], e["bound_s"]) for e in silent] == [(1, 3.0)], silent
    failed = [e for e in events if e["event"] == "rank_failed"]
    assert [e["rank"] for e in failed] == [1] and "no heartbeat" in failed[0]["error"]


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def test_bad_scripts_are_one_line_errors_naming_the_value(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = ["--out", str(tmp_path)]
    assert "script not found: /nope/train.py" in _error(capsys, "--script", "/nope/train.py",
                                                         *out)
    assert f"got a folder: {tmp_path}" in _error(capsys, "--script", str(tmp_path), *out)
    binary = tmp_path / "model.pt"
    binary.write_bytes(b"\x80\x02\x00\x00garbage\x00")
    assert f"not a Python script: {binary}" in _error(capsys, "--script", str(binary), *out)
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\ndef main(:\n")
    err = _error(capsys, "--script", str(broken), *out)
    assert f"not a Python script: {broken}" in err and "line 2" in err
    assert not list(tmp_path.glob("run-*")), "nothing is started for bad input"


def test_options_that_do_not_fit_a_script_run_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = ["--out", str(tmp_path)]
    s = str(SCRIPT)
    assert "--mitigate auto" in _error(capsys, "--script", s, "--mitigate", "auto", *out)
    assert "--tp 2" in _error(capsys, "--script", s, "--tp", "2", *out)
    assert "'--seconds 3'" in _error(capsys, *out, "--", "--seconds", "3")
    err = _error(capsys, "--script", s, "--fault", "compute:rank=1,factor=2,start=20", *out)
    assert "compute:rank=1,factor=2,start=20" in err and "--detect" in err and "20s" in err
    assert "start='20x'" in _error(capsys, "--script", s, "--fault",
                                   "compute:rank=1,factor=2,start=20x", *out)


def test_a_monitor_without_run_dir_writes_to_the_script_runs_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stalwart.detect import Monitor

    monkeypatch.setenv("STALWART_MONITOR_RUN_DIR", str(tmp_path))
    Monitor(rank=0, world=1).close()
    assert (tmp_path / "detect_stats.json").exists()
    monkeypatch.delenv("STALWART_MONITOR_RUN_DIR")
    other = tmp_path / "other"
    other.mkdir()
    Monitor(rank=0, world=1, run_dir=other).close()  # an explicit run_dir wins
    assert (other / "detect_stats.json").exists()
