"""Every benchmark invocation gets a clean work folder of its own."""

from __future__ import annotations

from pathlib import Path

from stalwart.bench import fresh_workdir


def test_each_invocation_gets_a_new_empty_folder(tmp_path: Path) -> None:
    a = fresh_workdir(tmp_path, "lossy")
    (a / "runs" / "reliable-loss0").mkdir(parents=True)  # what a first run leaves behind
    b = fresh_workdir(tmp_path, "lossy")
    assert a != b and b.parent == tmp_path and list(b.iterdir()) == []
    assert fresh_workdir(tmp_path, "detect").name.startswith("detect-")
