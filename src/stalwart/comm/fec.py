"""Systematic Reed-Solomon erasure coding of a phase's packets (forward error correction).

Mechanism: instead of sending every packet c times (repetition: loss p -> p**c for c times the
bytes), a sender cuts the k*S data packets it sends one peer in a phase into S *stripes* of k
packets, sends the data packets as they are (systematic) and adds m parity packets per stripe;
the receiver rebuilds the data of any stripe from any k of its k+m packets (an MDS code: a
Cauchy matrix over GF(2^8), so k + m <= 256). Stripes are *interleaved*: data packet r belongs
to stripe r % S and parity packet q to stripe q % S, so consecutive datagrams -- which a burst,
or a dropped segmentation-offload run, takes together -- fall into different stripes. The
receiver decodes only the stripes that lost data, as soon as k of their packets are in.

Parity per link is sized from that link's measured loss rate p (``plan``): the residual chunk
loss of a stripe is ``p * P(at least m of the other k+m-1 packets lost)``, computed exactly
(binomial tail); when segmentation offload sends runs of ``run`` datagrams that can be dropped
whole and S < run, a run carries ceil(run/S) packets of one stripe and the tail is computed in
runs instead. Among the geometries that meet the residual target the planner takes the one with
the fewest parity *bytes times k* (encoding and decoding cost k multiply-adds per parity byte:
past k ~ 64 the CPU, not the wire, is what a larger stripe costs), within a wire budget.
A link that reads clean (``plan`` gives None) gets ``floor``: one parity packet per stripe,
stripes interleaved at least as many ways as a sent run is long, so that the first run dropped
whole after a clean period is rebuilt (the native engine makes parity while it seals each
packet, so the floor costs no pass of its own over the data).

Library, chosen by measurement on this project's machines (x86-64, AVX2, 2 shared cores;
4 MiB of data per call, MTU 1500 packets): ISA-L's ``ec_encode_data`` (Intel's erasure code
library, SIMD GF(2^8) multiply-add) encodes 4.7 GB/s of data with 1 parity row, 0.77 GB/s with
20 and 0.15 GB/s with 43 (6-15 GB/s of multiply-adds), and one call codes all S stripes at
once (the stripes' blocks are contiguous in the flat vector). zfec (C, Vandermonde) did 0.2
GB/s with 1 parity row and 0.1 GB/s with 8, one call per stripe on ``bytes`` objects; galois
(numpy) and reedsolo (pure Python) are slower still. ISA-L is loaded with ctypes: a system
``libisal`` if there is one, else the copy that the ``pyeclib`` wheel ships (a dependency of
this package, manylinux wheels for x86-64 and aarch64). Without either, a numpy
implementation of the same arithmetic runs instead (correct, ~100x slower; ``BACKEND`` says
which is in use, and the tests check ISA-L against it).

Guarantees: ``encode`` and ``decode`` are exact inverses for any erasure pattern of at most m
packets per stripe (tests: every pattern up to m for small codes, random bursts for large);
``plan`` is monotone in p and its geometry always satisfies k + m <= 256 and m*S <= 2*n (at
most 2x the data in parity, so protection that sizes itself from loss cannot feed on the load
it adds without bound).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import math
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from stalwart import envknobs

MAX_BLOCKS = 256  # k + m over GF(2^8) with a Cauchy matrix
MAX_PARITY_RATIO = 2.0  # parity packets per data packet, at most
# cost of a parity packet relative to its wire cost, per data packet in its stripe (k): from
# the measurements above, one datagram through kernel + tag costs about as much CPU as ~16
# multiply-add passes over it
CPU_PER_K = 1.0 / 16.0
FLOOR_MIN_K = 16  # data packets per stripe of the clean-link parity (``floor``), at least
WIRE_BUDGET = 0.45  # parity bytes per data byte the planner accepts before it trades CPU

# ---- GF(2^8), polynomial 0x11d (ISA-L's) --------------------------------------------------
_EXP = np.zeros(512, np.uint8)
_LOG = np.zeros(256, np.int64)
_x = 1
for _i in range(255):
    _EXP[_i] = _x
    _LOG[_x] = _i
    _x <<= 1
    if _x & 0x100:
        _x ^= 0x11D
_EXP[255:510] = _EXP[:255]
_a = np.arange(256)
MUL = np.where((_a[:, None] == 0) | (_a[None, :] == 0), 0,
               _EXP[(_LOG[_a][:, None] + _LOG[_a][None, :]) % 255]).astype(np.uint8)
INV = np.zeros(256, np.uint8)
INV[1:] = _EXP[(255 - _LOG[1:]) % 255]


def gf_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Matrix product over GF(2^8) (small matrices: coding coefficients, not data)."""
    prod = MUL[a[:, :, None], b[None, :, :]]  # (r, t, c)
    return np.bitwise_xor.reduce(prod, axis=1).astype(np.uint8)


