"""The seven frozen sections of a run's configuration, each field with its documentation.

``job`` (which ranks run, where they write), ``train`` (the built-in workload), ``detect``
(the straggler monitor), ``policy`` (mitigation), ``comm`` (the data-parallel collective),
``overlap`` (tensor-parallel overlap), ``testbed`` (the emulated hosts and their faults).
``FLAT`` names each field among the flat options (the command line's, config.json's keys);
``field_docs`` lists every field with its default and documentation (docs/config.md).
Values only: checking them is ``stalwart.config.resolve``'s job. Torch-free, imports nothing
of stalwart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["FLAT", "NESTED", "SECTIONS", "TUPLES", "CommConfig", "DetectConfig", "JobConfig",
           "OverlapConfig", "PolicyConfig", "TestbedConfig", "TrainConfig", "field_docs", "knob"]

def knob(default: Any, doc: str, *, flat: str | None = None, factory: Any = None) -> Any:
    """A section field with its documentation; ``flat``: its name among the flat options and
    config.json's top-level keys when that differs from the field's (the section's own name
    is taken by the section)."""
    meta = {"doc": doc, **({"flat": flat} if flat else {})}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class JobConfig:
    """Which ranks run what, on which devices, and where they write."""

    nproc: int = knob(4, "ranks at launch (under torchrun: the world size)")
    out: str = knob("runs", "folder that holds run directories")
    name: str | None = knob(None, "run directory name under ``out`` (the launcher picks "
                                  "run-DATE-TIME when none is given)")
    resume: bool = knob(False, "continue the run ``name`` from its latest checkpoint")
    hosts: tuple[int, ...] | None = knob(
        None, "host slot of each rank; None: rank r on host r. Set by the launcher when it "
              "restarts a job without a host (S4), so that faults follow hosts")
    script: str | None = knob(None, "a user's own torchrun script run as the ranks instead "
                                    "of stalwart's workload (``--script PATH -- ARGS``)")
    script_args: tuple[str, ...] = knob(None, "the script's arguments (after ``--``)",
                                        factory=tuple)
    threads: int = knob(1, "torch threads per rank (ranks share the machine's cores)")
    device: str = knob("auto", "auto | cpu | cuda: where each rank computes and which "
                               "backend it uses (devices.py)")


@dataclass(frozen=True)
class TrainConfig:
    """The built-in GPT workload: model, data, batch, optimizer, evaluation, checkpoints.
    None means "the preset's value" until ``resolve`` fills it."""

    tp: int = knob(1, "tensor-parallel size (data-parallel size: nproc / tp)")
    steps: int = knob(200, "optimizer steps")
    seed: int = knob(0, "seed of the model's initialisation and of the data order")
    preset: str = knob("tiny", "model size (presets.py)")
    data: str | None = knob(None, "text file or folder (None: this Python's standard "
                                  "library)")
    max_data_bytes: int = knob(16 * 1024 * 1024, "bytes of the corpus read at most")
    batch_size: int | None = knob(None, "samples per rank and micro-batch at launch")
    lr: float | None = knob(None, "peak learning rate")
    micro_batches: int = knob(1, "gradient-accumulation micro-batches per step and rank")
    global_batch: int | None = knob(
        None, "samples per step over all ranks, fixed for the whole run: a restart at "
              "another world size keeps it and changes how many micro-batches each rank "
              "computes (resolved: batch_size x micro-batches x data-parallel ranks)")
    micro_batch_size: int | None = knob(
        None, "samples per micro-batch, the unit mitigation moves between ranks (resolved: "
              "batch_size, or the largest split into <= 4 with mitigation on)")
    warmup: int = knob(20, "learning-rate warm-up steps")
    grad_clip: float = knob(1.0, "gradient-norm clip")
    weight_decay: float = knob(0.1, "AdamW weight decay")
    eval_every: int = knob(50, "steps between validation passes")
    eval_batches: int = knob(8, "batches per validation pass")
    ckpt_every: int = knob(100, "steps between checkpoints")
    halt_at: int | None = knob(None, "stop after this step as if preempted (to exercise "
                                     "--resume)")


@dataclass(frozen=True)
class DetectConfig:
    """The straggler monitor in a run (``stalwart.detect.Monitor``'s arguments; the
    thresholds behind them: docs/calibration.md). config.json: the ``detection`` object."""

    enabled: bool | None = knob(None, "run the monitor inside each rank (resolved: on for "
                                      "stalwart's workload, off for a --script run)",
                                flat="detect")
    warmup: int = knob(10, "samples the change detectors ignore at the start")
    persist: int = knob(20, "samples an unexplained slowdown must last to be logged")
    history: int = knob(1000, "samples kept per rank")
    max_every: int = knob(1, "at most this many steps per exchange (reliable comm)")
    lossy_check_every: int = knob(
        8, "--comm lossy: steps per exchange (the monitor's TCP rows stall on "
           "retransmission timeouts under loss; training does not)")
    lossy_lag: int = knob(2, "--comm lossy: rows are read this many exchanges later")
    compute_reps: int = knob(64, "matmuls per round of the compute test")
    link_bytes: int = knob(1 << 18, "bytes per transfer of the link test")

    def problems(self) -> list[str]:
        return [f"detection.{k} must be >= 1, got {v}" for k, v in (
            ("warmup", self.warmup + 1), ("persist", self.persist), ("history", self.history),
            ("max_every", self.max_every), ("lossy_check_every", self.lossy_check_every),
            ("lossy_lag", self.lossy_lag), ("compute_reps", self.compute_reps),
            ("link_bytes", self.link_bytes)) if v < 1]


@dataclass(frozen=True)
class PolicyConfig:
    """Mitigation (``stalwart.mitigate.policy.Policy``). config.json: the ``policy`` object,
    and ``mitigate`` at the top level."""

    mode: str = knob("off", "off | auto | rebalance: act on stragglers", flat="mitigate")
    every: int = knob(2, "steps per exchange of the agreement channel")
    min_gain: float = knob(0.05, "a first plan must be predicted this much faster")
    replan_gain: float = knob(0.25, "a plan in force is replaced only for this much more")
    revert_windows: int = knob(2, "healthy exchanges in a row before a revert")

    def problems(self) -> list[str]:
        out = [f"policy.{k} must be >= 1, got {v}" for k, v in (
            ("every", self.every), ("revert_windows", self.revert_windows)) if v < 1]
        out += [f"policy.{k} must be in [0, 1), got {v}" for k, v in (
            ("min_gain", self.min_gain), ("replan_gain", self.replan_gain))
            if not 0.0 <= v < 1.0]
        return out


@dataclass(frozen=True)
class CommConfig:
    """The data-parallel collective. Its data-plane knobs (engine, datagram offload, numpy
    coding) are environment overrides only (stalwart.envknobs)."""

    mode: str = knob("reliable", "reliable (torch.distributed) | lossy (stalwart's UDP "
                                 "collective, which tolerates loss)", flat="comm")
    fec: str | None = knob(None, "--comm lossy: the loss protection, rs (Reed-Solomon "
                                 "parity) | copies | none; None: STALWART_FEC when the launch "
                                 "started, else rs (comm/ddp.py ``attach``)")


@dataclass(frozen=True)
class OverlapConfig:
    """Tensor-parallel communication overlap."""

    mode: str = knob("off", "off | si: overlap the tensor-parallel collectives with compute "
                            "(needs tp >= 2)", flat="overlap")


@dataclass(frozen=True)
class TestbedConfig:
    """The emulated hosts the ranks run on, and the faults scheduled on them."""

    kind: str = knob("local", "local (this machine) | netns (one network namespace per "
                              "host, with its own link)", flat="testbed")
    faults: tuple[str, ...] = knob(None, "``--fault`` specs (faultspec.py)", factory=tuple)
    mtu: int = knob(1500, "link MTU of the emulated hosts")
    ranks_per_host: int = knob(1, "ranks on one emulated host (netns): slot s runs on host "
                                  "s // this, so a host's link faults slow all its ranks")
    cpu_cap: str = knob("auto", "fair: cap each host at its share of the cores, min(1, "
                                "cores / hosts), so that a compute fault of factor F gives "
                                "about F; auto: cap when CPU faults are scheduled; off: never")


SECTIONS: dict[str, type] = {"job": JobConfig, "train": TrainConfig, "detect": DetectConfig,
                             "policy": PolicyConfig, "comm": CommConfig,
                             "overlap": OverlapConfig, "testbed": TestbedConfig}
# config.json's nested objects: key -> section (its fields without a flat name live there)
NESTED = {"detection": "detect", "policy": "policy"}
_SECTION_OF_NESTED = {v: k for k, v in NESTED.items()}
TUPLES = {"hosts", "script_args", "faults"}


def _flat_names() -> dict[str, tuple[str, str]]:
    """flat option name -> (section, field): every field of a flat section under its own
    name, and each field with a ``flat`` name (the nested sections' top-level keys)."""
    out: dict[str, tuple[str, str]] = {}
    for sec, kind in SECTIONS.items():
        for f in fields(kind):
            name = f.metadata.get("flat") or (None if sec in _SECTION_OF_NESTED else f.name)
            if name is not None:
                out[name] = (sec, f.name)
    return out


FLAT: dict[str, tuple[str, str]] = _flat_names()


def field_docs() -> list[tuple[str, str, str, Any, str]]:
    """(section, field, flat option or '', default, doc) of every field, in order: the
    source of docs/config.md's tables."""
    flat_of = {v: k for k, v in FLAT.items()}
    out = []
    for sec, kind in SECTIONS.items():
        for f in fields(kind):
            default = f.default if f.default is not dataclasses.MISSING \
                else f.default_factory()  # type: ignore[misc]
            out.append((sec, f.name, flat_of.get((sec, f.name), ""), default, f.metadata["doc"]))
    return out




def markdown() -> str:
    """docs/config.md's generated tables: one per section, then the environment's knobs."""
    from stalwart import envknobs

    def cell(text: str) -> str:
        return " ".join(text.split()).replace("|", "\\|")

    out: list[str] = []
    for sec, kind in SECTIONS.items():
        nested = _SECTION_OF_NESTED.get(sec)
        out += [f"### `{sec}`", "", cell((kind.__doc__ or "").split(chr(10) * 2)[0]), "",
                "| field | config.json key | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{name}` | `{flat or f'{nested}.{name}'}` | `{default!r}` | {cell(doc)} |"
                for s, name, flat, default, doc in field_docs() if s == sec]
        out.append("")
    out += ["### Environment variables (stalwart/envknobs.py)", "",
            "| variable | kind | default | meaning |", "|---|---|---|---|"]
    out += [f"| `{k.name}` | {k.kind} | {f'`{k.default}`' if k.default else ''} | "
            f"{cell(k.doc)} |" for k in envknobs.KNOBS.values()]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
