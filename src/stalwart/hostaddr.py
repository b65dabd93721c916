"""The address a rank's own sockets bind: the lossy transport's UDP socket and the rank-0
control channel (rowlink.py) both need it, so it lives here rather than in either
capability's package (importing stalwart.comm from detect loaded the whole transport).

Guarantees: no packet is sent to find an address (a UDP connect is a route lookup); an address
that cannot be found is a one-line ``OSError`` naming MASTER_ADDR and the variable to set.
"""

from __future__ import annotations

import os
import socket


def default_host() -> str:
    """The address this rank's socket binds: ``STALWART_HOST_ADDR`` when set (the launcher and
    the testbed set it), else the local interface that routes to ``MASTER_ADDR`` (under
    torchrun across machines, the one the peers can reach), else 127.0.0.1 (one machine).

    Why not always 127.0.0.1: under torchrun on several hosts every rank then advertised a
    loopback address, its peers' packets went to their own loopback, and each rank trained on
    its own gradient with no error. The route is found by connecting a UDP socket (no packet
    is sent) and reading the source address the kernel chose for it.
    """
    env = os.environ.get("STALWART_HOST_ADDR")
    if env:
        return env
    master = os.environ.get("MASTER_ADDR")
    if not master:
        return "127.0.0.1"
    return route_source(master, int(os.environ.get("MASTER_PORT", "9") or 9))


def route_source(dest: str, port: int = 9) -> str:
    """The local IPv4 address the kernel would send from to reach ``dest``.

    Raises ``OSError`` with a one-line message when ``dest`` does not resolve or has no route.
    """
    try:
        ip = socket.gethostbyname(dest)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, port))  # UDP connect: a route lookup, nothing is sent
            return str(s.getsockname()[0])
    except OSError as e:
        raise OSError(f"stalwart: cannot find the local address that reaches MASTER_ADDR="
                      f"{dest!r} ({e}); set STALWART_HOST_ADDR to this host's address") from None


def is_loopback(host: str) -> bool:
    return host.startswith("127.") or host == "localhost"
