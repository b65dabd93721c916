"""The native receive path's finite-value check, which its tag pass does on the GHASH's own
loads (``gh_tag_check`` / ``gh_ztag_check`` in engine.c; a scan after the tag with OpenSSL's
GHASH), gives the Python reference's verdict (``Wire.check_one``) for a NaN or an infinity at
every position of a full chunk and of partial chunks of lengths that put the payload's end at
every offset of the hash's 128-byte groups and at the 512-bit GHASH's 512-byte group bounds, at
both MTUs and through each GHASH this CPU has (512-bit, 256-bit, OpenSSL's); finite payloads
are accepted and placed bit for bit."""

from __future__ import annotations

import socket

import numpy as np
import pytest
from fuzz_native import bind_rounds
from ghash_paths import GHASHES, expected_ghash, use_ghash

from stalwart.comm import native
from stalwart.comm.layout import Layout
from stalwart.comm.rounds import ROUNDS_OPEN
from stalwart.comm.wire import OVERHEAD, PHASE_GRAD, REASONS, Wire, max_floats_for_mtu

KEY, JOB, WORLD, ME = bytes(range(32)), 7, 2, 0


def _engine(lay: Layout, chunk: int):  # noqa: ANN202 (the C type)
    wires = [Wire(KEY, JOB, WORLD, s, lay.shard_lens, chunk) for s in range(WORLD)]
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    eng = native.module().Engine(fd=sock.fileno(), key=wires[ME].job_key, job=JOB, world=WORLD,
                                 me=ME, shard_lens=lay.shard_lens, chunk=chunk,
                                 slot=OVERHEAD + 4 * chunk, rounds_open=ROUNDS_OPEN,
                                 may_copy=False, batch=4, rx_segments=1)
    eng.set_peers([0x7F000001] * WORLD, [1000 + s for s in range(WORLD)])
    rounds = bind_rounds(eng, lay, ME)
    shared = (np.zeros(WORLD), np.zeros(WORLD, bool), np.zeros(len(REASONS), np.int64),
              np.zeros(WORLD), np.zeros(WORLD))
    eng.bind_shared(*shared)
    eng.set_round(0)
    return eng, wires, rounds, sock, shared


@pytest.mark.parametrize("ghash", GHASHES)
@pytest.mark.parametrize("mtu", [1500, 9000])
def test_native_finite_check_equals_the_python_reference(mtu: int, ghash: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    if not native.AVAILABLE:
        pytest.skip("the native engine is not built")
    use_ghash(ghash, monkeypatch)
    chunk = max_floats_for_mtu(mtu)
    # payload lengths whose end (40 + 4n bytes) falls at every 4-byte offset of a 128-byte
    # group, within, at and past the first group (22 floats), at the first and second 512-byte
    # groups' ends (118 and 246 floats), and the full chunk
    lens = sorted({chunk, chunk - 1, 1, 2, 21, 22, 23, *range(54, 86), 117, 118, 119, 245, 246,
                   247})
    rng = np.random.default_rng(mtu)
    for m in lens:
        lay = Layout(numel=2 * m, world=WORLD, chunk=chunk)  # shard 0: one chunk of m floats
        eng, wires, rounds, sock, _ = _engine(lay, chunk)
        try:
            assert eng.counters()["ghash"] == expected_ghash(ghash)
            ref = Wire(KEY, JOB, WORLD, ME, lay.shard_lens, chunk)
            base = rng.standard_normal(m).astype(np.float32)
            positions = range(m) if m <= 64 or m == chunk else rng.choice(m, 64, replace=False)
            for pos in positions:
                for bad in (np.nan, np.inf, -np.inf):
                    x = base.copy()
                    x[pos] = bad
                    pkt = wires[1].packet(PHASE_GRAD, 0, ME, 0, x)
                    want = ref.check_one(pkt, 1, 0)[1]
                    assert want == REASONS.index("nonfinite")
                    assert eng.feed(pkt, 1) == want, (mtu, ghash, m, pos, bad)
            pkt = wires[1].packet(PHASE_GRAD, 0, ME, 0, base)
            assert ref.check_one(pkt, 1, 0)[1] == 0
            assert eng.feed(pkt, 1) == 0
            assert rounds[0].acc.sum[:m].tobytes() == base.tobytes()
        finally:
            sock.close()
