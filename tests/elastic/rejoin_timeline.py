"""Where a node's rejoin under torchrun spends its time: a measurement, not a test (timings are
contention-bound on a shared machine; run it by hand, ~1 min at load 15-20).

    python tests/elastic/rejoin_timeline.py            # one cold rejoin, split
    python tests/elastic/rejoin_timeline.py --gate 3   # the join alone, 3 times

The job: a membership store and two local "nodes", each ``torchrun --standalone
--nproc-per-node 2 examples/elastic_ddp.py --steps 1000000 --compute-ms 100`` (the bench's
extra compute; tests/elastic/cluster.py), world 4. Node b's agent and workers are SIGKILLed
once the job has done 20 steps; once the survivors trained a step at world 2, b is started
again with the same line (``t_back``).

Cold (default): b starts 2 s after that, and the run prints, for each of b's two new
processes, when (from ``t_back``) its agent had spawned it, its script reached its first line
(``t_start``: interpreter and imports done), ``elastic.Job()`` returned (``t_joined``: the
script's data, model and optimizer built, then joined and the state received) and its first
step; then the bench's ``rejoin_s`` (to the first step done at world 4) and ``rejoin_split``
(startup / after_start); and the imports that took over 0.05 s in b's processes
(``PYTHONPROFILEIMPORTTIME``: the agent's ``torch.distributed.run``, each worker's
``torch``, and ``torch._dynamo``, which the optimizer's first ``add_param_group`` imports
lazily -- with this on, every import is also logged, which slows b a little).

``--gate N``: N cycles of b killed and started again with ``--start-when GATE`` (its start-up
and set-up done, waiting at the gate: found by its workers' CPU time standing still for 1 s),
the gate opened -> the first step done at world 4: ``elastic.Job()`` (joining, the state
received), the wait for the survivors' next step boundary, and one step (+ up to 50 ms of the
script's gate poll).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2]))
from tests.elastic.cluster import Cluster  # noqa: E402

WORLD = 4


def _cpu_ticks(pids: list[int]) -> int:
    total = 0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total


def _first_full(c: Cluster, after: float) -> float | None:
    ts = [r["t"] for r in c.rows() if r["world"] >= WORLD and r["t"] > after]
    return min(ts) if ts else None


def _kill_b(c: Cluster) -> None:
    c.kill("b")
    t_kill = time.time()
    while not any(r["world"] == WORLD - 2 and r["t"] > t_kill for r in c.rows()):
        time.sleep(0.05)


def cold(c: Cluster, out: Path) -> None:
    _kill_b(c)
    time.sleep(2.0)
    t_back = time.time()
    c.start("b", extra_env={"PYTHONPROFILEIMPORTTIME": "1"})
    spawned: dict[int, float] = {}
    while _first_full(c, t_back) is None:
        for w in c.workers("b"):
            spawned.setdefault(w, time.time())
        if time.time() - t_back > 300:
            raise SystemExit("no step at the full world in 300 s:\n" + c.tail())
        time.sleep(0.02)
    first = _first_full(c, t_back)
    assert first is not None
    starts = []
    for f, rs in c.files().items():
        s = rs[0]
        if not s.get("start") or s["t_start"] < t_back:
            continue
        pid = int(f.stem.rsplit("-", 1)[1])
        steps = [r for r in rs if "step" in r]
        starts.append(s["t_start"])
        print(f"  b pid {pid}: spawned +{spawned.get(pid, float('nan')) - t_back:.2f}  "
              f"first line +{s['t_start'] - t_back:.2f}  Job() returned "
              f"+{s['t_joined'] - t_back:.2f}  first step +{steps[0]['t'] - t_back:.2f} "
              f"(step {steps[0]['step']}, world {steps[0]['world']})")
    total = first - t_back
    print(f"rejoin_s {total:.2f} = startup {max(starts) - t_back:.2f} + after_start "
          f"{first - max(starts):.2f}  (load {os.getloadavg()[0]:.1f})")
    heavy: dict[str, list[float]] = {}
    for line in (out / "b.log").read_text().splitlines():
        m = re.search(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", line)
        if m and int(m.group(1)) > 50_000:
            heavy.setdefault(m.group(2), []).append(int(m.group(1)) / 1e6)
    print("  imports over 0.05 s in b's processes (s, per process): "
          + ", ".join(f"{k} {[round(x, 2) for x in v]}" for k, v in heavy.items()))


def gated(c: Cluster, out: Path, n: int) -> None:
    got = []
    for k in range(n):
        _kill_b(c)
        gate = out / f"gate{k}"
        t0 = time.time()
        c.start("b", args=[*c.args, "--start-when", str(gate)])
        while len(c.workers("b")) < 2:
            time.sleep(0.1)
        last, still = _cpu_ticks(c.workers("b")), 0
        while still < 4:  # 1 s without a CPU tick to speak of: waiting at the gate
            time.sleep(0.25)
            now = _cpu_ticks(c.workers("b"))
            still = still + 1 if now - last <= 1 else 0
            last = now
        t_gate = time.time()
        gate.touch()
        while (first := _first_full(c, t_gate)) is None:
            if time.time() - t_gate > 120:
                raise SystemExit("no step at the full world in 120 s:\n" + c.tail())
            time.sleep(0.02)
        got.append(first - t_gate)
        print(f"  cycle {k}: start-up and set-up {t_gate - t0:.1f} s, gate -> first step at "
              f"world {WORLD}: {first - t_gate:.3f} s (load {os.getloadavg()[0]:.1f})",
              flush=True)
    got.sort()
    print(f"gate -> first step at world {WORLD}: median {got[len(got) // 2]:.3f} s of {n}: "
          f"{[round(x, 3) for x in got]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gate", type=int, default=0, metavar="N",
                   help="measure the join alone, N times (default: one cold rejoin)")
    a = p.parse_args()
    out = Path(tempfile.mkdtemp(prefix="rejoin-"))
    c = Cluster(out, min_world=WORLD, script_args=["--steps", "1000000", "--compute-ms", "100"])
    try:
        c.start("a")
        c.start("b")
        c.wait_step(20, timeout=300)
        if a.gate:
            gated(c, out, a.gate)
        else:
            cold(c, out)
    finally:
        c.close()
    print(f"(logs and step records: {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
