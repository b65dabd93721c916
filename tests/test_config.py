"""The run configuration: frozen sections, resolved once, round-trips through config.json;
bad values are one line; every STALWART_* variable is listed in one module."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from stalwart import envknobs
from stalwart.config import (
    FLAT,
    SECTIONS,
    CommConfig,
    ConfigError,
    DetectConfig,
    PolicyConfig,
    RunConfig,
    field_docs,
    resolve,
)


def test_nested_settings_round_trip_through_config_json(tmp_path: Path) -> None:
    cfg = resolve(RunConfig(nproc=2, detect=DetectConfig(persist=30, lossy_lag=3),
                            policy=PolicyConfig(revert_windows=3)))
    cfg.save(tmp_path / "config.json")
    back = RunConfig.load(tmp_path / "config.json")
    assert back == cfg and back.detect.persist == 30 and back.policy.revert_windows == 3
    # a config.json from before the nested settings loads with their defaults
    assert RunConfig.from_dict({"nproc": 2}).detect == DetectConfig()


def test_settings_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        DetectConfig().persist = 3  # type: ignore[misc]


@pytest.mark.parametrize(("cfg", "needle"), [
    (RunConfig(detect=DetectConfig(persist=0)), "detection.persist must be >= 1, got 0"),
    (RunConfig(policy=PolicyConfig(min_gain=1.5)), "policy.min_gain must be in [0, 1)"),
])
def test_a_bad_setting_is_one_line_naming_it(cfg: RunConfig, needle: str) -> None:
    with pytest.raises(ConfigError, match=r"^[^\n]+$") as e:
        resolve(cfg)
    assert needle in str(e.value)


def test_an_unknown_nested_key_is_named() -> None:
    with pytest.raises(ConfigError, match="detection.bogus"):
        RunConfig.from_dict({"detection": {"bogus": 1}})


def test_flat_options_land_in_their_sections_and_read_back_flat() -> None:
    cfg = RunConfig(nproc=2, tp=2, comm="reliable", testbed="netns", overlap="si",
                    mitigate="auto", detect=False, faults=["loss:host=0,p=0.1"])
    assert (cfg.job.nproc, cfg.train.tp, cfg.testbed.kind, cfg.overlap.mode) == \
        (2, 2, "netns", "si")
    assert cfg.policy.mode == "auto" and cfg.detect.enabled is False
    assert cfg.tp == 2 and cfg.mitigate == "auto" and cfg.faults == ("loss:host=0,p=0.1",)
    with pytest.raises(TypeError, match="bogus"):
        RunConfig(bogus=1)


def test_the_configuration_is_frozen() -> None:
    cfg = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.job = cfg.job  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cfg.nproc = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.tp = 2  # type: ignore[misc]
    # a change is a new value: the launcher's restart on other hosts
    moved = replace(cfg, job=replace(cfg.job, nproc=3, hosts=(0, 2, 3)))
    assert moved.slots() == 4 and cfg.nproc == 4


def test_resolve_fills_the_defaults_once_and_is_idempotent() -> None:
    raw = RunConfig(nproc=4, mitigate="auto")
    cfg = resolve(raw)
    t = cfg.train
    assert (t.batch_size, t.lr, t.micro_batch_size, t.global_batch) == (8, 3e-3, 2, 32)
    assert cfg.detect.enabled is True and raw.train.batch_size is None  # raw unchanged
    assert resolve(cfg) == cfg
    assert resolve(RunConfig(script=__file__)).detect.enabled is False  # a script: asked for


def test_every_field_is_documented_and_every_flat_option_named_once() -> None:
    docs = field_docs()
    assert len(docs) == sum(len(dataclasses.fields(k)) for k in SECTIONS.values())
    assert all(doc.strip() for *_, doc in docs)
    assert len(FLAT) == len(set(FLAT.values()))


def test_old_run_directories_load_and_keep_their_values() -> None:
    corpus = sorted(Path(__file__).parent.glob("replay/corpus/**/config.json"))
    assert corpus
    for path in corpus:
        raw = json.loads(path.read_text())
        flat = RunConfig.load(path).to_dict()
        for key, value in raw.items():
            if isinstance(value, dict):
                assert {k: flat[key][k] for k in value} == value, (path, key)
            else:
                assert flat[key] == value, (path, key)


SRC = Path(__file__).parent.parent / "src" / "stalwart"


def test_every_stalwart_environment_variable_is_listed_in_envknobs() -> None:
    used = set()
    for path in SRC.rglob("*"):
        if path.suffix in (".py", ".c"):
            used |= set(re.findall(r"STALWART_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    used -= {"STALWART_BOCPD_STEP_H"}  # a C header guard
    assert used <= set(envknobs.KNOBS), sorted(used - set(envknobs.KNOBS))


# still set through os.environ outside envknobs, for the ranks a benchmark launches
_SETS_FOR_ITS_RANKS = {"bench/lossy.py"}


def test_overrides_are_read_only_in_envknobs() -> None:
    overrides = [k for k, v in envknobs.KNOBS.items() if v.kind == "override"]
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel == "envknobs.py" or rel in _SETS_FOR_ITS_RANKS:
            continue
        text = path.read_text()
        for name in overrides:
            assert not re.search(rf"environ(\.get)?\(?\[?[\"']{name}[\"']", text), (path, name)


def test_docs_config_md_holds_the_generated_tables() -> None:
    from stalwart.sections import markdown

    text = (SRC.parent.parent / "docs" / "config.md").read_text()
    start = text.index("-->\n", text.index("<!-- generated")) + len("-->\n")
    end = text.index("<!-- end generated -->")
    assert text[start:end] == markdown(), "run: python -m stalwart.sections"


def test_the_launchers_restart_changes_membership_only(tmp_path: Path) -> None:
    from stalwart.launch import _restart_config
    from stalwart.rundir import EventLog
    from stalwart.supervise import Relaunch

    cfg = resolve(RunConfig(nproc=4, mitigate="auto", out=str(tmp_path), name="r"))
    events = EventLog(tmp_path)
    new, step = _restart_config(cfg, tmp_path, events, lambda _: None,
                                Relaunch(hosts=(0, 1, 3), step=6, strategy="S4", reason="x"))
    assert (new.job.nproc, new.job.hosts, new.job.resume, step) == (3, (0, 1, 3), True, 6)
    assert new.train == cfg.train and cfg.job.nproc == 4  # same global batch; cfg unchanged
    assert RunConfig.load(tmp_path / "config.json") == new
    back, _ = _restart_config(new, tmp_path, events, lambda _: None,
                              Relaunch(hosts=(0, 1, 2, 3), step=9, strategy="S4", reason="y"))
    events.close()
    assert back.job.hosts is None and back.job.nproc == 4  # all hosts again: rank r on host r


def test_the_environments_fec_enters_the_configuration_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from stalwart.comm.collective import FEC_MODES as COMM_FEC_MODES
    from stalwart.config import FEC_MODES, with_environment

    assert FEC_MODES == COMM_FEC_MODES
    monkeypatch.setenv("STALWART_FEC", "copies")
    assert resolve(with_environment(RunConfig(comm="lossy"))).comm.fec == "copies"
    assert with_environment(RunConfig(comm=CommConfig(mode="lossy", fec="none"))).comm.fec \
        == "none"  # given wins
    monkeypatch.setenv("STALWART_FEC", "parity")
    with pytest.raises(ConfigError, match=r"^unknown fec 'parity' \(choose from"):
        resolve(with_environment(RunConfig(comm="lossy")))
