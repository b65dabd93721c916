"""The native engine is built where it must be (CI), and without it the transport says so in
one line and runs the Python engine; a bad engine name is one line naming it."""

from __future__ import annotations

import os

import pytest

from stalwart.comm import native


def test_the_native_engine_is_built_where_required() -> None:
    if os.environ.get("STALWART_REQUIRE_NATIVE") != "1":
        pytest.skip("STALWART_REQUIRE_NATIVE=1 is set by CI (.ci/run)")
    assert native.AVAILABLE, native._WHY
    assert native.engine_name() == "native"


def test_without_the_extension_the_python_engine_runs_with_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("STALWART_ENGINE", raising=False)
    monkeypatch.setattr(native, "AVAILABLE", False)
    monkeypatch.setattr(native, "_warned", False)
    assert native.engine_name() == "python"
    assert native.engine_name() == "python"  # said once
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "using the Python engine" in err
    with pytest.raises(ValueError, match="not built"):
        native.engine_name("native")


def test_an_unknown_engine_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STALWART_ENGINE", "fpga")
    with pytest.raises(ValueError, match="'fpga'") as e:
        native.engine_name()
    assert "\n" not in str(e.value)
