"""Every bench suite reports its progress: scenario i of n, elapsed, an estimate of what is left."""

from __future__ import annotations

import inspect
import re

import pytest

from stalwart.bench import SUITES, Steps


def test_the_line_counts_scenarios_and_estimates_from_those_done() -> None:
    st = Steps("detect", 4, quiet=True)
    first = st.start("clean-0")
    assert first.startswith("[bench detect] 1/4 clean-0: ") and "left" not in first
    st._t0 -= 120.0  # two minutes into the suite, one scenario done
    second = st.start("clean-1")
    assert re.search(r"2/4 clean-1: 2m0\ds elapsed, about 6m0\ds left", second), second


@pytest.mark.parametrize("suite", SUITES)
def test_every_suite_reports_its_scenarios(suite: str) -> None:
    import importlib

    src = inspect.getsource(importlib.import_module(f"stalwart.bench.{suite}"))
    assert "Steps(" in src and ".start(" in src
