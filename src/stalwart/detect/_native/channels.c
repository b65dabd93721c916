/* The per-step parts of the per-rank channels in C: CusumBank.add (cusum.py) and
 * OutlierBank.add (outlier.py) up to their rare branches.
 *
 * Why native: on rank 0 these run once per step over every rank right after a training step
 * has evicted the caches; as ~35 numpy calls on arrays of 4 they cost ~170 us of CPU there
 * (docs/detect.md), as one call each a few us. The Python methods remain the reference
 * (``native = False`` on a bank), and tests/detect/test_channels_native.py compares the two
 * on random inputs: the same arithmetic in the same order, libm's log on both sides.
 *
 * cusum_step(keys, xs, seen, start_key, mu0, sigma, s, zero_key, backoff, live, ratios,
 *            key, col, warmup, learn, k, clip, h, log_n) -> (fits, alarms)
 *   keys int64 (n x H), xs float64 (n x H), seen/start_key/zero_key int64 (n),
 *   mu0/sigma/s/backoff/ratios float64 (n), live bool (n, written). Writes the ring column
 *   ``col``, counts the sample, updates S and the last zero of every live rank (sigma not
 *   nan on entry); returns the ranks whose reference is due to be fitted and the live ranks
 *   whose S is past their threshold (the caller fits and raises, as the reference does).
 *
 * best_split(v, candidates): robust.best_split's split, its costs summed as numpy sums (below).
 *
 * outlier_step(over, logrel, excess, keys, count, filled, whole, line, comps, key, p)
 *   over bool (n x W), logrel/excess float64 (n x W), keys int64 (W), count/filled int64 (n),
 *   whole bool (n), line/comps float64 (n). One sample of every rank into column ``p`` of
 *   the windows (the reference's add after its warm-up test, before its stride test).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bocpd_step.h"

typedef struct { Py_buffer b; int ok; } Buf;

static int get(PyObject *o, Buf *x, int writable, Py_ssize_t itemsize, Py_ssize_t len,
               const char *what) {
    x->ok = 0;
    if (PyObject_GetBuffer(o, &x->b, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    x->ok = 1;
    if (x->b.itemsize != itemsize || (len >= 0 && x->b.len != len * itemsize)) {  /* -1: any */
        PyErr_Format(PyExc_ValueError, "channels: %s has the wrong size or type", what);
        return -1;
    }
    return 0;
}

static void rel(Buf *x) { if (x->ok) PyBuffer_Release(&x->b); }

/* The CUSUM bank's arrays (cusum.py), borrowed from their buffers for one call. */
typedef struct {
    int64_t *keys, *seen, *start, *zero;
    double *xs, *mu0, *sigma, *s, *backoff;
    char *live;
    Py_ssize_t n, H;
    long long warmup, learn;
    double k, clip, h, log_n;
} Cusum;

/* One CUSUM step of every rank (``CusumBank._step``'s arithmetic): ratios into ring column
 * ``col``; the ranks due for a fit into ``fits`` and those past their threshold into
 * ``alarms`` (n entries each at most), their counts into ``*nf`` and ``*na``. */
static void cusum_row(Cusum *C, const double *ratios, long long key, Py_ssize_t col,
                      Py_ssize_t *fits, Py_ssize_t *nf, Py_ssize_t *alarms, Py_ssize_t *na) {
    Py_ssize_t H = C->H;
    *nf = *na = 0;
    for (Py_ssize_t r = 0; r < C->n; r++) {
        double v = ratios[r];
        double x = log(v != v ? v : (v < 1e-9 ? 1e-9 : v));
        C->keys[r * H + col] = key;
        C->xs[r * H + col] = x;
        C->seen[r] += 1;
        if (C->seen[r] == C->warmup + 1) C->start[r] = key;
        double sig = C->sigma[r];
        C->live[r] = !(sig != sig);
        if (!C->live[r]) {
            C->s[r] = 0.0;
            if (C->seen[r] >= C->warmup + C->learn) fits[(*nf)++] = r;
            continue;
        }
        double lo = -C->clip * sig, hi = C->clip * sig, d = x - C->mu0[r];
        d = d > lo ? d : (d != d ? d : lo);   /* np.clip: maximum, then minimum */
        d = d < hi ? d : (d != d ? d : hi);
        double t = C->s[r] + (d - C->k);
        t = t != t ? t : (t > 0.0 ? t : 0.0);  /* np.maximum(0, t) */
        C->s[r] = t;
        if (t == 0.0) C->zero[r] = key;
        double thr = (C->h + C->log_n * sig / (2.0 * C->k)) * C->backoff[r] * sig;
        if (t > thr) alarms[(*na)++] = r;
    }
}

static int cmp_double(const void *a, const void *b);

/* Rearranges a[0..n) so that a[k] is the value sorting would put there, every a[< k] <= a[k]
 * and every a[> k] >= a[k] (Hoare's selection, median-of-three pivot): O(n) expected, where
 * a qsort of each rank's reference was O(n log n) through a comparison callback. */
static void select_kth(double *a, Py_ssize_t n, Py_ssize_t k) {
    Py_ssize_t lo = 0, hi = n - 1;
    while (hi > lo) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        double x = a[lo], y = a[mid], z = a[hi], t;
        double piv = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        Py_ssize_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] < piv) i++;
            while (a[j] > piv) j--;
            if (i <= j) { t = a[i]; a[i] = a[j]; a[j] = t; i++; j--; }
        }
        if (k <= j) hi = j;
        else if (k >= i) lo = i;
        else return;
    }
}

/* The median as ``_row_medians`` takes it (0.5 x the sum of the two middle values); a[]
 * is reordered. */
static double select_median(double *a, Py_ssize_t n) {
    Py_ssize_t hi = n / 2, lo = (n - 1) / 2;
    select_kth(a, n, hi);
    double vhi = a[hi], vlo = vhi;
    if (lo != hi) {
        vlo = a[0];
        for (Py_ssize_t j = 1; j < hi; j++) if (a[j] > vlo) vlo = a[j];
    }
    return 0.5 * (vlo + vhi);
}

/* ``CusumBank._refit``: every live rank with at least ``learn`` samples in its reference
 * (ring entries keyed from its start_key to min(zero_key, key - lag)) gets mu0 = their
 * median and sigma = max(min_sigma, 1.4826 x the median of their absolute deviations from
 * it); medians as ``_row_medians`` takes them (0.5 x the sum of the two middle values).
 * -1 (MemoryError set) if out of memory. */
static int cusum_refit(Cusum *C, long long key, long long lag, double min_sigma) {
    Py_ssize_t H = C->H;
    double *t = PyMem_Malloc((H > 0 ? H : 1) * sizeof(double));
    if (!t) { PyErr_NoMemory(); return -1; }
    for (Py_ssize_t r = 0; r < C->n; r++) {
        if (!C->live[r]) continue;
        long long upto = C->zero[r] < key - lag ? C->zero[r] : key - lag;
        Py_ssize_t cnt = 0;
        for (Py_ssize_t j = 0; j < H; j++) {
            int64_t k = C->keys[r * H + j];
            if (k >= C->start[r] && k <= upto) t[cnt++] = C->xs[r * H + j];
        }
        if (cnt < C->learn || cnt == 0) continue;
        double mu = select_median(t, cnt);
        for (Py_ssize_t j = 0; j < cnt; j++) t[j] = fabs(t[j] - mu);
        double v = 1.4826 * select_median(t, cnt);
        C->mu0[r] = mu;
        C->sigma[r] = v != v ? v : (min_sigma > v ? min_sigma : v);  /* np.maximum */
    }
    PyMem_Free(t);
    return 0;
}

