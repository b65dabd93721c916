"""Emulated hosts: one network namespace per host, joined by a Linux bridge through veth pairs.

Host i is namespace ``stw-<pid>-<k>-h<i>`` with interface ``eth0`` at ``10.213.0.(i+1)/24`` and
loopback up; its veth peer ``stwp<pid36>-<k36>-<i36>`` is a port of bridge ``stwb<pid>-<k>``.
The bridge and its ports have no address in the root namespace (IPv6 address generation is off
as well), so the /24 exists only inside our namespaces: traffic flows between the created hosts
and nowhere else. Several ``Hosts`` may coexist (same addresses, separate bridges).

Faults on hosts -- ``set_link`` (tbf), ``set_pair`` (htb + u32), ``set_loss`` (nftables),
``set_cut`` (nftables: a silent drop of everything to and from the host) -- are kept as desired
state per host and the kernel configuration is rebuilt from it, so overlapping faults compose
and clearing one leaves the others in force.

``control()`` adds, on first use, one more namespace on the bridge at ``CONTROL_ADDR`` that no
fault addresses (``stw-<pid>-<k>-ctl``): where the launcher's side of the job's control plane
listens (heartbeat.py), so that it reaches every host over that host's own link.
"""

from __future__ import annotations

import os

from stalwart.errors import ConfigError
from stalwart.testbed import cleanup, loss, shaping
from stalwart.testbed._sys import (
    IFNAMSIZ,
    PREFIX,
    TestbedError,
    b36,
    next_tag,
    quiet,
    require_root,
    require_tool,
    run,
)

SUBNET = "10.213.0"
MAX_HOSTS = 253
CONTROL_ADDR = f"{SUBNET}.254"
CUT_TABLE = "stw_cut"


