"""The layering that tools outside training rely on, checked in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

# a meta-path finder that refuses torch: what an environment without it would do
_NO_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not importable here")
sys.meta_path.insert(0, NoTorch())
"""

PURE = ("stalwart.cli", "stalwart.config", "stalwart.runargs", "stalwart.replay",
        "stalwart.detect.changepoint", "stalwart.detect.cusum", "stalwart.detect.decision",
        "stalwart.detect.localize", "stalwart.detect.period", "stalwart.mitigate.policy",
        "stalwart.mitigate.planner", "stalwart.mitigate.remap", "stalwart.mitigate.decisions")


def test_the_command_line_and_the_decision_code_import_without_torch() -> None:
    code = _NO_TORCH + "".join(f"import {m}\n" for m in PURE) + (
        "from stalwart.cli import build_parser\n"
        "build_parser().parse_args(['run', '--nproc', '2'])\n"
        "assert 'torch' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_guard_refuses_torch() -> None:
    # the check above can fail: the same guard stops a module that does need torch
    code = _NO_TORCH + "import stalwart.detect.monitor\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "torch is not importable here" in r.stderr