static PyObject *index_list(const Py_ssize_t *idx, Py_ssize_t m) {
    PyObject *out = PyList_New(m);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *v = PyLong_FromSsize_t(idx[i]);
        if (!v) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static const Py_ssize_t CUSUM_ISZ[11] = {8, 8, 8, 8, 8, 8, 8, 8, 8, 1, 8};
static const int CUSUM_WR[11] = {1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 0};  /* mu0, sigma: refit */
static const char *CUSUM_NAMES[11] = {"keys", "xs", "seen", "start_key", "mu0", "sigma", "s",
                                      "zero_key", "backoff", "live", "ratios"};

/* The bank's 10 arrays (o[0..9], in cusum_step's order) into C; n from ``live``. */
static int cusum_bind(PyObject **o, Buf *B, Cusum *C) {
    Py_ssize_t n, H;
    {
        Py_buffer probe;
        if (PyObject_GetBuffer(o[9], &probe, PyBUF_SIMPLE) < 0) return -1;
        n = probe.len;  /* live: one byte per rank */
        PyBuffer_Release(&probe);
        if (PyObject_GetBuffer(o[0], &probe, PyBUF_SIMPLE) < 0) return -1;
        H = n > 0 ? probe.len / 8 / n : 0;
        PyBuffer_Release(&probe);
    }
    for (int i = 0; i < 10; i++)
        if (get(o[i], &B[i], CUSUM_WR[i], CUSUM_ISZ[i], i < 2 ? n * H : n, CUSUM_NAMES[i]) < 0)
            return -1;
    C->keys = B[0].b.buf; C->xs = B[1].b.buf; C->seen = B[2].b.buf; C->start = B[3].b.buf;
    C->mu0 = B[4].b.buf; C->sigma = B[5].b.buf; C->s = B[6].b.buf; C->zero = B[7].b.buf;
    C->backoff = B[8].b.buf; C->live = B[9].b.buf;
    C->n = n;
    C->H = H;
    return 0;
}

static PyObject *cusum_step(PyObject *self, PyObject *args) {
    PyObject *o[11];
    long long key, col;
    Cusum C;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOLLLLdddd", &o[0], &o[1], &o[2], &o[3], &o[4],
                          &o[5], &o[6], &o[7], &o[8], &o[9], &o[10], &key, &col, &C.warmup,
                          &C.learn, &C.k, &C.clip, &C.h, &C.log_n))
        return NULL;
    Buf B[11];
    memset(B, 0, sizeof B);
    PyObject *res = NULL, *fits = NULL, *alarms = NULL;
    Py_ssize_t *idx = NULL;
    if (cusum_bind(o, B, &C) < 0) goto done;
    if (get(o[10], &B[10], 0, 8, C.n, "ratios") < 0) goto done;
    if (col < 0 || col >= C.H) { PyErr_SetString(PyExc_IndexError, "cusum_step: col"); goto done; }
    idx = PyMem_Malloc(2 * (C.n > 0 ? C.n : 1) * sizeof(Py_ssize_t));
    if (!idx) { PyErr_NoMemory(); goto done; }
    {
        Py_ssize_t nf, na;
        cusum_row(&C, B[10].b.buf, key, col, idx, &nf, idx + C.n, &na);
        fits = index_list(idx, nf);
        alarms = fits ? index_list(idx + C.n, na) : NULL;
        if (fits && alarms) res = PyTuple_Pack(2, fits, alarms);
    }
done:
    PyMem_Free(idx);
    Py_XDECREF(fits);
    Py_XDECREF(alarms);
    for (int i = 0; i < 11; i++) rel(&B[i]);
    return res;
}

/* cusum_refit(keys, xs, seen, start_key, mu0, sigma, s, zero_key, backoff, live, key, lag,
 * min_sigma): ``CusumBank._refit`` of the bank's arrays in place (its ``live`` mask: the C
 * step's), the same values. At 10,000 ranks x 200 samples numpy's masked sorts took ~60 ms
 * a refit, ~3.5 ms a step amortised (every 16 steps): ~40% of rank 0's quiet step. */
static PyObject *cusum_refit_py(PyObject *self, PyObject *args) {
    PyObject *o[10];
    long long key, lag;
    double min_sigma;
    Cusum C;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOLLdL", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5],
                          &o[6], &o[7], &o[8], &o[9], &key, &lag, &min_sigma, &C.learn))
        return NULL;
    Buf B[10];
    memset(B, 0, sizeof B);
    PyObject *res = NULL;
    if (cusum_bind(o, B, &C) < 0) goto done;
    if (cusum_refit(&C, key, lag, min_sigma) < 0) goto done;
    res = Py_None;
    Py_INCREF(res);
done:
    for (int i = 0; i < 10; i++) rel(&B[i]);
    return res;
}

/* The outlier bank's arrays (outlier.py), borrowed from their buffers for one call. */
typedef struct {
    char *over, *whole;
    double *logrel, *excess, *line;
    int64_t *keys, *count, *filled;
    Py_ssize_t n, W;
} Outl;

/* One sample of every rank (compute ``c``) into column ``p`` of the windows
 * (``OutlierBank._step``'s arithmetic); -1 (MemoryError set) if out of memory. */
/* The peers' median of every rank from the row's two (n even) or three (n odd) middle order
 * statistics, found by selection in O(n): removing rank r's value from the sorted row leaves
 * the others' median at a place fixed by whether c[r] lies below, at or above the middle
 * (equal values are interchangeable: the same numbers as sorting every index). */
static int outlier_row(Outl *O, const double *c, long long key, Py_ssize_t p) {
    Py_ssize_t n = O->n, W = O->W;
    double small[64];
    double *t = n <= 64 ? small : PyMem_Malloc(n * sizeof(double));
    if (!t) { PyErr_NoMemory(); return -1; }
    memcpy(t, c, n * sizeof(double));
    double A, B, C = 0.0;
    int odd = n % 2;
    if (!odd) {  /* m = n - 1 others, odd: peer = s[n/2 - 1] if c[r] >= s[n/2] else s[n/2] */
        Py_ssize_t h = n / 2;
        select_kth(t, n, h);
        B = t[h];
        A = t[0];
        for (Py_ssize_t j = 1; j < h; j++) if (t[j] > A) A = t[j];
    } else {  /* h = (n-1)/2; A, B, C = s[h-1], s[h], s[h+1] */
        Py_ssize_t h = (n - 1) / 2;
        select_kth(t, n, h);
        B = t[h];
        A = t[0];
        for (Py_ssize_t j = 1; j < h; j++) if (t[j] > A) A = t[j];
        C = t[h + 1];
        for (Py_ssize_t j = h + 2; j < n; j++) if (t[j] < C) C = t[j];
    }
    if (t != small) PyMem_Free(t);
    double lo_peer = 0, mid_peer = 0, hi_peer = 0;
    if (odd) {
        lo_peer = 0.5 * (B + C);   /* c[r] below the middle (pos <= h-1) */
        mid_peer = 0.5 * (A + C);  /* at it (pos == h) */
        hi_peer = 0.5 * (A + B);   /* above (pos >= h+1) */
    }
    for (Py_ssize_t r = 0; r < n; r++) {
        double peer;
        if (!odd) peer = c[r] >= B ? A : B;
        else peer = c[r] < B ? lo_peer : (c[r] > B ? hi_peer : mid_peer);
        double x = c[r] / peer;
        int full = O->filled[r] >= W;
        if (full) {
            O->whole[r] = 0;
            O->count[r] -= O->over[r * W + p] ? 1 : 0;
        } else {
            O->filled[r] += 1;
        }
        char ov = x > O->line[r];
        O->count[r] += ov;
        O->over[r * W + p] = ov;
        O->logrel[r * W + p] = log(x);
        O->excess[r * W + p] = c[r] - peer;
    }
    O->keys[p] = key;
    return 0;
}

static const char *OUTL_NAMES[9] = {"over", "logrel", "excess", "keys", "count", "filled",
                                    "whole", "line", "comps"};
static const int OUTL_WR[9] = {1, 1, 1, 1, 1, 1, 1, 0, 0};
static const Py_ssize_t OUTL_ISZ[9] = {1, 8, 8, 8, 8, 8, 1, 8, 8};

/* The bank's 8 arrays (o[0..7], in outlier_step's order) for n ranks into C. */
static int outlier_bind(PyObject **o, Buf *B, Outl *O, Py_ssize_t n) {
    Py_ssize_t W;
    {
        Py_buffer probe;
        if (PyObject_GetBuffer(o[3], &probe, PyBUF_SIMPLE) < 0) return -1;
        W = probe.len / 8;  /* keys */
        PyBuffer_Release(&probe);
    }
    const Py_ssize_t len[8] = {n * W, n * W, n * W, W, n, n, n, n};
    for (int i = 0; i < 8; i++)
        if (get(o[i], &B[i], OUTL_WR[i], OUTL_ISZ[i], len[i], OUTL_NAMES[i]) < 0) return -1;
    O->over = B[0].b.buf; O->logrel = B[1].b.buf; O->excess = B[2].b.buf; O->keys = B[3].b.buf;
    O->count = B[4].b.buf; O->filled = B[5].b.buf; O->whole = B[6].b.buf; O->line = B[7].b.buf;
    O->n = n;
    O->W = W;
    return 0;
}

