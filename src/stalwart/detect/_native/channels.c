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

static PyMethodDef methods[] = {
    {"cusum_step", cusum_step, METH_VARARGS, "One CUSUM step of every rank (see the file)."},
    {"outlier_step", outlier_step, METH_VARARGS, "One sample of every rank's window."},
    {"push_many", (PyCFunction)(void (*)(void))push_many, METH_FASTCALL,
     "Gate.push for each gate; the (index, code) of those not NONE."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "_channels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__channels(void) {
    if (PyType_Ready(&GateType) < 0) return NULL;
    PyObject *m = PyModule_Create(&mod);
    if (!m) return NULL;
    Py_INCREF(&GateType);
    if (PyModule_AddObject(m, "Gate", (PyObject *)&GateType) < 0) {
        Py_DECREF(&GateType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