class Hosts:
    """``with Hosts(4, mtu=9000) as h: subprocess.run([*h.exec_prefix(1), "python", ...])``."""

    def __init__(self, n: int, mtu: int = 1500) -> None:
        if not 1 <= n <= MAX_HOSTS:
            raise ConfigError(f"number of hosts must be in [1, {MAX_HOSTS}], got {n}")
        if not 576 <= mtu <= 65535:
            raise ConfigError(f"mtu must be in [576, 65535], got {mtu}")
        require_root("the netns testbed")
        require_tool("ip", "the netns testbed")
        self.n, self.mtu = n, mtu
        self.tag = next_tag()
        pid, k = (int(x) for x in self.tag.split("-"))
        self.bridge = f"{PREFIX}b{self.tag}"
        self._ports = [f"{PREFIX}p{b36(pid)}-{b36(k)}-{b36(i)}" for i in range(n)]
        self._ns = [f"{PREFIX}-{self.tag}-h{i}" for i in range(n)]
        if max(len(self.bridge), *(len(p) for p in self._ports)) > IFNAMSIZ:
            raise TestbedError(f"interface name too long for tag {self.tag}")
        self._link: dict[int, int] = {}  # host -> link rate (bit/s)
        self._pairs: dict[int, dict[int, int]] = {}  # host -> {peer host: rate}
        self._loss: dict[int, float] = {}
        self._cut: set[int] = set()
        self._control: tuple[str, str] | None = None  # (namespace, its bridge port)
        self._closed = False
        self._owner = os.getpid()
        cleanup.cleanup_stale()
        cleanup.register(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- construction ----------------------------------------------------------------------
    def _build(self) -> None:
        for ns in self._ns:
            run(["ip", "netns", "add", ns])
        br = self.bridge
        root_cmds = [
            f"link add name {br} type bridge",
            f"link set dev {br} addrgenmode none",  # no IPv6 link-local: no address in root ns
            f"link set dev {br} mtu {self.mtu}",
        ]
        for port, ns in zip(self._ports, self._ns, strict=True):
            root_cmds += self._port_cmds(port, ns)
        root_cmds.append(f"link set dev {br} up")
        run(["ip", "-batch", "-"], input="\n".join(root_cmds) + "\n")
        for i, ns in enumerate(self._ns):
            self._address(ns, self.addr(i))

    def _port_cmds(self, port: str, ns: str) -> list[str]:
        """``ip -batch`` lines (root namespace): a veth pair, ``eth0`` in ``ns`` and ``port``
        on the bridge, up."""
        return [f"link add name {port} mtu {self.mtu} type veth peer name eth0 mtu {self.mtu} "
                f"netns {ns}",
                f"link set dev {port} addrgenmode none",
                f"link set dev {port} master {self.bridge}",
                f"link set dev {port} up"]

    @staticmethod
    def _address(ns: str, addr: str) -> None:
        """Loopback up and ``eth0`` at ``addr``/24 inside ``ns``."""
        run(["ip", "-n", ns, "-batch", "-"], input="\n".join([
            "link set dev lo up", "link set dev eth0 addrgenmode none",
            f"addr add {addr}/24 dev eth0", "link set dev eth0 up",
        ]) + "\n")

    def control(self) -> str:
        """The control namespace's name (built on first call): one more port on the bridge,
        address ``CONTROL_ADDR``, never addressed by a fault (a cut drops its traffic with the
        cut host, like every other end's)."""
        if self._control is None:
            pid, k = (int(x) for x in self.tag.split("-"))
            ns, port = f"{PREFIX}-{self.tag}-ctl", f"{PREFIX}p{b36(pid)}-{b36(k)}-ctl"
            if len(port) > IFNAMSIZ:
                raise TestbedError(f"interface name too long for tag {self.tag}")
            self._control = (ns, port)  # close() removes whatever part of it was made
            run(["ip", "netns", "add", ns])
            run(["ip", "-batch", "-"], input="\n".join(self._port_cmds(port, ns)) + "\n")
            self._address(ns, CONTROL_ADDR)
            if self._cut:
                self._recut()
        return self._control[0]

    # -- addressing ------------------------------------------------------------------------
    def addr(self, i: int) -> str:
        self._check(i)
        return f"{SUBNET}.{i + 1}"

    def ns(self, i: int) -> str:
        self._check(i)
        return self._ns[i]

    def port(self, i: int) -> str:
        """The bridge-side veth of host i (its egress is the host's ingress)."""
        self._check(i)
        return self._ports[i]

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns(i)]

    def _check(self, i: int) -> None:
        if not 0 <= i < self.n:
            raise IndexError(f"host {i} out of range [0, {self.n - 1}]")

    # -- faults ----------------------------------------------------------------------------
    def set_loss(self, i: int, p: float) -> str:
        """Drop each packet arriving at host i with probability p; returns the mechanism."""
        if not 0.0 <= p < 1.0:
            raise ValueError(f"loss probability must be in [0, 1), got {p}")
        require_tool("nft", "loss faults")
        self._loss[i] = p
        return loss.set_loss(self.ns(i), p)

    def clear_loss(self, i: int) -> None:
        self._loss.pop(i, None)
        loss.clear_loss(self.ns(i))

    def set_cut(self, i: int, cut: bool = True) -> str:
        """Cut host i off (``cut``) or restore it: every packet from it is dropped where it
        arrives, and every packet arriving at it, silently (input hooks, like a pulled cable:
        senders see no error). Returns the mechanism."""
        require_tool("nft", "cut faults")
        self._check(i)
        if cut:
            self._cut.add(i)
        else:
            self._cut.discard(i)
        self._recut()
        return (f"nftables inet {CUT_TABLE} input: all of eth0 dropped in host{i}, "
                f"packets from {self.addr(i)} dropped in every other namespace") if cut else ""

    def _recut(self) -> None:
        spaces = list(enumerate(self._ns)) + (
            [(-1, self._control[0])] if self._control is not None else [])
        for j, ns in spaces:
            rules = ['iifname "eth0" counter drop'] if j in self._cut else [
                f'iifname "eth0" ip saddr {self.addr(c)} counter drop' for c in sorted(self._cut)]
            if not rules:
                quiet(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", CUT_TABLE])
                continue
            body = "".join(f"    {r}\n" for r in rules)
            run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=(
                f"table inet {CUT_TABLE}\ndelete table inet {CUT_TABLE}\n"
                f"table inet {CUT_TABLE} {{\n  chain input {{\n"
                f"    type filter hook input priority -10; policy accept;\n{body}  }}\n}}\n"))

    def set_link(self, i: int, rate_bps: int | None) -> str:
        """Limit host i's link (both directions) to rate_bps (None: unlimited)."""
        if rate_bps is None:
            self._link.pop(i, None)
        else:
            self._link[i] = int(rate_bps)
        return self._reshape(i, ingress=True)

    def clear_link(self, i: int) -> None:
        self.set_link(i, None)

    def set_pair(self, a: int, b: int, rate_bps: int | None) -> str:
        """Limit only the traffic between hosts a and b (both directions; None: unlimited)."""
        if a == b:
            raise ValueError("a pair needs two different hosts")
        for x, y in ((a, b), (b, a)):
            peers = self._pairs.setdefault(x, {})
            if rate_bps is None:
                peers.pop(y, None)
            else:
                peers[y] = int(rate_bps)
        da = self._reshape(a, ingress=False)
        db = self._reshape(b, ingress=False)
        return f"host{a}: {da}; host{b}: {db}"

    def clear_pair(self, a: int, b: int) -> None:
        self.set_pair(a, b, None)

    def _reshape(self, i: int, ingress: bool) -> str:
        require_tool("tc", "link faults")
        link = self._link.get(i)
        peers = {self.addr(j): r for j, r in self._pairs.get(i, {}).items()}
        out = shaping.shape("eth0", netns=self.ns(i), mtu=self.mtu, link_bps=link, peers=peers)
        if ingress:
            inn = shaping.shape(self.port(i), netns=None, mtu=self.mtu, link_bps=link)
            if link is not None:
                out += f" (egress) + {inn} (ingress)"
        return out

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Remove every namespace (with its eth0, qdiscs and nft tables) and the bridge.
        Idempotent; only the creating process tears down (a forked child must not)."""
        if self._closed or os.getpid() != self._owner:
            return
        self._closed = True
        # Deleting a veth end destroys the pair at once; a namespace deletion alone frees its
        # interfaces only later (asynchronously, and only after its last process has exited).
        ports, spaces = list(self._ports), list(self._ns)
        if self._control is not None:
            spaces.append(self._control[0])
            ports.append(self._control[1])
        cmds = [f"link del dev {p}" for p in ports] + [f"netns del {ns}" for ns in spaces]
        cmds.append(f"link del dev {self.bridge}")
        try:
            run(["ip", "-force", "-batch", "-"], input="\n".join(cmds) + "\n", check=False)
        except TestbedError:
            pass
        for ns in spaces:  # whatever the batch could not do (e.g. it was interrupted)
            if os.path.exists(f"/run/netns/{ns}"):
                quiet(["ip", "netns", "del", ns])
        cleanup.unregister(self)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
