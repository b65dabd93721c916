/* The native receive engine of stalwart.comm's lossy transport (the data plane).
 *
 * Mechanism: the same per-datagram rules as the Python engine (wire.Wire.check plus
 * receiving.PyReceiver's placement), run on a pthread that never takes the GIL: recvmmsg with
 * UDP GRO, header parsing and bounds checks, the AES-256-GCM tag (GMAC: nothing encrypted; its
 * own VPCLMULQDQ GHASH, on 512-bit vectors where the CPU has AVX-512 and 256-bit ones where it
 * has AVX2, else OpenSSL's GCM128), placement into the round
 * buffers (numpy arrays that Python allocated and reads after a phase), loss bookkeeping per
 * (round, phase), Reed-Solomon decoding of stripes that lost data (ISA-L's ec_encode_data
 * through dlopen, the copy pyeclib ships; a table-driven loop without it), and the owner's sum.
 * It also seals outgoing rows (sequence number + tag) with the GIL released. Python runs per
 * phase: it starts a phase, waits on this engine's condition variable (woken only when a
 * sender completes, a marker arrives, a late peer starts or a silent one speaks) and reads
 * the results.
 *
 * Guarantees: every rule of the Python engine, in the same order, with the same reason codes
 * (tests run the suite with both engines; the fuzz test feeds arbitrary bytes through
 * ``feed``). A datagram is never read past its received size, never written anywhere but the
 * round buffers it names after all checks passed, and rejected datagrams are only counted.
 * Cost: one GMAC per accepted-or-forged datagram (spares skip it), one memcpy / add per
 * payload, no allocation on the hot path except a stripe's parity buffer per (round, phase,
 * sender) the first time parity arrives.
 */
#define PY_SSIZE_T_CLEAN
#define OPENSSL_SUPPRESS_DEPRECATED /* AES_set_encrypt_key, AES_encrypt: the fallback cipher */
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/aes.h>
#include <openssl/modes.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <immintrin.h>
#include <stdlib.h>
#include <wmmintrin.h>

#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif

#define MAGIC 0x5357
#define HEADER_BYTES 40
#define TAG_BYTES 16
#define OVERHEAD (HEADER_BYTES + TAG_BYTES)
#define PHASE_GRAD 0
#define PHASE_VALUE 1
#define PHASE_NORM 2
#define FLAG_END 1
#define FLAG_PARITY 2
#define MAX_BLOCKS 256
#define FB_UNKNOWN 0xFFFF
#define MAX_ANNOUNCED_COPIES 16
#define PHASES_PENDING 16
#define MAX_ROUNDS 8
#define FB_CAP 4096

typedef struct Mac Mac; /* the packet tag's state (below) */

enum { RJ_OK, RJ_MALFORMED, RJ_BAD_TAG, RJ_UNKNOWN_SENDER, RJ_OLD_ROUND, RJ_FUTURE_ROUND,
       RJ_BAD_RANGE, RJ_NONFINITE, RJ_DUPLICATE, RJ_LATE, RJ_SPARE, N_REASONS };

/* ---- GF(2^8), polynomial 0x11d (ISA-L's) ------------------------------------------------ */
static uint8_t GF_EXP[512], GF_LOG[256], GF_INV[256];

static void gf_init(void) {
    int x = 1;
    for (int i = 0; i < 255; i++) {
        GF_EXP[i] = (uint8_t)x;
        GF_LOG[x] = (uint8_t)i;
        x <<= 1;
        if (x & 0x100) x ^= 0x11d;
    }
    for (int i = 255; i < 510; i++) GF_EXP[i] = GF_EXP[i - 255];
    GF_INV[0] = 0;
    for (int a = 1; a < 256; a++) GF_INV[a] = GF_EXP[(255 - GF_LOG[a]) % 255];
}

static inline uint8_t gf_mul(uint8_t a, uint8_t b) {
    if (!a || !b) return 0;
    return GF_EXP[GF_LOG[a] + GF_LOG[b]];
}

/* inverse of an n x n matrix (row-major) in place into out; 0 on success */
static int gf_invert(const uint8_t *in, uint8_t *out, int n, uint8_t *m) {
    if (n > MAX_BLOCKS) return -1;
    int w = 2 * n;
    for (int r = 0; r < n; r++) {
        for (int c = 0; c < n; c++) m[r * w + c] = in[r * n + c];
        for (int c = 0; c < n; c++) m[r * w + n + c] = (uint8_t)(r == c);
    }
    for (int c = 0; c < n; c++) {
        int piv = -1;
        for (int r = c; r < n; r++)
            if (m[r * w + c]) { piv = r; break; }
        if (piv < 0) return -1;
        if (piv != c)
            for (int t = 0; t < w; t++) {
                uint8_t tmp = m[c * w + t]; m[c * w + t] = m[piv * w + t]; m[piv * w + t] = tmp;
            }
        uint8_t inv = GF_INV[m[c * w + c]];
        for (int t = 0; t < w; t++) m[c * w + t] = gf_mul(inv, m[c * w + t]);
        for (int r = 0; r < n; r++) {
            uint8_t f = m[r * w + c];
            if (r == c || !f) continue;
            for (int t = 0; t < w; t++) m[r * w + t] ^= gf_mul(f, m[c * w + t]);
        }
    }
    for (int r = 0; r < n; r++)
        for (int c = 0; c < n; c++) out[r * n + c] = m[r * w + n + c];
    return 0;
}

/* ---- ISA-L (optional, dlopen) -------------------------------------------------------------- */
typedef void (*ec_init_tables_t)(int, int, unsigned char *, unsigned char *);
typedef void (*ec_encode_data_t)(int, int, int, unsigned char *, unsigned char **,
                                 unsigned char **);
static ec_init_tables_t isal_init = NULL;
static ec_encode_data_t isal_encode = NULL;
typedef void (*ec_encode_data_update_t)(int, int, int, int, unsigned char *, unsigned char *,
                                        unsigned char **);
static ec_encode_data_update_t isal_update = NULL;

/* dst[r] = sum_t coef[r][t] * src[t] over GF(2^8), nbytes per block */
static void gf_apply(const uint8_t *coef, int rows, int k, uint8_t **src, uint8_t **dst,
                     int nbytes) {
    if (isal_init && isal_encode) {
        unsigned char *tbls = malloc((size_t)32 * k * rows);
        if (tbls) {
            isal_init(k, rows, (unsigned char *)coef, tbls);
            isal_encode(nbytes, k, rows, tbls, src, dst);
            free(tbls);
            return;
        }
    }
    for (int r = 0; r < rows; r++) {
        memset(dst[r], 0, (size_t)nbytes);
        for (int t = 0; t < k; t++) {
            uint8_t c = coef[r * k + t];
            if (!c) continue;
            for (int b = 0; b < nbytes; b++) dst[r][b] ^= gf_mul(c, src[t][b]);
        }
    }
}

/* parity accumulated while a phase is sealed (``Engine.send``'s sixth entry field): the m
 * parity rows of S interleaved stripes of k members (fec.py's geometry and Cauchy code, parity
 * row t of stripe i at acc + (t*S + i) * blk), updated with each data packet as it is sealed,
 * while its payload is in cache: parity += A[t][r / S] * payload (``len`` bytes; the rest of a
 * short last packet counts as zeros). The same bytes as fec.encode, without a pass of its own
 * over the values. */
typedef struct {
    uint8_t *acc, *coef, *tbls;
    int S, m, k;
    size_t blk;
} ParAcc;

static int paracc_init(ParAcc *a, uint8_t *acc, int64_t n, int S, int m, size_t blk) {
    memset(a, 0, sizeof *a);
    if (S < 1 || m < 1 || n < 1) return -1;
    int k = (int)((n + S - 1) / S);
    if (k + m > MAX_BLOCKS) return -1;
    a->acc = acc; a->S = S; a->m = m; a->k = k; a->blk = blk;
    a->coef = malloc((size_t)m * k);
    a->tbls = malloc((size_t)32 * k * m);
    if (!a->coef || !a->tbls) { free(a->coef); free(a->tbls); a->coef = a->tbls = NULL; return -1; }
    for (int t = 0; t < m; t++)
        for (int j = 0; j < k; j++) a->coef[t * k + j] = GF_INV[(k + t) ^ j];
    if (isal_init) isal_init(k, m, a->coef, a->tbls);
    return 0;
}

static void paracc_add(const ParAcc *a, int64_t r, const uint8_t *pay, int len) {
    if (!a->acc || len <= 0) return;
    int i = (int)(r % a->S), j = (int)(r / a->S);
    uint8_t *dst[MAX_BLOCKS];
    for (int t = 0; t < a->m; t++) dst[t] = a->acc + (size_t)(t * a->S + i) * a->blk;
    if (isal_init && isal_update) {
        isal_update(len, a->k, a->m, j, a->tbls, (unsigned char *)pay, dst);
        return;
    }
    for (int t = 0; t < a->m; t++) {
        uint8_t c = a->coef[t * a->k + j];
        for (int b = 0; b < len; b++) dst[t][b] ^= gf_mul(c, pay[b]);
    }
}

/* whether n float32 at p are all finite: exponent bits not all ones, tested on the bit patterns
 * so that the loop vectorizes (a per-float isfinite() branch was a whole pass at ~1 ns/float) */
#define NOINLINE __attribute__((noinline))
static NOINLINE int all_finite(const uint8_t *p, int64_t n) {
    uint32_t bad = 0;
    for (int64_t t = 0; t < n; t++) {
        uint32_t b;
        memcpy(&b, p + 4 * t, 4);
        bad |= (b & 0x7f800000u) == 0x7f800000u;
    }
    return !bad;
}

/* ---- engine --------------------------------------------------------------------------- */
typedef struct {
    int n, S, m, k;
    float *par;       /* (m*S, chunk) */
    uint8_t *pseen;   /* m*S */
    int64_t *have;    /* S */
    uint8_t *done;    /* S */
} FecRx;

typedef struct {
    int bound;
    int64_t rnd;
    uint8_t closed[3];
    /* Python-owned numpy buffers of this round (receiving._Round) */
    Py_buffer b_sum, b_count, b_seen, b_contrib, b_vals, b_norm, b_got, b_marker, b_gtag,
        b_vtag, b_recovered;
    int has_contrib;
    /* where the broadcast values land: vals, or the caller's output vector while it is bound
     * (Engine_values_into: the values go straight to it, no copy-out after the phase) */
    float *vdst; Py_buffer b_vout; int has_vout;
    Py_buffer *b_vseen; /* world */
    float *sum; int32_t *count; uint8_t *seen; float *contrib; float *vals; double *norm;
    int64_t *got; int64_t *marker; uint8_t *gtag; uint8_t *vtag; int64_t *recovered;
    uint8_t **vseen;
    FecRx **fec; /* 3 * world */
} Round;

typedef struct { int64_t key; double n; } Pending;

typedef struct {
    PyObject_HEAD
    int fd, world, me, chunk, slot, rounds_open, may_copy, batch, rx_segments;
    uint32_t job;
    int64_t *shard_lens, *bounds, *n_chunks, *chunk_base;
    int64_t round;
    uint32_t *peer_addr; uint16_t *peer_port; /* network order */
    Round rounds[MAX_ROUNDS];
    /* shared arrays (Python-owned) */
    Py_buffer b_heard, b_ever, b_rejected, b_lgot, b_lowed;
    int shared_bound;
    double *heard; uint8_t *ever; int64_t *rejected; double *lgot, *lowed;
    /* loss estimator pending/booked per sender */
    Pending *pending; int *n_pending;  /* world * PHASES_PENDING */
    int64_t *booked_keys; int *n_booked;
    int64_t *marker_booked; /* 3 * world: last marker round booked */
    /* deadline hints and loss feedback, drained by Python per phase */
    double *hint; uint8_t *hint_new;
    int fb_src[FB_CAP]; double fb_rate[FB_CAP]; int fb_n;
    /* watch: what wakes the waiting thread */
    int w_slot, w_phase; int64_t *w_exp; uint8_t *w_silent; uint8_t *spoke; int64_t w_sig;
    /* crypto */
    Mac *tx_ctx, *rx_ctx;
    uint64_t seq;
    pthread_mutex_t mu; pthread_cond_t cv; pthread_mutex_t seal_mu;
    pthread_t thread; int running; volatile int stop;
    /* receive ring */
    uint8_t *rx; struct mmsghdr *msgs; struct iovec *iovs; struct sockaddr_in *sas;
    uint8_t *cmsgs;
    /* per-batch scratch */
    uint8_t **d_ptr; int64_t *d_size; int *d_src; uint8_t *d_why;
    uint8_t *tmp; /* decode scratch: blocks */
    uint8_t *gf;  /* decode scratch: matrices */
    /* test hook: drop datagrams (not markers) in bursts before the checks */
    int drop_period, drop_burst; int64_t drop_count, dropped;
    int n_rules; int64_t rules[16][6]; /* sender, phase mask, end, chunk lo, chunk hi, round */
    int64_t rx_batches;
    double rx_cpu; /* CPU seconds of the receive thread (updated every 64 batches) */
    int64_t rx_msgs, rx_dgrams; /* messages received, datagrams in them (GRO coalesces) */
} Engine;

#define CMSG_SLOT 32

static double now_mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

typedef struct {
    uint16_t magic; uint8_t phase, flags; uint32_t job, rnd; uint16_t sender, shard;
    uint32_t offset, length, hint; uint16_t fb, copies; uint64_t seq;
    uint8_t finite; /* not on the wire: check_tag's finding, every payload float finite */
} Hdr;

static void parse(const uint8_t *p, Hdr *h) {
    h->magic = rd16(p); h->phase = p[2]; h->flags = p[3]; h->job = rd32(p + 4);
    h->rnd = rd32(p + 8); h->sender = rd16(p + 12); h->shard = rd16(p + 14);
    h->offset = rd32(p + 16); h->length = rd32(p + 20); h->hint = rd32(p + 24);
    h->fb = rd16(p + 28); h->copies = rd16(p + 30); h->seq = rd64(p + 32);
}

/* ---- the packet tag: AES-256-GCM with everything as authenticated data (GMAC) ----------
 * Through OpenSSL's GCM128 interface (CRYPTO_gcm128_*: the same GHASH code EVP runs, PCLMUL /
 * AVX) with the block cipher given as a function: AES-NI here when the CPU has it (the cipher
 * runs once per packet, for the tag mask), OpenSSL's AES_encrypt otherwise. EVP's per-call
 * layers (provider dispatch, parameter objects: ~200 ns per packet, measured) are skipped;
 * the tag is the same bytes (tests check it against pyca ``cryptography``). */
typedef struct { __m128i rk[15]; } NiKey;

__attribute__((target("aes,sse2"))) static __m128i ni_spread(__m128i a) {
    __m128i t = _mm_slli_si128(a, 4);
    a = _mm_xor_si128(a, t);
    t = _mm_slli_si128(t, 4);
    a = _mm_xor_si128(a, t);
    t = _mm_slli_si128(t, 4);
    return _mm_xor_si128(a, t);
}

/* the AES-256 key schedule (FIPS-197) with AESKEYGENASSIST */
__attribute__((target("aes,sse2"))) static void ni_key(NiKey *k, const uint8_t *key) {
    __m128i a = _mm_loadu_si128((const __m128i *)key);
    __m128i b = _mm_loadu_si128((const __m128i *)(key + 16));
    k->rk[0] = a; k->rk[1] = b;
#define NI_ROUND(i, rc)                                                                        \
    a = _mm_xor_si128(ni_spread(a), _mm_shuffle_epi32(_mm_aeskeygenassist_si128(b, rc), 0xff)); \
    k->rk[i] = a;                                                                              \
    if (i < 14) {                                                                              \
        b = _mm_xor_si128(ni_spread(b),                                                        \
                          _mm_shuffle_epi32(_mm_aeskeygenassist_si128(a, 0), 0xaa));           \
        k->rk[i + 1] = b;                                                                      \
    }
    NI_ROUND(2, 0x01) NI_ROUND(4, 0x02) NI_ROUND(6, 0x04) NI_ROUND(8, 0x08)
    NI_ROUND(10, 0x10) NI_ROUND(12, 0x20) NI_ROUND(14, 0x40)
#undef NI_ROUND
}