def gf_invert(a: np.ndarray) -> np.ndarray:
    """Inverse of a square matrix over GF(2^8) (Gauss-Jordan); raises if singular."""
    n = a.shape[0]
    m = np.concatenate([a.astype(np.uint8), np.eye(n, dtype=np.uint8)], axis=1)
    for c in range(n):
        piv = c + int(np.flatnonzero(m[c:, c])[0]) if m[c:, c].any() else -1
        if piv < 0:
            raise ValueError("singular matrix")
        if piv != c:
            m[[c, piv]] = m[[piv, c]]
        m[c] = MUL[INV[m[c, c]], m[c]]
        f = m[:, c].copy()
        f[c] = 0
        m ^= MUL[f[:, None], m[c][None, :]]
    return m[:, n:].copy()


@lru_cache(maxsize=256)
def cauchy(k: int, m: int) -> np.ndarray:
    """The (m, k) parity coefficients: row j, column t = 1 / ((k + j) xor t) (ISA-L's
    ``gf_gen_cauchy1_matrix``). Every square submatrix of a Cauchy matrix is invertible, so
    the code is MDS: any k of the k+m packets determine the data."""
    if not (1 <= k and 0 <= m and k + m <= MAX_BLOCKS):
        raise ValueError(f"bad code k={k} m={m} (k + m <= {MAX_BLOCKS})")
    j = np.arange(k, k + m)[:, None]
    t = np.arange(k)[None, :]
    out = INV[j ^ t]
    out.flags.writeable = False
    return out


# ---- the multiply-add kernel: ISA-L, or numpy --------------------------------------------
ISAL_PATH: str | None = None  # the library loaded (the native engine dlopens the same one)


def _load_isal() -> ctypes.CDLL | None:
    if envknobs.fec_numpy():
        return None
    names = []
    found = ctypes.util.find_library("isal")
    if found:
        names.append(found)
    spec = importlib.util.find_spec("pyeclib")
    if spec is not None and spec.submodule_search_locations:
        site = os.path.dirname(list(spec.submodule_search_locations)[0])
        names += sorted(glob.glob(os.path.join(site, "pyeclib.libs", "libisal*.so*")))
    global ISAL_PATH
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            P, I = ctypes.c_void_p, ctypes.c_int  # noqa: E741
            lib.ec_init_tables.argtypes = [I, I, P, P]
            lib.ec_init_tables.restype = None
            lib.ec_encode_data.argtypes = [I, I, I, P, P, P]
            lib.ec_encode_data.restype = None
            ISAL_PATH = name
            return lib
        except (OSError, AttributeError):
            continue
    return None


_ISAL = _load_isal()
BACKEND = "isa-l" if _ISAL is not None else "numpy"


def apply(coef: np.ndarray, src: np.ndarray, dst: np.ndarray, nbytes: int) -> None:
    """dst[r] = sum_t coef[r, t] * src[t] over GF(2^8), ``nbytes`` bytes per block.

    ``src`` (k,) and ``dst`` (r,) are uint64 arrays of block addresses (the caller keeps the
    memory alive and ``nbytes`` readable/writable at each). One native call for all blocks.
    """
    r, k = coef.shape
    if r == 0 or nbytes == 0:
        return
    coef = np.ascontiguousarray(coef, np.uint8)
    src = np.ascontiguousarray(src, np.uint64)
    dst = np.ascontiguousarray(dst, np.uint64)
    if _ISAL is not None:
        tbls = np.empty(32 * k * r, np.uint8)
        _ISAL.ec_init_tables(k, r, coef.ctypes.data, tbls.ctypes.data)
        _ISAL.ec_encode_data(int(nbytes), k, r, tbls.ctypes.data, src.ctypes.data,
                             dst.ctypes.data)
        return
    blocks = [np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(int(p)))
              for p in src.tolist()]
    for i, p in enumerate(dst.tolist()):
        out = np.zeros(nbytes, np.uint8)
        for t in range(k):
            if coef[i, t]:
                out ^= MUL[coef[i, t]][blocks[t]]
        np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(int(p)))[:] = out


