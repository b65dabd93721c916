"""Elastic membership for data-parallel training on any launcher (torchrun, ``stalwart run``):
a typed protocol kept in a c10d store (``protocol.py`` decides, ``store.py`` keeps it,
``rank.py`` is a process's side) and the user API ``Job`` (``job.py``); docs/elastic.md.
The built-in trainer's link with ``stalwart run`` (membership generations, a rejoining rank's
ready signal, the take-back request, exit records) is kept in the same store process:
``runlink.py`` is the launcher's side, ``ranklink.py`` the rank's.

``Job`` is imported on first use, so that the torch-free ``protocol`` loads without torch."""

from __future__ import annotations

from typing import Any

from stalwart.elastic.errors import ElasticError, Refused, StoreLost, UsageError

__all__ = ["ElasticError", "Job", "Refused", "StoreLost", "UsageError"]


def __getattr__(name: str) -> Any:
    if name == "Job":
        from stalwart.elastic.job import Job

        return Job
    raise AttributeError(f"module 'stalwart.elastic' has no attribute {name!r}")