__attribute__((target("aes,sse2"))) static void ni_block(const unsigned char in[16],
                                                         unsigned char out[16], const void *key) {
    const NiKey *k = key;
    __m128i x = _mm_xor_si128(_mm_loadu_si128((const __m128i *)in), k->rk[0]);
    for (int i = 1; i < 14; i++) x = _mm_aesenc_si128(x, k->rk[i]);
    _mm_storeu_si128((__m128i *)out, _mm_aesenclast_si128(x, k->rk[14]));
}

/* ---- GHASH with VPCLMULQDQ (the tag's hash; the same function OpenSSL computes) --------
 * GCM's GHASH (NIST SP 800-38D) over 256-bit vectors: two blocks per carry-less multiply,
 * eight blocks (128 bytes) per reduction -- the unreduced products of the blocks with
 * H^8..H^1 are XORed, then shifted and reduced once (Gueron-Kounavis; both steps are linear),
 * the middle terms by Karatsuba. Used when the CPU has AES-NI, PCLMULQDQ, AVX2 and VPCLMULQDQ
 * and not AVX-512 (``ghash_path``; with AVX-512 the 512-bit gh_z* below), else OpenSSL's GCM128;
 * ``STALWART_GHASH=vpclmulqdq`` forces this one, ``=openssl`` OpenSSL's (for
 * measuring one against the other: the tags are the same bytes, which the tests check against
 * pyca ``cryptography`` for every payload length of a chunk). Measured (microbenchmark, one
 * core of an AMD EPYC with AVX2 + VPCLMULQDQ and no AVX-512; a 40-byte header + payload):
 * 0.12-0.15 ns/B against OpenSSL 3.0's 0.17-0.25 at 8,960 bytes, 0.15 against 0.29-0.46 at
 * 1,472 (OpenSSL takes the header's partial block and the payload's unaligned head byte by
 * byte). Cost: 3 x 8 powers of H (16 bytes each) per key; nothing per packet but the tag's
 * one AES block. */

#define GHZ_GROUP 32  /* blocks per reduction of the 512-bit GHASH (gh_z*) */

typedef struct {
    __m128i h[8];   /* H^1..H^8, byte-reflected (as the multiply takes them) */
    __m256i hp[4];  /* lanes (H^8,H^7), (H^6,H^5), (H^4,H^3), (H^2,H^1) */
    __m256i hk[4];  /* the same, each lane's halves XORed (low 64 bits: Karatsuba) */
    /* the 512-bit path's: H^32..H^1 in descending order, then 4 zero entries (a group of m
     * blocks reads H^m..H^1 from entry 32 - m, in 4-lane loads that may run past H^1) */
    __m128i hd[GHZ_GROUP + 4];
    __m128i hkd[GHZ_GROUP + 4];  /* the same, each entry's halves XORed */
} GhKey;

#define GH_T __attribute__((target("pclmul,ssse3,sse4.1,avx2,vpclmulqdq")))

