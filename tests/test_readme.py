"""The README's library examples run as written: each one under a 2-rank torchrun-style
environment (real processes, real gloo and, for the second, the real UDP transport)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port

README = Path(__file__).parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)




def test_the_readme_has_its_library_examples() -> None:
    assert len(BLOCKS) == 3
    assert "stalwart.detect.Monitor()" in BLOCKS[0] and "stalwart.comm.attach" in BLOCKS[1]
    assert "elastic.Job(" in BLOCKS[2]
    assert "Monitor" not in BLOCKS[1]  # the monitor cannot see the lossy transport's traffic


@pytest.mark.slow
@pytest.mark.parametrize("i", [0, 1, 2], ids=["detect", "lossy", "elastic"])
def test_a_readme_example_runs_as_written(tmp_path: Path, i: int) -> None:
    script = tmp_path / "example.py"
    script.write_text(BLOCKS[i])
    port = str(free_port())
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    if i == 0:
        assert all(out.strip().splitlines()[-1].startswith("[") for out in outs)  # report()
    if i == 2:
        assert all(out.strip().splitlines()[-1] == "2 ranks, generation 0, step 50"
                   for out in outs)
