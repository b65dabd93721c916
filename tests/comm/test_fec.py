"""Erasure-coded phases: the Reed-Solomon coder, the parity planner, parity packets on the wire,
and the real UDP collective rebuilding chunks lost in bursts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from inproc import Dropping, make_group, run_threads

from stalwart.comm import fec
from stalwart.comm.layout import Layout
from stalwart.comm.wire import FLAG_PARITY, PHASE_GRAD, R, Wire, max_floats_for_mtu


def _blocks(values: np.ndarray, chunk: int, geo: fec.Stripes) -> np.ndarray:
    pad = np.zeros(geo.k * geo.S * chunk, np.float32)
    pad[: values.size] = values
    return pad.reshape(geo.k * geo.S, chunk)


def _rebuild(blocks: np.ndarray, par: np.ndarray, geo: fec.Stripes, i: int,
             lost: list[int], lost_par: list[int]) -> np.ndarray:
    """Decode stripe i with data members ``lost`` and parity rows ``lost_par`` missing."""
    k, S = geo.k, geo.S
    prow = [j for j in range(geo.m) if j not in lost_par][: len(lost)]
    known = [j for j in range(k) if j not in lost]
    src = [blocks[j * S + i].ctypes.data for j in known]
    src += [par[j * S + i].ctypes.data for j in prow]
    coef = fec.decode_matrix(k, geo.m, lost, prow)
    return fec.decode(coef, np.array(src, np.uint64), blocks.shape[1] * 4).view(np.float32)


def test_every_erasure_pattern_up_to_m_is_rebuilt_exactly() -> None:
    rng = np.random.default_rng(0)
    chunk, geo = 7, fec.Stripes(n=14, S=3, m=3)  # k = 5, the last stripe has a virtual member
    values = rng.standard_normal(14 * chunk - 3).astype(np.float32)  # short last chunk
    par = fec.encode(values, chunk, geo)
    blocks = _blocks(values, chunk, geo)
    for i in range(geo.S):
        for e in range(1, geo.m + 1):
            for lost in itertools.combinations(range(geo.k), e):
                for lost_par in itertools.combinations(range(geo.m), geo.m - e):
                    out = _rebuild(blocks, par, geo, i, list(lost), list(lost_par))
                    for x, j in enumerate(lost):
                        assert np.array_equal(out[x], blocks[j * geo.S + i]), (i, lost, lost_par)


def test_large_code_rebuilds_a_burst_and_native_equals_numpy(monkeypatch) -> None:
    rng = np.random.default_rng(1)
    chunk, geo = 354, fec.Stripes(n=700, S=4, m=40)  # k = 175
    values = rng.standard_normal(700 * chunk).astype(np.float32)
    par = fec.encode(values, chunk, geo)
    blocks = _blocks(values, chunk, geo)
    lost = list(range(60, 100))  # 40 consecutive members of stripe 2
    out = _rebuild(blocks, par, geo, 2, lost, [])
    assert all(np.array_equal(out[x], blocks[j * 4 + 2]) for x, j in enumerate(lost))
    # the numpy arithmetic (the fallback, and the reference) gives the same bytes
    small = fec.Stripes(n=12, S=2, m=3)
    v = rng.standard_normal(12 * 16).astype(np.float32)
    native = fec.encode(v, 16, small)
    monkeypatch.setattr(fec, "_ISAL", None)
    assert np.array_equal(fec.encode(v, 16, small).view(np.uint32), native.view(np.uint32))


def test_gf_inverse_and_cauchy_submatrices() -> None:
    a = fec.cauchy(6, 4)
    for rows in itertools.combinations(range(4), 3):
        sub = a[np.ix_(list(rows), [0, 2, 5])]
        assert np.array_equal(fec.gf_matmul(fec.gf_invert(sub), sub), np.eye(3, dtype=np.uint8))


@pytest.mark.parametrize("n", [14, 85, 470, 2960])
def test_plan_meets_the_target_within_bounds_and_grows_with_loss(n: int) -> None:
    target, last = 2e-5, 0
    for p in (1e-4, 1e-3, 0.01, 0.05, 0.1, 0.2):
        for run in (1, 8):
            geo = fec.plan(n, p, target, run)
            assert geo is not None and geo.valid() and geo.k + geo.m <= 256
            assert geo.parity <= 2 * n + geo.S
            b = -(-run // geo.S) if geo.S < run else 1
            if fec.residual(geo.k, geo.m, fec._bucket(p), b) > target:
                # out of reach within 2x parity (tiny phases in runs): the most protection
                assert geo.parity >= 2 * n - geo.S, (n, p, run, geo)
        geo = fec.plan(n, p, target, 1)
        assert geo.parity >= last  # more loss, never less parity
        last = geo.parity
    assert fec.plan(n, 1e-6, target) is None  # below the target: no parity at all


def test_residual_matches_a_direct_count() -> None:
    # k=4, m=2, p=0.3: a given packet is lost after decoding iff it is lost and >= 2 of the
    # other 5 are -- enumerate all 2**6 patterns
    k, m, p = 4, 2, 0.3
    direct = 0.0
    for pat in itertools.product([0, 1], repeat=k + m):
        if pat[0] and sum(pat) > m:
            direct += p ** sum(pat) * (1 - p) ** (k + m - sum(pat))
    assert fec.residual(k, m, p) == pytest.approx(direct, rel=1e-9)


def test_parity_packets_pass_the_parser_and_bad_geometry_is_rejected() -> None:
    lay = Layout(numel=400, world=2, chunk=8)  # 25 chunks per shard
    rx = Wire(bytes(32), 3, 2, 0, lay.shard_lens, 8)
    tx = Wire(bytes(32), 3, 2, 1, lay.shard_lens, 8)
    garbage = np.frombuffer(np.array([0x7FC00000] * 8, np.uint32).tobytes(), np.float32)

    def par(S: int, m: int, q: int, length: int = 8) -> int:
        pkt = tx.packet(PHASE_GRAD, 0, 0, q, garbage[:length], flags=FLAG_PARITY, fb=S,
                        copies=m)
        return rx.check_one(pkt, 1, 0)[1]

    assert par(5, 3, 14) == R["ok"]  # NaN bit patterns are fine in parity
    assert par(5, 3, 15) == R["bad_range"]  # index past m*S
    assert par(0, 3, 0) == R["bad_range"]  # no stripes
    assert par(26, 1, 0) == R["bad_range"]  # more stripes than packets
    assert par(1, 240, 0) == R["bad_range"]  # k + m > 256
    assert par(5, 3, 0, length=7) == R["bad_range"]  # parity is a whole chunk


# data and parity dropped in bursts of 8 consecutive arrivals out of every 50 (16% loss, all
# of it in bursts), before the receiver's checks
PERIOD, BURST = 50, 8


@pytest.mark.parametrize("mode,inplace", [("rs", False), ("rs", True), ("none", False)])
def test_bursty_loss_is_rebuilt_by_parity_and_lost_without(mode: str, inplace: bool,
                                                           engine: str) -> None:
    # inplace: allreduce(x, out=x), where the native engine places the owners' chunks in the
    # output itself and rebuilds the lost ones there (reading the arrived ones from it)
    world, numel = 3, 120_000
    group = make_group(world, numel, cls=Dropping, fec_mode=mode, cap=2.0)
    for c in group:
        c.set_drop(PERIOD, BURST)
    try:
        lost = recovered = 0
        for it in range(3):
            xs = [np.arange(numel, dtype=np.float32) * 1e-3 + 2.0 ** r + it for r in range(world)]
            exact = sum(xs) / world
            bufs = [x.copy() for x in xs]
            outs = run_threads([lambda c=c, x=x, b=b: c.allreduce(b, out=b) if inplace
                                else c.allreduce(x)
                                for c, x, b in zip(group, xs, bufs, strict=True)])
            assert not any(isinstance(o, BaseException) for o in outs), outs
            for (out, phases), b in zip(outs, bufs, strict=True):
                assert not inplace or out is b
                lost += sum(p.lost for p in phases)
                recovered += sum(p.recovered for p in phases)
                if mode == "rs":
                    np.testing.assert_allclose(out, exact, rtol=1e-6)
        assert all(c.dropped > 100 for c in group)  # the bursts really dropped packets
        if mode == "rs":
            assert lost == 0 and recovered > 100
            assert all(c.bad_packets() == 0 for c in group)
        else:
            assert lost > 100 and recovered == 0
    finally:
        for c in group:
            c.close()


def test_floor_interleaves_a_run_and_stays_small() -> None:
    for n, run in [(2960, 32), (1480, 23), (300, 8), (128, 8), (60_000, 32)]:
        geo = fec.floor(n, run)
        assert geo is not None and geo.m == 1 and geo.valid()
        assert geo.S >= run  # a run's consecutive packets fall in different stripes
        assert geo.k >= fec.FLOOR_MIN_K - 1 and geo.parity * fec.FLOOR_MIN_K <= n + geo.S
        # one run dropped whole, anywhere: at most one packet per stripe
        for start in (0, 1, n // 2, n - run):
            hit = np.bincount(np.arange(start, start + run) % geo.S, minlength=geo.S)
            assert hit.max() <= 1
    assert fec.floor(100, 8) is None  # 8 parity per 100: past 1/16 of the phase
    assert fec.floor(0, 8) is None


def _rounds(group: list, numel: int, rounds: int) -> tuple[int, int]:
    """``rounds`` all-reduces of distinct vectors; asserts exact results; (lost, recovered)."""
    world = len(group)
    lost = recovered = 0
    for it in range(rounds):
        xs = [np.arange(numel, dtype=np.float32) * 1e-3 + 2.0 ** r + it for r in range(world)]
        outs = run_threads([lambda c=c, x=x: c.allreduce(x)
                            for c, x in zip(group, xs, strict=True)])
        assert not any(isinstance(o, BaseException) for o in outs), outs
        for out, phases in outs:
            lost += sum(p.lost for p in phases)
            recovered += sum(p.recovered for p in phases)
            if not sum(p.lost for p in phases):
                np.testing.assert_allclose(out, sum(xs) / world, rtol=1e-6)
    return lost, recovered


@pytest.mark.parametrize("floor", [True, False])
def test_a_run_dropped_on_a_clean_link_is_rebuilt(floor: bool, engine: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # every link reads clean (``Sender.link_loss`` 0: what a sender sees after 16 reports of 0), and
    # one run of consecutive data packets -- the sender's run length -- is dropped whole from
    # every sender in both phases of every round: the first loss event after a clean period.
    # With the clean-link floor each stripe loses one packet and is rebuilt; without it
    # (the rule before: no parity on a clean link) the run is lost for good.
    if not floor:
        monkeypatch.setattr(fec, "floor", lambda n, run=1: None)
    world, numel = 3, 300_000
    group = make_group(world, numel, cls=Dropping, fec_mode="rs", cap=2.0)
    try:
        n = min(group[0].layout.n_chunks(s) for s in range(world))
        run = group[0].sender._run(n)
        assert fec.floor(n, run) is not None or not floor
        for c in group:
            c.sender.link_loss = lambda dest: 0.0
            c.set_drop(rules=[(-1, 0xFF, 0, run, 2 * run, -1)])
        lost, recovered = _rounds(group, numel, 2)
        assert all(c.dropped >= 2 * run for c in group)
        if floor:
            assert lost == 0 and recovered > 0
            assert all(c.bad_packets() == 0 for c in group)
        else:
            assert lost > 0 and recovered == 0
    finally:
        for c in group:
            c.close()


@pytest.mark.parametrize("mtu", [1500, 9000])
@pytest.mark.parametrize("loss", [0.0, 0.05])
def test_parity_filled_while_sealing_equals_the_encoder(loss: float, mtu: int, engine: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # the native send accumulates the parity while it seals each packet (MTU 1500: rows
    # filled, then tagged; 9000: tagged and sent from the values); every parity block it made
    # must be the coder's (fec.encode) bit for bit, for the clean floor (m = 1) and a lossy
    # link's plan (m > 1), the shards' short last packets included
    from stalwart.comm.sending import Sender

    made: list[tuple[bool, bool]] = []
    orig = Sender._parity_rows

    def check(self, phase, shard, values, geo, hint_us, par=None):  # noqa: ANN001, ANN202
        if par is not None:
            ref = fec.encode(values, self.chunk, geo)
            made.append((geo.m > 1, bool(np.array_equal(par.view(np.uint32),
                                                        ref.view(np.uint32)))))
        return orig(self, phase, shard, values, geo, hint_us, par)

    monkeypatch.setattr(Sender, "_parity_rows", check)
    world = 3
    numel = 3 * max_floats_for_mtu(mtu) * (300 if mtu == 1500 else 140) + 17
    group = make_group(world, numel, mtu=mtu, fec_mode="rs", cap=2.0)
    try:
        for c in group:
            c.sender.link_loss = lambda dest, p=loss: p
        lost, _ = _rounds(group, numel, 2)
        assert lost == 0
    finally:
        for c in group:
            c.close()
    if engine == "native":
        assert made and all(ok for _, ok in made)
        assert all(big == (loss > 0) for big, _ in made)
    else:
        assert not made  # the Python engine encodes in a pass of its own