GH_T static inline __m128i gh_bswap(__m128i x) {
    return _mm_shuffle_epi8(x, _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

/* (lo, hi): 256-bit carry-less product, shifted left by one and reduced mod the GCM polynomial */
GH_T static inline __m128i gh_reduce(__m128i tmp3, __m128i tmp6) {
    __m128i tmp2, tmp4, tmp5, tmp7, tmp8, tmp9;
    tmp7 = _mm_srli_epi32(tmp3, 31);
    tmp8 = _mm_srli_epi32(tmp6, 31);
    tmp3 = _mm_slli_epi32(tmp3, 1);
    tmp6 = _mm_slli_epi32(tmp6, 1);
    tmp9 = _mm_srli_si128(tmp7, 12);
    tmp8 = _mm_slli_si128(tmp8, 4);
    tmp7 = _mm_slli_si128(tmp7, 4);
    tmp3 = _mm_or_si128(tmp3, tmp7);
    tmp6 = _mm_or_si128(tmp6, tmp8);
    tmp6 = _mm_or_si128(tmp6, tmp9);
    tmp7 = _mm_slli_epi32(tmp3, 31);
    tmp8 = _mm_slli_epi32(tmp3, 30);
    tmp9 = _mm_slli_epi32(tmp3, 25);
    tmp7 = _mm_xor_si128(tmp7, tmp8);
    tmp7 = _mm_xor_si128(tmp7, tmp9);
    tmp8 = _mm_srli_si128(tmp7, 4);
    tmp7 = _mm_slli_si128(tmp7, 12);
    tmp3 = _mm_xor_si128(tmp3, tmp7);
    tmp2 = _mm_srli_epi32(tmp3, 1);
    tmp4 = _mm_srli_epi32(tmp3, 2);
    tmp5 = _mm_srli_epi32(tmp3, 7);
    tmp2 = _mm_xor_si128(tmp2, tmp4);
    tmp2 = _mm_xor_si128(tmp2, tmp5);
    tmp2 = _mm_xor_si128(tmp2, tmp8);
    tmp3 = _mm_xor_si128(tmp3, tmp2);
    return _mm_xor_si128(tmp6, tmp3);
}

/* unreduced product a*b accumulated into (lo, hi) */
GH_T static inline void gh_mul_acc(__m128i a, __m128i b, __m128i *lo, __m128i *hi) {
    __m128i t0 = _mm_clmulepi64_si128(a, b, 0x00);
    __m128i t1 = _mm_xor_si128(_mm_clmulepi64_si128(a, b, 0x10), _mm_clmulepi64_si128(a, b, 0x01));
    __m128i t2 = _mm_clmulepi64_si128(a, b, 0x11);
    *lo = _mm_xor_si128(*lo, _mm_xor_si128(t0, _mm_slli_si128(t1, 8)));
    *hi = _mm_xor_si128(*hi, _mm_xor_si128(t2, _mm_srli_si128(t1, 8)));
}

GH_T static inline __m128i gh_mul(__m128i a, __m128i b) {
    __m128i lo = _mm_setzero_si128(), hi = _mm_setzero_si128();
    gh_mul_acc(a, b, &lo, &hi);
    return gh_reduce(lo, hi);
}

/* h_block: E(K, 0^128) as bytes */
GH_T static void gh_init(GhKey *k, const uint8_t h_block[16]) {
    __m128i h = gh_bswap(_mm_loadu_si128((const __m128i *)h_block));
    k->h[0] = h;
    for (int i = 1; i < 8; i++) k->h[i] = gh_mul(k->h[i - 1], h);
    for (int j = 0; j < 4; j++)  /* lane 0 = H^(8-2j), lane 1 = H^(7-2j) */
        k->hp[j] = _mm256_set_m128i(k->h[6 - 2 * j], k->h[7 - 2 * j]);
    for (int j = 0; j < 4; j++)
        k->hk[j] = _mm256_xor_si256(k->hp[j], _mm256_shuffle_epi32(k->hp[j], 0x4e));
    __m128i p = h;
    for (int i = GHZ_GROUP - 1; i >= 0; i--) {  /* entry i = H^(GHZ_GROUP - i) */
        k->hd[i] = p;
        k->hkd[i] = _mm_xor_si128(p, _mm_shuffle_epi32(p, 0x4e));
        if (i) p = gh_mul(p, h);
    }
    for (int i = GHZ_GROUP; i < GHZ_GROUP + 4; i++) k->hd[i] = k->hkd[i] = _mm_setzero_si128();
}

/* X <- GHASH update of X (reflected) with n bytes at p, n a multiple of 16. Two optional jobs
 * done on the same loads, in the same pass (constants after inlining: the plain loop is
 * unchanged): with ``dst``, the bytes are also stored there (the send's copy of a payload into
 * its row: authenticate while copying); with ``bad``, every 32-bit lane whose float32 exponent
 * bits are all ones (NaN or Inf) sets that lane of *bad (the receive's finite-value check). The
 * extra loads are none and the extra work per 32 bytes is one store, or an and, a compare and an
 * or, beside three carry-less multiplies: the pass stays bound by the multiplies. */
GH_T static inline __attribute__((always_inline)) __m128i gh_blocks_x(
    const GhKey *k, __m128i x, const uint8_t *p, size_t n, uint8_t *dst, __m256i *bad) {
    const __m256i bs = _mm256_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                       0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i em = _mm256_set1_epi32(0x7f800000);
    __m256i nf = _mm256_setzero_si256();
    while (n >= 128) {
        __m256i lo = _mm256_setzero_si256(), mid = lo, hi = lo;
        for (int j = 0; j < 4; j++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(p + 32 * j));
            if (dst) _mm256_storeu_si256((__m256i *)(dst + 32 * j), raw);
            if (bad) nf = _mm256_or_si256(nf, _mm256_cmpeq_epi32(_mm256_and_si256(raw, em), em));
            __m256i b = _mm256_shuffle_epi8(raw, bs);
            if (j == 0) b = _mm256_xor_si256(b, _mm256_zextsi128_si256(x));
            __m256i h = k->hp[j];
            __m256i bk = _mm256_xor_si256(b, _mm256_shuffle_epi32(b, 0x4e));
            lo = _mm256_xor_si256(lo, _mm256_clmulepi64_epi128(b, h, 0x00));
            hi = _mm256_xor_si256(hi, _mm256_clmulepi64_epi128(b, h, 0x11));
            mid = _mm256_xor_si256(mid, _mm256_clmulepi64_epi128(bk, k->hk[j], 0x00));
        }
        __m128i l = _mm_xor_si128(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
        __m128i m = _mm_xor_si128(_mm256_castsi256_si128(mid), _mm256_extracti128_si256(mid, 1));
        __m128i h = _mm_xor_si128(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
        m = _mm_xor_si128(m, _mm_xor_si128(l, h));  /* Karatsuba: mid = (a0^a1)(b0^b1)^lo^hi */
        l = _mm_xor_si128(l, _mm_slli_si128(m, 8));
        h = _mm_xor_si128(h, _mm_srli_si128(m, 8));
        x = gh_reduce(l, h);
        p += 128; n -= 128;
        if (dst) dst += 128;
    }
    if (n) {  /* 1..7 blocks: block i times H^(nb-i) */
        int nb = (int)(n / 16);
        __m128i lo = _mm_setzero_si128(), hi = lo;
        for (int i = 0; i < nb; i++) {
            __m128i raw = _mm_loadu_si128((const __m128i *)(p + 16 * i));
            if (dst) _mm_storeu_si128((__m128i *)(dst + 16 * i), raw);
            if (bad) {
                __m128i e4 = _mm256_castsi256_si128(em);
                nf = _mm256_or_si256(nf, _mm256_zextsi128_si256(
                                             _mm_cmpeq_epi32(_mm_and_si128(raw, e4), e4)));
            }
            __m128i b = gh_bswap(raw);
            if (i == 0) b = _mm_xor_si128(b, x);
            gh_mul_acc(b, k->h[nb - 1 - i], &lo, &hi);
        }
        x = gh_reduce(lo, hi);
    }
    if (bad) *bad = _mm256_or_si256(*bad, nf);
    return x;
}

GH_T static __m128i gh_blocks(const GhKey *k, __m128i x, const uint8_t *p, size_t n) {
    return gh_blocks_x(k, x, p, n, NULL, NULL);
}

/* gh_blocks, storing the bytes at dst as well */
GH_T static __m128i gh_blocks_copy(const GhKey *k, __m128i x, const uint8_t *p, size_t n,
                                   uint8_t *dst) {
    return gh_blocks_x(k, x, p, n, dst, NULL);
}

/* gh_blocks, with the NaN/Inf lanes of the bytes ORed into *bad */
GH_T static __m128i gh_blocks_check(const GhKey *k, __m128i x, const uint8_t *p, size_t n,
                                    __m256i *bad) {
    return gh_blocks_x(k, x, p, n, NULL, bad);
}

/* GHASH_H(A || 0-pad || [8 len(A)]_64 || [0]_64) for A = hdr[0:nh) || pay[0:np), as the
 * reflected value (bswap it back to bytes) */
GH_T static __m128i gh_aad2(const GhKey *k, const uint8_t *hdr, size_t nh, const uint8_t *pay,
                            size_t np) {
    __m128i x = _mm_setzero_si128();
    uint8_t buf[16];
    uint64_t bits = (uint64_t)(nh + np) * 8;
    if (pay == hdr + nh) {  /* one stream in memory (a row, a received datagram): no seam */
        np += nh;
        nh = 0;
        pay = hdr;
    }
    size_t nfull = nh / 16 * 16;
    x = gh_blocks(k, x, hdr, nfull);
    size_t r = nh - nfull;  /* header tail joins the payload's head in one block */
    if (r) {
        size_t take = np < 16 - r ? np : 16 - r;
        memset(buf, 0, 16);
        memcpy(buf, hdr + nfull, r);
        memcpy(buf + r, pay, take);
        x = gh_blocks(k, x, buf, 16);
        pay += take; np -= take;
    }
    /* the 128-byte groups, then what is left (< 128 bytes, zero-padded) and the length block
     * together: one or two reductions */
    size_t bulk = np / 128 * 128, rest = np - bulk, padded = (rest + 15) / 16 * 16;
    uint8_t last[160];
    x = gh_blocks(k, x, pay, bulk);
    memset(last, 0, padded + 16);
    memcpy(last, pay + bulk, rest);
    for (int i = 0; i < 8; i++) last[padded + i] = (uint8_t)(bits >> (56 - 8 * i));
    return gh_blocks(k, x, last, padded + 16);
}

enum { GH_OPENSSL = 0, GH_256 = 1, GH_512 = 2 };
static const char *const GH_NAMES[] = {"openssl", "vpclmulqdq", "vpclmulqdq512"};

struct Mac {
    GhKey gh;  /* first: 32-byte aligned vectors (Mac is allocated 64-aligned) */
    GCM128_CONTEXT *gcm;
    union { NiKey ni; AES_KEY sw; } key;
    int fast;  /* the tag's GHASH: GH_OPENSSL (OpenSSL's GCM128), GH_256 (gh_*), GH_512 (gh_z*);
                * the engine's own ones with ni_block for the mask */
};

/* E(K, iv || 1): the tag's mask */
GH_T static __m128i gh_mask(const Mac *m, const uint8_t iv[12]) {
    uint8_t j0[16], ek[16];
    memcpy(j0, iv, 12);
    j0[12] = 0; j0[13] = 0; j0[14] = 0; j0[15] = 1;
    ni_block(j0, ek, &m->key.ni);
    return _mm_loadu_si128((const __m128i *)ek);
}

/* the tag with the VPCLMULQDQ GHASH: GHASH_H(hdr || pay, lengths) XOR E(K, iv || 1) */
GH_T static void gh_tag(const Mac *m, const uint8_t *hdr, const uint8_t *pay, int n,
                        const uint8_t iv[12], uint8_t out[16]) {
    __m128i x = gh_bswap(gh_aad2(&m->gh, hdr, HEADER_BYTES, pay, (size_t)n));
    _mm_storeu_si128((__m128i *)out, _mm_xor_si128(x, gh_mask(m, iv)));
}

/* the end of a contiguous stream of `total` bytes: its last `rest` (< 128) bytes at p,
 * zero-padded, and the length block, in one or two reductions (as gh_aad2) */
GH_T static __m128i gh_tail(const GhKey *k, __m128i x, const uint8_t *p, size_t rest,
                            size_t total) {
    uint8_t last[160];
    size_t padded = (rest + 15) / 16 * 16;
    uint64_t bits = (uint64_t)total * 8;
    memset(last, 0, padded + 16);
    memcpy(last, p, rest);
    for (int i = 0; i < 8; i++) last[padded + i] = (uint8_t)(bits >> (56 - 8 * i));
    return gh_blocks(k, x, last, padded + 16);
}

/* gh_tag of a row whose header is in place, its payload (np bytes at src) copied to
 * row + HEADER_BYTES in the same pass as the hash (the 128-byte groups after the first are
 * loaded once, stored to the row and hashed from the registers): the same tag as a copy then
 * gh_tag over the row, one pass over the payload instead of two */
GH_T static void gh_tag_fill(const Mac *m, uint8_t *row, const uint8_t *src, size_t np,
                             const uint8_t iv[12], uint8_t out[16]) {
    const GhKey *k = &m->gh;
    size_t n = HEADER_BYTES + np, bulk = n / 128 * 128, from = HEADER_BYTES;
    __m128i x = _mm_setzero_si128();
    if (bulk) { /* the group holding the header: copied first, then hashed from the row */
        memcpy(row + HEADER_BYTES, src, 128 - HEADER_BYTES);
        x = gh_blocks(k, x, row, 128);
        x = gh_blocks_copy(k, x, src + 128 - HEADER_BYTES, bulk - 128, row + 128);
        from = bulk;
    }
    memcpy(row + from, src + (from - HEADER_BYTES), n - from);
    x = gh_bswap(gh_tail(k, x, row + bulk, n - bulk, n));
    _mm_storeu_si128((__m128i *)out, _mm_xor_si128(x, gh_mask(m, iv)));
}

/* the NaN/Inf lanes (float32 exponent bits all ones) of 16 bytes at stream offset o whose
 * lanes lie at or past the header (stream offset >= HEADER_BYTES): all ones where so */
GH_T static inline __m128i gh_nonfinite16(__m128i raw, int64_t o) {
    const __m128i e4 = _mm_set1_epi32(0x7f800000);
    __m128i at = _mm_add_epi32(_mm_set1_epi32((int)o), _mm_setr_epi32(0, 4, 8, 12));
    __m128i pay = _mm_cmpgt_epi32(at, _mm_set1_epi32(HEADER_BYTES - 1));
    return _mm_and_si128(pay, _mm_cmpeq_epi32(_mm_and_si128(raw, e4), e4));
}

/* gh_tag of a contiguous packet (n bytes: header, payload) that also tells whether every
 * float32 of the payload is finite (1) or not (0): the 128-byte groups after the first are
 * checked on the hash's own loads (gh_blocks_check); the first group's payload lanes and the
 * last < 128 bytes, already in L1, by a few 16-byte compares beside their hash */
GH_T static int gh_tag_check(const Mac *m, const uint8_t *p, size_t n, const uint8_t iv[12],
                             uint8_t out[16]) {
    const GhKey *k = &m->gh;
    size_t bulk = n / 128 * 128, rest = n - bulk, padded = (rest + 15) / 16 * 16;
    __m128i x = _mm_setzero_si128(), nf = _mm_setzero_si128();
    __m256i bad = _mm256_setzero_si256();
    if (bulk) {
        x = gh_blocks(k, x, p, 128);
        for (int o = HEADER_BYTES / 16 * 16; o < 128; o += 16)
            nf = _mm_or_si128(nf, gh_nonfinite16(_mm_loadu_si128((const __m128i *)(p + o)), o));
        x = gh_blocks_check(k, x, p + 128, bulk - 128, &bad);
    }
    uint8_t last[160];  /* as gh_tail: the rest zero-padded (zeros are finite), the lengths */
    uint64_t bits = (uint64_t)n * 8;
    memset(last, 0, padded + 16);
    memcpy(last, p + bulk, rest);
    for (size_t o = 0; o < padded; o += 16)
        nf = _mm_or_si128(nf, gh_nonfinite16(_mm_loadu_si128((const __m128i *)(last + o)),
                                             (int64_t)(bulk + o)));
    for (int i = 0; i < 8; i++) last[padded + i] = (uint8_t)(bits >> (56 - 8 * i));
    x = gh_bswap(gh_blocks(k, x, last, padded + 16));
    _mm_storeu_si128((__m128i *)out, _mm_xor_si128(x, gh_mask(m, iv)));
    bad = _mm256_or_si256(bad, _mm256_zextsi128_si256(nf));
    return _mm256_testz_si256(bad, bad);
}

/* ---- GHASH with VPCLMULQDQ on 512-bit vectors -------------------------------------------
 * The same GHASH as gh_* above, four blocks per carry-less multiply and up to GHZ_GROUP (32)
 * blocks per reduction: a group of m blocks is multiplied by H^m..H^1 (read from the key's
 * descending table at entry 32 - m, so a short group needs no table of its own), the three
 * unreduced products (lo, hi, Karatsuba middle) XORed over the group, folded from four lanes
 * to one and reduced once. A packet's full 16-byte blocks go through in groups of 32; the last
 * group takes what is left (its last vector loaded and stored under a mask, the lanes past the
 * end zero: a zero block adds nothing) and the stream's end -- the partial block, loaded under
 * a byte mask, and the length block -- as its last one or two blocks: an MTU 1500 datagram
 * (1,496 bytes) in 3 reductions where the 256-bit path takes 12, and no copy of the tail.
 * X (the hash so far) is multiplied by H^(group's blocks) on its own, after the data products:
 * the chain from one group to the next is that one multiply and the reduction, not the whole
 * group's XOR tree. Used where the CPU has AVX-512F, VL and BW (the byte shuffle and masks) and
 * VPCLMULQDQ (``ghash_path``; ``STALWART_GHASH=vpclmulqdq512`` asks for it, ``=vpclmulqdq``
 * forces the 256-bit one); the tag is the same bytes (tests/comm/test_send_paths.py against
 * pyca for every payload length and each send path). Measured (microbenchmark, CPU time, one
 * core of this project's AMD EPYC with AVX-512 and VPCLMULQDQ, best of 5, the machine shared),
 * per payload byte, 512-bit against 256-bit: the tag of an 8,984-byte packet 0.029 against
 * 0.103 ns, the send's fill 0.032 against 0.108, the receive's tag + finite check 0.031 against
 * 0.103; at 1,496 bytes 0.039 / 0.051 / 0.043 against 0.108 / 0.134 / 0.119 (57-74 ns per
 * packet against 157-196). Cost: 2 x 36 more 16-byte key entries; gcc allocates zmm16-31 here
 * (register pressure), which leaves the thread's Hi16_ZMM state (1 KB) in use, saved and
 * restored at its context switches (not measured on its own). */
#define GHZ_T __attribute__((target("pclmul,ssse3,sse4.1,avx2,vpclmulqdq,avx512f,avx512vl,avx512bw")))

/* X <- X updated with m blocks at p and then t (0..2) more given reflected (t0, t1: the
 * stream's last blocks), m + t in 1..GHZ_GROUP, in one reduction. With ``dst`` the m blocks
 * are stored there too (fill); with ``bad``, their float32 lanes whose exponent bits are all
 * ones set bits of *bad, except in the first vector the lanes not in *keep (then *keep is all) */
GHZ_T static inline __attribute__((always_inline)) __m128i gh_zgroup_t(
    const GhKey *k, __m128i x, const uint8_t *p, int m, uint8_t *dst, __mmask16 *bad,
    __mmask16 *keep, int t, __m128i t0, __m128i t1) {
    const __m512i bs = _mm512_broadcast_i32x4(
        _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i em = _mm512_set1_epi32(0x7f800000);
    const __m128i *hd = k->hd + (GHZ_GROUP - m - t), *hkd = k->hkd + (GHZ_GROUP - m - t);
    __m512i lo = _mm512_setzero_si512(), mid = lo, hi = lo;
    for (int j = 0; 4 * j < m; j++) {
        int left = m - 4 * j;
        __m512i raw;
        if (left >= 4) {
            raw = _mm512_loadu_si512((const void *)(p + 64 * j));
            if (dst) _mm512_storeu_si512((void *)(dst + 64 * j), raw);
        } else {
            __mmask8 lm = (__mmask8)((1u << (2 * left)) - 1);
            raw = _mm512_maskz_loadu_epi64(lm, (const void *)(p + 64 * j));
            if (dst) _mm512_mask_storeu_epi64((void *)(dst + 64 * j), lm, raw);
        }
        if (bad) {
            *bad |= _mm512_mask_cmpeq_epi32_mask(*keep, _mm512_and_si512(raw, em), em);
            *keep = 0xFFFF;
        }
        __m512i b = _mm512_shuffle_epi8(raw, bs);
        __m512i h = _mm512_loadu_si512((const void *)(hd + 4 * j));
        __m512i hk = _mm512_loadu_si512((const void *)(hkd + 4 * j));
        __m512i bk = _mm512_xor_si512(b, _mm512_shuffle_epi32(b, (_MM_PERM_ENUM)0x4e));
        lo = _mm512_xor_si512(lo, _mm512_clmulepi64_epi128(b, h, 0x00));
        hi = _mm512_xor_si512(hi, _mm512_clmulepi64_epi128(b, h, 0x11));
        mid = _mm512_xor_si512(mid, _mm512_clmulepi64_epi128(bk, hk, 0x00));
    }
    __m256i l2 = _mm256_xor_si256(_mm512_castsi512_si256(lo), _mm512_extracti64x4_epi64(lo, 1));
    __m256i m2 = _mm256_xor_si256(_mm512_castsi512_si256(mid), _mm512_extracti64x4_epi64(mid, 1));
    __m256i h2 = _mm256_xor_si256(_mm512_castsi512_si256(hi), _mm512_extracti64x4_epi64(hi, 1));
    __m128i l = _mm_xor_si128(_mm256_castsi256_si128(l2), _mm256_extracti128_si256(l2, 1));
    __m128i md = _mm_xor_si128(_mm256_castsi256_si128(m2), _mm256_extracti128_si256(m2, 1));
    __m128i hh = _mm_xor_si128(_mm256_castsi256_si128(h2), _mm256_extracti128_si256(h2, 1));
    for (int u = 0; u < t; u++) {  /* the tail blocks times H^t..H^1 */
        __m128i b = u ? t1 : t0, h = k->hd[GHZ_GROUP - t + u], hk = k->hkd[GHZ_GROUP - t + u];
        __m128i bk = _mm_xor_si128(b, _mm_shuffle_epi32(b, 0x4e));
        l = _mm_xor_si128(l, _mm_clmulepi64_si128(b, h, 0x00));
        hh = _mm_xor_si128(hh, _mm_clmulepi64_si128(b, h, 0x11));
        md = _mm_xor_si128(md, _mm_clmulepi64_si128(bk, hk, 0x00));
    }
    /* X times H^(m+t) last: the only product on the chain from one group to the next */
    __m128i xk = _mm_xor_si128(x, _mm_shuffle_epi32(x, 0x4e));
    l = _mm_xor_si128(l, _mm_clmulepi64_si128(x, hd[0], 0x00));
    hh = _mm_xor_si128(hh, _mm_clmulepi64_si128(x, hd[0], 0x11));
    md = _mm_xor_si128(md, _mm_clmulepi64_si128(xk, hkd[0], 0x00));
    md = _mm_xor_si128(md, _mm_xor_si128(l, hh));  /* Karatsuba: mid = (a0^a1)(b0^b1)^lo^hi */
    l = _mm_xor_si128(l, _mm_slli_si128(md, 8));
    hh = _mm_xor_si128(hh, _mm_srli_si128(md, 8));
    return gh_reduce(l, hh);
}

GHZ_T static inline __attribute__((always_inline)) __m128i gh_zgroup(
    const GhKey *k, __m128i x, const uint8_t *p, int m, uint8_t *dst, __mmask16 *bad,
    __mmask16 *keep) {
    return gh_zgroup_t(k, x, p, m, dst, bad, keep, 0, _mm_setzero_si128(), _mm_setzero_si128());
}

/* X <- X updated with n bytes at p (n a multiple of 16): groups of 32 blocks, then the rest
 * as one group; dst, bad, keep as gh_zgroup's */
GHZ_T static inline __attribute__((always_inline)) __m128i gh_zblocks_x(
    const GhKey *k, __m128i x, const uint8_t *p, size_t n, uint8_t *dst, __mmask16 *bad,
    __mmask16 keep) {
    while (n >= 16 * GHZ_GROUP) {
        x = gh_zgroup(k, x, p, GHZ_GROUP, dst, bad, &keep);
        p += 16 * GHZ_GROUP; n -= 16 * GHZ_GROUP;
        if (dst) dst += 16 * GHZ_GROUP;
    }
    if (n) x = gh_zgroup(k, x, p, (int)(n / 16), dst, bad, &keep);
    return x;
}

GHZ_T static __m128i gh_zblocks(const GhKey *k, __m128i x, const uint8_t *p, size_t n) {
    return gh_zblocks_x(k, x, p, n, NULL, NULL, 0);
}

/* the end of a contiguous stream of `total` bytes whose last n bytes are at p (stream offset
 * total - n): its full blocks in groups, the last group with the partial block (loaded under a
 * byte mask, zero-padded) and the length block folded in -- one reduction for the end, no copy.
 * dst, bad and keep as gh_zgroup's; with bad, the partial block's lanes at stream offsets
 * >= HEADER_BYTES are checked as well */
GHZ_T static inline __attribute__((always_inline)) __m128i gh_zend_x(
    const GhKey *k, __m128i x, const uint8_t *p, size_t n, size_t total, uint8_t *dst,
    __mmask16 *bad, __mmask16 keep) {
    size_t nb = n / 16, rest = n % 16;
    int t = rest ? 2 : 1;
    __mmask16 pm = (__mmask16)((1u << rest) - 1);
    __m128i part = _mm_maskz_loadu_epi8(pm, (const void *)(p + 16 * nb));
    if (dst) _mm_mask_storeu_epi8((void *)(dst + 16 * nb), pm, part);
    if (bad && rest) {
        __m128i v = gh_nonfinite16(part, (int64_t)(total - n + 16 * nb));
        *bad |= (__mmask16)_mm_movemask_ps(_mm_castsi128_ps(v));
    }
    __m128i len = _mm_set_epi64x((long long)((uint64_t)total * 8), 0);  /* reflected */
    __m128i t0 = rest ? gh_bswap(part) : len;
    while (nb > (size_t)(GHZ_GROUP - t)) {
        int m = nb >= GHZ_GROUP ? GHZ_GROUP : (int)nb;
        x = gh_zgroup(k, x, p, m, dst, bad, &keep);
        p += 16 * m; nb -= (size_t)m;
        if (dst) dst += 16 * m;
    }
    return gh_zgroup_t(k, x, p, (int)nb, dst, bad, &keep, t, t0, len);
}

GHZ_T static __m128i gh_zend(const GhKey *k, __m128i x, const uint8_t *p, size_t n,
                             size_t total) {
    return gh_zend_x(k, x, p, n, total, NULL, NULL, 0);
}

/* gh_tag through the 512-bit GHASH: header and payload need not be contiguous (the iovec
 * send); when not, the header and the payload's first 24 bytes are hashed from a copy */
GHZ_T static void gh_ztag(const Mac *m, const uint8_t *hdr, const uint8_t *pay, int np,
                          const uint8_t iv[12], uint8_t out[16]) {
    const GhKey *k = &m->gh;
    size_t n = (size_t)np, total = HEADER_BYTES + n;
    __m128i x = _mm_setzero_si128();
    if (pay == hdr + HEADER_BYTES) {
        x = gh_zend(k, x, hdr, total, total);
    } else {
        uint8_t buf[64];
        size_t take = n < 64 - HEADER_BYTES ? n : 64 - HEADER_BYTES;
        memcpy(buf, hdr, HEADER_BYTES);
        memcpy(buf + HEADER_BYTES, pay, take);
        if (take == 64 - HEADER_BYTES) {
            x = gh_zblocks(k, x, buf, 64);
            x = gh_zend(k, x, pay + take, n - take, total);
        } else {
            x = gh_zend(k, x, buf, total, total);
        }
    }
    x = gh_bswap(x);
    _mm_storeu_si128((__m128i *)out, _mm_xor_si128(x, gh_mask(m, iv)));
}

/* gh_tag_fill through the 512-bit GHASH: the header's 64-byte group copied first and hashed
 * from the row, the rest of the payload loaded once, stored to the row and hashed from the
 * registers */
GHZ_T static void gh_ztag_fill(const Mac *m, uint8_t *row, const uint8_t *src, size_t np,
                               const uint8_t iv[12], uint8_t out[16]) {
    const GhKey *k = &m->gh;
    size_t n = HEADER_BYTES + np;
    __m128i x = _mm_setzero_si128();
    if (n >= 64) {
        memcpy(row + HEADER_BYTES, src, 64 - HEADER_BYTES);
        x = gh_zblocks(k, x, row, 64);
        x = gh_zend_x(k, x, src + 64 - HEADER_BYTES, n - 64, n, row + 64, NULL, 0);
    } else {
        memcpy(row + HEADER_BYTES, src, np);
        x = gh_zend(k, x, row, n, n);
    }
    x = gh_bswap(x);
    _mm_storeu_si128((__m128i *)out, _mm_xor_si128(x, gh_mask(m, iv)));
}

/* gh_tag_check through the 512-bit GHASH: every payload lane checked on the hash's own loads
 * (the header's lanes masked off) */
GHZ_T static int gh_ztag_check(const Mac *m, const uint8_t *p, size_t n, const uint8_t iv[12],
                               uint8_t out[16]) {
    __mmask16 bad = 0;
    __m128i x = gh_zend_x(&m->gh, _mm_setzero_si128(), p, n, n, NULL, &bad,
                          (__mmask16)(0xFFFFu << (HEADER_BYTES / 4)));
    x = gh_bswap(x);
    _mm_storeu_si128((__m128i *)out, _mm_xor_si128(x, gh_mask(m, iv)));
    return bad == 0;
}

static void mac_free(Mac *m) {
    if (!m) return;
    if (m->gcm) CRYPTO_gcm128_release(m->gcm);
    OPENSSL_cleanse(&m->key, sizeof m->key);
    OPENSSL_cleanse(&m->gh, sizeof m->gh);
    free(m);
}

/* the GHASH this CPU runs (AES-NI is checked by the caller): the 512-bit one where it has
 * AVX-512F/VL/BW and VPCLMULQDQ, the 256-bit one where it has AVX2 and VPCLMULQDQ, else
 * OpenSSL's. STALWART_GHASH = openssl | vpclmulqdq | vpclmulqdq512 forces one (for tests and
 * measurements), never one the CPU lacks: a forced path it lacks falls back as above. */
#define GH_512_DEFAULT 1  /* 0: the 512-bit GHASH only when forced (a CPU where it is slower) */
static int ghash_path(void) {
    int has256 = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("avx2")
                 && __builtin_cpu_supports("vpclmulqdq");
    int has512 = has256 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")
                 && __builtin_cpu_supports("avx512bw");
    const char *force = getenv("STALWART_GHASH");
    if (force && !strcmp(force, "openssl")) return GH_OPENSSL;
    if (force && !strcmp(force, "vpclmulqdq")) return has256 ? GH_256 : GH_OPENSSL;
    if (has512 && GH_512_DEFAULT) return GH_512;
    if (force && !strcmp(force, "vpclmulqdq512") && has512) return GH_512;
    return has256 ? GH_256 : GH_OPENSSL;
}

static Mac *mac_new(const uint8_t *key) {
    Mac *m = aligned_alloc(64, (sizeof(Mac) + 63) / 64 * 64);
    if (!m) return NULL;
    memset(m, 0, sizeof *m);
    if (__builtin_cpu_supports("aes")) {
        ni_key(&m->key.ni, key);
        m->gcm = CRYPTO_gcm128_new(&m->key.ni, ni_block);
        int path = m->gcm ? ghash_path() : GH_OPENSSL;
        if (path != GH_OPENSSL) {
            uint8_t zero[16] = {0}, h[16];
            ni_block(zero, h, &m->key.ni);
            gh_init(&m->gh, h);
            OPENSSL_cleanse(h, sizeof h);
            m->fast = path;
        }
    } else if (AES_set_encrypt_key(key, 256, &m->key.sw) == 0) {
        m->gcm = CRYPTO_gcm128_new(&m->key.sw, (block128_f)AES_encrypt);
    }
    if (!m->gcm) { mac_free(m); return NULL; }
    return m;
}

/* the GCM nonce of a packet: sender | 0 | seq, from its header */
static void mac_iv(const uint8_t *hdr, uint8_t iv[12]) {
    memset(iv, 0, 12);
    memcpy(iv, hdr + 12, 2);
    memcpy(iv + 4, hdr + 32, 8);
}

/* the tag over a packet whose header (HEADER_BYTES at hdr) and payload (n bytes at pay) need
 * not be contiguous: GCM's authenticated data fed in two updates is the same stream. 0 on
 * success */
static int gmac2(Mac *m, const uint8_t *hdr, const uint8_t *pay, int n, uint8_t *out) {
    uint8_t iv[12];
    mac_iv(hdr, iv);
    if (m->fast == GH_512) {
        gh_ztag(m, hdr, pay, n, iv, out);
        return 0;
    }
    if (m->fast) {
        gh_tag(m, hdr, pay, n, iv, out);
        return 0;
    }
    CRYPTO_gcm128_setiv(m->gcm, iv, sizeof iv);
    if (CRYPTO_gcm128_aad(m->gcm, hdr, HEADER_BYTES) != 0) return -1;
    if (n > 0 && CRYPTO_gcm128_aad(m->gcm, pay, (size_t)n) != 0) return -1;
    CRYPTO_gcm128_tag(m->gcm, out, TAG_BYTES);
    return 0;
}

/* the tag of data[0:n) (header, then payload), written to out[16] */
static int gmac(Mac *m, const uint8_t *data, int n, uint8_t *out) {
    if (n < HEADER_BYTES) return -1;
    return gmac2(m, data, data + HEADER_BYTES, n - HEADER_BYTES, out);
}

/* fill and seal a row whose header is in place: its payload (n bytes at src) copied to
 * row + HEADER_BYTES, the tag written after it -- in one pass over the payload with the fast
 * GHASH (gh_tag_fill), a copy then the tag with OpenSSL's. 0 on success */
static int gmac_fill(Mac *m, uint8_t *row, const uint8_t *src, int n) {
    uint8_t *out = row + HEADER_BYTES + n;
    if (m->fast) {
        uint8_t iv[12];
        mac_iv(row, iv);
        if (m->fast == GH_512) gh_ztag_fill(m, row, src, (size_t)n, iv, out);
        else gh_tag_fill(m, row, src, (size_t)n, iv, out);
        return 0;
    }
    memcpy(row + HEADER_BYTES, src, (size_t)n);
    return gmac(m, row, HEADER_BYTES + n, out);
}

/* ---- loss estimator (copies.LossEstimator, same arithmetic) ------------------------------- */
static void loss_arrived(Engine *e, int s, int64_t key, double n) {
    int64_t *bk = e->booked_keys + (size_t)s * PHASES_PENDING;
    for (int i = 0; i < e->n_booked[s]; i++)
        if (bk[i] == key) { e->lgot[s] += n; return; }
    Pending *pd = e->pending + (size_t)s * (PHASES_PENDING + 1);
    int np_ = e->n_pending[s];
    for (int i = 0; i < np_; i++)
        if (pd[i].key == key) { pd[i].n += n; return; }
    pd[np_].key = key; pd[np_].n = n; np_++;
    while (np_ > PHASES_PENDING) { /* the oldest phase whose marker never came */
        memmove(pd, pd + 1, sizeof(Pending) * (size_t)(np_ - 1));
        np_--;
    }
    e->n_pending[s] = np_;
}

static void loss_owe(Engine *e, int s, double datagrams, int64_t key) {
    double f = pow(0.97, datagrams / 300.0);
    double got = 0.0;
    Pending *pd = e->pending + (size_t)s * (PHASES_PENDING + 1);
    for (int i = 0; i < e->n_pending[s]; i++)
        if (pd[i].key == key) {
            got = pd[i].n;
            memmove(pd + i, pd + i + 1, sizeof(Pending) * (size_t)(e->n_pending[s] - i - 1));
            e->n_pending[s]--;
            break;
        }
    e->lgot[s] = e->lgot[s] * f + got;
    e->lowed[s] = e->lowed[s] * f + datagrams;
    int64_t *bk = e->booked_keys + (size_t)s * PHASES_PENDING;
    for (int i = 0; i < e->n_booked[s]; i++)
        if (bk[i] == key) return;
    if (e->n_booked[s] == PHASES_PENDING) {
        memmove(bk, bk + 1, sizeof(int64_t) * (PHASES_PENDING - 1));
        e->n_booked[s]--;
    }
    bk[e->n_booked[s]++] = key;
}

/* ---- placement (receiving.PyReceiver._place and its helpers) ----------------------------- */
static inline Round *slot_of(Engine *e, int64_t rnd) { return &e->rounds[rnd % e->rounds_open]; }
static inline int64_t nchunks(Engine *e, int s) { return e->n_chunks[s]; }

static void fec_free(FecRx *f) {
    if (!f) return;
    free(f->par); free(f->pseen); free(f->have); free(f->done); free(f);
}

static void maybe_decode(Engine *e, Round *st, int ph, int s, FecRx *rx, int i) {
    int k = rx->k, S = rx->S, n = rx->n, C = e->chunk;
    if (rx->done[i] || rx->have[i] < k) return;
    rx->done[i] = 1;
    uint8_t *seen = ph == PHASE_GRAD ? st->seen + (size_t)s * nchunks(e, e->me) : st->vseen[s];
    int missing[MAX_BLOCKS], ne = 0;
    for (int j = 0; j * S + i < n; j++)
        if (!seen[j * S + i]) missing[ne++] = j;
    if (!ne) return;
    int prow[MAX_BLOCKS], np_ = 0;
    for (int j = 0; j < rx->m && np_ < ne; j++)
        if (rx->pseen[j * S + i]) prow[np_++] = j;
    if (np_ < ne) return; /* cannot happen: have >= k */
    int shard = ph == PHASE_GRAD ? e->me : s;
    int64_t slen = e->shard_lens[shard];
    float *buf; int64_t base;
    if (ph == PHASE_GRAD) { buf = st->contrib + (size_t)s * nchunks(e, e->me) * C; base = 0; }
    else { buf = st->vdst; base = e->bounds[s]; }
    /* scratch: one zero block, one padded tail, e output blocks */
    float *zero = (float *)e->tmp;
    float *tail = zero + C;
    float *out = tail + C;
    memset(zero, 0, sizeof(float) * C);
    uint8_t *src[MAX_BLOCKS], *dst[MAX_BLOCKS];
    uint8_t known[MAX_BLOCKS]; int nk = 0;
    int mi = 0;
    for (int j = 0; j < k; j++) {
        if (mi < ne && missing[mi] == j) { mi++; continue; }
        known[nk] = (uint8_t)j;
        int64_t r = (int64_t)j * S + i;
        if (r >= n) src[nk] = (uint8_t *)zero;
        else if ((r + 1) * C > slen && ph != PHASE_GRAD) {
            memset(tail, 0, sizeof(float) * C);
            memcpy(tail, buf + base + r * C, sizeof(float) * (size_t)(slen - r * C));
            src[nk] = (uint8_t *)tail;
        } else src[nk] = (uint8_t *)(buf + base + r * C);
        nk++;
    }
    for (int x = 0; x < ne; x++) src[nk + x] = (uint8_t *)(rx->par + (size_t)(prow[x] * S + i) * C);
    for (int x = 0; x < ne; x++) dst[x] = (uint8_t *)(out + (size_t)x * C);
    /* coefficients: A[P,D]^-1 (A[P,K] | I), A = the Cauchy matrix 1/((k+j) xor t) */
    /* scratch (held under the engine mutex): Gauss-Jordan, e x e inverse, right side, result */
    uint8_t *gj = e->gf, *sub = gj + 2 * MAX_BLOCKS * MAX_BLOCKS, *inv = sub + MAX_BLOCKS * MAX_BLOCKS;
    uint8_t *rhs = inv + MAX_BLOCKS * MAX_BLOCKS, *coef = rhs + MAX_BLOCKS * MAX_BLOCKS;
    for (int a = 0; a < ne; a++)
        for (int b = 0; b < ne; b++) sub[a * ne + b] = GF_INV[(k + prow[a]) ^ missing[b]];
    if (gf_invert(sub, inv, ne, gj) != 0) return;
    for (int a = 0; a < ne; a++) {
        for (int b = 0; b < nk; b++) rhs[a * k + b] = GF_INV[(k + prow[a]) ^ known[b]];
        for (int b = 0; b < ne; b++) rhs[a * k + nk + b] = (uint8_t)(a == b);
    }
    for (int a = 0; a < ne; a++)
        for (int b = 0; b < k; b++) {
            uint8_t v = 0;
            for (int t = 0; t < ne; t++) v ^= gf_mul(inv[a * ne + t], rhs[t * k + b]);
            coef[a * k + b] = v;
        }
    gf_apply(coef, ne, k, src, dst, 4 * C);
    for (int x = 0; x < ne; x++) {
        int64_t r = (int64_t)missing[x] * S + i;
        int64_t len = slen - r * C < C ? slen - r * C : C;
        float *v = out + (size_t)x * C;
        if (!all_finite((const uint8_t *)v, len)) { e->rejected[RJ_NONFINITE]++; continue; }
        if (ph == PHASE_GRAD) {
            st->seen[(size_t)s * nchunks(e, e->me) + r] = 1;
            float *sum = st->sum + r * C;
            if (st->count[r] == 0) memcpy(sum, v, sizeof(float) * len); /* (see sum_into) */
            else for (int64_t t = 0; t < len; t++) sum[t] += v[t];
            memcpy(st->contrib + (size_t)s * nchunks(e, e->me) * C + r * C, v, sizeof(float) * len);
            st->count[r]++;
        } else {
            st->vseen[s][r] = 1;
            memcpy(st->vdst + base + r * C, v, sizeof(float) * len);
        }
        st->got[ph * e->world + s]++;
        st->recovered[ph]++;
    }
}

static void fec_data_arrived(Engine *e, Round *st, int ph, int s, int64_t c) {
    FecRx *rx = st->fec[ph * e->world + s];
    if (!rx) return;
    int i = (int)(c % rx->S);
    rx->have[i]++;
    maybe_decode(e, st, ph, s, rx, i);
}

static int place_parity(Engine *e, Round *st, int ph, int s, int q, int S, int m,
                        const float *pay) {
    int shard = ph == PHASE_GRAD ? e->me : s;
    int n = (int)nchunks(e, shard);
    FecRx *rx = st->fec[ph * e->world + s];
    if (!rx) {
        int nn = n > 1 ? n : 1;
        if (S < 1) return RJ_BAD_RANGE;
        int k = (n + S - 1) / S;
        if (!(S <= nn && m >= 1 && k + m <= MAX_BLOCKS && (int64_t)m * S <= 2 * (int64_t)nn + S))
            return RJ_BAD_RANGE;
        rx = calloc(1, sizeof(FecRx));
        if (!rx) return RJ_MALFORMED;
        rx->n = n; rx->S = S; rx->m = m; rx->k = k;
        rx->par = malloc(sizeof(float) * (size_t)m * S * e->chunk);
        rx->pseen = calloc((size_t)m * S, 1);
        rx->have = calloc((size_t)S, sizeof(int64_t));
        rx->done = calloc((size_t)S, 1);
        if (!rx->par || !rx->pseen || !rx->have || !rx->done) { fec_free(rx); return RJ_MALFORMED; }
        uint8_t *seen = ph == PHASE_GRAD ? st->seen + (size_t)s * nchunks(e, e->me) : st->vseen[s];
        for (int r = 0; r < n; r++)
            if (seen[r]) rx->have[r % S]++;
        for (int r = n; r < k * S; r++) rx->have[r % S]++; /* virtual: known zeros */
        st->fec[ph * e->world + s] = rx;
    } else if (rx->S != S || rx->m != m) {
        return RJ_BAD_RANGE; /* one geometry per sender, phase and round */
    }
    if (rx->pseen[q]) return RJ_DUPLICATE;
    rx->pseen[q] = 1;
    memcpy(rx->par + (size_t)q * e->chunk, pay, sizeof(float) * e->chunk);
    int i = q % S;
    rx->have[i]++;
    maybe_decode(e, st, ph, s, rx, i);
    return RJ_OK;
}

/* the owner's sum of the others' contributions: sum += pay, or sum = pay for the chunk's first
 * contribution (``first``: the sum is never cleared between rounds; aggregate.ShardAccumulator),
 * and keep a copy of pay when keep is set (the erasure decoder's copy of each contribution), in
 * one pass over the payload; a function of its own so that a profiler attributes the summation
 * to it (``stalwart bench lossy --only profile``) */
/* (the copy loops stay loops, not memcpy calls: one pass over the payload for both stores,
 * and the profile counts them here) */
__attribute__((optimize("no-tree-loop-distribute-patterns")))
static NOINLINE void sum_into(float *restrict sum, float *restrict keep,
                              const float *restrict pay, int64_t n, int first) {
    if (first && keep) {
        for (int64_t t = 0; t < n; t++) {
            float v = pay[t];
            sum[t] = v;
            keep[t] = v;
        }
    } else if (first) {
        for (int64_t t = 0; t < n; t++) sum[t] = pay[t];
    } else if (keep) {
        for (int64_t t = 0; t < n; t++) {
            float v = pay[t];
            sum[t] += v;
            keep[t] = v;
        }
    } else {
        for (int64_t t = 0; t < n; t++) sum[t] += pay[t];
    }
}

/* the owner's average of one chunk: out = (sum + own) / d, element by element in float32 (the
 * same operations as numpy's add then divide: the same bits); out may be own itself */
static NOINLINE void sum_into_mean(float *restrict out, const float *restrict sum,
                                   const float *restrict own, int64_t n, float d) {
    for (int64_t t = 0; t < n; t++) out[t] = (sum[t] + own[t]) / d;
}

static NOINLINE void sum_into_mean_inplace(float *restrict io, const float *restrict sum,
                                           int64_t n, float d) {
    for (int64_t t = 0; t < n; t++) io[t] = (sum[t] + io[t]) / d;
}

/* the same with d a power of two: x * (1/d) is x / d exactly (1/d is exact, both correctly
 * rounded from the same value), and a multiply costs a fraction of a divide */
static NOINLINE void sum_into_mean_pow2(float *restrict out, const float *restrict sum,
                                        const float *restrict own, int64_t n, float r) {
    for (int64_t t = 0; t < n; t++) out[t] = (sum[t] + own[t]) * r;
}

static NOINLINE void sum_into_mean_pow2_inplace(float *restrict io, const float *restrict sum,
                                                int64_t n, float r) {
    for (int64_t t = 0; t < n; t++) io[t] = (sum[t] + io[t]) * r;
}

static int place(Engine *e, const uint8_t *row, const Hdr *h) {
    int64_t rnd = h->rnd;
    int ph = h->phase, s = h->sender, C = e->chunk;
    int64_t off = h->offset, n = h->length;
    Round *st = slot_of(e, rnd);
    if (!st->bound || st->rnd != rnd) return rnd < e->round ? RJ_OLD_ROUND : RJ_FUTURE_ROUND;
    int is_end = h->flags & FLAG_END;
    uint8_t *gseen = st->seen + (size_t)s * nchunks(e, e->me);
    if (st->closed[ph]) {
        if (is_end || ph == PHASE_NORM) return RJ_OK;
        if (h->flags & FLAG_PARITY) return RJ_SPARE;
        uint8_t *seen = ph == PHASE_GRAD ? gseen : st->vseen[s];
        return seen[off / C] ? RJ_OK : RJ_LATE;
    }
    if (is_end) {
        st->marker[ph * e->world + s] = off;
        if (h->hint > 0) { e->hint[s] = h->hint / 1e6; e->hint_new[s] = 1; }
        return RJ_OK;
    }
    const float *pay = (const float *)(row + HEADER_BYTES); /* alignment: rows are 8-aligned */
    if (h->flags & FLAG_PARITY) return place_parity(e, st, ph, s, (int)off, h->fb, h->copies, pay);
    int64_t c = off / C;
    if (ph == PHASE_NORM) {
        if (st->got[ph * e->world + s]) return RJ_OK;
        st->norm[s] = (double)pay[0];
    } else if (ph == PHASE_GRAD) {
        if (gseen[c]) return e->may_copy ? RJ_OK : RJ_DUPLICATE;
        gseen[c] = 1;
        sum_into(st->sum + off,
                 st->contrib ? st->contrib + (size_t)s * nchunks(e, e->me) * C + off : NULL,
                 pay, n, st->count[c] == 0);
        st->count[c]++;
        memcpy(st->gtag + ((size_t)s * nchunks(e, e->me) + c) * TAG_BYTES,
               row + HEADER_BYTES + 4 * n, TAG_BYTES);
        st->got[ph * e->world + s]++;
        fec_data_arrived(e, st, ph, s, c);
        return RJ_OK;
    } else {
        if (st->vseen[s][c]) return e->may_copy ? RJ_OK : RJ_DUPLICATE;
        st->vseen[s][c] = 1;
        memcpy(st->vdst + e->bounds[s] + off, pay, 4 * n);
        memcpy(st->vtag + (size_t)(e->chunk_base[s] + c) * TAG_BYTES, row + HEADER_BYTES + 4 * n,
               TAG_BYTES);
        st->got[ph * e->world + s]++;
        fec_data_arrived(e, st, ph, s, c);
        return RJ_OK;
    }
    st->got[ph * e->world + s]++;
    return RJ_OK;
}

static int same_tag(Engine *e, const uint8_t *row, const Hdr *h) {
    int64_t rnd = h->rnd;
    int s = h->sender;
    Round *st = slot_of(e, rnd);
    if (!st->bound || st->rnd != rnd || s == e->me) return 0;
    int64_t c = h->offset / e->chunk;
    const uint8_t *ref;
    if (h->phase == PHASE_GRAD) {
        if (c >= nchunks(e, e->me) || !st->seen[(size_t)s * nchunks(e, e->me) + c]) return 0;
        ref = st->gtag + ((size_t)s * nchunks(e, e->me) + c) * TAG_BYTES;
    } else {
        if (c >= nchunks(e, s) || !st->vseen[s][c]) return 0;
        ref = st->vtag + (size_t)(e->chunk_base[s] + c) * TAG_BYTES;
    }
    return memcmp(row + HEADER_BYTES + 4 * (size_t)h->length, ref, TAG_BYTES) == 0;
}

/* ---- the checks (wire.Wire.check), split around the tag so that the lock is not held
 * while hashing ------------------------------------------------------------------------ */
static int check_pre(Engine *e, const uint8_t *p, int64_t size, Hdr *h) {
    if (size < OVERHEAD || size > e->slot) return RJ_MALFORMED;
    parse(p, h);
    int is_end = h->flags == FLAG_END;
    if (h->magic != MAGIC || h->job != e->job) return RJ_MALFORMED;
    if ((int64_t)h->length > e->slot && !is_end) return RJ_MALFORMED;
    if (size != (is_end ? OVERHEAD : OVERHEAD + 4 * (int64_t)h->length)) return RJ_MALFORMED;
    if (e->may_copy && !h->flags && h->sender < e->world && h->sender != e->me) {
        Round *st = slot_of(e, h->rnd);
        if (st->bound && st->rnd == (int64_t)h->rnd) {
            int64_t c = h->offset / e->chunk;
            if (h->phase == PHASE_GRAD) {
                if (c < nchunks(e, e->me) && st->seen[(size_t)h->sender * nchunks(e, e->me) + c])
                    return RJ_SPARE;
            } else if (h->phase == PHASE_VALUE) {
                if (c < nchunks(e, h->sender) && st->vseen[h->sender][c]) return RJ_SPARE;
            }
        }
    }
    return RJ_OK;
}

/* the tag check; also sets h->finite (every payload float finite), which check_post reads
 * for data packets: found by the fast GHASH's own loads (gh_tag_check), else by a scan of a
 * data packet's payload after the tag */
static int check_tag(Mac *ctx, const uint8_t *p, int64_t size, Hdr *h) {
    uint8_t tag[TAG_BYTES];
    int64_t n = size - TAG_BYTES;
    if (n < HEADER_BYTES) return RJ_BAD_TAG;
    if (ctx->fast) {
        uint8_t iv[12];
        mac_iv(p, iv);
        h->finite = (uint8_t)(ctx->fast == GH_512 ? gh_ztag_check(ctx, p, (size_t)n, iv, tag)
                                                  : gh_tag_check(ctx, p, (size_t)n, iv, tag));
    } else {
        if (gmac(ctx, p, (int)n, tag) != 0) return RJ_BAD_TAG;
        h->finite = h->flags != 0 || all_finite(p + HEADER_BYTES, (n - HEADER_BYTES) / 4);
    }
    return CRYPTO_memcmp(tag, p + size - TAG_BYTES, TAG_BYTES) == 0 ? RJ_OK : RJ_BAD_TAG;
}

static int check_post(Engine *e, const uint8_t *p, const Hdr *h, int src_ok, int64_t cur) {
    int64_t s = h->sender;
    if (s >= e->world || s == e->me || !src_ok) return RJ_UNKNOWN_SENDER;
    int64_t rnd = h->rnd;
    if (rnd < cur) return RJ_OLD_ROUND;
    if (rnd > cur + e->rounds_open - 1) return RJ_FUTURE_ROUND;
    int ph = h->phase, fl = h->flags;
    int64_t shard = h->shard, off = h->offset, len = h->length;
    int64_t want = ph == PHASE_GRAD ? e->me : s;
    if (!(ph <= PHASE_NORM && shard == want)) return RJ_BAD_RANGE;
    if (!(fl == 0 || fl == FLAG_END || fl == FLAG_PARITY)) return RJ_BAD_RANGE;
    int64_t slen = e->shard_lens[shard < e->world ? shard : e->world - 1];
    int64_t C = e->chunk, nch = (slen + C - 1) / C;
    int ok;
    if (fl == FLAG_END) {
        ok = ph != PHASE_NORM && len <= 2 * nch + MAX_BLOCKS;
    } else if (fl == FLAG_PARITY) {
        int64_t S = h->fb, m = h->copies;
        int64_t k = (nch + (S > 1 ? S : 1) - 1) / (S > 1 ? S : 1);
        ok = ph != PHASE_NORM && S >= 1 && S <= nch && m >= 1 && k + m <= MAX_BLOCKS &&
             m * S <= 2 * nch + S && off < m * S && len == C;
    } else if (ph == PHASE_NORM) {
        ok = off == 0 && len == 1;
    } else {
        ok = off % C == 0 && off < slen && len == (C < slen - off ? C : slen - off);
    }
    if (!ok) return RJ_BAD_RANGE;
    if (fl == 0 && !h->finite) return RJ_NONFINITE; /* found by check_tag */
    return RJ_OK;
}

/* a datagram whose checks are done: bookkeeping + placement (PyReceiver._on_rest) */
static void settle(Engine *e, const uint8_t *p, const Hdr *h, int why, double now) {
    int s = h->sender;
    int unauth = why == RJ_MALFORMED || why == RJ_BAD_TAG || why == RJ_UNKNOWN_SENDER ||
                 why == RJ_SPARE;
    if (why == RJ_MALFORMED) { e->rejected[why]++; return; } /* header may be unparsed */
    if (!unauth && s < e->world) {
        e->heard[s] = now;
        e->ever[s] = 1;
        e->spoke[s] = 1;
    }
    if (s < e->world && h->phase != PHASE_NORM) {
        int64_t key = (int64_t)h->rnd * 3 + h->phase;
        if (!(h->flags & FLAG_END)) {
            if (why == RJ_OK || why == RJ_OLD_ROUND || (why == RJ_SPARE && same_tag(e, p, h)))
                loss_arrived(e, s, key, 1.0);
        } else if ((why == RJ_OK || why == RJ_OLD_ROUND) && h->phase < 3) {
            int64_t *bk = &e->marker_booked[h->phase * e->world + s];
            if ((int64_t)h->rnd > *bk) {
                *bk = h->rnd;
                int cp = h->copies < 1 ? 1 : h->copies;
                if (cp > MAX_ANNOUNCED_COPIES) cp = MAX_ANNOUNCED_COPIES;
                loss_owe(e, s, (double)h->offset * cp + h->length, key);
                if (h->fb != FB_UNKNOWN && e->fb_n < FB_CAP) {
                    e->fb_src[e->fb_n] = s;
                    e->fb_rate[e->fb_n] = h->fb / 10000.0;
                    e->fb_n++;
                }
            }
        }
    }
    if (why == RJ_OK) why = place(e, p, h);
    /* also after place(): the round may have ended since the packet was checked */
    if (why == RJ_OLD_ROUND && (int64_t)h->rnd == e->round - 1)
        why = (h->flags & FLAG_END) ? RJ_OK : RJ_LATE; /* end-marker copies count as nothing */
    if (why) e->rejected[why]++;
}

static int64_t watch_sig(Engine *e) {
    if (e->w_slot < 0) return 0;
    Round *st = &e->rounds[e->w_slot];
    int ph = e->w_phase, W = e->world;
    int64_t done = 0, ended = 0, started = 0, spoke = 0;
    for (int s = 0; s < W; s++) {
        if (e->w_exp[s] < 0) continue;
        int d = st->got[ph * W + s] >= e->w_exp[s];
        done += d;
        ended += d || st->marker[ph * W + s] >= 0;
        int any = 0;
        for (int q = 0; q < 3; q++) any |= st->got[q * W + s] > 0 || st->marker[q * W + s] >= 0;
        started += any;
        spoke += e->w_silent[s] && e->spoke[s];
    }
    return done | ended << 12 | started << 24 | spoke << 36;
}

/* the most datagram bytes one block of process() takes through its three passes: a block is
 * checked, tagged and placed while it is still in the L1/L2 cache (a whole recvmmsg batch --
 * ~9 GRO messages of up to 64 KB, measured: 380-560 KB -- is not, and each pass re-read it
 * from farther away); the lock is taken twice per block */
#define PROCESS_BLOCK_BYTES (32 * 1024)

/* process datagrams [i0, i1): three passes, the lock held around the first and the last */
static void process_block(Engine *e, int i0, int i1, Hdr *hs) {
    pthread_mutex_lock(&e->mu);
    for (int i = i0; i < i1; i++) {
        memset(&hs[i], 0, sizeof(Hdr));
        e->d_why[i] = (uint8_t)check_pre(e, e->d_ptr[i], e->d_size[i], &hs[i]);
    }
    pthread_mutex_unlock(&e->mu);
    for (int i = i0; i < i1; i++)
        if (e->d_why[i] == RJ_OK) e->d_why[i] = (uint8_t)check_tag(e->rx_ctx, e->d_ptr[i], e->d_size[i], &hs[i]);
    double now = now_mono();
    pthread_mutex_lock(&e->mu);
    int64_t cur = e->round > 0 ? e->round : 0;
    cur &= 0xFFFFFFFF;
    for (int i = i0; i < i1; i++) {
        int why = e->d_why[i];
        if (why == RJ_OK) {
            int s = hs[i].sender;
            int ok = s < e->world && e->d_src[i] == s;
            why = check_post(e, e->d_ptr[i], &hs[i], ok, cur);
        }
        settle(e, e->d_ptr[i], &hs[i], why, now);
    }
    pthread_mutex_unlock(&e->mu);
}

/* process n datagrams, in blocks of at most PROCESS_BLOCK_BYTES (at least one datagram), in
 * arrival order; the waiting thread is woken once, after the last block, if what it watches
 * changed */
static void process(Engine *e, int n) {
    Hdr hs[n > 0 ? n : 1];
    for (int i0 = 0; i0 < n;) {
        int i1 = i0 + 1;
        int64_t bytes = e->d_size[i0];
        while (i1 < n && bytes + e->d_size[i1] <= PROCESS_BLOCK_BYTES) bytes += e->d_size[i1++];
        process_block(e, i0, i1, hs);
        i0 = i1;
    }
    pthread_mutex_lock(&e->mu);
    int64_t sig = watch_sig(e);
    if (sig != e->w_sig) {
        e->w_sig = sig;
        pthread_cond_broadcast(&e->cv);
    }
    pthread_mutex_unlock(&e->mu);
}

static int src_index(Engine *e, const struct sockaddr_in *sa) {
    for (int s = 0; s < e->world; s++)
        if (e->peer_addr[s] == sa->sin_addr.s_addr && e->peer_port[s] == sa->sin_port) return s;
    return -1;
}

static int keep_datagram(Engine *e, const uint8_t *p, int64_t size) {
    if (e->drop_period <= 0 && e->n_rules == 0) return 1;
    if (size < HEADER_BYTES) return 1;
    Hdr h;
    parse(p, &h);
    int end = (h.flags & FLAG_END) != 0;
    int64_t c = e->drop_count++;
    int drop = e->drop_period > 0 && !end && c % e->drop_period < e->drop_burst;
    for (int i = 0; i < e->n_rules && !drop; i++) {
        int64_t *r = e->rules[i], chunk = h.offset / e->chunk;
        drop = (r[0] < 0 || r[0] == h.sender) && ((r[1] >> h.phase) & 1) &&
               (r[2] < 0 || r[2] == end) && (end || (chunk >= r[3] && chunk < r[4])) &&
               (r[5] < 0 || r[5] == (int64_t)h.rnd);
    }
    if (drop) e->dropped++;
    return !drop;
}

static void *rx_loop(void *arg) {
    Engine *e = (Engine *)arg;
    int R = e->rx_segments, slot = e->slot;
    while (!e->stop) {
        for (int i = 0; i < e->batch; i++) {
            e->msgs[i].msg_hdr.msg_namelen = sizeof(struct sockaddr_in);
            e->msgs[i].msg_hdr.msg_controllen = CMSG_SLOT;
            e->msgs[i].msg_hdr.msg_flags = 0;
        }
        int got = recvmmsg(e->fd, e->msgs, (unsigned)e->batch, MSG_WAITFORONE, NULL);
        if (got <= 0) continue;
        e->rx_batches++;
        if ((e->rx_batches & 63) == 0) {
            struct timespec ts;
            clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
            e->rx_cpu = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
        }
        int nd = 0;
        int cap = e->batch * R;
        for (int i = 0; i < got; i++) {
            uint8_t *buf = e->rx + (size_t)i * R * slot;
            int64_t len = e->msgs[i].msg_len;
            int src = src_index(e, &e->sas[i]);
            int seg = 0;
            struct msghdr *mh = &e->msgs[i].msg_hdr;
            for (struct cmsghdr *cm = CMSG_FIRSTHDR(mh); cm; cm = CMSG_NXTHDR(mh, cm))
                if (cm->cmsg_level == SOL_UDP && cm->cmsg_type == UDP_GRO) {
                    int v; memcpy(&v, CMSG_DATA(cm), sizeof(int)); seg = v;
                }
            if (seg <= 0) seg = (int)len;
            for (int64_t off = 0; off < len && nd < cap; off += seg) {
                if (seg == slot && off / slot >= R) break;
                int64_t size = len - off < seg ? len - off : seg;
                if (!keep_datagram(e, buf + off, size)) continue;
                e->d_ptr[nd] = buf + off; e->d_size[nd] = size; e->d_src[nd] = src;
                nd++;
            }
        }
        e->rx_msgs += got;
        e->rx_dgrams += nd;
        process(e, nd);
    }
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    e->rx_cpu = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    return NULL;
}

/* ---- Python API ---------------------------------------------------------------------- */
static int get_buf(PyObject *o, Py_buffer *b, Py_ssize_t min_bytes, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (b->len < min_bytes) {
        PyErr_Format(PyExc_ValueError, "engine: %s has %zd bytes, needs %zd", what, b->len,
                     min_bytes);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

static void release_round(Engine *e, Round *st) {
    if (!st->bound) return;
    PyBuffer_Release(&st->b_sum); PyBuffer_Release(&st->b_count); PyBuffer_Release(&st->b_seen);
    if (st->has_contrib) PyBuffer_Release(&st->b_contrib);
    PyBuffer_Release(&st->b_vals); PyBuffer_Release(&st->b_norm); PyBuffer_Release(&st->b_got);
    PyBuffer_Release(&st->b_marker); PyBuffer_Release(&st->b_gtag);
    PyBuffer_Release(&st->b_vtag); PyBuffer_Release(&st->b_recovered);
    if (st->has_vout) PyBuffer_Release(&st->b_vout);
    st->has_vout = 0;
    for (int s = 0; s < e->world; s++) PyBuffer_Release(&st->b_vseen[s]);
    free(st->b_vseen); free(st->vseen);
    for (int q = 0; q < 3 * e->world; q++) fec_free(st->fec[q]);
    free(st->fec);
    st->bound = 0;
}

static void stop_thread(Engine *e) {
    if (e->running) {
        e->stop = 1;
        Py_BEGIN_ALLOW_THREADS
        pthread_join(e->thread, NULL);
        Py_END_ALLOW_THREADS
        e->running = 0;
    }
}

static void Engine_dealloc(Engine *e) {
    stop_thread(e);
    for (int i = 0; i < MAX_ROUNDS; i++) release_round(e, &e->rounds[i]);
    if (e->shared_bound) {
        PyBuffer_Release(&e->b_heard); PyBuffer_Release(&e->b_ever);
        PyBuffer_Release(&e->b_rejected); PyBuffer_Release(&e->b_lgot);
        PyBuffer_Release(&e->b_lowed);
    }
    mac_free(e->tx_ctx);
    mac_free(e->rx_ctx);
    free(e->shard_lens); free(e->bounds); free(e->n_chunks); free(e->chunk_base);
    free(e->peer_addr); free(e->peer_port); free(e->pending); free(e->n_pending);
    free(e->booked_keys); free(e->n_booked); free(e->marker_booked); free(e->hint);
    free(e->hint_new); free(e->w_exp); free(e->w_silent); free(e->spoke);
    free(e->rx); free(e->msgs); free(e->iovs); free(e->sas); free(e->cmsgs);
    free(e->d_ptr); free(e->d_size); free(e->d_src); free(e->d_why); free(e->tmp); free(e->gf);
    pthread_mutex_destroy(&e->mu); pthread_mutex_destroy(&e->seal_mu);
    pthread_cond_destroy(&e->cv);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

static int Engine_init(Engine *e, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"fd", "key", "job", "world", "me", "shard_lens", "chunk", "slot",
                             "rounds_open", "may_copy", "batch", "rx_segments", NULL};
    int fd, world, me, chunk, slot, rounds_open, may_copy, batch, rx_segments;
    unsigned long job;
    Py_buffer key;
    PyObject *lens;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iy*kiiOiiipii", kwlist, &fd, &key, &job, &world,
                                     &me, &lens, &chunk, &slot, &rounds_open, &may_copy, &batch,
                                     &rx_segments))
        return -1;
    if (key.len != 32 || world < 1 || world > 65535 || me < 0 || me >= world || chunk < 1 ||
        slot != OVERHEAD + 4 * chunk || rounds_open < 1 || rounds_open > MAX_ROUNDS ||
        batch < 1 || rx_segments < 1) {
        PyBuffer_Release(&key);
        PyErr_SetString(PyExc_ValueError, "engine: bad geometry or key");
        return -1;
    }
    e->fd = fd; e->world = world; e->me = me; e->chunk = chunk; e->slot = slot;
    e->rounds_open = rounds_open; e->may_copy = may_copy; e->batch = batch;
    e->rx_segments = rx_segments; e->job = (uint32_t)job; e->round = -1;
    e->tx_ctx = mac_new(key.buf);
    e->rx_ctx = mac_new(key.buf);
    PyBuffer_Release(&key);
    if (!e->tx_ctx || !e->rx_ctx) { PyErr_SetString(PyExc_RuntimeError, "engine: AES-GCM init"); return -1; }
    PyObject *seq = PySequence_Fast(lens, "shard_lens must be a sequence");
    if (!seq) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != world) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "engine: shard_lens must have world entries");
        return -1;
    }
    e->shard_lens = calloc(world, 8); e->bounds = calloc(world + 1, 8);
    e->n_chunks = calloc(world, 8); e->chunk_base = calloc(world + 1, 8);
    for (int s = 0; s < world; s++) {
        e->shard_lens[s] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, s));
        e->bounds[s + 1] = e->bounds[s] + e->shard_lens[s];
        e->n_chunks[s] = (e->shard_lens[s] + chunk - 1) / chunk;
        e->chunk_base[s + 1] = e->chunk_base[s] + e->n_chunks[s];
    }
    Py_DECREF(seq);
    if (PyErr_Occurred()) return -1;
    e->peer_addr = calloc(world, 4); e->peer_port = calloc(world, 2);
    e->pending = calloc((size_t)world * (PHASES_PENDING + 1), sizeof(Pending));
    e->n_pending = calloc(world, sizeof(int));
    e->booked_keys = calloc((size_t)world * PHASES_PENDING, 8);
    e->n_booked = calloc(world, sizeof(int));
    e->marker_booked = malloc((size_t)3 * world * 8);
    for (int i = 0; i < 3 * world; i++) e->marker_booked[i] = -1;
    e->hint = calloc(world, 8); e->hint_new = calloc(world, 1);
    e->w_exp = calloc(world, 8); e->w_silent = calloc(world, 1); e->spoke = calloc(world, 1);
    e->w_slot = -1;
    size_t ring = (size_t)batch * rx_segments * slot;
    e->rx = aligned_alloc(64, (ring + 63) / 64 * 64);
    e->msgs = calloc(batch, sizeof(struct mmsghdr));
    e->iovs = calloc(batch, sizeof(struct iovec));
    e->sas = calloc(batch, sizeof(struct sockaddr_in));
    e->cmsgs = calloc(batch, CMSG_SLOT);
    int cap = batch * rx_segments;
    e->d_ptr = calloc(cap, sizeof(uint8_t *)); e->d_size = calloc(cap, 8);
    e->d_src = calloc(cap, sizeof(int)); e->d_why = calloc(cap, 1);
    e->tmp = aligned_alloc(64, ((size_t)4 * chunk * (2 + MAX_BLOCKS) + 63) / 64 * 64);
    e->gf = malloc((size_t)6 * MAX_BLOCKS * MAX_BLOCKS);
    if (!e->rx || !e->msgs || !e->tmp || !e->d_ptr || !e->gf) { PyErr_NoMemory(); return -1; }
    for (int i = 0; i < batch; i++) {
        e->iovs[i].iov_base = e->rx + (size_t)i * rx_segments * slot;
        e->iovs[i].iov_len = (size_t)rx_segments * slot;
        e->msgs[i].msg_hdr.msg_name = &e->sas[i];
        e->msgs[i].msg_hdr.msg_iov = &e->iovs[i];
        e->msgs[i].msg_hdr.msg_iovlen = 1;
        e->msgs[i].msg_hdr.msg_control = e->cmsgs + (size_t)i * CMSG_SLOT;
    }
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->seal_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&e->cv, &ca);
    pthread_condattr_destroy(&ca);
    return 0;
}

