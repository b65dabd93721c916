"""Measurement probes that verify a fault mechanism really acts: real sockets, real processes.

Used by ``stalwart testbed check`` and by the tests. Each probe runs small Python programs inside
the emulated hosts (``ip netns exec``) and measures at the receiver:

* ``udp_loss``        -- datagrams sent vs received (the sender reports its count over TCP after
                         the last datagram, so the receiver knows when the stream is complete);
* ``tcp_throughput``  -- bulk TCP bytes over the receiver's first-to-last-byte time;
* ``busy_loop_time``  -- wall time of a fixed pure-Python loop in a process placed in a cgroup
                         before it starts timing; ``loop_for`` sizes that loop to a wall time on
                         this machine, because a CFS quota is only exact over many periods (a
                         loop of a few periods sees the phase of the first one and the tick's
                         overrun, and a fixed count is a different length on every machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence

from stalwart.testbed.cpu import CpuGroup
from stalwart.testbed.hosts import Hosts

_UDP_RECV = r"""
import json, select, socket, sys
addr, port = sys.argv[1], int(sys.argv[2])
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE (root)
u.bind((addr, port))
t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
t.bind((addr, port)); t.listen(1)
print("ready", flush=True)
c, _ = t.accept()
seen, buf = set(), b""
while not buf.endswith(b"\n"):
    r, _, _ = select.select([u, c], [], [])
    if u in r:
        seen.add(int(u.recv(64).split(b" ")[0]))
    if c in r:
        buf += c.recv(64)
u.setblocking(False)
while True:
    try:
        seen.add(int(u.recv(64).split(b" ")[0]))
    except BlockingIOError:
        break
print(json.dumps({"sent": int(buf), "received": len(seen)}), flush=True)
"""

_UDP_SEND = r"""
import socket, sys
addr, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = socket.create_connection((addr, port), timeout=30)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
pad = b"x" * 32
for i in range(n):
    u.sendto(b"%d " % i + pad, (addr, port))
c.sendall(b"%d\n" % n)
c.close()
"""

_TCP_RECV = r"""
import json, socket, sys, time
addr, port = sys.argv[1], int(sys.argv[2])
t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
t.bind((addr, port)); t.listen(1)
print("ready", flush=True)
c, _ = t.accept()
buf = bytearray(1 << 16)
first = c.recv_into(buf); t0 = time.perf_counter(); n = 0; t1 = t0
while True:
    k = c.recv_into(buf)
    if not k:
        break
    n += k; t1 = time.perf_counter()
# bytes after the first read over the time they took to arrive
print(json.dumps({"bytes": n, "seconds": t1 - t0}), flush=True)
"""

_TCP_SEND = r"""
import socket, sys, time
addr, port, secs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
c = socket.create_connection((addr, port), timeout=30)
chunk = b"\0" * (1 << 16)
end = time.perf_counter() + secs
while time.perf_counter() < end:
    c.sendall(chunk)
c.close()
"""

_BUSY = r"""
import sys, time
sys.stdin.readline()
t0 = time.perf_counter()
x = 0
for i in range(int(sys.argv[1])):
    x += i
print(time.perf_counter() - t0, flush=True)
"""


# prepended to each probe program: it dies with the thread that started it (PR_SET_PDEATHSIG),
# so a probe in flight when its launcher exits -- a receiver blocked in accept() because the
# host is cut off -- never outlives it (nor keeps the launcher's output pipes open)
_TIED = ("import ctypes as _c, os as _o, signal as _s, sys as _y\n"
         "_c.CDLL('libc.so.6').prctl(1, _s.SIGKILL)\n"
         "_o.getppid() == int(_y.argv.pop(1)) or _o._exit(1)\n")


def _pair(hosts: Hosts, src: int, dst: int, recv_code: str, send_code: str,
          recv_args: Sequence[str], send_args: Sequence[str], timeout: float) -> dict:
    """Run a receiver in host ``dst`` and a sender in host ``src``; the receiver's last line
    (JSON). Either failing, or not done in ``timeout``, raises; their stderr is kept out of
    the caller's (a probe of a host cut off fails by design)."""
    py = [sys.executable, "-S", "-c"]
    me = str(os.getpid())
    recv = subprocess.Popen([*hosts.exec_prefix(dst), *py, _TIED + recv_code, me, *recv_args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert recv.stdout is not None
        if recv.stdout.readline().strip() != "ready":
            raise RuntimeError("probe receiver did not start")
        subprocess.run([*hosts.exec_prefix(src), *py, _TIED + send_code, me, *send_args],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=timeout)
        out, _ = recv.communicate(timeout=timeout)
        return json.loads(out.strip().splitlines()[-1])
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()


def udp_loss(hosts: Hosts, src: int, dst: int, count: int = 10_000,
             port: int = 47001) -> tuple[int, int]:
    """Send `count` UDP datagrams from host src to host dst; returns (sent, distinct received)."""
    d = hosts.addr(dst)
    r = _pair(hosts, src, dst, _UDP_RECV, _UDP_SEND, [d, str(port)], [d, str(port), str(count)],
              timeout=60)
    return int(r["sent"]), int(r["received"])


def tcp_throughput(hosts: Hosts, src: int, dst: int, seconds: float = 2.0,
                   port: int = 47002) -> float:
    """Bulk TCP from host src to host dst for `seconds`; bits/s measured at the receiver."""
    d = hosts.addr(dst)
    r = _pair(hosts, src, dst, _TCP_RECV, _TCP_SEND, [d, str(port)], [d, str(port),
              str(seconds)], timeout=seconds * 10 + 30)
    return 8.0 * r["bytes"] / max(r["seconds"], 1e-9)


def busy_loop_time(iterations: int, group: CpuGroup | None = None) -> float:
    """Wall seconds of a fixed pure-Python loop, run in `group` (None: where we are)."""
    p = subprocess.Popen([sys.executable, "-S", "-c", _BUSY, str(iterations)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if group is not None:
            group.add(p.pid)  # before the loop starts: the child waits for our go
        out, _ = p.communicate("go\n", timeout=120)
        return float(out.strip())
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def loop_for(seconds: float, group: CpuGroup | None = None) -> int:
    """Iterations of ``busy_loop_time``'s loop that take about `seconds` unthrottled here."""
    n = 500_000
    t = busy_loop_time(n, group)
    while t < 0.05:  # too short to scale from
        n *= 4
        t = busy_loop_time(n, group)
    return max(n, int(n * seconds / t))
