"""Where the CPU of an all-reduce goes, per payload byte: `stalwart bench lossy --only profile`.

Mechanism: each rank samples itself with ``perf record`` (software event ``cpu-clock``, one
sample per ``PERIOD_NS`` of CPU, all threads, kernel call chains) while it runs a block of
all-reduces of one system -- ours, then gloo, in the same processes -- and classifies every
sample by the function it landed in (``stage``) and the thread it ran on (``side``): the
native engine's receive thread is named ``stw-rx``; everything else of ours (the send, the
Python per-phase work, the final average and copy-out) runs on the main thread. gloo's work
runs on its own threads. Kernel samples are split by the system call in their chain (send /
receive / other); user samples by symbol and library (libcrypto and the engine's own GHASH
and AES-NI block function = authentication, ISA-L = parity, memcpy/memmove = copies, the
engine's ``sum_into`` and numpy's / gloo's add loops = summation, ...). The result is CPU
nanoseconds per payload byte -- the bytes a rank sends (and receives) per all-reduce, the
same for both systems: 2 (N-1)/N of the vector.

What it does not show: time spent waiting (not CPU), and the CPU the machine's other jobs
took. A sample costs the sampled thread nothing measurable at this period (perf writes from
its own process), but kernel work done on behalf of another process (softirq receive
processing of a peer's packets on the veth pair) is charged to whichever thread was running:
per-rank figures move between send and receive by that, the totals over ranks do not.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections import defaultdict
from pathlib import Path

PERIOD_NS = 100_000  # one sample per 0.1 ms of CPU: ~1,000 samples per all-reduce here

STAGES = ("syscalls: send", "syscalls: receive", "kernel: other", "authentication", "parity",
          "copies", "summation", "checks", "engine: parse, placement", "python + numpy",
          "other")

# informational row: the part of the kernel rows spent in the kernel's copy routines (user
# memory <-> socket buffers); not a stage of its own (it is inside the syscall rows)
KERNEL_COPY = "(of which kernel copies)"
_KCOPY_SYMS = ("copy_user", "rep_movs", "_copy_to_iter", "_copy_from_iter", "memcpy",
               "copy_page", "csum_partial_copy")
_SEND = ("sendmsg", "sendmmsg", "sendto", "writev", "ksys_write", "sock_write_iter")
_RECV = ("recvmsg", "recvmmsg", "recvfrom", "readv", "ksys_read", "sock_read_iter")
_COPY_SYMS = ("memcpy", "memmove", "__memcpy", "__memmove", "_copy_", "copy_user", "memcpy_")
# the engine's own tag code (its GHASH, its AES-NI block function): authentication, not parse
_AUTH_SYMS = ("gh_", "ni_block", "ni_key")
_SUM_SYMS = ("sum_into", "FLOAT_add", "FLOAT_divide", "gloo::sum", "add_kernel", "vectorized_loop",
             "FLOAT_multiply")


def available() -> str | None:
    """None when ``perf`` can sample this process; otherwise why not (one line)."""
    if shutil.which("perf") is None:
        return "perf is not installed"
    try:
        r = subprocess.run(["perf", "stat", "-e", "cpu-clock", "true"], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"perf does not run: {e}"
    return None if r.returncode == 0 else f"perf refused: {r.stderr.strip().splitlines()[-1:]}"


class Sampler:
    """``perf record`` of this process between ``start()`` and ``stop()``: perf is started
    with sampling disabled and enabled through its control FIFO (it acknowledges), so a
    block is sampled from its first instruction however long perf takes to attach."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.proc: subprocess.Popen | None = None
        self.ctl = path.with_suffix(".ctl")
        self.ack = path.with_suffix(".ack")

    def _say(self, what: str) -> None:
        with open(self.ctl, "w") as c:
            c.write(what + "\n")
        with open(self.ack) as a:
            a.readline()

    def start(self) -> None:
        for f in (self.ctl, self.ack):
            f.unlink(missing_ok=True)
            os.mkfifo(f)
        self.proc = subprocess.Popen(
            ["perf", "record", "-q", "-e", "cpu-clock", "-c", str(PERIOD_NS), "-g",
             "-D", "-1", f"--control=fifo:{self.ctl},{self.ack}",
             "-p", str(os.getpid()), "-o", str(self.path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._say("enable")

    def stop(self) -> dict[str, dict[str, int]]:
        assert self.proc is not None
        self._say("disable")
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=300)
        out = subprocess.run(["perf", "script", "-i", str(self.path), "-F",
                              "comm,tid,pid,period,ip,sym,dso"], capture_output=True,
                             text=True, timeout=600).stdout
        for f in (self.path, self.ctl, self.ack):
            f.unlink(missing_ok=True)
        return classify(out)


def _stage(leaf_sym: str, leaf_dso: str, chain: list[str]) -> str:
    if "kernel" in leaf_dso:
        if any(any(k in s for k in _SEND) for s in chain):
            return "syscalls: send"
        if any(any(k in s for k in _RECV) for s in chain):
            return "syscalls: receive"
        return "kernel: other"
    if "libcrypto" in leaf_dso or leaf_sym.startswith(_AUTH_SYMS):
        return "authentication"
    if "isal" in leaf_dso or "erasure" in leaf_dso or leaf_sym.startswith(
            ("ec_encode", "gf_", "maybe_decode", "gf_apply")):
        return "parity"
    if any(k in leaf_sym for k in _COPY_SYMS):
        return "copies"
    if any(k in leaf_sym for k in _SUM_SYMS) or ("gloo" in leaf_sym and "sum" in leaf_sym):
        return "summation"
    if leaf_sym.startswith(("all_finite", "check_pre", "check_post", "check_tag")):
        return "checks"
    if "_stwnative" in leaf_dso:
        return "engine: parse, placement"
    if "python" in leaf_dso or "_multiarray" in leaf_dso or "numpy" in leaf_dso:
        return "python + numpy"
    return "other"


def classify(script: str) -> dict[str, dict[str, int]]:
    """``perf script`` text (comm, tid, pid, period, callchain) -> {side: {stage: ns}}, side
    being ``rx`` (the native receive thread), ``main`` (the process's main thread) or
    ``threads`` (any other thread: gloo's, torch's, the Python engine's receiver)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    head: list[str] | None = None
    chain: list[tuple[str, str]] = []

    def flush() -> None:
        if head is None or not chain:
            return
        comm, pid, tid, period = head
        side = "rx" if comm.startswith("stw-rx") else ("main" if pid == tid else "threads")
        sym, dso = chain[0]
        out[side][_stage(sym, dso, [s for s, _ in chain])] += int(period)
        if "kernel" in dso and any(k in sym for k in _KCOPY_SYMS):
            out[side][KERNEL_COPY] += int(period)  # a part of the syscall rows, not a stage

    for line in script.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            flush()
            chain = []
            head = _head(line)
            continue
        parts = line.strip().split(None, 1)
        rest = parts[1] if len(parts) > 1 else ""
        sym, _, dso = rest.rpartition(" (")
        chain.append((sym.split("+0x")[0], dso.rstrip(")")))
    flush()
    return {k: dict(v) for k, v in out.items()}


def _head(line: str) -> list[str] | None:
    """``comm pid/tid period:`` (comm may hold spaces) -> [comm, pid, tid, period]."""
    toks = line.split()
    try:
        period = toks[-1].rstrip(":")
        pid, tid = toks[-2].split("/")
        int(period), int(pid), int(tid)
    except (ValueError, IndexError):
        return None
    return [" ".join(toks[:-2]), pid, tid, period]


def table(recs: list[dict]) -> dict:
    """Per-rank profiles (``lossy_worker.profile``) -> {system: {side: {stage: ns per byte}}},
    summed over ranks and divided by the payload bytes of all ranks' all-reduces, with a
    ``total`` per side and over sides, and the CPU the samples account for against the
    process CPU clock (``covered``: samples x period / process_time)."""
    res: dict = {}
    for system in ("ours", "gloo"):
        nbytes = sum(r["payload_bytes"] * r["iters"] for r in recs)
        ns: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        cpu = 0.0
        for r in recs:
            cpu += r[system]["cpu_s"]
            for side, st in r[system]["samples"].items():
                for stage, v in st.items():
                    ns[side][stage] += v
        sides = {side: {stage: ns[side].get(stage, 0.0) / nbytes for stage in STAGES
                        if ns[side].get(stage)} for side in sorted(ns)}
        for side, d in sides.items():
            d["total"] = sum(d.values())
            d[KERNEL_COPY] = ns[side].get(KERNEL_COPY, 0.0) / nbytes
        both = {stage: sum(s.get(stage, 0.0) for s in sides.values())
                for stage in (*STAGES, KERNEL_COPY)}
        both = {k: v for k, v in both.items() if v}
        both["total"] = sum(v for k, v in both.items() if k != KERNEL_COPY)
        sampled = sum(sum(v for k, v in s.items() if k != KERNEL_COPY)
                      for s in ns.values()) * 1e-9
        res[system] = {"sides": sides, "all": both, "covered": sampled / max(cpu, 1e-12),
                       "cpu_ns_per_byte_process": cpu * 1e9 / nbytes}
    return res


def markdown(tab: dict, title: str) -> str:
    """The table as docs/comm.md prints it: a row per stage, ours by side, ours, gloo."""
    ours, gloo = tab["ours"], tab["gloo"]
    sides = [s for s in ("rx", "main", "threads") if s in ours["sides"]]
    head = ["stage"] + [f"ours {s}" for s in sides] + ["ours", "gloo"]
    lines = [f"**{title}** (CPU ns per payload byte, all ranks)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for stage in (*STAGES, "total", KERNEL_COPY):
        cells = [ours["sides"][s].get(stage, 0.0) for s in sides]
        row = [*cells, ours["all"].get(stage, 0.0), gloo["all"].get(stage, 0.0)]
        if not any(row):
            continue
        lines.append(f"| {stage} | " + " | ".join(f"{v:.3f}" for v in row) + " |")
    lines.append(f"| (process clock) | {'| ' * len(sides)}{ours['cpu_ns_per_byte_process']:.3f}"
                 f" | {gloo['cpu_ns_per_byte_process']:.3f} |")
    return "\n".join(lines)
