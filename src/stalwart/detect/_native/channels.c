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

typedef struct { Py_buffer b; int ok; } Buf;

static int get(PyObject *o, Buf *x, int writable, Py_ssize_t itemsize, Py_ssize_t len,
               const char *what) {
    x->ok = 0;
    if (PyObject_GetBuffer(o, &x->b, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    x->ok = 1;
    if (x->b.itemsize != itemsize || x->b.len != len * itemsize) {
        PyErr_Format(PyExc_ValueError, "channels: %s has the wrong size or type", what);
        return -1;
    }
    return 0;
}

static void rel(Buf *x) { if (x->ok) PyBuffer_Release(&x->b); }

static PyObject *cusum_step(PyObject *self, PyObject *args) {
    PyObject *o[11];
    long long key, col, warmup, learn;
    double k, clip, h, log_n;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOLLLLdddd", &o[0], &o[1], &o[2], &o[3], &o[4],
                          &o[5], &o[6], &o[7], &o[8], &o[9], &o[10], &key, &col, &warmup,
                          &learn, &k, &clip, &h, &log_n))
        return NULL;
    Buf B[11];
    memset(B, 0, sizeof B);
    PyObject *res = NULL, *fits = NULL, *alarms = NULL;
    Py_ssize_t n = -1, H = 0;
    {
        Py_buffer probe;
        if (PyObject_GetBuffer(o[9], &probe, PyBUF_SIMPLE) < 0) return NULL;
        n = probe.len;  /* live: one byte per rank */
        PyBuffer_Release(&probe);
        if (PyObject_GetBuffer(o[0], &probe, PyBUF_SIMPLE) < 0) return NULL;
        H = n > 0 ? probe.len / 8 / n : 0;
        PyBuffer_Release(&probe);
    }
    static const char *names[11] = {"keys", "xs", "seen", "start_key", "mu0", "sigma", "s",
                                    "zero_key", "backoff", "live", "ratios"};
    const int wr[11] = {1, 1, 1, 1, 0, 0, 1, 1, 0, 1, 0};
    const Py_ssize_t isz[11] = {8, 8, 8, 8, 8, 8, 8, 8, 8, 1, 8};
    for (int i = 0; i < 11; i++)
        if (get(o[i], &B[i], wr[i], isz[i], i < 2 ? n * H : n, names[i]) < 0) goto done;
    if (col < 0 || col >= H) { PyErr_SetString(PyExc_IndexError, "cusum_step: col"); goto done; }
    {
        int64_t *keys = B[0].b.buf, *seen = B[2].b.buf, *start = B[3].b.buf;
        int64_t *zero = B[7].b.buf;
        double *xs = B[1].b.buf, *mu0 = B[4].b.buf, *sigma = B[5].b.buf, *s = B[6].b.buf;
        double *backoff = B[8].b.buf, *ratios = B[10].b.buf;
        char *live = B[9].b.buf;
        fits = PyList_New(0);
        alarms = PyList_New(0);
        if (!fits || !alarms) goto done;
        for (Py_ssize_t r = 0; r < n; r++) {
            double v = ratios[r];
            double x = log(v != v ? v : (v < 1e-9 ? 1e-9 : v));
            keys[r * H + col] = key;
            xs[r * H + col] = x;
            seen[r] += 1;
            if (seen[r] == warmup + 1) start[r] = key;
            double sig = sigma[r];
            live[r] = !(sig != sig);
            if (!live[r]) {
                s[r] = 0.0;
                if (seen[r] >= warmup + learn) {
                    PyObject *i = PyLong_FromSsize_t(r);
                    if (!i || PyList_Append(fits, i) < 0) { Py_XDECREF(i); goto done; }
                    Py_DECREF(i);
                }
                continue;
            }
            double lo = -clip * sig, hi = clip * sig, d = x - mu0[r];
            d = d > lo ? d : (d != d ? d : lo);   /* np.clip: maximum, then minimum */
            d = d < hi ? d : (d != d ? d : hi);
            double t = s[r] + (d - k);
            t = t != t ? t : (t > 0.0 ? t : 0.0);  /* np.maximum(0, t) */
            s[r] = t;
            if (t == 0.0) zero[r] = key;
            double thr = (h + log_n * sig / (2.0 * k)) * backoff[r] * sig;
            if (t > thr) {
                PyObject *i = PyLong_FromSsize_t(r);
                if (!i || PyList_Append(alarms, i) < 0) { Py_XDECREF(i); goto done; }
                Py_DECREF(i);
            }
        }
        res = PyTuple_Pack(2, fits, alarms);
    }
done:
    Py_XDECREF(fits);
    Py_XDECREF(alarms);
    for (int i = 0; i < 11; i++) rel(&B[i]);
    return res;
}

