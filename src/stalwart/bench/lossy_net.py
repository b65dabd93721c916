"""Benchmark helpers for `stalwart bench lossy`: run ranks on testbed hosts, UDP-only loss.

``run_on_hosts`` starts one process per testbed host (``Hosts.exec_prefix``) with the torchrun
environment and waits for all, killing the rest if one fails or the time limit passes.
``set_udp_loss`` drops a fraction of the UDP datagrams arriving at a host (nftables on the
input hook, like the testbed's ``loss`` fault, but matching UDP only): the drift benchmark uses
it so that its exact drift probe, a reliable gloo (TCP) all-gather outside the measured path,
is not slowed by the loss it is measuring the effect of.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from stalwart.testbed.loss import SCALE, threshold

UDP_TABLE = "stw_udploss"


def set_udp_loss(netns: str, p: float, dev: str = "eth0") -> None:
    rules = (f"table inet {UDP_TABLE}\ndelete table inet {UDP_TABLE}\n"
             f"table inet {UDP_TABLE} {{\n  chain input {{\n"
             f"    type filter hook input priority 0; policy accept;\n")
    if p > 0:
        rules += (f"    iifname \"{dev}\" meta l4proto udp numgen random mod {SCALE} < "
                  f"{threshold(p)} counter drop\n")
    rules += "  }\n}\n"
    subprocess.run(["ip", "netns", "exec", netns, "nft", "-f", "-"], input=rules, text=True,
                   check=True, capture_output=True)


def set_udp_burst_loss(netns: str, period: int, burst: int, dev: str = "eth0") -> None:
    """Drop UDP arriving at a host in bursts: ``burst`` consecutive packets out of every
    ``period`` (a counter, not a random draw: nftables ``numgen inc``). On the testbed a
    segmentation-offload run is one packet here, so a burst takes whole runs."""
    rules = (f"table inet {UDP_TABLE}\ndelete table inet {UDP_TABLE}\n"
             f"table inet {UDP_TABLE} {{\n  chain input {{\n"
             f"    type filter hook input priority 0; policy accept;\n"
             f"    iifname \"{dev}\" meta l4proto udp numgen inc mod {period} < {burst} "
             f"counter drop\n  }}\n}}\n")
    subprocess.run(["ip", "netns", "exec", netns, "nft", "-f", "-"], input=rules, text=True,
                   check=True, capture_output=True)


def udp_dropped(netns: str) -> int:
    """Packets the UDP loss rule (``set_udp_loss``/``set_udp_burst_loss``) dropped so far."""
    cp = subprocess.run(["ip", "netns", "exec", netns, "nft", "list", "table", "inet",
                         UDP_TABLE], capture_output=True, text=True, check=False)
    for line in cp.stdout.splitlines() if cp.returncode == 0 else []:
        if "counter packets" in line:
            words = line.split()
            return int(words[words.index("packets") + 1])
    return 0


def run_on_hosts(hosts, module: str, args: list[str], out: Path, timeout: float,
                 extra_env: dict[str, str] | None = None,
                 progress: Callable[[str], None] | None = None) -> list[dict]:
    """Run ``python -m module *args`` as rank i on host i; returns each rank's JSON result
    (``out/rank-R.json``, written by the worker). ``progress`` gets each new line that rank 0
    writes to ``out/progress`` (the worker's stage)."""
    out.mkdir(parents=True, exist_ok=True)
    world = hosts.n
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for i in range(world):
            env = dict(os.environ, RANK=str(i), WORLD_SIZE=str(world), LOCAL_RANK=str(i),
                       MASTER_ADDR=hosts.addr(0), MASTER_PORT="29500",
                       STALWART_HOST_ADDR=hosts.addr(i), STALWART_MTU=str(hosts.mtu),
                       GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1", **(extra_env or {}))
            log = open(out / f"rank-{i}.log", "wb")  # noqa: SIM115
            logs.append(log)
            procs.append(subprocess.Popen(
                [*hosts.exec_prefix(i), sys.executable, "-m", module, str(out), *args],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        t_end = time.monotonic() + timeout
        shown = ""
        while any(p.poll() is None for p in procs):
            if progress is not None and (out / "progress").exists():
                line = (out / "progress").read_text().strip()
                if line and line != shown:
                    shown = line
                    progress(line)
            if any(p.poll() not in (None, 0) for p in procs):
                bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
                raise RuntimeError(f"rank(s) {bad} failed; see {out}/rank-*.log")
            if time.monotonic() > t_end:
                raise RuntimeError(f"ranks did not finish within {timeout:.0f} s")
            time.sleep(0.2)
        bad = [i for i, p in enumerate(procs) if p.returncode != 0]
        if bad:
            raise RuntimeError(f"rank(s) {bad} failed; see {out}/rank-*.log")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]
