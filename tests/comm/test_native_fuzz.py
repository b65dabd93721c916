"""The native engine built with AddressSanitizer and coverage hooks: fuzzed for a bounded time
(malformed, truncated, replayed, wrong-key and well-formed-but-hostile packets, interleaved
with rounds beginning and phases closing), and run on real sockets with burst loss. Any crash,
sanitizer report or broken invariant fails the test. Longer runs by hand: see fuzz_native.py."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.comm import native

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


def _asan_env(so: Path) -> dict[str, str]:
    libs = [subprocess.run(["gcc", f"-print-file-name={n}"], capture_output=True, text=True,
                           check=True).stdout.strip() for n in ("libasan.so", "libstdc++.so")]
    return dict(os.environ, LD_PRELOAD=" ".join(libs), PYTHONMALLOC="malloc",
                ASAN_OPTIONS="detect_leaks=0:abort_on_error=1", STW_FUZZ_SO=str(so),
                PYTHONPATH=str(HERE))


@pytest.fixture(scope="module")
def asan_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not native.AVAILABLE or shutil.which("gcc") is None:
        pytest.skip("needs the native engine and gcc")
    if importlib.util.find_spec("atheris") is None:
        pytest.skip("needs atheris (pip install atheris)")
    out = tmp_path_factory.mktemp("asan")
    subprocess.run([sys.executable, str(HERE / "fuzz_native.py"), "build", str(out)],
                   check=True, capture_output=True)
    return out / "_stwnative.so"


def test_fuzzing_the_receive_path_finds_nothing(asan_build: Path, tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, str(HERE / "fuzz_native.py"), "fuzz",
                        "-max_total_time=20", f"-artifact_prefix={tmp_path}/"],
                       env=_asan_env(asan_build), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Done " in p.stderr and "ERROR: AddressSanitizer" not in p.stderr
    assert not list(tmp_path.glob("crash-*"))


def test_the_sanitized_engine_reduces_exactly_under_burst_loss(asan_build: Path) -> None:
    p = subprocess.run([sys.executable, str(HERE / "fuzz_native.py"), "traffic"],
                       env=_asan_env(asan_build), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "traffic ok" in p.stdout
