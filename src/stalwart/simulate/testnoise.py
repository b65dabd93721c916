"""The validation tests' noise as the testbed measured it, resampled by the simulator.

Mechanism: from recorded run directories (``validation.jsonl``: every rank's raw compute-test
rounds and link round trips at each validation pause; ``config.json``: the faults injected)
three empirical pools of log residuals:
- ``compute``: a healthy rank's compute-test round over the median of that round across the
  record's healthy ranks (ranks a compute or contention fault does not slow at that step);
- ``compute_faulty``: a compute-faulted rank's round over the same median, less the log of
  its nominal factor (how far a ``factor`` x fault reads from ``factor``: the quota of a
  2-core machine under load is not exact);
- ``link``: a pair's round trip over the median round trip of its record, in records with
  no link, pair-link or loss fault in force (what a healthy pair reads).
The simulator draws a round of a rank whose compute factor is f as f x exp(scale x a sample
of ``compute``) (``compute_faulty`` when f > 1), and a pair's round trip as its link factor x
exp(scale x a sample of ``link``): bootstrap, so the measured tails -- the healthy rank whose
test reads 1.5x under load, the healthy pair 5x -- come with it (``DEFAULT``:
``data/validation_noise.json``, measured from the replay corpus, tests/replay/corpus).

Limits: the records hold 2-5 ranks each, so the median a rank is divided by includes it
(a 2-rank record's residuals are half the pair's difference); a link fault's reading is its
simulated factor x healthy noise (the testbed shapes rates, which give no nominal factor).
Cost: one ``rng.choice`` per call, O(N x rounds).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stalwart.simulate.noise import robust_sd

DEFAULT = Path(__file__).with_name("data") / "validation_noise.json"


@dataclass
class TestNoise:
    """The three pools (module docstring), scaled by ``scale`` (1: as measured)."""

    __test__ = False  # (not a pytest class)

    compute: np.ndarray
    compute_faulty: np.ndarray
    link: np.ndarray
    scale: float = 1.0
    source: str = ""

    def rounds(self, rng: np.random.Generator, factor: np.ndarray, k: int) -> np.ndarray:
        """``k`` compute-test rounds of every rank (rows), relative to a healthy rank's
        median: ``factor`` x resampled noise."""
        n = len(factor)
        if self.scale == 0.0 or self.compute.size == 0:
            return np.repeat(factor[:, None], k, axis=1).astype(float)
        res = rng.choice(self.compute, (n, k))
        slow = np.flatnonzero(factor > 1.0)
        if slow.size and self.compute_faulty.size:
            res[slow] = rng.choice(self.compute_faulty, (slow.size, k))
        return factor[:, None] * np.exp(self.scale * res)

    def rtts(self, rng: np.random.Generator, slow: np.ndarray) -> np.ndarray:
        """Every pair's round trip relative to a healthy pair's median: its link factor
        (``slow``) x resampled noise."""
        if self.scale == 0.0 or self.link.size == 0:
            return np.asarray(slow, dtype=float).copy()
        return slow * np.exp(self.scale * rng.choice(self.link, len(slow)))

    def sigma(self) -> tuple[float, float]:
        """Robust spread (1.4826 MAD) of the compute and link pools after scaling."""
        return self.scale * robust_sd(self.compute), self.scale * robust_sd(self.link)

    @classmethod
    def load(cls, path: Path = DEFAULT, scale: float = 1.0) -> TestNoise:
        d = json.loads(Path(path).read_text())
        return cls(np.asarray(d["compute"], float), np.asarray(d["compute_faulty"], float),
                   np.asarray(d["link"], float), scale, str(d.get("source", path)))


def _spec(s: str) -> tuple[str, dict[str, str]]:
    kind, _, rest = s.partition(":")
    return kind, dict(kv.split("=", 1) for kv in rest.split(",") if "=" in kv)


def _in_force(f: dict[str, str], step: int) -> bool:
    start = int(f.get("start", "0").rstrip("s") or 0)
    end = f.get("end")
    return step >= start and (end is None or step < int(end.rstrip("s")))


def _record(rec: dict[str, Any], faults: list[tuple[str, dict[str, str]]],
            out: dict[str, list[float]]) -> None:
    """One validation record's residuals into the three pools."""
    step = int(rec.get("step", 0))
    live = [(k, f) for k, f in faults if _in_force(f, step)]
    slowed = {int(f["rank"]): float(f.get("factor", "nan")) for k, f in live
              if k in ("compute", "contention") and "rank" in f}
    ev = rec.get("evidence") or []
    rows = {int(e["rank"]): e.get("compute_rounds") or [] for e in ev}
    k = min((len(r) for r in rows.values()), default=0)
    healthy = [r for r in rows if r not in slowed]
    if k and len(healthy) >= 2:
        med = np.median(np.asarray([rows[r][:k] for r in healthy], float), axis=0)
        for r, xs in rows.items():
            res = np.log(np.asarray(xs[:k], float) / med)
            if r not in slowed:
                out["compute"].extend(res.tolist())
            elif slowed[r] == slowed[r] and slowed[r] > 0:  # a compute fault's nominal factor
                out["compute_faulty"].extend((res - np.log(slowed[r])).tolist())
    if any(kind in ("link", "pairlink", "loss") for kind, _ in live):
        return
    rtt = np.asarray([t for e in ev for t in (e.get("links") or {}).values()], float)
    rtt = rtt[rtt > 0]
    if rtt.size >= 2:
        out["link"].extend(np.log(rtt / np.median(rtt)).tolist())


def measure(run_dirs: list[Path]) -> dict[str, Any]:
    """The three pools from recorded run directories (module docstring)."""
    out: dict[str, list[float]] = {"compute": [], "compute_faulty": [], "link": []}
    used = []
    for d in run_dirs:
        d = Path(d)
        vfile = d / "validation.jsonl"
        if not vfile.exists():
            continue
        cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").exists() \
            else {}
        faults = [_spec(s) for s in cfg.get("faults") or []]
        for line in vfile.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if rec.get("kind", "validation") == "validation":
                    _record(rec, faults, out)
        used.append(d.name)
    return {**{k: [round(x, 5) for x in v] for k, v in out.items()},
            "source": ", ".join(used)}
