"""The scenario runs of ``stalwart bench detect``: which job, which faults, and which figure
each run counts toward.

Families (``Scenario.family``):
- ``clean``  -- no fault (20 runs): the built-in GPT with 10 seeds, each user script twice,
  the variable-step-time script once more, and the GPT, the variable-step-time script and the
  MLP each beside a noisy neighbour (a busy process on the machine, outside the job's
  cgroups).
  Scored as ``false_positives``.
- ``mid``    -- the built-in GPT, one fault applied at step ``START`` (compute 1.3x/2x on every
  rank, slow host link, slow pair, CPU contention, a fault that starts and ends). Scored as
  ``detection_rate`` / ``localization_accuracy`` / ``median_latency_iters``.
- ``born``   -- the built-in GPT with a fault present from step 0 (no ``start=``): compute 2x
  and 1.3x, a slow host link, a slow pair of hosts. ``detection_rate_born``.
- ``script`` -- a user's own DDP script through ``stalwart run --script`` (scripts/mlp.py,
  scripts/cnn_bn.py, scripts/varlen.py: they import nothing from stalwart) with a compute
  fault mid-run (at the monitor's iteration ``SCRIPT_START``) or from the start.
  ``detection_rate_scripts`` counts these and the GPT's compute faults of ``mid`` and
  ``born`` (the built-in GPT is the third user workload of the issue).
- ``lossy``  -- ``--comm lossy`` at 5% packet loss, scored apart as ``lossy_*``.
- ``group``  -- 3 emulated hosts of 2 ranks (``--ranks-per-host 2``), both ranks of one host
  slowed alike (one slow worker): ``group_detection_rate``, the share of those faults found
  and named as the whole host (truth.py: compute faults applied together are one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEPS = 70
START = 30
BATCH = 32  # per-rank micro-batch: ~0.2 s steps with 4 ranks on 2 cores
SCRIPT_SECONDS = 30.0  # a user script trains this long (after ~10-20 s of start-up)
SCRIPT_START = 150  # a mid-run fault in a script starts at this monitor iteration (4-10 s in)
SCRIPTS_DIR = Path(__file__).resolve().parent / "scripts"
SCRIPTS = {"mlp": "mlp.py", "cnn": "cnn_bn.py", "varlen": "varlen.py"}
LOSS = "loss:host=all,p=0.05"


@dataclass(frozen=True)
class Scenario:
    name: str
    faults: tuple[str, ...] = ()
    seed: int = 0
    steps: int = STEPS
    comm: str = "reliable"
    workload: str = "gpt"  # "gpt" (stalwart's own worker) or a key of SCRIPTS
    noisy: int = 0  # busy processes beside the job, outside its cgroups (noisy neighbour)
    nproc: int = 4
    ranks_per_host: int = 1

    @property
    def stragglers(self) -> int:
        """Faults the detector must find (packet loss is the lossy scenarios' weather)."""
        return sum(1 for f in self.faults if not f.startswith("loss:"))

    @property
    def born(self) -> bool:
        """Every straggler fault is there from the first step (no ``start=``)."""
        return self.stragglers > 0 and all(
            "start=" not in f for f in self.faults if not f.startswith("loss:"))

    @property
    def family(self) -> str:
        if self.comm == "lossy":
            return "lossy"
        if not self.stragglers:
            return "clean"
        if self.ranks_per_host > 1:
            return "group"
        if self.workload != "gpt":
            return "script"
        return "born" if self.born else "mid"

    @property
    def in_scripts(self) -> bool:
        """Counted by ``detection_rate_scripts``: a user script's fault, or a compute fault
        (no contention) on the built-in GPT, mid-run or from the start."""
        if self.family == "script":
            return True
        return self.family in ("mid", "born") and all(
            f.startswith("compute:") for f in self.faults)

    @property
    def severe(self) -> bool:
        """A 2x compute fault: the issue wants every one of these found in the scripts."""
        return any(f.startswith("compute:") and "factor=2," in f + "," for f in self.faults)


def _mid(quick: bool) -> list[Scenario]:
    s = START
    if quick:
        return [
            Scenario("compute-r3-x2", (f"compute:rank=3,factor=2,start={s}",)),
            Scenario("link-h1", (f"link:host=1,rate=30mbit,start={s}",)),
            Scenario("compute-r1-x2-transient", (f"compute:rank=1,factor=2,start={s},end=50",),
                     steps=75),
        ]
    out = [Scenario(f"compute-r{r}-x{f}", (f"compute:rank={r},factor={f},start={s}",), seed=r)
           for f in (1.3, 2) for r in range(4)]
    return out + [
        Scenario("link-h1", (f"link:host=1,rate=30mbit,start={s}",)),
        Scenario("link-h2", (f"link:host=2,rate=30mbit,start={s}",), seed=1),
        Scenario("pairlink-1-2", (f"pairlink:hosts=1-2,rate=20mbit,start={s}",)),
        Scenario("pairlink-0-3", (f"pairlink:hosts=0-3,rate=20mbit,start={s}",), seed=1),
        Scenario("contention-r2-p2", (f"contention:rank=2,procs=2,start={s}",)),
        Scenario("contention-r0-p1", (f"contention:rank=0,procs=1,start={s}",), seed=1),
        Scenario("compute-r1-x2-transient", (f"compute:rank=1,factor=2,start={s},end=50",),
                 steps=75),
    ]


def _born(quick: bool) -> list[Scenario]:
    if quick:
        return [Scenario("born-compute-r2-x2", ("compute:rank=2,factor=2",))]
    return [
        Scenario("born-compute-r2-x2", ("compute:rank=2,factor=2",)),
        Scenario("born-compute-r0-x2", ("compute:rank=0,factor=2",), seed=1),
        Scenario("born-compute-r1-x1.3", ("compute:rank=1,factor=1.3",)),
        Scenario("born-compute-r3-x1.3", ("compute:rank=3,factor=1.3",), seed=1),
        Scenario("born-link-h1", ("link:host=1,rate=30mbit",)),
        Scenario("born-link-h3", ("link:host=3,rate=30mbit",), seed=1),
        Scenario("born-pairlink-1-2", ("pairlink:hosts=1-2,rate=20mbit",)),
        Scenario("born-pairlink-0-3", ("pairlink:hosts=0-3,rate=20mbit",), seed=1),
    ]


def _scripts(quick: bool) -> list[Scenario]:
    k = SCRIPT_START
    if quick:
        return [Scenario("mlp-born-r2-x2", ("compute:rank=2,factor=2",), workload="mlp")]
    out: list[Scenario] = []
    for i, w in enumerate(SCRIPTS):
        out += [
            Scenario(f"{w}-born-r{(i + 1) % 4}-x2", (f"compute:rank={(i + 1) % 4},factor=2",),
                     workload=w),
            Scenario(f"{w}-mid-r{(i + 2) % 4}-x2",
                     (f"compute:rank={(i + 2) % 4},factor=2,start={k}",), workload=w),
            Scenario(f"{w}-born-r{(i + 3) % 4}-x1.3",
                     (f"compute:rank={(i + 3) % 4},factor=1.3",), workload=w),
        ]
    return out


def _clean(quick: bool) -> list[Scenario]:
    if quick:
        return [Scenario("clean-0"), Scenario("varlen-clean-0", workload="varlen")]
    # silence on 20 clean runs: 10 of the GPT, each user script twice, the variable-step-time
    # script a third time, three runs beside a noisy neighbour (GPT, variable-step-time, MLP)
    out = [Scenario(f"clean-{i}", seed=i) for i in range(10)]
    out += [Scenario(f"{w}-clean-{i}", seed=i, workload=w) for w in SCRIPTS for i in range(2)]
    out += [Scenario("varlen-clean-2", seed=2, workload="varlen"),
            Scenario("clean-noisy-neighbour", noisy=1),
            Scenario("varlen-clean-noisy-neighbour", noisy=1, workload="varlen"),
            Scenario("mlp-clean-noisy-neighbour", noisy=1, workload="mlp")]
    return out


def _lossy(quick: bool) -> list[Scenario]:
    s = START
    if quick:
        return [Scenario("lossy-compute-r2-x2", (LOSS, f"compute:rank=2,factor=2,start={s}"),
                         comm="lossy")]
    return [
        Scenario("lossy-clean-0", (LOSS,), comm="lossy"),
        Scenario("lossy-clean-1", (LOSS,), seed=1, comm="lossy"),
        Scenario("lossy-compute-r2-x2", (LOSS, f"compute:rank=2,factor=2,start={s}"),
                 comm="lossy"),
        Scenario("lossy-compute-r0-x2", (LOSS, f"compute:rank=0,factor=2,start={s}"), seed=1,
                 comm="lossy"),
        Scenario("lossy-link-h1", (LOSS, f"link:host=1,rate=30mbit,start={s}"), comm="lossy"),
    ]


def _group(host: int, factor: float, start: int | None, seed: int = 0) -> Scenario:
    window = "" if start is None else f",start={start}"
    return Scenario(f"group-h{host}-x{factor:g}" + ("-born" if start is None else ""),
                    tuple(f"compute:rank={r},factor={factor:g}{window}"
                          for r in (2 * host, 2 * host + 1)),
                    seed=seed, nproc=6, ranks_per_host=2)


def _groups(quick: bool) -> list[Scenario]:
    if quick:
        return [_group(1, 2, START)]
    return [_group(1, 2, START), _group(2, 3, START, seed=1), _group(0, 2, START, seed=2),
            _group(1, 2, None, seed=3)]


def scenarios(quick: bool) -> list[Scenario]:
    """Every run of one invocation, clean runs first (``--quick``: 10 runs, ~8 min here)."""
    return (_clean(quick) + _mid(quick) + _born(quick) + _scripts(quick) + _lossy(quick)
            + _groups(quick))


def run_config(sc: Scenario, workdir: Path, tag: str) -> Any:
    """The RunConfig of one scenario run: the GPT as the bench always ran it, or a user script
    run as ``stalwart run --script PATH --testbed netns --nproc 4 --detect -- --seconds S``."""
    from stalwart.config import RunConfig

    common: dict[str, Any] = dict(nproc=sc.nproc, ranks_per_host=sc.ranks_per_host,
                                  testbed="netns", faults=list(sc.faults),
                                  seed=sc.seed, out=str(workdir), name=f"{tag}-{sc.name}")
    if sc.workload == "gpt":
        return RunConfig(steps=sc.steps, batch_size=BATCH, comm=sc.comm, **common)
    return RunConfig(script=str(SCRIPTS_DIR / SCRIPTS[sc.workload]), detect=True,
                     script_args=["--seconds", f"{SCRIPT_SECONDS:g}"], **common)