static PyObject *outlier_step(PyObject *self, PyObject *args) {
    PyObject *o[9];
    long long key, p;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOLL", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5],
                          &o[6], &o[7], &o[8], &key, &p))
        return NULL;
    Buf B[9];
    memset(B, 0, sizeof B);
    PyObject *res = NULL;
    Py_ssize_t n;
    Outl O;
    {
        Py_buffer probe;
        if (PyObject_GetBuffer(o[8], &probe, PyBUF_SIMPLE) < 0) return NULL;
        n = probe.len / 8;  /* comps */
        PyBuffer_Release(&probe);
    }
    if (outlier_bind(o, B, &O, n) < 0 || get(o[8], &B[8], 0, 8, n, "comps") < 0) goto done;
    if (n < 2 || p < 0 || p >= O.W) {
        PyErr_SetString(PyExc_ValueError, "outlier_step: need 2 ranks and 0 <= p < window");
        goto done;
    }
    if (outlier_row(&O, B[8].b.buf, key, p) < 0) goto done;
    Py_INCREF(Py_None);
    res = Py_None;
done:
    for (int i = 0; i < 9; i++) rel(&B[i]);
    return res;
}

/* ---- Gate: a ChangeDetector's pre-filter and segment (prefilter.py, ``PyGate`` is the
 * reference). push(key, seconds) -> code: NONE (nothing for the model), UPDATE (``x`` is the
 * model's next value), START (the segment is long enough for a first model), WAKE (a sleeping
 * model must be rebuilt from the segment before its newest sample, then fed ``x``). */
enum { G_NONE = 0, G_UPDATE = 1, G_START = 2, G_WAKE = 3 };

typedef struct {
    PyObject_HEAD
    long long warmup, min_baseline, max_lag, cap;
    double min_shift, z_sig, clip, min_scale;
    char gate;
    long long seen, pos, quiet, far, slept, model_updates, scale_n;
    char pending, live, model;
    double scale, centre, x;  /* scale: NaN until the first model */
    long long *keys;
    double *vals;
    Py_ssize_t head, len;
} Gate;

static void gate_dealloc(Gate *g) {
    PyMem_Free(g->keys);
    PyMem_Free(g->vals);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

static int gate_init(Gate *g, PyObject *args, PyObject *kw) {
    static char *kwl[] = {"warmup", "min_baseline", "max_lag", "history", "min_shift", "z_sig",
                          "clip", "min_scale", "gate", NULL};
    int gate = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LLLLdddd|p", kwl, &g->warmup, &g->min_baseline,
                                     &g->max_lag, &g->cap, &g->min_shift, &g->z_sig, &g->clip,
                                     &g->min_scale, &gate))
        return -1;
    if (g->cap < 1 || g->max_lag < 1) {
        PyErr_SetString(PyExc_ValueError, "Gate: history and max_lag must be >= 1");
        return -1;
    }
    g->gate = (char)gate;
    g->seen = g->pos = g->quiet = g->far = g->slept = g->model_updates = g->scale_n = 0;
    g->pending = g->model = 0;
    g->live = 1;
    g->scale = NAN;
    g->centre = g->x = 0.0;
    PyMem_Free(g->keys);
    PyMem_Free(g->vals);
    g->keys = PyMem_Malloc(g->cap * sizeof(long long));
    g->vals = PyMem_Malloc(g->cap * sizeof(double));
    g->head = g->len = 0;
    if (!g->keys || !g->vals) { PyErr_NoMemory(); return -1; }
    return 0;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : (x > y ? 1 : 0);
}

static double sorted_median(double *s, Py_ssize_t n) {  /* numpy's: mean of the two middle */
    return n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2.0;
}

/* robust_scale of the segment's first n values: 1.4826 * MAD (robust.robust_scale) */
static int robust_scale_first(Gate *g, Py_ssize_t n, double *out) {
    double *t = PyMem_Malloc((n > 0 ? n : 1) * sizeof(double));
    if (!t) { PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < n; i++) t[i] = g->vals[(g->head + i) % g->cap];
    qsort(t, n, sizeof(double), cmp_double);
    double med = sorted_median(t, n);
    for (Py_ssize_t i = 0; i < n; i++) t[i] = fabs(t[i] - med);
    qsort(t, n, sizeof(double), cmp_double);
    *out = 1.4826 * sorted_median(t, n);
    PyMem_Free(t);
    return 0;
}

static void append(Gate *g, long long key, double x) {
    if (g->len == g->cap) { g->head = (g->head + 1) % g->cap; g->len--; }
    Py_ssize_t i = (g->head + g->len) % g->cap;
    g->keys[i] = key;
    g->vals[i] = x;
    g->len++;
}

static int push_one(Gate *g, long long key, double seconds) {
    g->seen++;
    g->pending = 0;
    if (g->seen <= g->warmup || !(seconds > 0) || !isfinite(seconds)) return G_NONE;
    double x = log(seconds);
    g->pos++;
    append(g, key, x);
    if (!g->model) return g->len >= g->min_baseline ? G_START : G_NONE;
    Py_ssize_t n = g->len - g->max_lag;  /* the noise scale, again each time the segment doubles */
    if (n >= 2 * g->scale_n) {
        double sc;
        if (robust_scale_first(g, n, &sc) < 0) return -1;
        g->scale = g->min_scale > sc ? g->min_scale : sc;  /* max(robust, min_scale) */
        g->scale_n = n;
    }
    double centre = g->centre;
    double scale = (g->scale != g->scale || g->scale == 0.0) ? g->min_scale : g->scale;
    int code = G_UPDATE;
    if (g->gate) {
        double a = log1p(g->min_shift), b = g->z_sig * 1.25 * scale / sqrt((double)g->max_lag);
        double need = b > a ? b : a;
        int far = fabs(x - centre) > need;
        g->far = ((g->far << 1) | far) & 7;
        if (g->live) {
            g->quiet = far ? 0 : g->quiet + 1;
            if (g->quiet > g->max_lag) { g->live = 0; g->slept++; return G_NONE; }
        } else {
            if (g->far != 3 && g->far != 5 && g->far != 6 && g->far != 7) {
                g->slept++;
                return G_NONE;
            }
            code = G_WAKE;
        }
    }
    g->model_updates++;
    double c = g->clip * scale, lo = centre - c, hi = centre + c;
    double v = lo > x ? lo : x;
    g->x = hi < v ? hi : v;
    return code;
}

static PyObject *gate_push(Gate *g, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "push(key, seconds)"); return NULL; }
    long long key = PyLong_AsLongLong(args[0]);
    double s = PyFloat_AsDouble(args[1]);
    if (PyErr_Occurred()) return NULL;
    int code = push_one(g, key, s);
    return code < 0 ? NULL : PyLong_FromLong(code);
}

static PyObject *gate_copy(Gate *g, PyObject *args) {
    PyObject *o_keys, *o_vals;
    if (!PyArg_ParseTuple(args, "OO", &o_keys, &o_vals)) return NULL;
    Buf K = {0}, V = {0};
    PyObject *res = NULL;
    if (get(o_keys, &K, 1, 8, g->len, "keys") < 0 || get(o_vals, &V, 1, 8, g->len, "vals") < 0)
        goto done;
    for (Py_ssize_t i = 0; i < g->len; i++) {
        Py_ssize_t j = (g->head + i) % g->cap;
        ((int64_t *)K.b.buf)[i] = g->keys[j];
        ((double *)V.b.buf)[i] = g->vals[j];
    }
    Py_INCREF(Py_None);
    res = Py_None;
done:
    rel(&K);
    rel(&V);
    return res;
}

static PyObject *gate_keep_last(Gate *g, PyObject *arg) {
    Py_ssize_t run = PyLong_AsSsize_t(arg);
    if (run == -1 && PyErr_Occurred()) return NULL;
    if (run < 0 || run > g->len) { PyErr_SetString(PyExc_ValueError, "keep_last: run"); return NULL; }
    g->head = (g->head + g->len - run) % g->cap;
    g->len = run;
    Py_RETURN_NONE;
}

static Py_ssize_t gate_length(Gate *g) { return g->len; }

static PyTypeObject GateType;

