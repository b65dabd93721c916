"""Setup of the lossy collective's group: the one-time exchange of the job's secret and the
ranks' addresses, over a reliable channel (torch.distributed's object collectives).

Mechanism: rank 0 draws the per-job secret and job id with ``os.urandom`` and broadcasts them
(gloo or any backend with object collectives); every rank binds its socket to
``transport.default_host()`` (``STALWART_HOST_ADDR``, else the interface that routes to
``MASTER_ADDR``) and the addresses are exchanged with ``all_gather_object``, with each rank's
host name: a job that spans hosts while a rank bound a loopback address fails at setup with
one line, instead of every rank training on its own gradient.

Guarantees: every rank gets rank 0's secret and job id and every rank's bound address and host
name; ``check_addresses`` refuses (one line) a job that spans hosts while a rank bound a
loopback address. Cost: one broadcast, one all-gather and one barrier, once per collective.
"""

from __future__ import annotations

import torch.distributed as dist

from stalwart.comm.transport import is_loopback


def check_addresses(addrs: list[tuple[str, int]], hosts: list[str]) -> None:
    """Raise (one line) when the job spans hosts and a rank bound a loopback address: its
    peers' packets to it would land on their own loopback and never reach it."""
    if len(set(hosts)) < 2:
        return
    for r, ((a, port), h) in enumerate(zip(addrs, hosts, strict=True)):
        if is_loopback(a):
            raise RuntimeError(
                f"stalwart.comm: rank {r} on host {h!r} bound loopback {a}:{port} but the job "
                f"spans hosts {sorted(set(hosts))}; set STALWART_HOST_ADDR (or MASTER_ADDR) to "
                f"an address the other hosts can reach")


class DistExchange:
    """Setup-time exchange over torch.distributed (reliable; used once, before training)."""

    def __init__(self, group) -> None:
        self.group = group

    def broadcast_from_0(self, obj):
        box = [obj]
        # src is a GLOBAL rank: the group's rank 0 (global rank 0 may not be in the group)
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def all_gather(self, obj) -> list:
        out = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def world_rank(self) -> tuple[int, int]:
        """This process's group size and rank in it."""
        return dist.get_world_size(self.group), dist.get_rank(self.group)
