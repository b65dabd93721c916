"""Which forward error protection ``attach`` builds: the erasure code by default, and what
``STALWART_FEC`` says when the script cannot pass ``fec=`` (the lossy benchmark's unprotected
training runs go through ``stalwart run --comm lossy`` and rely on it: if the variable were
ignored, their "unprotected" figures would silently measure the parity again)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import stalwart.comm.ddp as ddp


class _Built(Exception):
    """Raised by the stand-in collective: attach got as far as building it."""

    def __init__(self, kw: dict[str, Any]) -> None:
        super().__init__("built")
        self.kw = kw


class _Recorder:
    def __init__(self, numel: int, **kw: Any) -> None:
        raise _Built(kw)


def _built_with(monkeypatch: pytest.MonkeyPatch, **attach_kw: Any) -> dict[str, Any]:
    monkeypatch.setattr(ddp, "LossyCollective", _Recorder)  # no socket, no process group
    with pytest.raises(_Built) as e:
        ddp.attach(torch.nn.Linear(4, 4), torch.optim.SGD, lr=0.1, **attach_kw)
    return e.value.kw


def test_default_protection_is_the_erasure_code_for_the_residual_target(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STALWART_FEC", raising=False)
    kw = _built_with(monkeypatch)
    assert kw["fec_mode"] == "rs" and kw["fec_target"] == ddp.AUTO_TARGET


def test_stalwart_fec_none_turns_the_protection_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STALWART_FEC", "none")
    assert _built_with(monkeypatch)["fec_mode"] == "none"
    # an explicit argument wins over the environment
    assert _built_with(monkeypatch, fec="rs")["fec_mode"] == "rs"


def test_an_unknown_stalwart_fec_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STALWART_FEC", "parity")
    monkeypatch.setattr(ddp, "LossyCollective", _Recorder)
    with pytest.raises(ValueError, match="fec must be one of") as e:
        ddp.attach(torch.nn.Linear(4, 4), torch.optim.SGD, lr=0.1)
    assert "\n" not in str(e.value)
