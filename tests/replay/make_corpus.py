"""Record the replay corpus: real ``stalwart run`` jobs, trimmed to what replay reads.

    sudo .venv/bin/python tests/replay/make_corpus.py tests/replay/corpus [NAME ...]

Two parts: ``tune/`` (``TUNE``), the runs thresholds may be set on, and ``heldout/``
(``HELDOUT``), recorded with other seeds, workloads (the bench's user scripts: variable
sequence lengths, BatchNorm) and world sizes (5 ranks), on which figures are reported
(``stalwart replay --score``). Each run is a short job on the local testbed (compute and
contention faults are cgroup CPU quotas and busy processes: root) or on network namespaces
(link faults: root). Only ``config.json``, ``events.jsonl`` (the ground truth: the faults
applied), ``validation.jsonl`` (the raw validation rounds the rules are re-run on) and the
metrics columns replay reads are kept, so the corpus stays small (~2-4 MB).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# the metrics columns replay reads (stalwart.replay)
KEEP = ("step", "rank", "step_time", "compute_time", "comm_time", "fb_time", "micro_batches",
        "plan_version", "world")

C = "compute:rank={r},factor={f},start={s}"
SCRIPT = ["--script", "tests/scripts/plain_ddp.py", "--detect"]
TUNE: dict[str, list[str]] = {
    "clean-n2": ["--nproc", "2", "--steps", "80"],
    "clean-n3": ["--nproc", "3", "--steps", "80"],
    "clean-n4": ["--nproc", "4", "--steps", "80"],
    "clean-n4-seed1": ["--nproc", "4", "--steps", "80", "--seed", "1"],
    "clean-n2-lossy": ["--nproc", "2", "--steps", "80", "--comm", "lossy"],
    "clean-n4-mitigate": ["--nproc", "4", "--steps", "80", "--mitigate", "auto"],
    "compute2x-n2": ["--nproc", "2", "--steps", "80", "--fault", C.format(r=1, f=2, s=30)],
    "compute3x-n4": ["--nproc", "4", "--steps", "80", "--fault", C.format(r=2, f=3, s=30)],
    "compute1.5x-n3": ["--nproc", "3", "--steps", "90", "--fault", C.format(r=1, f=1.5, s=30)],
    "compute2x-n4-ends": ["--nproc", "4", "--steps", "90",
                          "--fault", "compute:rank=3,factor=2,start=30,end=60"],
    "compute2x-n3-lossy": ["--nproc", "3", "--steps", "80", "--comm", "lossy",
                           "--fault", C.format(r=2, f=2, s=30)],
    "compute3x-n4-mitigate-ends": ["--nproc", "4", "--steps", "110", "--mitigate", "auto",
                                   "--fault", "compute:rank=2,factor=3,start=25,end=70"],
    "compute2x-n3-rebalance": ["--nproc", "3", "--steps", "100", "--mitigate", "rebalance",
                               "--fault", C.format(r=0, f=2, s=30)],
    "contention-n4": ["--nproc", "4", "--steps", "80",
                      "--fault", "contention:rank=0,procs=2,start=30"],
    "link-n4-netns": ["--nproc", "4", "--steps", "70", "--testbed", "netns",
                      "--fault", "link:host=2,rate=10mbit,start=30"],
    "pairlink-n4-netns-mitigate": ["--nproc", "4", "--steps", "80", "--testbed", "netns",
                                   "--mitigate", "auto",
                                   "--fault", "pairlink:hosts=1-2,rate=10mbit,start=30"],
    "loss-n3-netns-lossy": ["--nproc", "3", "--steps", "60", "--testbed", "netns",
                            "--comm", "lossy", "--fault", "loss:host=all,p=0.05"],
    "clean-n4-netns": ["--nproc", "4", "--steps", "60", "--testbed", "netns"],
    # slow from the start (issue 24): no change point exists; the outlier test or the audit
    "born-compute2x-n4": ["--nproc", "4", "--steps", "90", "--fault", "compute:rank=2,factor=2"],
    "born-compute1.3x-n4": ["--nproc", "4", "--steps", "120",
                            "--fault", "compute:rank=1,factor=1.3"],
    "born-compute2x-n3-mitigate": ["--nproc", "3", "--steps", "100", "--mitigate", "auto",
                                   "--fault", "compute:rank=1,factor=2"],
    "born-link-n4-netns": ["--nproc", "4", "--steps", "60", "--testbed", "netns",
                           "--fault", "link:host=1,rate=30mbit"],
    "born-pairlink-n4-netns": ["--nproc", "4", "--steps", "60", "--testbed", "netns",
                               "--fault", "pairlink:hosts=1-2,rate=20mbit"],
    # a user's own script (tests/scripts/plain_ddp.py: an MLP that imports nothing from
    # stalwart), its monitor iterations replayed: other world sizes too
    "script-born-compute2x-n4-netns": SCRIPT + ["--nproc", "4", "--testbed", "netns",
                                                "--fault", "compute:rank=2,factor=2",
                                                "--", "--seconds", "8"],
    "script-clean-n3-netns": SCRIPT + ["--nproc", "3", "--testbed", "netns",
                                       "--", "--seconds", "8"],
    "script-born-compute2x-n2": SCRIPT + ["--nproc", "2", "--fault", "compute:rank=0,factor=2",
                                          "--", "--seconds", "8"],
    # the scenario of tests/detect/test_e2e.py's born compute straggler (batch 1024)
    "script-born-compute2x-b1024-n4-netns": SCRIPT + [
        "--nproc", "4", "--testbed", "netns", "--fault", "compute:rank=2,factor=2",
        "--", "--seconds", "9", "--batch", "1024"],
}


B = "src/stalwart/bench/scripts/"
HELDOUT: dict[str, list[str]] = {
    "h-clean-n5-seed7": ["--nproc", "5", "--steps", "80", "--seed", "7"],
    "h-clean-n3-seed7-mb2": ["--nproc", "3", "--steps", "80", "--seed", "7",
                             "--micro-batches", "2"],
    "h-clean-n4-seed7-netns": ["--nproc", "4", "--steps", "60", "--seed", "7",
                               "--testbed", "netns"],
    "h-script-clean-varlen-n4": ["--script", B + "varlen.py", "--detect", "--nproc", "4",
                                 "--", "--seconds", "10"],
    "h-script-clean-mlp-n3": ["--script", B + "mlp.py", "--detect", "--nproc", "3",
                              "--", "--seconds", "8"],
    "h-script-clean-cnn-n4": ["--script", B + "cnn_bn.py", "--detect", "--nproc", "4",
                              "--", "--seconds", "10"],
    "h-compute1.3x-n5-seed7": ["--nproc", "5", "--steps", "120", "--seed", "7",
                               "--fault", C.format(r=3, f=1.3, s=30)],
    "h-compute2.5x-n3-seed7": ["--nproc", "3", "--steps", "80", "--seed", "7",
                               "--fault", C.format(r=0, f=2.5, s=25)],
    "h-compute1.5x-n4-seed7-mb2": ["--nproc", "4", "--steps", "100", "--seed", "7",
                                   "--micro-batches", "2", "--fault", C.format(r=1, f=1.5, s=35)],
    "h-contention-n3-seed7": ["--nproc", "3", "--steps", "80", "--seed", "7",
                              "--fault", "contention:rank=2,procs=2,start=30"],
    "h-born-compute1.5x-n5": ["--nproc", "5", "--steps", "100", "--seed", "7",
                              "--fault", "compute:rank=4,factor=1.5"],
    "h-born-compute3x-n3-seed7": ["--nproc", "3", "--steps", "80", "--seed", "7",
                                  "--fault", "compute:rank=2,factor=3"],
    "h-script-born-compute3x-varlen-n4": ["--script", B + "varlen.py", "--detect",
                                          "--nproc", "4", "--fault", "compute:rank=1,factor=3",
                                          "--", "--seconds", "10"],
    "h-script-born-compute2x-mlp-n3": ["--script", B + "mlp.py", "--detect", "--nproc", "3",
                                       "--fault", "compute:rank=2,factor=2",
                                       "--", "--seconds", "8"],
    "h-link-n5-netns": ["--nproc", "5", "--steps", "70", "--seed", "7", "--testbed", "netns",
                        "--fault", "link:host=3,rate=10mbit,start=30"],
    "h-pairlink-n3-netns": ["--nproc", "3", "--steps", "70", "--seed", "7", "--testbed",
                            "netns", "--fault", "pairlink:hosts=0-2,rate=10mbit,start=25"],
    "h-born-link-n3-netns": ["--nproc", "3", "--steps", "60", "--seed", "7", "--testbed",
                             "netns", "--fault", "link:host=2,rate=20mbit"],
}
PARTS = {"tune": TUNE, "heldout": HELDOUT}


def trim(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    shutil.copy(src / "events.jsonl", dst / "events.jsonl")
    if (src / "validation.jsonl").is_file():
        shutil.copy(src / "validation.jsonl", dst / "validation.jsonl")
    # a script run (--script) records the monitor's iterations instead of metrics
    series = "metrics.jsonl" if (src / "metrics.jsonl").is_file() else "iterations.jsonl"
    with open(src / series) as f, open(dst / series, "w") as out:
        for line in f:
            m = json.loads(line)
            row = {k: (round(v, 6) if isinstance(v, float) else v)
                   for k, v in m.items() if k in KEEP}
            out.write(json.dumps(row, separators=(",", ":")) + "\n")


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    runs = {n: (part, args) for part, rs in PARTS.items() for n, args in rs.items()}
    names = argv[1:] or list(runs)
    for name in names:
        part, args = runs[name]
        with tempfile.TemporaryDirectory() as tmp:
            # the run's own arguments last: a script's follow its "--"
            cmd = [sys.executable, "-m", "stalwart.cli", "run", "--name", name, "--out", tmp,
                   "--no-progress", *args]
            print(" ".join(cmd[2:]), flush=True)
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"{name}: exit {r.returncode}: {r.stderr[-500:]}", flush=True)
                continue
            trim(Path(tmp) / name, out / part / name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