static PyObject *Engine_set_peers(Engine *e, PyObject *args) {
    PyObject *addrs, *ports;
    if (!PyArg_ParseTuple(args, "OO", &addrs, &ports)) return NULL;
    for (int s = 0; s < e->world; s++) {
        PyObject *a = PySequence_GetItem(addrs, s), *p = PySequence_GetItem(ports, s);
        if (!a || !p) { Py_XDECREF(a); Py_XDECREF(p); return NULL; }
        e->peer_addr[s] = htonl((uint32_t)PyLong_AsUnsignedLong(a));
        e->peer_port[s] = htons((uint16_t)PyLong_AsUnsignedLong(p));
        Py_DECREF(a); Py_DECREF(p);
    }
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Engine_bind_round(Engine *e, PyObject *args) {
    int i;
    PyObject *sum, *count, *seen, *contrib, *vals, *vseen, *norm, *got, *marker, *gtag, *vtag,
        *rec;
    if (!PyArg_ParseTuple(args, "iOOOOOOOOOOOO", &i, &sum, &count, &seen, &contrib, &vals,
                          &vseen, &norm, &got, &marker, &gtag, &vtag, &rec))
        return NULL;
    if (i < 0 || i >= e->rounds_open) { PyErr_SetString(PyExc_ValueError, "slot"); return NULL; }
    Round *st = &e->rounds[i];
    release_round(e, st);
    int W = e->world;
    int64_t nc = e->n_chunks[e->me], C = e->chunk, total = e->chunk_base[W];
    if (get_buf(sum, &st->b_sum, 4 * e->shard_lens[e->me], "sum") < 0) return NULL;
    if (get_buf(count, &st->b_count, 4 * nc, "count") < 0) goto f1;
    if (get_buf(seen, &st->b_seen, W * nc, "seen") < 0) goto f2;
    st->has_contrib = contrib != Py_None;
    if (st->has_contrib && get_buf(contrib, &st->b_contrib, 4 * W * nc * C, "contrib") < 0) goto f3;
    if (get_buf(vals, &st->b_vals, 4 * e->bounds[W], "vals") < 0) goto f4;
    if (get_buf(norm, &st->b_norm, 8 * W, "norm") < 0) goto f5;
    if (get_buf(got, &st->b_got, 8 * 3 * W, "got") < 0) goto f6;
    if (get_buf(marker, &st->b_marker, 8 * 3 * W, "marker") < 0) goto f7;
    if (get_buf(gtag, &st->b_gtag, TAG_BYTES * W * nc, "gtag") < 0) goto f8;
    if (get_buf(vtag, &st->b_vtag, TAG_BYTES * total, "vtag") < 0) goto f9;
    if (get_buf(rec, &st->b_recovered, 8 * 3, "recovered") < 0) goto f10;
    st->b_vseen = calloc(W, sizeof(Py_buffer));
    st->vseen = calloc(W, sizeof(uint8_t *));
    for (int s = 0; s < W; s++) {
        PyObject *v = PySequence_GetItem(vseen, s);
        int bad = !v || get_buf(v, &st->b_vseen[s], e->n_chunks[s], "vseen") < 0;
        Py_XDECREF(v);
        if (bad) {
            for (int q = 0; q < s; q++) PyBuffer_Release(&st->b_vseen[q]);
            free(st->b_vseen); free(st->vseen);
            goto f11;
        }
        st->vseen[s] = st->b_vseen[s].buf;
    }
    st->sum = st->b_sum.buf; st->count = st->b_count.buf; st->seen = st->b_seen.buf;
    st->contrib = st->has_contrib ? st->b_contrib.buf : NULL;
    st->vals = st->b_vals.buf; st->vdst = st->vals; st->norm = st->b_norm.buf; st->got = st->b_got.buf;
    st->marker = st->b_marker.buf; st->gtag = st->b_gtag.buf; st->vtag = st->b_vtag.buf;
    st->recovered = st->b_recovered.buf;
    st->fec = calloc((size_t)3 * W, sizeof(FecRx *));
    st->rnd = -1;
    memset(st->closed, 0, 3);
    st->bound = 1;
    Py_RETURN_NONE;
f11: PyBuffer_Release(&st->b_recovered);
f10: PyBuffer_Release(&st->b_vtag);
f9: PyBuffer_Release(&st->b_gtag);
f8: PyBuffer_Release(&st->b_marker);
f7: PyBuffer_Release(&st->b_got);
f6: PyBuffer_Release(&st->b_norm);
f5: PyBuffer_Release(&st->b_vals);
f4: if (st->has_contrib) PyBuffer_Release(&st->b_contrib);
f3: PyBuffer_Release(&st->b_seen);
f2: PyBuffer_Release(&st->b_count);
f1: PyBuffer_Release(&st->b_sum);
    return NULL;
}

static PyObject *Engine_bind_shared(Engine *e, PyObject *args) {
    PyObject *heard, *ever, *rej, *lgot, *lowed;
    if (!PyArg_ParseTuple(args, "OOOOO", &heard, &ever, &rej, &lgot, &lowed)) return NULL;
    if (e->shared_bound) { PyErr_SetString(PyExc_RuntimeError, "already bound"); return NULL; }
    int W = e->world;
    if (get_buf(heard, &e->b_heard, 8 * W, "heard") < 0) return NULL;
    if (get_buf(ever, &e->b_ever, W, "ever") < 0) { PyBuffer_Release(&e->b_heard); return NULL; }
    if (get_buf(rej, &e->b_rejected, 8 * N_REASONS, "rejected") < 0) goto g2;
    if (get_buf(lgot, &e->b_lgot, 8 * W, "loss got") < 0) goto g3;
    if (get_buf(lowed, &e->b_lowed, 8 * W, "loss owed") < 0) goto g4;
    e->heard = e->b_heard.buf; e->ever = e->b_ever.buf; e->rejected = e->b_rejected.buf;
    e->lgot = e->b_lgot.buf; e->lowed = e->b_lowed.buf;
    e->shared_bound = 1;
    Py_RETURN_NONE;
g4: PyBuffer_Release(&e->b_lgot);
g3: PyBuffer_Release(&e->b_rejected);
g2: PyBuffer_Release(&e->b_ever); PyBuffer_Release(&e->b_heard);
    return NULL;
}

static int ready(Engine *e) {
    if (!e->shared_bound) { PyErr_SetString(PyExc_RuntimeError, "engine: shared arrays not bound"); return 0; }
    for (int i = 0; i < e->rounds_open; i++)
        if (!e->rounds[i].bound) { PyErr_SetString(PyExc_RuntimeError, "engine: round not bound"); return 0; }
    return 1;
}

static PyObject *Engine_start(Engine *e, PyObject *noargs) {
    if (!ready(e)) return NULL;
    if (e->running) Py_RETURN_NONE;
    e->stop = 0;
    if (pthread_create(&e->thread, NULL, rx_loop, e) != 0) {
        PyErr_SetString(PyExc_OSError, "engine: pthread_create failed");
        return NULL;
    }
    pthread_setname_np(e->thread, "stw-rx"); /* profilers tell the receive side by it */
    e->running = 1;
    Py_RETURN_NONE;
}

static PyObject *Engine_stop(Engine *e, PyObject *noargs) {
    stop_thread(e);
    Py_RETURN_NONE;
}

/* the mutex, taken with the GIL released while blocked (the receive thread never needs the GIL,
 * but another Python thread may hold this mutex and need the GIL to release it) */
static PyObject *Engine_lock(Engine *e, PyObject *noargs) {
    if (pthread_mutex_trylock(&e->mu) != 0) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&e->mu);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *Engine_unlock(Engine *e, PyObject *noargs) {
    pthread_mutex_unlock(&e->mu);
    Py_RETURN_NONE;
}

static PyObject *Engine_wait(Engine *e, PyObject *args) {
    double timeout;
    if (!PyArg_ParseTuple(args, "d", &timeout)) return NULL;
    if (timeout < 0) timeout = 0;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double t = (double)ts.tv_sec + 1e-9 * ts.tv_nsec + timeout;
    ts.tv_sec = (time_t)t;
    ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pthread_cond_timedwait(&e->cv, &e->mu, &ts);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(rc == 0);
}

static PyObject *Engine_notify(Engine *e, PyObject *noargs) {
    pthread_cond_broadcast(&e->cv);
    Py_RETURN_NONE;
}

/* under the lock: the slot's native state for round rnd (Python resets its arrays) */
static PyObject *Engine_reset_round(Engine *e, PyObject *args) {
    int i;
    long long rnd;
    if (!PyArg_ParseTuple(args, "iL", &i, &rnd)) return NULL;
    if (i < 0 || i >= e->rounds_open || !e->rounds[i].bound) {
        PyErr_SetString(PyExc_ValueError, "slot");
        return NULL;
    }
    Round *st = &e->rounds[i];
    st->rnd = rnd;
    if (st->has_vout) PyBuffer_Release(&st->b_vout);
    st->has_vout = 0;
    st->vdst = st->vals;
    memset(st->closed, 0, 3);
    for (int q = 0; q < 3 * e->world; q++) { fec_free(st->fec[q]); st->fec[q] = NULL; }
    Py_RETURN_NONE;
}

static PyObject *Engine_set_round(Engine *e, PyObject *args) {
    long long r;
    if (!PyArg_ParseTuple(args, "L", &r)) return NULL;
    e->round = r;
    Py_RETURN_NONE;
}

static PyObject *Engine_close_phase(Engine *e, PyObject *args) {
    int i, ph;
    if (!PyArg_ParseTuple(args, "ii", &i, &ph)) return NULL;
    if (i < 0 || i >= e->rounds_open || ph < 0 || ph > 2) {
        PyErr_SetString(PyExc_ValueError, "slot/phase");
        return NULL;
    }
    e->rounds[i].closed[ph] = 1;
    Py_RETURN_NONE;
}

/* the owner's average of round rnd (slot i) after its reduce-scatter phase closed (nothing
 * writes the sum then): out[c] = (sum[c] + own[c]) / (count[c] + 1) per chunk c, own[c] where
 * no other contribution arrived -- aggregate.ShardAccumulator.average, bit for bit, in one
 * pass (read sum and own, write out). ``own`` and ``out`` are float32 vectors of the shard's
 * length; ``out`` may be ``own`` (in place), not a partial overlap. GIL released. */
static PyObject *Engine_average(Engine *e, PyObject *args) {
    int i;
    long long rnd;
    PyObject *own_o, *out_o;
    if (!PyArg_ParseTuple(args, "iLOO", &i, &rnd, &own_o, &out_o)) return NULL;
    if (i < 0 || i >= e->rounds_open || !e->rounds[i].bound || e->rounds[i].rnd != rnd) {
        PyErr_SetString(PyExc_ValueError, "average: not the slot's round");
        return NULL;
    }
    Round *st = &e->rounds[i];
    if (!st->closed[PHASE_GRAD]) {
        PyErr_SetString(PyExc_ValueError, "average: the reduce-scatter phase is still open");
        return NULL;
    }
    int64_t len = e->shard_lens[e->me], C = e->chunk;
    Py_buffer bo, bw;
    if (PyObject_GetBuffer(own_o, &bo, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    if (get_buf(out_o, &bw, 0, "out") < 0) { PyBuffer_Release(&bo); return NULL; }
    const char *bad = NULL;
    if (bo.len != len * 4 || bo.itemsize != 4 || bw.len != len * 4 || bw.itemsize != 4)
        bad = "average: own and out must be float32 of the shard's length";
    const char *po = bo.buf, *pw = bw.buf;
    if (!bad && pw != po && pw < po + bo.len && po < pw + bw.len)
        bad = "average: out overlaps own without being it";
    if (bad) {
        PyBuffer_Release(&bo); PyBuffer_Release(&bw);
        PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    const float *own = bo.buf, *sum = st->sum;
    float *out = bw.buf;
    const int32_t *count = st->count;
    int64_t nc = nchunks(e, e->me);
    Py_BEGIN_ALLOW_THREADS
    for (int64_t c = 0; c < nc; c++) {
        int64_t lo = c * C, n = len - lo < C ? len - lo : C;
        int32_t k = count[c] + 1;
        if (k == 1) {
            if (out != own) memcpy(out + lo, own + lo, sizeof(float) * (size_t)n);
        } else if ((k & (k - 1)) == 0) {
            if (out == own) sum_into_mean_pow2_inplace(out + lo, sum + lo, n, 1.0f / (float)k);
            else sum_into_mean_pow2(out + lo, sum + lo, own + lo, n, 1.0f / (float)k);
        } else if (out == own) {
            sum_into_mean_inplace(out + lo, sum + lo, n, (float)k);
        } else {
            sum_into_mean(out + lo, sum + lo, own + lo, n, (float)k);
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&bo); PyBuffer_Release(&bw);
    Py_RETURN_NONE;
}

/* under the lock: the broadcast values of round rnd (slot i) from now on land in ``out`` (a
 * writable C-contiguous float32 vector of all elements) instead of the round's own buffer;
 * the chunks that landed there already are copied over first, so that ``out`` holds every
 * chunk marked seen. ``out`` = None: back to the round's buffer (``out`` keeps what landed).
 * The binding also ends with the round's slot being reset and with the engine. The caller
 * must not write the other owners' shards of ``out`` while bound. Returns the chunks copied. */
static PyObject *Engine_values_into(Engine *e, PyObject *args) {
    int i;
    long long rnd;
    PyObject *o;
    if (!PyArg_ParseTuple(args, "iLO", &i, &rnd, &o)) return NULL;
    if (i < 0 || i >= e->rounds_open || !e->rounds[i].bound) {
        PyErr_SetString(PyExc_ValueError, "slot");
        return NULL;
    }
    Round *st = &e->rounds[i];
    if (st->has_vout) PyBuffer_Release(&st->b_vout);
    st->has_vout = 0;
    st->vdst = st->vals;
    if (o == Py_None) return PyLong_FromLong(0);
    if (st->rnd != rnd || st->closed[PHASE_VALUE]) {
        PyErr_SetString(PyExc_ValueError, "values_into: not the slot's open round");
        return NULL;
    }
    int64_t numel = e->bounds[e->world];
    if (get_buf(o, &st->b_vout, numel * 4, "out") < 0) return NULL;
    if (st->b_vout.len != numel * 4 || st->b_vout.itemsize != 4) {
        PyBuffer_Release(&st->b_vout);
        PyErr_SetString(PyExc_ValueError, "values_into: out must be float32 of every element");
        return NULL;
    }
    float *out = st->b_vout.buf;
    int64_t copied = 0, C = e->chunk;
    for (int s = 0; s < e->world; s++) {
        if (s == e->me) continue;
        int64_t lo = e->bounds[s], len = e->shard_lens[s];
        for (int64_t c = 0; c < nchunks(e, s); c++) {
            if (!st->vseen[s][c]) continue;
            int64_t n = len - c * C < C ? len - c * C : C;
            memcpy(out + lo + c * C, st->vals + lo + c * C, sizeof(float) * (size_t)n);
            copied++;
        }
    }
    st->has_vout = 1;
    st->vdst = out;
    return PyLong_FromLongLong(copied);
}

/* under the lock: what wakes wait() -- a sender of (slot, phase) completes or sends its marker,
 * a peer starts the round, a silent peer speaks */
static PyObject *Engine_watch(Engine *e, PyObject *args) {
    int i, ph;
    PyObject *exp, *silent;
    if (!PyArg_ParseTuple(args, "iiOO", &i, &ph, &exp, &silent)) return NULL;
    for (int s = 0; s < e->world; s++) {
        PyObject *a = PySequence_GetItem(exp, s), *b = PySequence_GetItem(silent, s);
        if (!a || !b) { Py_XDECREF(a); Py_XDECREF(b); return NULL; }
        e->w_exp[s] = PyLong_AsLongLong(a);
        e->w_silent[s] = (uint8_t)PyObject_IsTrue(b);
        e->spoke[s] = 0;
        Py_DECREF(a); Py_DECREF(b);
    }
    if (PyErr_Occurred()) return NULL;
    e->w_slot = i < 0 ? -1 : i % e->rounds_open;
    e->w_phase = ph;
    e->w_sig = watch_sig(e);
    Py_RETURN_NONE;
}

/* under the lock: deadline hints and loss feedback since the last call */
static PyObject *Engine_drain(Engine *e, PyObject *noargs) {
    PyObject *hints = PyList_New(0), *fb = PyList_New(0);
    if (!hints || !fb) goto fail;
    for (int s = 0; s < e->world; s++) {
        if (e->hint_new[s]) {
            PyObject *t = Py_BuildValue("(id)", s, e->hint[s]);
            if (!t || PyList_Append(hints, t) < 0) { Py_XDECREF(t); goto fail; }
            Py_DECREF(t);
            e->hint_new[s] = 0;
        }
    }
    for (int q = 0; q < e->fb_n; q++) {
        PyObject *t = Py_BuildValue("(id)", e->fb_src[q], e->fb_rate[q]);
        if (!t || PyList_Append(fb, t) < 0) { Py_XDECREF(t); goto fail; }
        Py_DECREF(t);
    }
    e->fb_n = 0;
    return Py_BuildValue("(NN)", hints, fb);
fail:
    Py_XDECREF(hints); Py_XDECREF(fb);
    return NULL;
}

/* seal rows (n, slot) uint8 in place: next sequence numbers, then the tag after each payload.
 * With ``values`` (float32, the rows' payloads back to back), each payload is copied in first:
 * copy and tag of one row while it is in cache, instead of two passes over the whole phase */
static PyObject *Engine_seal(Engine *e, PyObject *args) {
    Py_buffer rows, lens, vals = {0};
    if (!PyArg_ParseTuple(args, "w*y*|y*", &rows, &lens, &vals)) return NULL;
    Py_ssize_t n = lens.len / 8;
    Py_ssize_t width = n ? rows.len / n : 0;
    const int64_t *L = lens.buf;
    int bad = n && (rows.len % n != 0 || width < OVERHEAD);
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n && !bad; i++) {
        bad = L[i] < 0 || OVERHEAD + 4 * L[i] > width;
        total += L[i];
    }
    if (vals.buf && vals.len != 4 * total) bad = 1;
    if (bad) {
        PyBuffer_Release(&rows); PyBuffer_Release(&lens);
        if (vals.buf) PyBuffer_Release(&vals);
        PyErr_SetString(PyExc_ValueError, "seal: rows/lengths/values do not match");
        return NULL;
    }
    int fail = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&e->seal_mu);
    uint8_t *base = rows.buf;
    const uint8_t *src = vals.buf;
    for (Py_ssize_t i = 0; i < n && !fail; i++) {
        uint8_t *p = base + i * width;
        uint64_t seq = e->seq++;
        memcpy(p + 32, &seq, 8);
        int m = HEADER_BYTES + 4 * (int)L[i];
        if (src) {
            fail = gmac_fill(e->tx_ctx, p, src, 4 * (int)L[i]) != 0;
            src += 4 * L[i];
        } else {
            fail = gmac(e->tx_ctx, p, m, p + m) != 0;
        }
    }
    pthread_mutex_unlock(&e->seal_mu);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&rows); PyBuffer_Release(&lens);
    if (vals.buf) PyBuffer_Release(&vals);
    if (fail) { PyErr_SetString(PyExc_RuntimeError, "seal: GCM failed"); return NULL; }
    Py_RETURN_NONE;
}

/* send a phase's rows: plan = [(rows (n, slot) uint8, lengths int64 (n), values float32 or None,
 * dest)], ``g`` rows per message (UDP GSO: the socket's UDP_SEGMENT is the slot size). Runs
 * of g consecutive rows go as one message, destinations interleaved run by run (no receiver
 * gets a long burst); an entry with values has each run's rows sealed just before it is
 * queued, so the receivers start while later runs are still being sealed. With ``direct``
 * and payloads of at least DIRECT_MIN_PAYLOAD bytes (below: the rows are filled, as without
 * it) the payloads are sent from ``values`` itself -- each datagram is three iovecs (the row's
 * header, the values, the tag kept in the row after the header) that the kernel gathers
 * into the message it segments -- so the values are read once (tag) and copied once (by
 * the kernel), never into the rows: rows sent this way hold no payload, so a caller that
 * sends the same rows again in a later call (repetition) passes direct=0 and they are
 * filled. An entry's optional fifth field ``seal`` = 0: its rows are sealed by an earlier
 * entry of this call (one broadcast to several peers: the same sealed bytes, one tag per
 * packet); it is sent from its values all the same. Returns
 * (datagrams handed to the kernel, bytes, failed messages); a failed message is skipped, never
 * retried (EINTR is retried). The GIL is released for the whole phase. */
#define SEND_BURST 32
/* the smallest payload per datagram sent from the values by iovecs (``direct``): below it the
 * rows are filled (a copy, then the tag over the row while it is in cache) and a run goes as
 * one contiguous buffer. Measured (sendmmsg + UDP GSO over loopback, CPU per payload byte,
 * 16 MiB): 1,444-byte payloads in runs of 32 -- 3 iovecs per datagram 0.84-0.87 ns, a copy
 * into the rows + 1 iovec 0.76-0.78; 8,944-byte payloads in runs of 7 -- iovecs 0.28-0.29,
 * copy 0.33-0.34. The crossover lies between; 4 KB is not measured more finely. */
#define DIRECT_MIN_PAYLOAD 4096
static PyObject *Engine_send(Engine *e, PyObject *args) {
    PyObject *plan;
    int g, direct = 0;
    if (!PyArg_ParseTuple(args, "Oi|p", &plan, &g, &direct)) return NULL;
    PyObject *seq = PySequence_Fast(plan, "plan must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (g < 1) g = 1;
    Py_buffer *rows = calloc(n ? n : 1, sizeof(Py_buffer));
    Py_buffer *lens = calloc(n ? n : 1, sizeof(Py_buffer));
    Py_buffer *vals = calloc(n ? n : 1, sizeof(Py_buffer));
    int *dest = calloc(n ? n : 1, sizeof(int));
    int *sealit = calloc(n ? n : 1, sizeof(int));
    Py_buffer *accb = calloc(n ? n : 1, sizeof(Py_buffer));
    ParAcc *pa = calloc(n ? n : 1, sizeof(ParAcc));
    int64_t *voff = NULL;
    Py_ssize_t got = 0, maxruns = 0, total_rows = 0;
    int bad = !rows || !lens || !vals || !dest || !sealit || !accb || !pa;
    for (; got < n && !bad; got++) {
        PyObject *it = PySequence_Fast_GET_ITEM(seq, got), *r, *l, *v, *par = Py_None;
        int d, sl = 1;
        if (!PyArg_ParseTuple(it, "OOOi|pO", &r, &l, &v, &d, &sl, &par)) { bad = 1; break; }
        sealit[got] = sl;
        if (PyObject_GetBuffer(r, &rows[got], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) { bad = 1; break; }
        if (PyObject_GetBuffer(l, &lens[got], PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(&rows[got]); bad = 1; break;
        }
        if (v != Py_None && PyObject_GetBuffer(v, &vals[got], PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(&rows[got]); PyBuffer_Release(&lens[got]); bad = 1; break;
        }
        Py_ssize_t nr = lens[got].len / 8;
        const int64_t *L = lens[got].buf;
        int64_t tot = 0;
        int ok = d >= 0 && d < e->world && rows[got].len == nr * e->slot;
        for (Py_ssize_t i = 0; i < nr && ok; i++) {
            ok = L[i] >= 0 && OVERHEAD + 4 * L[i] <= e->slot;
            tot += L[i];
        }
        if (ok && vals[got].buf && vals[got].len != 4 * tot) ok = 0;
        if (ok && par != Py_None) { /* (acc, S, m): parity accumulated as the rows are sealed */
            PyObject *ab; int S_, m_;
            ok = vals[got].buf && sl && PyArg_ParseTuple(par, "Oii", &ab, &S_, &m_)
                 && PyObject_GetBuffer(ab, &accb[got], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) == 0;
            if (ok) {
                size_t blk = 4 * (size_t)e->chunk;
                ok = paracc_init(&pa[got], accb[got].buf, nr, S_, m_, blk) == 0
                     && (size_t)accb[got].len == (size_t)m_ * S_ * blk;
                for (Py_ssize_t i = 0; i < nr && ok; i++) ok = L[i] <= e->chunk;
                if (!ok) { free(pa[got].coef); free(pa[got].tbls); PyBuffer_Release(&accb[got]); }
            }
            if (!ok) memset(&pa[got], 0, sizeof(ParAcc));
        }
        if (!ok) {
            PyBuffer_Release(&rows[got]); PyBuffer_Release(&lens[got]);
            if (vals[got].buf) PyBuffer_Release(&vals[got]);
            PyErr_SetString(PyExc_ValueError, "send: rows, lengths, values or dest do not match");
            bad = 1;
            break;
        }
        dest[got] = d;
        Py_ssize_t runs = (nr + g - 1) / g;
        if (runs > maxruns) maxruns = runs;
        total_rows += nr;
    }
    if (!bad) {
        voff = calloc(total_rows + 1, 8);
        bad = !voff;
    }
    int64_t dgrams = 0, bytes = 0, errors = 0;
    int fail = 0;
    if (!bad) {
        /* where each row's payload starts in its entry's values */
        int64_t **offs = malloc(sizeof(int64_t *) * (n ? n : 1));
        int64_t *o = voff;
        for (Py_ssize_t p = 0; p < n; p++) {
            offs[p] = o;
            const int64_t *L = lens[p].buf;
            int64_t acc = 0;
            for (Py_ssize_t i = 0; i < lens[p].len / 8; i++) { o[i] = acc; acc += L[i]; }
            o += lens[p].len / 8;
        }
        struct sockaddr_in *sa = calloc(e->world, sizeof(struct sockaddr_in));
        for (int s = 0; s < e->world; s++) {
            sa[s].sin_family = AF_INET;
            sa[s].sin_addr.s_addr = e->peer_addr[s];
            sa[s].sin_port = e->peer_port[s];
        }
        /* per message of a burst: 3 iovecs per datagram (direct) or 1 */
        int dir = direct && e->slot - OVERHEAD >= DIRECT_MIN_PAYLOAD;
        struct iovec *iov = malloc(sizeof(struct iovec) * SEND_BURST * 3 * (size_t)g);
        if (!iov) fail = 1;
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&e->seal_mu);
        struct mmsghdr msgs[SEND_BURST];
        size_t mlen[SEND_BURST];
        int cnt[SEND_BURST];
        int k = 0;
        memset(msgs, 0, sizeof msgs);
        for (Py_ssize_t j = 0; j < maxruns && !fail; j++) {
            for (Py_ssize_t p = 0; p < n && !fail; p++) {
                Py_ssize_t nr = lens[p].len / 8;
                Py_ssize_t first = j * g;
                if (first >= nr) continue;
                Py_ssize_t last = first + g < nr ? first + g - 1 : nr - 1;
                const int64_t *L = lens[p].buf;
                uint8_t *base = rows[p].buf;
                struct iovec *v = iov + (size_t)k * 3 * g;
                size_t nv = 0;
                mlen[k] = (size_t)(last - first) * e->slot + OVERHEAD + 4 * (size_t)L[last];
                if (vals[p].buf && dir) {
                    for (Py_ssize_t i = first; i <= last && !fail; i++) {
                        uint8_t *row = base + i * e->slot;
                        uint8_t *pay = (uint8_t *)vals[p].buf + 4 * offs[p][i];
                        if (sealit[p]) { /* else an earlier entry sealed these rows */
                            uint64_t q = e->seq++;
                            memcpy(row + 32, &q, 8);
                            fail = gmac2(e->tx_ctx, row, pay, 4 * (int)L[i],
                                         row + HEADER_BYTES) != 0;
                            paracc_add(&pa[p], i, pay, 4 * (int)L[i]);
                        }
                        v[nv].iov_base = row; v[nv++].iov_len = HEADER_BYTES;
                        if (L[i]) { v[nv].iov_base = pay; v[nv++].iov_len = 4 * (size_t)L[i]; }
                        v[nv].iov_base = row + HEADER_BYTES; v[nv++].iov_len = TAG_BYTES;
                    }
                } else {
                    if (vals[p].buf && sealit[p]) { /* fill: copy and tag in one pass (gmac_fill) */
                        for (Py_ssize_t i = first; i <= last && !fail; i++) {
                            uint8_t *row = base + i * e->slot;
                            uint64_t q = e->seq++;
                            memcpy(row + 32, &q, 8);
                            fail = gmac_fill(e->tx_ctx, row,
                                             (const uint8_t *)vals[p].buf + 4 * offs[p][i],
                                             4 * (int)L[i]) != 0;
                            paracc_add(&pa[p], i, row + HEADER_BYTES, 4 * (int)L[i]);
                        }
                    }
                    v[0].iov_base = base + first * e->slot;
                    v[0].iov_len = mlen[k];
                    nv = 1;
                }
                msgs[k].msg_hdr.msg_name = &sa[dest[p]];
                msgs[k].msg_hdr.msg_namelen = sizeof(struct sockaddr_in);
                msgs[k].msg_hdr.msg_iov = v;
                msgs[k].msg_hdr.msg_iovlen = nv;
                cnt[k] = (int)(last - first + 1);
                k++;
                int final = j == maxruns - 1 && p == n - 1;
                if (k == SEND_BURST || final) {
                    int i = 0;
                    while (i < k) {
                        int r = sendmmsg(e->fd, msgs + i, (unsigned)(k - i), 0);
                        if (r < 0) {
                            if (errno == EINTR) continue;
                            errors++; /* e.g. EPERM from a firewall: skip this message */
                            i++;
                            continue;
                        }
                        for (int q = i; q < i + r; q++) { dgrams += cnt[q]; bytes += (int64_t)mlen[q]; }
                        i += r;
                    }
                    k = 0;
                }
            }
        }
        if (k && !fail) { /* the last entries had no run j == maxruns - 1 */
            int i = 0;
            while (i < k) {
                int r = sendmmsg(e->fd, msgs + i, (unsigned)(k - i), 0);
                if (r < 0) {
                    if (errno == EINTR) continue;
                    errors++;
                    i++;
                    continue;
                }
                for (int q = i; q < i + r; q++) { dgrams += cnt[q]; bytes += (int64_t)mlen[q]; }
                i += r;
            }
        }
        pthread_mutex_unlock(&e->seal_mu);
        Py_END_ALLOW_THREADS
        free(iov);
        free(sa);
        free(offs);
    }
    for (Py_ssize_t p = 0; p < got; p++) {
        PyBuffer_Release(&rows[p]); PyBuffer_Release(&lens[p]);
        if (vals[p].buf) PyBuffer_Release(&vals[p]);
        if (pa[p].acc) { free(pa[p].coef); free(pa[p].tbls); PyBuffer_Release(&accb[p]); }
    }
    free(rows); free(lens); free(vals); free(dest); free(sealit); free(voff);
    free(accb); free(pa);
    Py_DECREF(seq);
    if (bad) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return NULL;
    }
    if (fail) { PyErr_SetString(PyExc_RuntimeError, "send: GCM failed"); return NULL; }
    return Py_BuildValue("(LLL)", (long long)dgrams, (long long)bytes, (long long)errors);
}

/* one datagram through the whole receive path, as if it came from peer src (-1: unknown);
 * returns the reason code (tests and the fuzzer) */
static PyObject *Engine_feed(Engine *e, PyObject *args) {
    Py_buffer data;
    int src;
    if (!PyArg_ParseTuple(args, "y*i", &data, &src)) return NULL;
    if (!ready(e)) { PyBuffer_Release(&data); return NULL; }
    Py_ssize_t cap = e->slot;
    uint8_t *row = aligned_alloc(64, ((size_t)(data.len > cap ? data.len : cap) + 63) / 64 * 64);
    if (!row) { PyBuffer_Release(&data); return PyErr_NoMemory(); }
    memcpy(row, data.buf, data.len);
    int64_t size = data.len;
    PyBuffer_Release(&data);
    int why;
    Py_BEGIN_ALLOW_THREADS
    Hdr h;
    memset(&h, 0, sizeof h);
    pthread_mutex_lock(&e->mu);
    why = check_pre(e, row, size, &h);
    pthread_mutex_unlock(&e->mu);
    if (why == RJ_OK) why = check_tag(e->rx_ctx, row, size, &h);
    pthread_mutex_lock(&e->mu);
    int64_t cur = (e->round > 0 ? e->round : 0) & 0xFFFFFFFF;
    if (why == RJ_OK) why = check_post(e, row, &h, h.sender < e->world && src == h.sender, cur);
    int64_t before[N_REASONS];
    memcpy(before, e->rejected, sizeof before);
    settle(e, row, &h, why, now_mono());
    if (why == RJ_OK)  /* placement may still refuse it (late, duplicate, ...) */
        for (int q = 1; q < N_REASONS; q++)
            if (e->rejected[q] != before[q]) why = q;
    int64_t sig = watch_sig(e);
    if (sig != e->w_sig) { e->w_sig = sig; pthread_cond_broadcast(&e->cv); }
    pthread_mutex_unlock(&e->mu);
    Py_END_ALLOW_THREADS
    free(row);
    return PyLong_FromLong(why);
}

/* test hook: drop received datagrams before any check -- every ``period``-th run of ``burst``
 * (end markers excepted), and those matching a rule (sender, phase bit mask, end marker or not,
 * chunk range [lo, hi) of data packets, round; -1 = any) */
static PyObject *Engine_set_drop(Engine *e, PyObject *args) {
    int period, burst;
    PyObject *rules = NULL;
    if (!PyArg_ParseTuple(args, "ii|O", &period, &burst, &rules)) return NULL;
    int n = 0;
    if (rules) {
        PyObject *seq = PySequence_Fast(rules, "rules must be a sequence");
        if (!seq) return NULL;
        n = (int)PySequence_Fast_GET_SIZE(seq);
        if (n > 16) { Py_DECREF(seq); PyErr_SetString(PyExc_ValueError, "at most 16 rules"); return NULL; }
        for (int i = 0; i < n; i++) {
            PyObject *r = PySequence_Fast(PySequence_Fast_GET_ITEM(seq, i), "rule");
            if (!r || PySequence_Fast_GET_SIZE(r) != 6) {
                Py_XDECREF(r); Py_DECREF(seq);
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a rule has 6 fields");
                return NULL;
            }
            for (int j = 0; j < 6; j++) e->rules[i][j] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(r, j));
            Py_DECREF(r);
        }
        Py_DECREF(seq);
        if (PyErr_Occurred()) return NULL;
    }
    pthread_mutex_lock(&e->mu);
    e->drop_period = period; e->drop_burst = burst; e->n_rules = n;
    pthread_mutex_unlock(&e->mu);
    Py_RETURN_NONE;
}

static PyObject *Engine_counters(Engine *e, PyObject *noargs) {
    return Py_BuildValue("{s:L,s:L,s:K,s:d,s:L,s:L,s:s}", "dropped", (long long)e->dropped,
                         "rx_batches", (long long)e->rx_batches, "seq",
                         (unsigned long long)e->seq, "rx_cpu", e->rx_cpu, "rx_msgs",
                         (long long)e->rx_msgs, "rx_dgrams", (long long)e->rx_dgrams, "ghash",
                         GH_NAMES[e->tx_ctx ? e->tx_ctx->fast : GH_OPENSSL]);
}

static PyMethodDef Engine_methods[] = {
    {"set_peers", (PyCFunction)Engine_set_peers, METH_VARARGS, "peer addresses (u32, port)"},
    {"bind_round", (PyCFunction)Engine_bind_round, METH_VARARGS, "a round slot's buffers"},
    {"values_into", (PyCFunction)Engine_values_into, METH_VARARGS,
     "under the lock: a round's broadcast values land in this vector (None: the round's own)"},
    {"average", (PyCFunction)Engine_average, METH_VARARGS,
     "the owner's average of a closed reduce-scatter (slot, round, own, out)"},
    {"bind_shared", (PyCFunction)Engine_bind_shared, METH_VARARGS, "per-peer shared arrays"},
    {"start", (PyCFunction)Engine_start, METH_NOARGS, "start the receive thread"},
    {"stop", (PyCFunction)Engine_stop, METH_NOARGS, "stop and join the receive thread"},
    {"lock", (PyCFunction)Engine_lock, METH_NOARGS, "take the engine mutex"},
    {"unlock", (PyCFunction)Engine_unlock, METH_NOARGS, "release the engine mutex"},
    {"wait", (PyCFunction)Engine_wait, METH_VARARGS, "wait (mutex held) up to timeout s"},
    {"notify", (PyCFunction)Engine_notify, METH_NOARGS, "wake waiters"},
    {"reset_round", (PyCFunction)Engine_reset_round, METH_VARARGS, "new round in a slot"},
    {"set_round", (PyCFunction)Engine_set_round, METH_VARARGS, "the current round"},
    {"close_phase", (PyCFunction)Engine_close_phase, METH_VARARGS, "a phase of a slot ended"},
    {"watch", (PyCFunction)Engine_watch, METH_VARARGS, "what wakes wait()"},
    {"drain", (PyCFunction)Engine_drain, METH_NOARGS, "hints and feedback since last call"},
    {"seal", (PyCFunction)Engine_seal, METH_VARARGS, "seal rows in place"},
    {"send", (PyCFunction)Engine_send, METH_VARARGS, "seal (optionally) and send a phase"},
    {"feed", (PyCFunction)Engine_feed, METH_VARARGS, "one datagram through the receive path"},
    {"set_drop", (PyCFunction)Engine_set_drop, METH_VARARGS, "test hook: burst drops"},
    {"counters", (PyCFunction)Engine_counters, METH_NOARGS, "dropped, rx_batches, seq, ghash"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stalwart.comm._stwnative.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
};

static PyObject *mod_load_isal(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) Py_RETURN_FALSE;
    ec_init_tables_t a = (ec_init_tables_t)dlsym(h, "ec_init_tables");
    ec_encode_data_t b = (ec_encode_data_t)dlsym(h, "ec_encode_data");
    if (!a || !b) Py_RETURN_FALSE;
    isal_init = a;
    isal_encode = b;
    isal_update = (ec_encode_data_update_t)dlsym(h, "ec_encode_data_update");
    Py_RETURN_TRUE;
}

static PyObject *mod_has_isal(PyObject *self, PyObject *noargs) {
    return PyBool_FromLong(isal_init != NULL);
}

static PyMethodDef mod_methods[] = {
    {"load_isal", mod_load_isal, METH_VARARGS, "dlopen ISA-L for Reed-Solomon decoding"},
    {"has_isal", mod_has_isal, METH_NOARGS, "whether ISA-L is in use"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_stwnative",
                                    "Native data plane of stalwart.comm (see engine.c).", -1,
                                    mod_methods};

PyMODINIT_FUNC PyInit__stwnative(void) {
    gf_init();
    if (PyType_Ready(&EngineType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(&EngineType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