/* push_many(gates, key, values) -> [(i, code)] for the gates whose code is not NONE */
static PyObject *push_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "push_many(gates, key, values)"); return NULL; }
    PyObject *gates = PySequence_Fast(args[0], "push_many: gates"), *vals = NULL, *out = NULL;
    if (!gates) return NULL;
    long long key = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred()) goto fail;
    vals = PySequence_Fast(args[2], "push_many: values");
    if (!vals) goto fail;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(gates);
    if (PySequence_Fast_GET_SIZE(vals) != n) {
        PyErr_SetString(PyExc_ValueError, "push_many: as many values as gates");
        goto fail;
    }
    out = PyList_New(0);
    if (!out) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *go = PySequence_Fast_GET_ITEM(gates, i);
        if (!PyObject_TypeCheck(go, &GateType)) {
            PyErr_SetString(PyExc_TypeError, "push_many: not a Gate");
            goto fail;
        }
        double v = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(vals, i));
        if (v == -1.0 && PyErr_Occurred()) goto fail;
        int code = push_one((Gate *)go, key, v);
        if (code < 0) goto fail;
        if (code != G_NONE) {
            PyObject *t = Py_BuildValue("(ni)", i, code);
            if (!t || PyList_Append(out, t) < 0) { Py_XDECREF(t); goto fail; }
            Py_DECREF(t);
        }
    }
    Py_DECREF(gates);
    Py_DECREF(vals);
    return out;
fail:
    Py_XDECREF(out);
    Py_XDECREF(vals);
    Py_DECREF(gates);
    return NULL;
}

/* ---- rel_rows: DecisionCore.relative_rows' common path, rows in one call ----------------
 *
 * rel_rows(rows, start, end, gates, dets, bank, bank_sc, cusum, cusum_sc, outl, outl_sc)
 *   -> (stop, valid, osteps, asked, fits, alarms)
 *
 * For rows[start:end], each a (key, comps) of n ranks (2 <= n <= 64, every row the same n),
 * in order, what ``DecisionCore.relative`` does for a job of at most REF_RANKS ranks short of
 * its rare branches: a row with a compute that is not in (0, inf) is skipped (no state
 * changes); else its ratios to the row's median go to the per-rank gates (``push_one``), a
 * gate asking UPDATE has its BOCPD row stepped (``step_row``, bocpd_step.h: the arithmetic of
 * ``BOCPDBank.update_mass``), then the CUSUM step (``cusum_row``) and, past the outlier
 * bank's warm-up, its step (``outlier_row``); the CUSUM refit when its position is a multiple
 * of ``refit_every`` (``cusum_refit``) and the outlier test when its position is a multiple
 * of ``stride``, as far as it finds nothing. The call returns at the first row that leaves
 * work to Python (``stop``; ``end`` if none): a gate that asked START or WAKE, or an UPDATE
 * whose posterior mass passed its threshold (asked: (gate, code, lag, mass), code 4 =
 * verify), CUSUM fits or alarms (their ranks; Python then fits, refits and raises), an
 * outlier test with a rank at or past its critical count or a window length whose critical
 * count ``crit`` does not hold yet (``test``: Python runs ``OutlierBank._test``) -- Python
 * does that row's rest as ``relative`` would, in the same order. ``valid``: rows taken (the
 * CUSUM bank's position and the outlier bank's ``seen`` advance by it), ``osteps``: outlier
 * steps (its position advances by it).
 *
 *   gates: the n Gate objects; dets: n (bank row or -1, max_lag, threshold);
 *   bank: (mu, beta, log_beta, logpost, n, c, em, e, f, g), bank_sc: (log_h, log_1mh, max_run);
 *   cusum: its 10 arrays as cusum_step takes them, cusum_sc: (pos, refit_every, lag, warmup,
 *   learn, k, clip, h, log_n, min_sigma); outl: its 8 arrays as outlier_step takes them,
 *   outl_sc: (seen, warmup, pos, stride, min_window), crit: int64 (window + 1), the critical
 *   count by window length at the current test level (-1: not known).
 * Every row's comps are read before any state changes (a bad value raises with none).
 */
enum { G_VERIFY = 4 };
#define REL_MAX 64

