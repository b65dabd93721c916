"""The run configuration: nested settings round-trip through config.json, bad ones are one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from stalwart.config import ConfigError, DetectConfig, PolicyConfig, RunConfig


def test_nested_settings_round_trip_through_config_json(tmp_path: Path) -> None:
    cfg = RunConfig(nproc=2, detection=DetectConfig(persist=30, lossy_lag=3),
                    policy=PolicyConfig(revert_windows=3)).validate()
    cfg.save(tmp_path / "config.json")
    back = RunConfig.load(tmp_path / "config.json")
    assert back == cfg and back.detection.persist == 30 and back.policy.revert_windows == 3
    # a config.json from before the nested settings loads with their defaults
    assert RunConfig.from_dict({"nproc": 2}).detection == DetectConfig()


def test_settings_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        DetectConfig().persist = 3  # type: ignore[misc]


@pytest.mark.parametrize(("cfg", "needle"), [
    (RunConfig(detection=DetectConfig(persist=0)), "detection.persist must be >= 1, got 0"),
    (RunConfig(policy=PolicyConfig(min_gain=1.5)), "policy.min_gain must be in [0, 1)"),
])
def test_a_bad_setting_is_one_line_naming_it(cfg: RunConfig, needle: str) -> None:
    with pytest.raises(ConfigError, match=r"^[^\n]+$") as e:
        cfg.validate()
    assert needle in str(e.value)


def test_an_unknown_nested_key_is_named() -> None:
    with pytest.raises(ConfigError, match="detection.bogus"):
        RunConfig.from_dict({"detection": {"bogus": 1}})
