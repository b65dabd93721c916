"""Packet format: authentication and validation reject bad packets (counted, never raised)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stalwart.comm.layout import Layout
from stalwart.comm.wire import (
    FLAG_END,
    HEADER_BYTES,
    OVERHEAD,
    PHASE_GRAD,
    PHASE_NORM,
    PHASE_VALUE,
    R,
    Wire,
    max_floats_for_mtu,
)

KEY = bytes(range(32))
WORLD, CHUNK = 3, 8
LAY = Layout(numel=50, world=WORLD, chunk=CHUNK)  # shards of 17, 17, 16: not divisible


def wire(me: int, key: bytes = KEY, job: int = 7) -> Wire:
    return Wire(key, job, WORLD, me, LAY.shard_lens, CHUNK)


def good_packet(sender: int = 1, rnd: int = 5, offset: int = 8) -> bytes:
    """A valid gradient chunk from ``sender`` for owner 0's shard."""
    n = min(CHUNK, LAY.shard_len(0) - offset)
    return wire(sender).packet(PHASE_GRAD, rnd, 0, offset, np.arange(n, dtype=np.float32))


def check(data: bytes, src: int | None = 1, rnd: int = 5, me: int = 0) -> int:
    return wire(me).check_one(data, src, rnd)[1]


def test_valid_packet_is_accepted_in_current_and_next_round() -> None:
    assert check(good_packet(rnd=5), rnd=5) == R["ok"]
    assert check(good_packet(rnd=6), rnd=5) == R["ok"]  # a peer one round ahead
    assert check(good_packet(offset=16), rnd=5) == R["ok"]  # the short last chunk (1 float)


def test_wrong_key_and_other_job_are_rejected() -> None:
    forged = Wire(bytes(32), 7, WORLD, 1, LAY.shard_lens, CHUNK).packet(
        PHASE_GRAD, 5, 0, 0, np.ones(CHUNK, np.float32))
    assert check(forged) == R["bad_tag"]
    other_job = Wire(KEY, 8, WORLD, 1, LAY.shard_lens, CHUNK).packet(
        PHASE_GRAD, 5, 0, 0, np.ones(CHUNK, np.float32))
    assert check(other_job) == R["malformed"]


@pytest.mark.parametrize("where", [0, 5, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 9, -1])
def test_tampering_anywhere_is_rejected(where: int) -> None:
    pkt = bytearray(good_packet())
    pkt[where] ^= 0x01
    assert check(bytes(pkt)) != R["ok"]


def test_replay_of_an_old_round_is_rejected() -> None:
    assert check(good_packet(rnd=4), rnd=5) == R["old_round"]
    assert check(good_packet(rnd=7), rnd=5) == R["future_round"]


def test_unknown_senders_are_rejected() -> None:
    assert check(good_packet(sender=1), src=2) == R["unknown_sender"]  # spoofed address
    assert check(good_packet(sender=1), src=None) == R["unknown_sender"]  # not a peer at all
    own = wire(0).packet(PHASE_GRAD, 5, 0, 0, np.ones(CHUNK, np.float32))
    assert check(own, src=0) == R["unknown_sender"]  # claims to be me
    big = wire(1).packet(PHASE_GRAD, 5, 0, 0, np.ones(CHUNK, np.float32), sender=9)
    assert check(big, src=1) == R["unknown_sender"]


@pytest.mark.parametrize("phase,shard,offset,n", [
    (PHASE_GRAD, 1, 0, CHUNK),  # gradient for a shard I do not own
    (PHASE_GRAD, 0, 3, CHUNK),  # offset not chunk-aligned
    (PHASE_GRAD, 0, 0, CHUNK - 1),  # short chunk where a full one belongs
    (PHASE_GRAD, 0, 24, 1),  # offset past the shard's end
    (PHASE_GRAD, 0, 16, 2),  # runs past the shard's end
    (PHASE_VALUE, 2, 0, CHUNK),  # values of a shard the sender does not own
    (3, 0, 0, CHUNK),  # unknown phase
    (PHASE_NORM, 1, 0, 2),  # a norm is one float
    (PHASE_NORM, 0, 0, 1),  # a norm of a shard the sender does not own
])
def test_out_of_range_packets_are_rejected(phase: int, shard: int, offset: int, n: int) -> None:
    pkt = wire(1).packet(phase, 5, shard, offset, np.ones(n, np.float32))
    assert check(pkt) == R["bad_range"]