static PyObject *rel_rows(PyObject *self, PyObject *args) {
    PyObject *rows, *gates, *dets, *bank, *cusum, *outl;
    Py_ssize_t start, end;
    double log_h, log_1mh;
    Py_ssize_t max_run;
    long long cpos, refit, clag, owarm, oseen, opos, ostride, ominw;
    double min_sigma;
    PyObject *o_crit;
    Cusum C;
    if (!PyArg_ParseTuple(args, "OnnO!O!O!(ddn)O!(LLLLLddddd)O!(LLLLL)O", &rows, &start, &end,
                          &PyTuple_Type, &gates, &PyTuple_Type, &dets, &PyTuple_Type, &bank,
                          &log_h, &log_1mh, &max_run, &PyTuple_Type, &cusum, &cpos, &refit,
                          &clag, &C.warmup, &C.learn, &C.k, &C.clip, &C.h, &C.log_n,
                          &min_sigma, &PyTuple_Type, &outl, &oseen, &owarm, &opos, &ostride,
                          &ominw, &o_crit))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(gates);
    if (n < 2 || n > REL_MAX || PyTuple_GET_SIZE(dets) != n || PyTuple_GET_SIZE(bank) != 10 ||
        PyTuple_GET_SIZE(cusum) != 10 || PyTuple_GET_SIZE(outl) != 8 || refit < 1 ||
        ostride < 1 || max_run < 1 || max_run > 1023) {
        PyErr_SetString(PyExc_ValueError, "rel_rows: bad arguments");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(rows, "rel_rows: rows");
    if (!seq) return NULL;
    Buf BB[10], CB[10], OB[8], TB;
    memset(&TB, 0, sizeof TB);
    memset(BB, 0, sizeof BB);
    memset(CB, 0, sizeof CB);
    memset(OB, 0, sizeof OB);
    double *vals = NULL;
    long long *keys = NULL;
    PyObject *res = NULL, *asked = NULL, *fits = NULL, *alarms = NULL;
    Gate *G[REL_MAX];
    long long drow[REL_MAX], dlag[REL_MAX];
    double dthr[REL_MAX];
    Outl O;
    if (start < 0 || end > PySequence_Fast_GET_SIZE(seq) || start > end) {
        PyErr_SetString(PyExc_IndexError, "rel_rows: start, end");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *go = PyTuple_GET_ITEM(gates, i);
        if (!PyObject_TypeCheck(go, &GateType)) {
            PyErr_SetString(PyExc_TypeError, "rel_rows: not a Gate");
            goto done;
        }
        G[i] = (Gate *)go;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(dets, i), "LLd", &drow[i], &dlag[i], &dthr[i]))
            goto done;
    }
    /* the rows' values first: nothing changes if one cannot be read */
    Py_ssize_t m = end - start;
    vals = PyMem_Malloc((m > 0 ? m : 1) * n * sizeof(double));
    keys = PyMem_Malloc((m > 0 ? m : 1) * sizeof(long long));
    if (!vals || !keys) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *row = PySequence_Fast_GET_ITEM(seq, start + i);
        PyObject *kv = PySequence_Fast(row, "rel_rows: a row is (key, comps)");
        if (!kv) goto done;
        if (PySequence_Fast_GET_SIZE(kv) != 2) {
            Py_DECREF(kv);
            PyErr_SetString(PyExc_ValueError, "rel_rows: a row is (key, comps)");
            goto done;
        }
        keys[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(kv, 0));
        PyObject *cs = PySequence_Fast(PySequence_Fast_GET_ITEM(kv, 1), "rel_rows: comps");
        Py_DECREF(kv);
        if (!cs || PyErr_Occurred()) { Py_XDECREF(cs); goto done; }
        if (PySequence_Fast_GET_SIZE(cs) != n) {
            Py_DECREF(cs);
            PyErr_SetString(PyExc_ValueError, "rel_rows: every row has n values");
            goto done;
        }
        for (Py_ssize_t r = 0; r < n; r++)
            vals[i * n + r] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(cs, r));
        Py_DECREF(cs);
        if (PyErr_Occurred()) goto done;
    }
    for (int i = 0; i < 10; i++)
        if (get(PyTuple_GET_ITEM(bank, i), &BB[i], i < 5, 8, -1, "bank") < 0) goto done;
    PyObject *co[10], *oo[8];
    for (int i = 0; i < 10; i++) co[i] = PyTuple_GET_ITEM(cusum, i);
    for (int i = 0; i < 8; i++) oo[i] = PyTuple_GET_ITEM(outl, i);
    if (cusum_bind(co, CB, &C) < 0 || outlier_bind(oo, OB, &O, n) < 0) goto done;
    if (C.n != n || C.H < 1 || O.W < 1) {
        PyErr_SetString(PyExc_ValueError, "rel_rows: the banks' sizes do not match the gates");
        goto done;
    }
    if (get(o_crit, &TB, 0, 8, O.W + 1, "crit") < 0) goto done;
    const int64_t *crit = TB.b.buf;
    Py_ssize_t W = max_run + 2, cap_rows = BB[4].b.len / 8;
    if (BB[0].b.len / 8 < cap_rows * W || BB[1].b.len / 8 < cap_rows * W ||
        BB[2].b.len / 8 < cap_rows * W || BB[3].b.len / 8 < cap_rows * max_run ||
        BB[5].b.len / 8 < max_run + 1 || BB[6].b.len / 8 < max_run + 1 ||
        BB[7].b.len / 8 < max_run + 1 || BB[8].b.len / 8 < max_run + 1 ||
        BB[9].b.len / 8 < max_run + 1) {
        PyErr_SetString(PyExc_ValueError, "rel_rows: bank sizes do not match");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (drow[i] >= cap_rows) {
            PyErr_SetString(PyExc_IndexError, "rel_rows: bank row out of range");
            goto done;
        }
    double *mu = BB[0].b.buf, *beta = BB[1].b.buf, *lbeta = BB[2].b.buf, *lpost = BB[3].b.buf;
    int64_t *bn = BB[4].b.buf;
    const double *tc = BB[5].b.buf, *tem = BB[6].b.buf, *te = BB[7].b.buf, *tf = BB[8].b.buf;
    const double *tg = BB[9].b.buf;
    Py_ssize_t valid = 0, osteps = 0, stop = end;
    Py_ssize_t fidx[REL_MAX], aidx[REL_MAX], nf = 0, na = 0;
    int test = 0;
    asked = PyList_New(0);
    if (!asked) goto done;
    for (Py_ssize_t i = 0; i < m; i++) {
        const double *c = vals + i * n;
        long long key = keys[i];
        int ok = 1;
        for (Py_ssize_t r = 0; r < n; r++)
            if (!(c[r] > 0.0 && c[r] < INFINITY)) { ok = 0; break; }  /* (nan fails too) */
        if (!ok) continue;
        valid++;
        double s[REL_MAX], rl[REL_MAX];
        memcpy(s, c, n * sizeof(double));
        qsort(s, n, sizeof(double), cmp_double);
        double med = n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;  /* decision._median */
        for (Py_ssize_t r = 0; r < n; r++) rl[r] = c[r] / med;
        for (Py_ssize_t r = 0; r < n; r++) {  /* DetectorGroup.add, ChangeDetector.add */
            int code = push_one(G[r], key, rl[r]);
            if (code < 0) goto done;
            if (code == G_NONE) continue;
            long long lag = 0;
            double mass = 0.0;
            if (code == G_UPDATE && drow[r] >= 0) {
                lag = dlag[r] < G[r]->len - 1 ? dlag[r] : G[r]->len - 1;
                double out[1024];
                Py_ssize_t keep = step_row(mu, beta, lbeta, lpost, bn, drow[r], G[r]->x, tc,
                                           tem, te, tf, tg, log_h, log_1mh, max_run, out);
                for (Py_ssize_t j = 0; j < lag && j < keep; j++) mass += out[j];
                if (!(lag >= 1 && mass > dthr[r])) continue;  /* the common case */
                code = G_VERIFY;
            }
            PyObject *t = Py_BuildValue("(niLd)", r, code, lag, mass);
            if (!t || PyList_Append(asked, t) < 0) { Py_XDECREF(t); goto done; }
            Py_DECREF(t);
        }
        Py_ssize_t col = (Py_ssize_t)(cpos % C.H);  /* CusumBank.add */
        cpos++;
        cusum_row(&C, rl, key, col, fidx, &nf, aidx, &na);
        if (!nf && !na && cpos % refit == 0 && cusum_refit(&C, key, clag, min_sigma) < 0)
            goto done;  /* (with fits or alarms Python's after_step fits, refits and raises) */
        test = 0;
        if (++oseen > owarm) {  /* OutlierBank.add */
            if (outlier_row(&O, c, key, (Py_ssize_t)(opos % O.W)) < 0) goto done;
            opos++;
            osteps++;
            /* OutlierBank._test: a rank whose count reaches its window length's critical
             * count (crit, by length; -1: not known here) leaves the test to Python */
            if (opos % ostride == 0)
                for (Py_ssize_t r = 0; r < n; r++) {
                    if (O.filled[r] < ominw) continue;
                    int64_t need = crit[O.filled[r]];
                    if (need < 0 || O.count[r] >= need) { test = 1; break; }
                }
        }
        if (PyList_GET_SIZE(asked) || nf || na || test) {
            stop = start + i;
            break;
        }
    }
    fits = index_list(fidx, stop < end ? nf : 0);
    alarms = fits ? index_list(aidx, stop < end ? na : 0) : NULL;
    if (fits && alarms)
        res = Py_BuildValue("(nnnOOOi)", stop, valid, osteps, asked, fits, alarms,
                            stop < end ? test : 0);
done:
    Py_XDECREF(asked);
    Py_XDECREF(fits);
    Py_XDECREF(alarms);
    PyMem_Free(vals);
    PyMem_Free(keys);
    for (int i = 0; i < 10; i++) { rel(&BB[i]); rel(&CB[i]); }
    for (int i = 0; i < 8; i++) rel(&OB[i]);
    rel(&TB);
    Py_DECREF(seq);
    return res;
}

/* ---- gate_run: DecisionCore.sample_many's iteration channel, samples in one call ----------
 *
 * gate_run(gate, samples, start, end, det, bank, bank_sc) -> (stop, code, lag, mass)
 *
 * For samples[start:end] (each a (key, seconds, ...) tuple, e.g. an IterSample), in order,
 * the first half of ``ChangeDetector.add``: the gate's push and, for UPDATE, the BOCPD step
 * of the detector's bank row with the mass of its shortest ``lag`` run lengths
 * (``step_row``, bocpd_step.h), where lag = min(max_lag, segment length - 1). Returns at
 * the first sample that leaves work to Python (``stop``; ``end`` if none): START or WAKE
 * (``code``), or an UPDATE whose mass passed the threshold (code 4 = verify, with ``lag`` and
 * ``mass``): ``ChangeDetector.after_push`` does its rest. det: (bank row or -1, max_lag,
 * threshold); bank, bank_sc: as rel_rows takes them. Every sample is read before any state
 * changes (a bad value raises with none).
 */