static const double *sort_vals;
static int by_value(const void *a, const void *b) {
    double x = sort_vals[*(const Py_ssize_t *)a], y = sort_vals[*(const Py_ssize_t *)b];
    return x < y ? -1 : (x > y ? 1 : 0);
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
    Py_ssize_t n, W;
    {
        Py_buffer probe;
        if (PyObject_GetBuffer(o[8], &probe, PyBUF_SIMPLE) < 0) return NULL;
        n = probe.len / 8;  /* comps */
        PyBuffer_Release(&probe);
        if (PyObject_GetBuffer(o[3], &probe, PyBUF_SIMPLE) < 0) return NULL;
        W = probe.len / 8;  /* keys */
        PyBuffer_Release(&probe);
    }
    static const char *names[9] = {"over", "logrel", "excess", "keys", "count", "filled",
                                   "whole", "line", "comps"};
    const int wr[9] = {1, 1, 1, 1, 1, 1, 1, 0, 0};
    const Py_ssize_t isz[9] = {1, 8, 8, 8, 8, 8, 1, 8, 8};
    const Py_ssize_t len[9] = {n * W, n * W, n * W, W, n, n, n, n, n};
    for (int i = 0; i < 9; i++)
        if (get(o[i], &B[i], wr[i], isz[i], len[i], names[i]) < 0) goto done;
    if (n < 2 || p < 0 || p >= W) {
        PyErr_SetString(PyExc_ValueError, "outlier_step: need 2 ranks and 0 <= p < window");
        goto done;
    }
    {
        char *over = B[0].b.buf, *whole = B[6].b.buf;
        double *logrel = B[1].b.buf, *excess = B[2].b.buf, *line = B[7].b.buf;
        double *c = B[8].b.buf;
        int64_t *keys = B[3].b.buf, *count = B[4].b.buf, *filled = B[5].b.buf;
        Py_ssize_t small[2 * 64];
        Py_ssize_t *order = n <= 64 ? small : malloc(2 * n * sizeof(Py_ssize_t));
        if (!order) { PyErr_NoMemory(); goto done; }
        Py_ssize_t *pos = order + n;
        for (Py_ssize_t i = 0; i < n; i++) order[i] = i;
        sort_vals = c;  /* the GIL is held: no other call sorts meanwhile */
        qsort(order, n, sizeof(Py_ssize_t), by_value);
        for (Py_ssize_t i = 0; i < n; i++) pos[order[i]] = i;
        /* the median of the others: which of equal values is taken out does not matter */
        Py_ssize_t m = n - 1;
        for (Py_ssize_t r = 0; r < n; r++) {
#define RED(j) ((j) < pos[r] ? c[order[(j)]] : c[order[(j) + 1 < n ? (j) + 1 : n - 1]])
            double peer = m % 2 ? RED(m / 2) : 0.5 * (RED(m / 2 - 1) + RED(m / 2));
#undef RED
            double x = c[r] / peer;
            int full = filled[r] >= W;
            if (full) {
                whole[r] = 0;
                count[r] -= over[r * W + p] ? 1 : 0;
            } else {
                filled[r] += 1;
            }
            char ov = x > line[r];
            count[r] += ov;
            over[r * W + p] = ov;
            logrel[r * W + p] = log(x);
            excess[r * W + p] = c[r] - peer;
        }
        keys[p] = key;
        if (order != small) free(order);
        Py_INCREF(Py_None);
        res = Py_None;
    }
done:
    for (int i = 0; i < 9; i++) rel(&B[i]);
    return res;
}

static PyMethodDef methods[] = {
    {"cusum_step", cusum_step, METH_VARARGS, "One CUSUM step of every rank (see the file)."},
    {"outlier_step", outlier_step, METH_VARARGS, "One sample of every rank's window."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "_channels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__channels(void) { return PyModule_Create(&mod); }
