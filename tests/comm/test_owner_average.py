"""The owner's average: the sum is never cleared between rounds (a chunk's first contribution
is copied in), the owner's own values are averaged in at the end, and the native engine's
one-pass ``Engine.average`` gives the numpy reference's bits (``aggregate.ShardAccumulator``)."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from stalwart.comm import native
from stalwart.comm.aggregate import ShardAccumulator
from stalwart.comm.layout import Layout
from stalwart.comm.rounds import ROUNDS_OPEN
from stalwart.comm.wire import OVERHEAD, PHASE_GRAD, Wire
from tests.comm.fuzz_native import bind_rounds

WORLD, ME, CHUNK = 4, 1, 16
LAY = Layout(numel=4 * 16 * 9 + 7, world=WORLD, chunk=CHUNK)  # a short last chunk


def _fill(acc: ShardAccumulator, rng: np.random.Generator, senders: list[int],
          p_arrive: float) -> list[tuple[int, int, np.ndarray]]:
    """Each sender's chunks arrive with probability ``p_arrive``; returns what was added."""
    lo, hi = LAY.shard(acc.owner)
    added = []
    for s in senders:
        for c in range(LAY.n_chunks(acc.owner)):
            if rng.random() < p_arrive:
                n = min(CHUNK, hi - lo - c * CHUNK)
                v = rng.standard_normal(n).astype(np.float32)
                assert acc.add(s, c * CHUNK, v)
                added.append((s, c, v))
    return added


def test_a_reset_round_ignores_the_previous_rounds_sum() -> None:
    rng = np.random.default_rng(0)
    acc = ShardAccumulator(LAY, ME)
    lo, hi = LAY.shard(ME)
    others = [s for s in range(WORLD) if s != ME]
    acc.add_own(np.full(hi - lo, 1e6, np.float32))
    _fill(acc, rng, others, 1.0)  # round 1: a large sum everywhere
    acc.reset()
    own = rng.standard_normal(hi - lo).astype(np.float32)
    acc.add_own(own)
    added = _fill(acc, rng, others, 0.5)  # round 2: some chunks get nothing but the own
    tot, cnt = own.astype(np.float64), np.ones(hi - lo)
    for _, c, v in added:
        tot[c * CHUNK: c * CHUNK + v.size] += v
        cnt[c * CHUNK: c * CHUNK + v.size] += 1
    assert (cnt == 1).any() and (cnt > 1).any()
    np.testing.assert_allclose(acc.average(), tot / cnt, rtol=1e-5, atol=1e-6)
    nothing = cnt == 1
    assert np.array_equal(acc.average()[nothing], own[nothing])  # the own values, exactly


class _Engine:
    """A never-started native engine (rank ``ME``) bound to Python-owned round buffers."""

    def __init__(self) -> None:
        mod = native.module()
        wire = Wire(b"k" * 32, 7, WORLD, ME, LAY.shard_lens, CHUNK)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.eng = mod.Engine(fd=self.sock.fileno(), key=wire.job_key, job=7, world=WORLD,
                              me=ME, shard_lens=LAY.shard_lens, chunk=CHUNK,
                              slot=OVERHEAD + 4 * CHUNK, rounds_open=ROUNDS_OPEN,
                              may_copy=False, batch=4, rx_segments=1)
        self.rounds = bind_rounds(self.eng, LAY, ME)

    def close(self) -> None:
        self.eng.stop()
        self.sock.close()


@pytest.mark.skipif(not native.AVAILABLE, reason="the native engine is not built")
@pytest.mark.parametrize("p_arrive", [0.0, 0.4, 1.0])
def test_the_native_average_is_the_reference_bit_for_bit(p_arrive: float) -> None:
    rng = np.random.default_rng(int(p_arrive * 10))
    e = _Engine()
    try:
        st = e.rounds[0]
        lo, hi = LAY.shard(ME)
        st.acc.sum[:] = rng.standard_normal(st.acc.sum.size) * 1e3  # a previous round's
        _fill(st.acc, rng, [s for s in range(WORLD) if s != ME], p_arrive)
        own = (rng.standard_normal(hi - lo) * 3).astype(np.float32)
        st.acc.add_own(own)
        ref = st.acc.average()
        with pytest.raises(ValueError, match="still open"):
            e.eng.average(0, 0, own, np.empty_like(own))
        e.eng.close_phase(0, PHASE_GRAD)
        out = np.full_like(own, np.nan)
        e.eng.average(0, 0, own, out)
        assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))
        inplace = own.copy()
        e.eng.average(0, 0, inplace, inplace)  # out is own: element-wise in place
        assert np.array_equal(inplace.view(np.uint32), ref.view(np.uint32))
        both = np.zeros(2 * own.size, np.float32)
        with pytest.raises(ValueError, match="overlaps"):
            e.eng.average(0, 0, both[: own.size], both[1: own.size + 1])
        with pytest.raises(ValueError, match="shard's length"):
            e.eng.average(0, 0, own[:-1], out[:-1])
        with pytest.raises(ValueError, match="round"):
            e.eng.average(0, 1, own, out)
    finally:
        e.close()
