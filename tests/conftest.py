"""Shared test fixtures and the skip rules for root-only tests."""

from __future__ import annotations

import os
import shutil

import pytest


def root_missing() -> str | None:
    """Why root-only tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, nftables, cgroups)"
    for tool in ("ip", "nft", "tc"):
        if shutil.which(tool) is None:
            return f"needs {tool} (apt-get install -y iproute2 nftables)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    why = root_missing()
    if why is None:
        return
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)
