"""What the machine lacks is reported as one line naming it and how to install it (exit 2)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.config import ConfigError, RunConfig
from stalwart.testbed import open_testbed

SRC = Path(__file__).resolve().parents[2] / "src"


def test_netns_without_ip_is_a_one_line_error(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine where no tool is installed
    cfg = RunConfig(nproc=2, testbed="netns", faults=["loss:host=0,p=0.1"]).validate()
    with pytest.raises(ConfigError) as e:
        open_testbed(cfg, None)
    msg = str(e.value)
    assert "\n" not in msg
    assert "needs root" in msg or ("ip not found" in msg and "apt-get install -y iproute2" in msg)


@pytest.mark.root
def test_missing_nft_stops_the_run_with_exit_2(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("ip", "tc"):  # iproute2 present, nftables absent
        os.symlink(shutil.which(tool) or "", bin_dir / tool)
    env = {**os.environ, "PATH": str(bin_dir),
           "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "stalwart.cli", "run", "--testbed", "netns",
                        "--nproc", "2", "--steps", "2", "--fault", "loss:host=all,p=0.1",
                        "--out", str(tmp_path), "--name", "n", "--no-progress"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "nft not found" in lines[0] and "apt-get install -y nftables" \
        in lines[0], lines
    assert "Traceback" not in r.stderr