static PyObject *gate_run(PyObject *self, PyObject *args) {
    PyObject *gobj, *samples, *bank;
    Py_ssize_t start, end, max_run;
    long long row, max_lag;
    double thr, log_h, log_1mh;
    if (!PyArg_ParseTuple(args, "O!Onn(LLd)O!(ddn)", &GateType, &gobj, &samples, &start, &end,
                          &row, &max_lag, &thr, &PyTuple_Type, &bank, &log_h, &log_1mh,
                          &max_run))
        return NULL;
    if (PyTuple_GET_SIZE(bank) != 10 || max_run < 1 || max_run > 1023) {
        PyErr_SetString(PyExc_ValueError, "gate_run: bad arguments");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(samples, "gate_run: samples");
    if (!seq) return NULL;
    Gate *g = (Gate *)gobj;
    Buf BB[10];
    memset(BB, 0, sizeof BB);
    double *vals = NULL;
    long long *keys = NULL;
    PyObject *res = NULL;
    if (start < 0 || end > PySequence_Fast_GET_SIZE(seq) || start > end) {
        PyErr_SetString(PyExc_IndexError, "gate_run: start, end");
        goto done;
    }
    Py_ssize_t m = end - start;
    vals = PyMem_Malloc((m > 0 ? m : 1) * sizeof(double));
    keys = PyMem_Malloc((m > 0 ? m : 1) * sizeof(long long));
    if (!vals || !keys) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *s = PySequence_Fast_GET_ITEM(seq, start + i);
        if (!PyTuple_Check(s) || PyTuple_GET_SIZE(s) < 2) {
            PyErr_SetString(PyExc_TypeError, "gate_run: a sample is a (key, seconds, ...) tuple");
            goto done;
        }
        keys[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(s, 0));
        vals[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(s, 1));
        if (PyErr_Occurred()) goto done;
    }
    for (int i = 0; i < 10; i++)
        if (get(PyTuple_GET_ITEM(bank, i), &BB[i], i < 5, 8, -1, "bank") < 0) goto done;
    Py_ssize_t W = max_run + 2, cap_rows = BB[4].b.len / 8;
    if (BB[0].b.len / 8 < cap_rows * W || BB[1].b.len / 8 < cap_rows * W ||
        BB[2].b.len / 8 < cap_rows * W || BB[3].b.len / 8 < cap_rows * max_run ||
        BB[5].b.len / 8 < max_run + 1 || BB[6].b.len / 8 < max_run + 1 ||
        BB[7].b.len / 8 < max_run + 1 || BB[8].b.len / 8 < max_run + 1 ||
        BB[9].b.len / 8 < max_run + 1 || row >= cap_rows) {
        PyErr_SetString(PyExc_ValueError, "gate_run: bank sizes do not match");
        goto done;
    }
    Py_ssize_t stop = end;
    int code = G_NONE;
    long long lag = 0;
    double mass = 0.0;
    for (Py_ssize_t i = 0; i < m; i++) {
        code = push_one(g, keys[i], vals[i]);
        if (code < 0) goto done;
        lag = 0;
        mass = 0.0;
        if (code == G_NONE) continue;
        if (code == G_UPDATE && row >= 0) {
            lag = max_lag < g->len - 1 ? max_lag : g->len - 1;
            double out[1024];
            Py_ssize_t keep = step_row(BB[0].b.buf, BB[1].b.buf, BB[2].b.buf, BB[3].b.buf,
                                       BB[4].b.buf, row, g->x, BB[5].b.buf, BB[6].b.buf,
                                       BB[7].b.buf, BB[8].b.buf, BB[9].b.buf, log_h, log_1mh,
                                       max_run, out);
            for (Py_ssize_t j = 0; j < lag && j < keep; j++) mass += out[j];
            if (!(lag >= 1 && mass > thr)) continue;  /* the common case */
            code = G_VERIFY;
        }
        stop = start + i;
        break;
    }
    if (stop == end) { code = G_NONE; lag = 0; mass = 0.0; }
    res = Py_BuildValue("(niLd)", stop, code, lag, mass);
done:
    PyMem_Free(vals);
    PyMem_Free(keys);
    for (int i = 0; i < 10; i++) rel(&BB[i]);
    Py_DECREF(seq);
    return res;
}

#include <structmember.h>
static PyMemberDef gate_members[] = {
    {"warmup", T_LONGLONG, offsetof(Gate, warmup), 0, NULL},
    {"min_baseline", T_LONGLONG, offsetof(Gate, min_baseline), 0, NULL},
    {"max_lag", T_LONGLONG, offsetof(Gate, max_lag), 0, NULL},
    {"min_shift", T_DOUBLE, offsetof(Gate, min_shift), 0, NULL},
    {"z_sig", T_DOUBLE, offsetof(Gate, z_sig), 0, NULL},
    {"clip", T_DOUBLE, offsetof(Gate, clip), 0, NULL},
    {"min_scale", T_DOUBLE, offsetof(Gate, min_scale), 0, NULL},
    {"gate", T_BOOL, offsetof(Gate, gate), 0, NULL},
    {"seen", T_LONGLONG, offsetof(Gate, seen), 0, NULL},
    {"pos", T_LONGLONG, offsetof(Gate, pos), 0, NULL},
    {"quiet", T_LONGLONG, offsetof(Gate, quiet), 0, NULL},
    {"far", T_LONGLONG, offsetof(Gate, far), 0, NULL},
    {"slept", T_LONGLONG, offsetof(Gate, slept), 0, NULL},
    {"model_updates", T_LONGLONG, offsetof(Gate, model_updates), 0, NULL},
    {"scale_n", T_LONGLONG, offsetof(Gate, scale_n), 0, NULL},
    {"pending", T_BOOL, offsetof(Gate, pending), 0, NULL},
    {"live", T_BOOL, offsetof(Gate, live), 0, NULL},
    {"model", T_BOOL, offsetof(Gate, model), 0, NULL},
    {"scale", T_DOUBLE, offsetof(Gate, scale), 0, NULL},
    {"centre", T_DOUBLE, offsetof(Gate, centre), 0, NULL},
    {"x", T_DOUBLE, offsetof(Gate, x), 0, NULL},
    {NULL, 0, 0, 0, NULL}};

static PyMethodDef gate_methods[] = {
    {"push", (PyCFunction)(void (*)(void))gate_push, METH_FASTCALL, "push(key, seconds) -> code"},
    {"copy", (PyCFunction)gate_copy, METH_VARARGS, "copy(keys, vals): the segment, oldest first"},
    {"keep_last", (PyCFunction)gate_keep_last, METH_O, "keep only the newest run samples"},
    {NULL, NULL, 0, NULL}};

static PySequenceMethods gate_seq = {.sq_length = (lenfunc)gate_length};

static PyTypeObject GateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stalwart.detect._channels.Gate",
    .tp_basicsize = sizeof(Gate),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A ChangeDetector's pre-filter and segment (see channels.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)gate_init,
    .tp_dealloc = (destructor)gate_dealloc,
    .tp_members = gate_members,
    .tp_methods = gate_methods,
    .tp_as_sequence = &gate_seq,
};

/* ---- Holder: the monitor's held steps (monitor.py, ``Monitor.step``) -------------------
 *
 * A hinted step whose check has nothing due only records its hint's step, step time, compute
 * time and communication time and returns; ``hold`` is that test and record in one call
 * (the Python version touched ~15 attributes of a monitor whose memory a training step had
 * evicted: ~12 us of rank 0's CPU a step). State: ``checks`` (the monitor's check count),
 * ``due_at`` (the next check with work), ``n`` steps held in a buffer of ``cap`` (grown only
 * by ``push``), ``held_steps`` (steps that only recorded), ``on`` (monitor enabled and not
 * closed); ``sampler`` gets ``last_hint = time.perf_counter()`` at each held step.
 *
 * hold(step, metrics) -> bool: with ``on``, ``metrics`` a dict whose "step_time",
 *   "compute_time" and "comm_time" are present and not None, checks + 1 < due_at and
 *   n < cap: the four objects (as given) appended, checks and held_steps counted, True.
 *   Else nothing changes and False.
 * push(step, step_time, compute_time, comm_time): append (the buffer grows when full).
 * take() -> [(step, step_time, compute_time, comm_time)], oldest first; the buffer empties.
 * samples(cls) -> [cls(step, float(step_time), float(compute_time), float(comm_time))],
 *   oldest first, the buffer emptied -- ``cls`` a tuple subclass of four fields with no
 *   ``__new__`` logic (alarms.IterSample), made as ``tuple.__new__(cls, ...)`` would make
 *   it: the monitor's held samples without a Python call per step. On an error (a time that
 *   ``float`` refuses) the buffer is emptied all the same and the error raised (as ``take``
 *   then the conversion would).
 */
typedef struct {
    PyObject_HEAD
    PyObject **buf;  /* 4 per step held, owned references */
    Py_ssize_t n, cap;
    long long checks, due_at, held_steps;
    char on;
    PyObject *sampler, *clock;
} Holder;

static PyObject *K_ST, *K_CP, *K_CM, *K_LAST;

static void holder_clear_buf(Holder *h) {
    for (Py_ssize_t i = 0; i < 4 * h->n; i++) Py_CLEAR(h->buf[i]);
    h->n = 0;
}

