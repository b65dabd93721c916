"""Per-rank compute noise measured in recorded runs, resampled by the simulator.

Mechanism: from each healthy recorded run (``metrics.jsonl``: every rank's ``compute_time``
per step) two empirical pools of log residuals, after the first ``SKIP`` steps (warm-up):
- ``rank``: log(rank's compute / the median rank's compute at that step) -- how far one rank
  strays from its peers in one step (what the detector's per-rank channels see);
- ``job``: log(the step's median compute / the run's median) -- what moves every rank at
  once (what the iteration channel sees).
The simulator draws a rank's multiplier for a step as exp(scale x a sample of ``rank``) and
the step's as exp(scale x a sample of ``job``), independently (bootstrap: the pools keep
the measured tails -- the spikes a detector must not call stragglers -- without fitting a
distribution to them). Cost: two ``rng.choice`` calls per step, O(N).

``DEFAULT`` (``data/noise.json``) was measured on this project's testbed: 4 and 8 CPU ranks on
2 shared cores, so its spread (~10-20% per rank and step) is far above a GPU's (Meta's PRISM
reports ~9% GPU-time variability at 64k GPUs); ``scale`` shrinks or widens it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stalwart.rundir import RunData

SKIP = 10
DEFAULT = Path(__file__).with_name("data") / "noise.json"


def robust_sd(x: np.ndarray) -> float:
    """1.4826 x the median absolute deviation (the standard deviation of a normal); 0 empty."""
    return float(1.4826 * np.median(np.abs(x - np.median(x)))) if x.size else 0.0


@dataclass
class Noise:
    rank: np.ndarray  # log residuals of one rank against the step's median
    job: np.ndarray  # log residuals of the step's median against the run's
    scale: float = 1.0
    source: str = ""

    def ranks(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.scale == 0.0 or self.rank.size == 0:
            return np.ones(n)
        return np.exp(self.scale * rng.choice(self.rank, n))

    def step(self, rng: np.random.Generator) -> float:
        if self.scale == 0.0 or self.job.size == 0:
            return 1.0
        return float(np.exp(self.scale * self.job[rng.integers(self.job.size)]))

    def sigma(self) -> tuple[float, float]:
        """Robust spread (1.4826 MAD) of the two pools after scaling."""
        return self.scale * robust_sd(self.rank), self.scale * robust_sd(self.job)

    @classmethod
    def load(cls, path: Path = DEFAULT, scale: float = 1.0) -> Noise:
        d = json.loads(Path(path).read_text())
        return cls(np.asarray(d["rank"], float), np.asarray(d["job"], float), scale,
                   d.get("source", str(path)))


def measure(run_dirs: list[Path], until: dict[str, int] | None = None) -> dict[str, object]:
    """The two pools from recorded runs; ``until``: per run name, the first step not to use
    (a fault's start), else every step after ``SKIP``."""
    rank_pool: list[float] = []
    job_pool: list[float] = []
    for d in run_dirs:
        run = RunData.load(d)
        table = run.step_table("compute_time")  # step -> rank -> seconds
        stop = (until or {}).get(Path(d).name)
        meds = []
        for step in sorted(table):
            row = table[step]
            if step < SKIP or (stop is not None and step >= stop) or len(row) < 2:
                continue
            v = np.asarray([x for x in row.values() if x and x > 0])
            if v.size < 2:
                continue
            med = float(np.median(v))
            rank_pool.extend(np.log(v / med).tolist())
            meds.append(med)
        if meds:
            m = np.asarray(meds)
            job_pool.extend(np.log(m / np.median(m)).tolist())
    return {"rank": [round(x, 5) for x in rank_pool], "job": [round(x, 5) for x in job_pool],
            "source": ", ".join(Path(d).name for d in run_dirs)}
