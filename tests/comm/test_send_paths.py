"""The send side's two ways of building a datagram give the reference's bytes: the native
engine's tag (its VPCLMULQDQ GHASH where the CPU has it, else OpenSSL's GCM128 with an AES-NI
block function) equals pyca ``cryptography``'s AES-GCM tag for every payload length, and an
all-reduce is exact both where payloads are copied into the rows (MTU 1500: runs sent as one
buffer) and where they go from the vector by iovecs (MTU 9000)."""

from __future__ import annotations

import numpy as np
import pytest
from inproc import make_group, run_threads

from stalwart.comm import native
from stalwart.comm.wire import HEADER, HEADER_BYTES, MAGIC, OVERHEAD, Wire, max_floats_for_mtu

KEY = bytes(range(32))


def _cpu_has_fast_ghash() -> bool:
    """The CPU features the engine's own GHASH needs (``mac_new`` in engine.c)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return False
    return {"aes", "pclmulqdq", "avx2", "vpclmulqdq"} <= set(flags)


@pytest.mark.parametrize("ghash", ["default", "openssl"])
@pytest.mark.parametrize("mtu", [1500, 9000])
def test_native_seal_equals_the_python_reference(mtu: int, ghash: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every payload length from 0 to a full chunk (the header's 40 bytes put the payload at
    every offset within a 16-byte GHASH block, and the tail at every partial length), through
    the engine's GHASH and through OpenSSL's (``STALWART_GHASH=openssl``)."""
    if not native.AVAILABLE:
        pytest.skip("the native engine is not built")
    import socket

    if ghash == "openssl":
        monkeypatch.setenv("STALWART_GHASH", "openssl")
    else:
        monkeypatch.delenv("STALWART_GHASH", raising=False)
    chunk = max_floats_for_mtu(mtu)
    lens = [chunk, chunk, *range(chunk - 1, -1, -1)]
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
        used = eng.counters()["ghash"]
    assert used == ("vpclmulqdq" if ghash == "default" and _cpu_has_fast_ghash() else "openssl")
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


def test_the_profile_counts_the_engines_own_tag_code_as_authentication() -> None:
    """``stalwart bench lossy --only profile``: the engine's GHASH and AES-NI block function
    are the tag's work (authentication), not parse and placement (the rest of the engine)."""
    from stalwart.bench import lossy_profile as lp

    so = "/x/_stwnative.cpython-311-x86_64-linux-gnu.so"
    script = "".join(f"stw-rx 100/101 100000:\n\t7f01 {sym}+0x5 ({so})\n\n"
                     for sym in ("gh_blocks", "gh_tag", "ni_block", "parse_header"))
    assert lp.classify(script)["rx"] == {"authentication": 300000,
                                         "engine: parse, placement": 100000}
