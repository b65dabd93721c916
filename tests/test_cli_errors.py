"""Bad input: one line naming the bad value, exit code 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import FAST, stalwart


def assert_one_line_error(proc, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr + proc.stdout
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr + proc.stdout
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--nproc", "0"], ["--nproc", "0"]),
        (["--steps", "-5"], ["--steps", "-5"]),
        (["--preset", "enormous"], ["enormous"]),
        (["--data", "/nonexistent/corpus.txt"], ["/nonexistent/corpus.txt"]),
        (["--comm", "carrier-pigeon"], ["carrier-pigeon"]),
        (["--testbed", "cloud"], ["cloud"]),
        (["--overlap", "maybe"], ["maybe"]),
        (["--global-batch", "0"], ["--global-batch", "0"]),
        (["--cpu-cap", "half"], ["--cpu-cap", "half"]),
        (["--nproc", "three"], ["three"]),
        (["--nproc", "3", "--tp", "2"], ["--tp 2"]),
        (["--fault", "meteor:rank=1"], ["meteor"]),
        (["--fault", "compute:rank=9,factor=2"], ["rank"]),
        (["--bogus-flag"], ["--bogus-flag"]),
    ],
)
def test_bad_run_options(args: list[str], needles: list[str], tmp_path: Path) -> None:
    assert_one_line_error(stalwart("run", "--out", str(tmp_path), *args, timeout=60), *needles)


def test_unwritable_output_folder(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = blocker / "runs"
    assert_one_line_error(stalwart("run", "--out", str(out), timeout=60), str(out))


def test_resume_without_a_run(tmp_path: Path) -> None:
    assert_one_line_error(
        stalwart("run", "--out", str(tmp_path), "--name", "nothing", "--resume", timeout=60),
        "nothing",
    )


@pytest.mark.parametrize(("suite", "only"), [("mitigate", "nosuch"), ("lossy", "pairlink_tp")])
def test_bench_only_names_a_scenario_that_runs_alone(suite: str, only: str,
                                                      tmp_path: Path) -> None:
    got = stalwart("bench", suite, "--only", only, "--workdir", str(tmp_path), timeout=60)
    assert_one_line_error(got, "--only", only)
    assert not any(tmp_path.iterdir())  # refused before any run folder is made


def test_report_of_missing_dir(tmp_path: Path) -> None:
    assert_one_line_error(stalwart("report", str(tmp_path / "nope"), timeout=60), "nope")


@pytest.mark.slow
def test_corrupt_and_mismatched_checkpoints(tmp_path: Path) -> None:
    base = ["run", "--nproc", "2", "--out", str(tmp_path), "--name", "c", *FAST]
    first = stalwart(*base, "--halt-at", "6")
    assert first.returncode == 0, first.stdout + first.stderr
    mismatched = stalwart(*base, "--resume", "--seed", "7")
    assert_one_line_error(mismatched, "seed")
    ck = tmp_path / "c" / "checkpoints" / "step-000006" / "rank-1.pt"
    ck.write_bytes(b"\x00garbage" * 10)
    assert_one_line_error(stalwart(*base, "--resume"), "corrupt checkpoint", "rank-1.pt")
