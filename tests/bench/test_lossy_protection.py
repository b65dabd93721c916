"""``stalwart bench lossy`` times its all-reduce with the protection training uses.

Issue 16: the all-reduce used to be timed with ``copies=1`` (no protection), so at 5% loss
about 5% of the chunks were missing from the result it compared with gloo's exact
all-reduce. The figure is only comparable if the benchmark's ranks build their collective the
way ``attach`` does by default. No testbed needed: the hosts and the rank launcher are
replaced by stand-ins that record what the ranks would be given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import stalwart.bench.lossy as lossy
import stalwart.bench.lossy_net as lossy_net
import stalwart.testbed as testbed
from stalwart.comm.ddp import AUTO_TARGET


class _Launched(Exception):
    def __init__(self, module: str, argv: list[str]) -> None:
        super().__init__(module)
        self.module, self.argv = module, argv


class _Hosts:
    def __init__(self, n: int, mtu: int = 1500) -> None:
        self.n = n

    def __enter__(self) -> _Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def ns(self, i: int) -> str:
        return f"ns{i}"


def _stop(_hosts: Any, module: str, argv: list[str], *_a: Any, **_k: Any) -> None:
    raise _Launched(module, argv)


def test_the_benchmarked_allreduce_uses_attachs_default_protection(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(testbed, "Hosts", _Hosts)
    monkeypatch.setattr(lossy_net, "run_on_hosts", _stop)
    with pytest.raises(_Launched) as e:
        lossy.bench_allreduce(9000, {0.0: 2, 0.05: 2}, tmp_path, gloo_levels=[0.0, 0.05])
    assert e.value.module == "stalwart.bench.lossy_worker"
    kind, args = e.value.argv[0], json.loads(e.value.argv[1])
    assert kind == "allreduce"
    # what attach builds when the user changes nothing (tests/comm/test_attach_protection.py)
    assert args["fec"] == "rs" and args["fec_target"] == AUTO_TARGET
