"""The send side's two ways of building a datagram give the reference's bytes: the native
engine's tag (OpenSSL's GCM128 with an AES-NI block function) equals pyca ``cryptography``'s
AES-GCM tag, and an all-reduce is exact both where payloads are copied into the rows (MTU
1500: runs sent as one buffer) and where they go from the vector by iovecs (MTU 9000)."""

from __future__ import annotations

import numpy as np
import pytest
from inproc import make_group, run_threads

from stalwart.comm import native
from stalwart.comm.wire import HEADER, HEADER_BYTES, MAGIC, OVERHEAD, Wire, max_floats_for_mtu

KEY = bytes(range(32))


@pytest.mark.parametrize("mtu", [1500, 9000])
def test_native_seal_equals_the_python_reference(mtu: int) -> None:
    if not native.AVAILABLE:
        pytest.skip("the native engine is not built")
    import socket

    chunk = max_floats_for_mtu(mtu)
    lens = [chunk, chunk, 7, 1, 0]
    ref = Wire(KEY, 3, 2, 0, [sum(lens), 1], chunk)
    rng = np.random.default_rng(mtu)
    rows = np.zeros((len(lens), OVERHEAD + 4 * chunk), np.uint8)
    hdr = rows[:, :HEADER_BYTES].view(HEADER).reshape(len(lens))
    hdr["magic"], hdr["job"], hdr["length"] = MAGIC, ref.job, lens
    hdr["offset"] = rng.integers(0, 2**31, len(lens))
    values = rng.standard_normal(sum(lens)).astype(np.float32)
    mine = rows.copy()
    ref.seal_rows(rows, np.array(lens), values)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        eng = native.module().Engine(fd=s.fileno(), key=ref.job_key, job=ref.job, world=2, me=0,
                                     shard_lens=[sum(lens), 1], chunk=chunk,
                                     slot=OVERHEAD + 4 * chunk, rounds_open=2, may_copy=False,
                                     batch=4, rx_segments=1)
        eng.seal(mine, np.array(lens, np.int64), values)
    for i, n in enumerate(lens):  # header, payload, tag: the bytes that go on the wire
        end = OVERHEAD + 4 * n
        assert bytes(mine[i, :end]) == bytes(rows[i, :end]), f"row {i} ({n} floats)"


@pytest.mark.parametrize("mtu", [1500, 9000])
def test_allreduce_is_exact_on_both_send_paths(mtu: int, engine: str) -> None:
    world, numel = 3, 3 * max_floats_for_mtu(mtu) * 40 + 17  # runs of > 8 datagrams per peer
    group = make_group(world, numel, mtu=mtu, fec_mode="rs", cap=2.0)
    try:
        for it in range(2):
            xs = [np.arange(numel, dtype=np.float32) * 1e-3 + 2.0 ** r + it for r in range(world)]
            outs = run_threads([lambda c=c, x=x: c.allreduce(x)
                                for c, x in zip(group, xs, strict=True)])
            assert not any(isinstance(o, BaseException) for o in outs), outs
            for out, phases in outs:
                assert sum(p.lost for p in phases) == 0
                np.testing.assert_allclose(out, sum(xs) / world, rtol=1e-6)
        assert all(c.bad_packets() == 0 for c in group)
    finally:
        for c in group:
            c.close()