# ---- geometry -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Stripes:
    """n data packets in S interleaved stripes of k (the last stripes padded with virtual
    all-zero packets), m parity packets per stripe. Data packet r: stripe r % S, member
    r // S; parity packet q: stripe q % S, parity row q // S."""

    n: int
    S: int
    m: int

    @property
    def k(self) -> int:
        return -(-self.n // self.S)

    @property
    def parity(self) -> int:
        return self.m * self.S

    def valid(self) -> bool:
        return (1 <= self.S <= max(self.n, 1) and self.m >= 1
                and self.k + self.m <= MAX_BLOCKS and self.parity <= MAX_PARITY_RATIO
                * max(self.n, 1) + self.S)


_LOGFACT = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, 2 * MAX_BLOCKS + 2)))])


def _tail(n: int, t: int, p: float) -> float:
    """P(Binomial(n, p) >= t)."""
    if t <= 0:
        return 1.0
    if t > n:
        return 0.0
    x = np.arange(t, n + 1)
    logpmf = (_LOGFACT[n] - _LOGFACT[x] - _LOGFACT[n - x] + x * math.log(p)
              + (n - x) * math.log1p(-p))
    return float(min(np.exp(logpmf).sum(), 1.0))


def residual(k: int, m: int, p: float, b: int = 1) -> float:
    """Probability that a given data packet is lost after decoding: its packet is lost and
    more than m of its stripe's k+m packets are. With ``b`` > 1, packets go in units of b that
    are lost together (a dropped offload run): it counts units."""
    if p <= 0:
        return 0.0
    if p >= 1:
        return 1.0
    units = -(-k // b) + -(-m // b)
    return p * _tail(units - 1, m // b, p)


def parity_needed(k: int, p: float, target: float, b: int = 1) -> int | None:
    """Smallest m with residual <= target (None if none fits in GF(2^8)); the residual falls
    as m grows, so a binary search."""
    lo, hi = 1, MAX_BLOCKS - k
    if hi < 1 or residual(k, hi, p, b) > target:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if residual(k, mid, p, b) <= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _bucket(p: float) -> float:
    """p rounded UP onto a grid of 20 steps per decade (12% apart): plans are cached per
    bucket, so a rate that wanders a little does not re-plan every step."""
    if p <= 0:
        return 0.0
    return min(10.0 ** (math.ceil(math.log10(p) * 20 - 1e-9) / 20), 0.5)


def plan(n: int, p: float, target: float, run: int = 1) -> Stripes | None:
    """Stripe geometry for n data packets over a link with loss rate p (None: no parity
    needed, i.e. p alone already meets the target, or nothing to send)."""
    if n <= 0 or p <= target:
        return None
    return _plan(n, _bucket(p), target, max(1, run))


def floor(n: int, run: int = 1) -> Stripes | None:
    """The parity a link gets while it reads clean (``plan`` gives none): one parity packet
    per stripe, S = max(run, ceil(n / 255)) stripes (S <= n), so that a run of ``run``
    consecutive datagrams dropped whole -- a segmentation-offload run, the first loss event
    after a clean period -- costs every stripe at most one packet and is rebuilt. Two such
    events on one link in one phase can cost a chunk (per phase ~ (n x event rate)^2 / 2).
    None (no parity) where that is more than 1/``FLOOR_MIN_K`` of the phase's datagrams.
    Cost: S more datagrams per n (S/n, ~1.1% at MTU 1500 with 32-datagram runs) and one
    multiply-add per data byte, done while each packet is sealed (``Engine.send``) with the
    native engine."""
    S = max(1, run, -(-n // (MAX_BLOCKS - 1)))
    if S * FLOOR_MIN_K > n:
        return None  # a small phase: more than 1/16 of its datagrams again
    return Stripes(n, S, 1)


@lru_cache(maxsize=4096)
def _plan(n: int, p: float, target: float, run: int) -> Stripes | None:
    best: tuple[bool, float, Stripes] | None = None
    fallback: tuple[float, float, Stripes] | None = None  # (residual, wire): most protection
    ks = sorted({min(n, k) for k in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160,
                                     192, 224, 250)})
    for k in ks:
        S = -(-n // k)
        k = -(-n // S)
        b = -(-run // S) if S < run else 1
        m = parity_needed(k, p, target, b)
        if m is None or not Stripes(n, S, m).valid():
            # the target is out of reach with this k: the most parity the bounds allow
            m = min(MAX_BLOCKS - k, int((MAX_PARITY_RATIO * n + S) // S))
            if m < 1:
                continue
            geo = Stripes(n, S, m)
            cand = (residual(k, m, p, b), geo.parity / n, geo)
            if fallback is None or cand[:2] < fallback[:2]:
                fallback = cand
            continue
        geo = Stripes(n, S, m)
        wire = geo.parity / n
        cost = wire * (1.0 + k * CPU_PER_K)
        # within the wire budget the cheapest in CPU + wire; past it, the least wire
        key = (wire > WIRE_BUDGET, wire if wire > WIRE_BUDGET else cost)
        if best is None or key < best[:2]:
            best = (*key, geo)
    if best is not None:
        return best[2]
    return fallback[2] if fallback is not None else None


# ---- encode / decode ----------------------------------------------------------------------
def encode(values: np.ndarray, chunk: int, geo: Stripes) -> np.ndarray:
    """Parity of ``values`` (float32, n = ceil(len / chunk) data packets of ``chunk`` floats,
    the last one zero-padded): returns (m * S, chunk) float32, row q = parity row q // S of
    stripe q % S. Member j of every stripe is the contiguous span ``[j*S*chunk, (j+1)*S*chunk)``
    of the padded vector, so one native call codes all S stripes."""
    k, S, m = geo.k, geo.S, geo.m
    span = S * chunk
    values = np.ascontiguousarray(values, np.float32)
    full = min(k, values.size // span)  # members that lie wholly inside the vector
    tail = np.zeros((k - full, span), np.float32)
    if k > full:
        rest = values[full * span:]
        tail.reshape(-1)[: rest.size] = rest
    out = np.empty((m, span), np.float32)
    src = np.concatenate([
        values.ctypes.data + np.arange(full, dtype=np.uint64) * np.uint64(4 * span),
        tail.ctypes.data + np.arange(k - full, dtype=np.uint64) * np.uint64(4 * span),
    ]).astype(np.uint64)
    dst = out.ctypes.data + np.arange(m, dtype=np.uint64) * np.uint64(4 * span)
    apply(cauchy(k, m), src, dst, 4 * span)
    return out.reshape(m * S, chunk)


def decode_matrix(k: int, m: int, missing: list[int], parity_rows: list[int]) -> np.ndarray:
    """Coefficients that rebuild the ``missing`` data members (e of them) of a stripe from its
    known data members (all the others, in order) followed by the parity rows ``parity_rows``
    (e of them): (e, k). From parity_P = A[P, D] d_D + A[P, K] d_K (addition is xor):
    d_D = A[P, D]^-1 (A[P, K] d_K + parity_P)."""
    a = cauchy(k, m)
    e = len(missing)
    known = [t for t in range(k) if t not in set(missing)]
    inv = gf_invert(a[np.ix_(parity_rows, missing)])
    rhs = np.concatenate([a[np.ix_(parity_rows, known)], np.eye(e, dtype=np.uint8)], axis=1)
    return gf_matmul(inv, rhs)


def decode(coef: np.ndarray, src: np.ndarray, nbytes: int) -> np.ndarray:
    """Rebuild e blocks of ``nbytes`` from the k source block addresses ``src`` (known data
    members in order, then the parity blocks) with ``decode_matrix``'s coefficients."""
    e = coef.shape[0]
    out = np.empty((e, nbytes), np.uint8)
    dst = out.ctypes.data + np.arange(e, dtype=np.uint64) * np.uint64(nbytes)
    apply(coef, src, dst, nbytes)
    return out