static void holder_dealloc(Holder *h) {
    holder_clear_buf(h);
    PyMem_Free(h->buf);
    Py_XDECREF(h->sampler);
    Py_XDECREF(h->clock);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static int holder_init(Holder *h, PyObject *args, PyObject *kw) {
    static char *kwl[] = {"capacity", "sampler", "clock", NULL};
    Py_ssize_t cap;
    PyObject *sampler, *clock;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nOO", kwl, &cap, &sampler, &clock)) return -1;
    if (cap < 1) { PyErr_SetString(PyExc_ValueError, "Holder: capacity >= 1"); return -1; }
    holder_clear_buf(h);
    PyMem_Free(h->buf);
    h->buf = PyMem_Calloc(4 * cap, sizeof(PyObject *));
    if (!h->buf) { PyErr_NoMemory(); return -1; }
    h->cap = cap;
    h->checks = h->held_steps = 0;
    h->due_at = 1;
    h->on = 1;
    Py_INCREF(sampler);
    Py_XSETREF(h->sampler, sampler);
    Py_INCREF(clock);
    Py_XSETREF(h->clock, clock);
    return 0;
}

static int holder_append(Holder *h, PyObject *const *four) {
    if (h->n == h->cap) {
        Py_ssize_t cap = 2 * h->cap;
        PyObject **b = PyMem_Realloc(h->buf, 4 * cap * sizeof(PyObject *));
        if (!b) { PyErr_NoMemory(); return -1; }
        h->buf = b;
        h->cap = cap;
    }
    for (int i = 0; i < 4; i++) {
        Py_INCREF(four[i]);
        h->buf[4 * h->n + i] = four[i];
    }
    h->n++;
    return 0;
}

static PyObject *holder_hold(Holder *h, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "hold(step, metrics)"); return NULL; }
    PyObject *m = args[1];
    if (!h->on || !PyDict_CheckExact(m) || !(h->checks + 1 < h->due_at) || h->n >= h->cap)
        Py_RETURN_FALSE;
    PyObject *four[4] = {args[0], NULL, NULL, NULL};
    PyObject *keys[3] = {K_ST, K_CP, K_CM};
    for (int i = 0; i < 3; i++) {
        four[i + 1] = PyDict_GetItemWithError(m, keys[i]);  /* borrowed */
        if (!four[i + 1]) {
            if (PyErr_Occurred()) return NULL;
            Py_RETURN_FALSE;
        }
        if (four[i + 1] == Py_None) Py_RETURN_FALSE;
    }
    /* the dict may hold the only references: take ours before anything else runs */
    if (holder_append(h, four) < 0) return NULL;
    h->checks++;
    h->held_steps++;
    PyObject *now = PyObject_CallNoArgs(h->clock);
    if (!now || PyObject_SetAttr(h->sampler, K_LAST, now) < 0) { Py_XDECREF(now); return NULL; }
    Py_DECREF(now);
    Py_RETURN_TRUE;
}

static PyObject *holder_push(Holder *h, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "push(step, step_time, compute_time, comm_time)");
        return NULL;
    }
    if (holder_append(h, args) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *holder_take(Holder *h, PyObject *unused) {
    PyObject *out = PyList_New(h->n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < h->n; i++) {
        PyObject *t = PyTuple_New(4);
        if (!t) { Py_DECREF(out); return NULL; }
        for (int j = 0; j < 4; j++) {  /* the references move to the tuple */
            PyTuple_SET_ITEM(t, j, h->buf[4 * i + j]);
            h->buf[4 * i + j] = NULL;
        }
        PyList_SET_ITEM(out, i, t);
    }
    h->n = 0;
    return out;
}

static PyObject *holder_samples(Holder *h, PyObject *cls) {
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "samples(cls): cls a tuple subclass");
        return NULL;
    }
    PyTypeObject *tp = (PyTypeObject *)cls;
    PyObject *out = PyList_New(h->n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < h->n; i++) {
        PyObject *t = tp->tp_alloc(tp, 4);
        if (!t) { Py_DECREF(out); return NULL; }
        PyObject **b = h->buf + 4 * i;
        Py_INCREF(b[0]);
        PyTuple_SET_ITEM(t, 0, b[0]);
        for (int j = 1; j < 4; j++) {
            PyObject *f = PyFloat_CheckExact(b[j]) ? Py_NewRef(b[j]) : PyNumber_Float(b[j]);
            if (!f) { Py_DECREF(t); Py_DECREF(out); holder_clear_buf(h); return NULL; }
            PyTuple_SET_ITEM(t, j, f);
        }
        PyList_SET_ITEM(out, i, t);
    }
    holder_clear_buf(h);
    return out;
}

static PyMemberDef holder_members[] = {
    {"n", T_PYSSIZET, offsetof(Holder, n), READONLY, "steps held"},
    {"cap", T_PYSSIZET, offsetof(Holder, cap), READONLY, "the buffer's size, in steps"},
    {"checks", T_LONGLONG, offsetof(Holder, checks), 0, NULL},
    {"due_at", T_LONGLONG, offsetof(Holder, due_at), 0, NULL},
    {"held_steps", T_LONGLONG, offsetof(Holder, held_steps), 0, NULL},
    {"on", T_BOOL, offsetof(Holder, on), 0, NULL},
    {NULL, 0, 0, 0, NULL}};

static PyMethodDef holder_methods[] = {
    {"hold", (PyCFunction)(void (*)(void))holder_hold, METH_FASTCALL,
     "hold(step, metrics) -> bool (see channels.c)"},
    {"push", (PyCFunction)(void (*)(void))holder_push, METH_FASTCALL,
     "push(step, step_time, compute_time, comm_time)"},
    {"take", (PyCFunction)holder_take, METH_NOARGS, "the steps held, oldest first; emptied"},
    {"samples", (PyCFunction)holder_samples, METH_O,
     "samples(cls): the steps held as cls(step, float, float, float), oldest first; emptied"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject HolderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stalwart.detect._channels.Holder",
    .tp_basicsize = sizeof(Holder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The monitor's held steps (see channels.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)holder_init,
    .tp_dealloc = (destructor)holder_dealloc,
    .tp_members = holder_members,
    .tp_methods = holder_methods,
};

/* ---- by_step: rank 0's read of one exchange's rows (exchange.py, ``ExchangeRow.by_step``) --
 *
 * by_step(rows, size, at) -> [(int(rows[0][j]), [row[j + 1] for row in rows]) for j in
 *   range(size, size + 2 * n, 2)], n = int(min(row[at] for row in rows)): the same list
 *   ``ExchangeRow.by_step`` makes (the same float objects), or None where that one must run
 *   (no rows, a row not a list, a value not a float, n not a finite count, a row too short).
 */
static PyObject *by_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "by_step(rows, size, at)"); return NULL; }
    PyObject *rows = args[0];
    Py_ssize_t size = PyLong_AsSsize_t(args[1]), at = PyLong_AsSsize_t(args[2]);
    if ((size == -1 || at == -1) && PyErr_Occurred()) return NULL;
    if (!PyList_CheckExact(rows) || PyList_GET_SIZE(rows) < 1 || size < 0 || at < 0)
        Py_RETURN_NONE;
    Py_ssize_t R = PyList_GET_SIZE(rows), len = PY_SSIZE_T_MAX;
    double least = 0.0;
    for (Py_ssize_t r = 0; r < R; r++) {
        PyObject *row = PyList_GET_ITEM(rows, r);
        if (!PyList_CheckExact(row) || PyList_GET_SIZE(row) <= at) Py_RETURN_NONE;
        PyObject *v = PyList_GET_ITEM(row, at);
        if (!PyFloat_CheckExact(v)) Py_RETURN_NONE;
        double x = PyFloat_AS_DOUBLE(v);
        if (r == 0 || x < least) least = x;  /* (min: the first, replaced by a smaller one) */
        if (PyList_GET_SIZE(row) < len) len = PyList_GET_SIZE(row);
    }
    if (!(least >= 0.0 && least < 1e9)) Py_RETURN_NONE;
    Py_ssize_t n = (Py_ssize_t)least;  /* (int(): toward zero) */
    if (size + 2 * n > len) Py_RETURN_NONE;
    PyObject *first = PyList_GET_ITEM(rows, 0);
    for (Py_ssize_t k = 0; k < 2 * n; k++)
        for (Py_ssize_t r = 0; r < (k % 2 ? R : 1); r++)
            if (!PyFloat_CheckExact(PyList_GET_ITEM(PyList_GET_ITEM(rows, r), size + k)))
                Py_RETURN_NONE;
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t j = size + 2 * i;
        double kv = PyFloat_AS_DOUBLE(PyList_GET_ITEM(first, j));
        PyObject *key = isfinite(kv) ? PyLong_FromDouble(kv) : NULL;
        if (!key) {
            Py_DECREF(out);
            if (!PyErr_Occurred()) Py_RETURN_NONE;
            return NULL;
        }
        PyObject *comps = PyList_New(R);
        if (!comps) { Py_DECREF(key); Py_DECREF(out); return NULL; }
        for (Py_ssize_t r = 0; r < R; r++) {
            PyObject *v = PyList_GET_ITEM(PyList_GET_ITEM(rows, r), j + 1);
            Py_INCREF(v);
            PyList_SET_ITEM(comps, r, v);
        }
        PyObject *pair = PyTuple_Pack(2, key, comps);
        Py_DECREF(key);
        Py_DECREF(comps);
        if (!pair) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, i, pair);
    }
    return out;
}


