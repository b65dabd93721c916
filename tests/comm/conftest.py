"""Both engines of the lossy transport run the tests that use ``engine``: modules opt in
with ``pytestmark = pytest.mark.usefixtures("engine")`` (the native one is skipped when the
extension is not built)."""

from __future__ import annotations

import pytest

from stalwart.comm import native


@pytest.fixture(params=["native", "python"])
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native" and not native.AVAILABLE:
        pytest.skip("the native engine is not built")
    # the environment, so that spawned ranks and the testbed's processes use it too
    monkeypatch.setenv("STALWART_ENGINE", request.param)
    return request.param
