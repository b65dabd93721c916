"""The send side's ways of building a datagram give the reference's bytes: the native engine's
tag (its VPCLMULQDQ GHASH on 512- or 256-bit vectors where the CPU has it, else OpenSSL's GCM128
with an AES-NI block function) equals pyca ``cryptography``'s AES-GCM tag for every payload
length, on each send path (rows filled while sealing, rows sealed in place, and the MTU 9000
send from the values by iovecs), and an all-reduce is exact both where payloads are copied into
the rows (MTU 1500: runs sent as one buffer) and where they go from the vector by iovecs (MTU
9000)."""

from __future__ import annotations

import socket

import numpy as np
import pytest
from ghash_paths import GHASHES, expected_ghash, use_ghash
from inproc import make_group, run_threads

from stalwart.comm import native
from stalwart.comm.wire import HEADER, HEADER_BYTES, MAGIC, OVERHEAD, Wire, max_floats_for_mtu

KEY = bytes(range(32))


def _engine(ref: Wire, sock: socket.socket, chunk: int):  # noqa: ANN202 (the C type)
    return native.module().Engine(fd=sock.fileno(), key=ref.job_key, job=ref.job, world=2, me=0,
                                  shard_lens=ref.shard_lens, chunk=chunk,
                                  slot=OVERHEAD + 4 * chunk, rounds_open=2, may_copy=False,
                                  batch=4, rx_segments=1)


def _rows(mtu: int) -> tuple[Wire, np.ndarray, np.ndarray, np.ndarray]:
    """The reference's sealed rows for every payload length from 0 to a full chunk (the
    header's 40 bytes put the payload at every offset within a 16-byte GHASH block, and the
    tail at every partial length and every position in a 512-bit group of either GHASH), the
    unsealed rows (headers only), the lengths and the payloads back to back."""
    chunk = max_floats_for_mtu(mtu)
    lens = np.array([chunk, chunk, *range(chunk - 1, -1, -1)])
    ref = Wire(KEY, 3, 2, 0, [int(lens.sum()), 1], chunk)
    rng = np.random.default_rng(mtu)
    rows = np.zeros((len(lens), OVERHEAD + 4 * chunk), np.uint8)
    hdr = rows[:, :HEADER_BYTES].view(HEADER).reshape(len(lens))
    hdr["magic"], hdr["job"], hdr["length"] = MAGIC, ref.job, lens
    hdr["offset"] = rng.integers(0, 2**31, len(lens))
    values = rng.standard_normal(int(lens.sum())).astype(np.float32)
    blank = rows.copy()
    ref.seal_rows(rows, lens, values)
    return ref, rows, blank, values


def _use(ghash: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if not native.AVAILABLE:
        pytest.skip("the native engine is not built")
    use_ghash(ghash, monkeypatch)


@pytest.mark.parametrize("fill", [True, False])
@pytest.mark.parametrize("ghash", GHASHES)
@pytest.mark.parametrize("mtu", [1500, 9000])
def test_native_seal_equals_the_python_reference(mtu: int, ghash: str, fill: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every payload length from 0 to a full chunk, through each GHASH this CPU has: the
    engine's 512-bit one (the default where the CPU has AVX-512), its 256-bit one
    (``STALWART_GHASH=vpclmulqdq``) and OpenSSL's (``=openssl``); the payloads copied into the
    rows while sealing (``fill``: the MTU 1500 send) or already there."""
    _use(ghash, monkeypatch)
    ref, rows, mine, values = _rows(mtu)
    lens = mine[:, :HEADER_BYTES].view(HEADER).reshape(len(mine))["length"].astype(np.int64)
    if not fill:
        at = np.concatenate([[0], np.cumsum(lens)])
        for i, n in enumerate(lens.tolist()):
            mine[i, HEADER_BYTES: HEADER_BYTES + 4 * n] = values[at[i]: at[i] + n].view(np.uint8)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        eng = _engine(ref, s, max_floats_for_mtu(mtu))
        eng.seal(mine, lens, *((values,) if fill else ()))
        used = eng.counters()["ghash"]
    assert used == expected_ghash(ghash)
    for i, n in enumerate(lens.tolist()):  # header, payload, tag: the bytes that go on the wire
        end = OVERHEAD + 4 * n
        assert bytes(mine[i, :end]) == bytes(rows[i, :end]), f"row {i} ({n} floats)"


@pytest.mark.parametrize("ghash", GHASHES)
def test_direct_send_datagrams_equal_the_python_reference(ghash: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """MTU 9000's send from the values (header, payload and tag as three iovecs: the tag over a
    header and a payload that are not contiguous): each datagram on the wire is the
    reference's, for every payload length."""
    _use(ghash, monkeypatch)
    mtu = 9000
    ref, rows, blank, values = _rows(mtu)
    lens = blank[:, :HEADER_BYTES].view(HEADER).reshape(len(blank))["length"].astype(np.int64)
    at = np.concatenate([[0], np.cumsum(lens)])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        rx.bind(("127.0.0.1", 0))
        rx.settimeout(5.0)
        tx.bind(("127.0.0.1", 0))
        eng = _engine(ref, tx, max_floats_for_mtu(mtu))
        eng.set_peers([0x7F000001] * 2, [tx.getsockname()[1], rx.getsockname()[1]])
        assert eng.counters()["ghash"] == expected_ghash(ghash)
        step = 64
        for a in range(0, len(lens), step):
            b = min(a + step, len(lens))
            part = np.ascontiguousarray(blank[a:b])
            sent = eng.send([(part, lens[a:b], values[at[a]: at[b]], 1)], 1, True)
            assert sent[0] == b - a and sent[2] == 0, sent
            for i in range(a, b):
                end = OVERHEAD + 4 * int(lens[i])
                assert rx.recv(65536) == bytes(rows[i, :end]), f"row {i} ({lens[i]} floats)"


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