/* ---- best_split: robust.best_split's costs (changepoint.py's verification) --------------
 *
 * best_split(v, candidates) -> the candidate that ``robust.best_split`` returns (the same
 *   object; None without candidates), or NotImplemented where that one must run (v not a
 *   1-d contiguous float64 buffer, a nan in v, a candidate not an int in [0, len(v)]).
 *   The cost of a split at i is _abs_dev(v[:i]) + _abs_dev(v[i:]), each the upper half's
 *   sum of the sorted values minus the lower half's, summed as numpy's add.reduce sums a
 *   contiguous float64 vector (pairwise_sum: 8 partial sums in blocks of up to 128, halves
 *   above), so every cost is the reference's to the bit; the first of equal costs wins.
 *   The sorted heads grow by insertion from the smallest candidate's: one sort, then
 *   O(len(v)) per candidate, instead of two numpy sorts and four numpy calls each.
 */
static double pw_sum(const double *a, Py_ssize_t n) {
    if (n < 8) {
        double res = 0.0;
        for (Py_ssize_t i = 0; i < n; i++) res += a[i];
        return res;
    }
    if (n <= 128) {
        double r[8];
        Py_ssize_t i;
        for (int j = 0; j < 8; j++) r[j] = a[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    Py_ssize_t n2 = n / 2;
    n2 -= n2 % 8;
    return pw_sum(a, n2) + pw_sum(a + n2, n - n2);
}

/* ``_abs_dev`` of the sorted values s[0..n): float(upper.sum() - lower.sum()) */
static double abs_dev_sorted(const double *s, Py_ssize_t n) {
    Py_ssize_t k = n / 2;
    return pw_sum(s + n - k, k) - pw_sum(s, k);
}

static void sort_doubles(double *a, Py_ssize_t n) {
    if (n <= 32) {  /* insertion sort */
        for (Py_ssize_t i = 1; i < n; i++) {
            double x = a[i];
            Py_ssize_t j = i;
            for (; j > 0 && a[j - 1] > x; j--) a[j] = a[j - 1];
            a[j] = x;
        }
    } else {
        qsort(a, (size_t)n, sizeof(double), cmp_double);  /* (no nan here) */
    }
}

static PyObject *best_split_c(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "best_split(v, candidates)");
        return NULL;
    }
    Py_buffer vb;
    if (PyObject_GetBuffer(args[0], &vb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *cands = NULL, *out = NULL, **items = NULL;
    double *work = NULL, *big = NULL, tail[64];
    Py_ssize_t *at = NULL, n = 0, m = 0, lo = 0;
    char *asked = NULL;
    if (vb.ndim != 1 || vb.itemsize != 8 || !vb.format || strcmp(vb.format, "d") != 0)
        goto fallback;
    const double *v = (const double *)vb.buf;
    n = vb.shape ? vb.shape[0] : vb.len / 8;
    for (Py_ssize_t i = 0; i < n; i++)
        if (v[i] != v[i]) goto fallback;
    cands = PySequence_Fast(args[1], "best_split: candidates");
    if (!cands) goto error;
    m = PySequence_Fast_GET_SIZE(cands);
    if (m == 0) { out = Py_None; Py_INCREF(out); goto done; }
    items = PySequence_Fast_ITEMS(cands);
    at = PyMem_Malloc((size_t)m * sizeof(Py_ssize_t));
    /* the sorted head (n), then the costs by split index (n + 1) */
    work = PyMem_Malloc((size_t)(2 * n + 1) * sizeof(double));
    asked = PyMem_Calloc((size_t)n + 1, 1);
    if (!at || !work || !asked) { PyErr_NoMemory(); goto error; }
    lo = n;
    for (Py_ssize_t c = 0; c < m; c++) {
        if (!PyLong_CheckExact(items[c])) goto fallback;
        Py_ssize_t i = PyLong_AsSsize_t(items[c]);
        if (i == -1 && PyErr_Occurred()) { PyErr_Clear(); goto fallback; }
        if (i < 0 || i > n) goto fallback;
        at[c] = i;
        asked[i] = 1;
        if (i < lo) lo = i;
    }
    double *head = work, *cost = work + n;
    memcpy(head, v, (size_t)lo * sizeof(double));
    sort_doubles(head, lo);
    Py_ssize_t len = lo;
    for (Py_ssize_t i = lo; i <= n; i++) {
        if (i > lo) {  /* v[i - 1] joins the sorted head */
            double x = v[i - 1];
            Py_ssize_t j = len;
            for (; j > 0 && head[j - 1] > x; j--) head[j] = head[j - 1];
            head[j] = x;
            len++;
        }
        if (!asked[i]) continue;
        Py_ssize_t t = n - i;
        double *tl = tail;
        if (t > 64) {
            if (!big) big = PyMem_Malloc((size_t)n * sizeof(double));
            if (!big) { PyErr_NoMemory(); goto error; }
            tl = big;
        }
        memcpy(tl, v + i, (size_t)t * sizeof(double));
        sort_doubles(tl, t);
        cost[i] = abs_dev_sorted(head, len) + abs_dev_sorted(tl, t);
    }
    {
        double best = INFINITY;
        PyObject *best_o = Py_None;
        for (Py_ssize_t c = 0; c < m; c++)
            if (cost[at[c]] < best) { best = cost[at[c]]; best_o = items[c]; }
        out = best_o;
        Py_INCREF(out);
    }
    goto done;
fallback:
    out = Py_NotImplemented;
    Py_INCREF(out);
    goto done;
error:
    out = NULL;
done:
    PyMem_Free(big);
    PyMem_Free(asked);
    PyMem_Free(work);
    PyMem_Free(at);
    Py_XDECREF(cands);
    PyBuffer_Release(&vb);
    return out;
}

static PyMethodDef methods[] = {
    {"best_split", (PyCFunction)(void (*)(void))best_split_c, METH_FASTCALL,
     "robust.best_split's candidate (see the file), or NotImplemented."},
    {"by_step", (PyCFunction)(void (*)(void))by_step, METH_FASTCALL,
     "ExchangeRow.by_step's list (see the file), or None."},
    {"cusum_step", cusum_step, METH_VARARGS, "One CUSUM step of every rank (see the file)."},
    {"cusum_refit", cusum_refit_py, METH_VARARGS, "CusumBank._refit in place (see the file)."},
    {"outlier_step", outlier_step, METH_VARARGS, "One sample of every rank's window."},
    {"push_many", (PyCFunction)(void (*)(void))push_many, METH_FASTCALL,
     "Gate.push for each gate; the (index, code) of those not NONE."},
    {"rel_rows", rel_rows, METH_VARARGS, "DecisionCore.relative_rows' common path (see the file)."},
    {"gate_run", gate_run, METH_VARARGS, "DecisionCore.sample_many's channel steps (see the file)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "_channels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__channels(void) {
    if (PyType_Ready(&GateType) < 0 || PyType_Ready(&HolderType) < 0) return NULL;
    K_ST = PyUnicode_InternFromString("step_time");
    K_CP = PyUnicode_InternFromString("compute_time");
    K_CM = PyUnicode_InternFromString("comm_time");
    K_LAST = PyUnicode_InternFromString("last_hint");
    if (!K_ST || !K_CP || !K_CM || !K_LAST) return NULL;
    PyObject *m = PyModule_Create(&mod);
    if (!m) return NULL;
    Py_INCREF(&GateType);
    if (PyModule_AddObject(m, "Gate", (PyObject *)&GateType) < 0) {
        Py_DECREF(&GateType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&HolderType);
    if (PyModule_AddObject(m, "Holder", (PyObject *)&HolderType) < 0) {
        Py_DECREF(&HolderType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