def test_owner_values_and_end_markers_are_accepted() -> None:
    vals = wire(1).packet(PHASE_VALUE, 5, 1, 0, np.ones(CHUNK, np.float32))
    assert check(vals) == R["ok"]
    end = wire(1).packet(PHASE_GRAD, 5, 0, 3, np.zeros(0, np.float32), flags=FLAG_END, hint=9)
    assert check(end) == R["ok"]
    # a marker carries no payload (its length field counts the parity packets it announces)
    bad_end = wire(1).packet(PHASE_GRAD, 5, 0, 3, np.ones(2, np.float32), flags=FLAG_END)
    assert check(bad_end) == R["malformed"]
    with_parity = wire(1).packet(PHASE_GRAD, 5, 0, 3, np.zeros(0, np.float32), flags=FLAG_END,
                                 length=4)
    assert check(with_parity) == R["ok"]
    # announcing more parity packets than a slot holds bytes is still a valid marker
    many = wire(1).packet(PHASE_GRAD, 5, 0, 3, np.zeros(0, np.float32), flags=FLAG_END,
                          length=200)  # > the 88-byte slot, within the bound
    assert wire(0).check_one(many, 1, 5, slot=OVERHEAD + 4 * CHUNK)[1] == R["ok"]
    norm_end = wire(1).packet(PHASE_NORM, 5, 1, 0, np.zeros(0, np.float32), flags=FLAG_END)
    assert check(norm_end) == R["bad_range"]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_payload_is_rejected(bad: float) -> None:
    x = np.ones(CHUNK, np.float32)
    x[3] = bad
    assert check(wire(1).packet(PHASE_GRAD, 5, 0, 0, x)) == R["nonfinite"]


def test_truncated_and_padded_datagrams_are_malformed() -> None:
    pkt = good_packet()
    assert check(pkt[:-1]) == R["malformed"]
    assert check(pkt + b"\0") == R["malformed"]
    assert check(b"") == R["malformed"]
    assert check(pkt[:OVERHEAD - 1]) == R["malformed"]


def test_mtu_sizing_never_fragments() -> None:
    for mtu in (576, 1500, 9000, 65535):
        n = max_floats_for_mtu(mtu)
        assert 28 + OVERHEAD + 4 * n <= mtu < 28 + OVERHEAD + 4 * (n + 1)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=0, max_size=OVERHEAD + 4 * CHUNK + 8), st.integers(0, 2**32 - 1),
       st.sampled_from([None, 0, 1, 2]))
def test_fuzz_random_datagrams_never_raise_and_are_rejected(data: bytes, rnd: int,
                                                            src: int | None) -> None:
    w = wire(0)
    hdr, why = w.check_one(data, src, rnd)
    assert 0 < why < len(R)  # no random datagram carries a valid 128-bit tag


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.integers(0, OVERHEAD + 4 * CHUNK - 1), st.integers(1, 255),
                       min_size=1, max_size=6))
def test_fuzz_mutated_packets_are_rejected_and_nothing_is_written(
        flips: dict[int, int]) -> None:
    pkt = bytearray(good_packet(offset=0))
    for pos, x in flips.items():  # distinct positions, nonzero xor: the packet really changed
        pkt[pos] ^= x
    w = wire(0)
    rows = np.zeros((1, len(pkt)), np.uint8)
    rows[0] = np.frombuffer(bytes(pkt), np.uint8)
    before = rows.copy()
    src_ok = np.array([[False, True, False]])
    _, reasons = w.check(rows, np.array([len(pkt)]), src_ok, 5)
    assert reasons[0] != R["ok"]
    assert np.array_equal(rows, before)


def test_batch_check_mixes_good_and_bad() -> None:
    pkts = [good_packet(), good_packet(rnd=1), b"junk", good_packet(offset=16)]
    slot = max(len(p) for p in pkts)
    rows = np.zeros((len(pkts), slot), np.uint8)
    for i, p in enumerate(pkts):
        rows[i, :len(p)] = np.frombuffer(p, np.uint8)
    src_ok = np.zeros((len(pkts), WORLD), bool)
    src_ok[:, 1] = True
    hdr, reasons = wire(0).check(rows, np.array([len(p) for p in pkts]), src_ok, 5)
    assert reasons.tolist() == [R["ok"], R["old_round"], R["malformed"], R["ok"]]
    assert hdr["offset"][3] == 16 and hdr["length"][3] == 1
