/* One BOCPD step for rows of a BOCPDBank (stalwart.detect.bocpd), in C.
 *
 * The arithmetic of ``BOCPDBank.update`` (the Python reference, kept for tests): Normal-Gamma
 * model with the per-run-length terms tabulated (c, e - 1/2, e, f, g), the run-length
 * posterior in log space, the longest run folded into the cap. Why native: on rank 0 one
 * update is ~20 numpy calls over <= 300 run lengths, each ~1-3 us of call overhead -- most
 * of the monitor's per-step CPU while a channel is awake; here it is one call.
 *
 * update(mu, beta, log_beta, logpost, n, rows, xs, c, em, e, f, g, log_h, log_1mh, max_run,
 *        post) -- 2-d float64 C-contiguous mu/beta/log_beta (cap x max_run+2) and logpost
 * (cap x max_run), int64 n (cap), int64 rows and float64 xs (k), float64 tables
 * (max_run+1), post: float64 (k x width) written with each row's posterior (zeros after its
 * run lengths). Returns the width used (max over rows of min(n+1, max_run)).
 *
 * step(...): one row, returning only the mass of its shortest ``lag`` run lengths (below).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct { Py_buffer b; int ok; } Buf;

static int get(PyObject *o, Buf *x, int writable) {
    x->ok = 0;
    if (PyObject_GetBuffer(o, &x->b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT |
                           (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    x->ok = 1;
    return 0;
}

static void rel(Buf *x) { if (x->ok) PyBuffer_Release(&x->b); }

#include "bocpd_step.h"

static PyObject *update(PyObject *self, PyObject *args) {
    PyObject *o[12];
    double log_h, log_1mh;
    Py_ssize_t max_run;
    PyObject *o_post;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOddnO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5],
                          &o[6], &o[7], &o[8], &o[9], &o[10], &o[11], &log_h, &log_1mh,
                          &max_run, &o_post))
        return NULL;
    Buf B[13];
    memset(B, 0, sizeof B);
    int wr[13] = {1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1};
    PyObject *res = NULL;
    for (int i = 0; i < 13; i++)
        if (get(i < 12 ? o[i] : o_post, &B[i], wr[i]) < 0) goto done;
    {
        double *mu = B[0].b.buf, *beta = B[1].b.buf, *lbeta = B[2].b.buf, *lpost = B[3].b.buf;
        int64_t *n = B[4].b.buf, *rows = B[5].b.buf;
        double *xs = B[6].b.buf, *c = B[7].b.buf, *em = B[8].b.buf, *e = B[9].b.buf;
        double *f = B[10].b.buf, *g = B[11].b.buf, *post = B[12].b.buf;
        Py_ssize_t k = B[5].b.len / 8, cap_rows = B[4].b.len / 8;
        if (B[6].b.len / 8 != k || B[7].b.len / 8 < max_run + 1) {
            PyErr_SetString(PyExc_ValueError, "bocpd.update: sizes do not match");
            goto done;
        }
        /* the width of the vector path: max over rows of n+1, folded to max_run */
        Py_ssize_t w = 0;
        for (Py_ssize_t i = 0; i < k; i++) {
            if (rows[i] < 0 || rows[i] >= cap_rows) {
                PyErr_SetString(PyExc_IndexError, "bocpd.update: row out of range");
                goto done;
            }
            if (n[rows[i]] + 1 > w) w = n[rows[i]] + 1;
        }
        Py_ssize_t width = w > max_run ? max_run : w;
        if (B[12].b.len / 8 < k * width) {
            PyErr_SetString(PyExc_ValueError, "bocpd.update: post too small");
            goto done;
        }
        if (w > 1024) { PyErr_SetString(PyExc_ValueError, "bocpd.update: max_run > 1023"); goto done; }
        for (Py_ssize_t i = 0; i < k; i++) {
            Py_ssize_t keep = step_row(mu, beta, lbeta, lpost, n, rows[i], xs[i], c, em, e, f, g,
                                       log_h, log_1mh, max_run, post + i * width);
            for (Py_ssize_t j = keep; j < width; j++) post[i * width + j] = 0.0;
        }
        res = PyLong_FromSsize_t(width);
    }
done:
    for (int i = 0; i < 13; i++) rel(&B[i]);
    return res;
}

/* step(mu, beta, log_beta, logpost, n, c, em, e, f, g, row, x, log_h, log_1mh, max_run, lag)
 * -> float: one row's update (as ``update``), returning the posterior mass of run lengths
 * 1..lag summed in order -- what a ChangeDetector asks of the posterior, without building it. */
static PyObject *step(PyObject *self, PyObject *args) {
    PyObject *o[10];
    Py_ssize_t row, max_run, lag;
    double x, log_h, log_1mh;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOndddnn", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5],
                          &o[6], &o[7], &o[8], &o[9], &row, &x, &log_h, &log_1mh, &max_run,
                          &lag))
        return NULL;
    Buf B[10];
    memset(B, 0, sizeof B);
    int wr[10] = {1, 1, 1, 1, 1, 0, 0, 0, 0, 0};
    PyObject *res = NULL;
    for (int i = 0; i < 10; i++)
        if (get(o[i], &B[i], wr[i]) < 0) goto done;
    {
        int64_t *n = B[4].b.buf;
        Py_ssize_t W = max_run + 2, cap_rows = B[4].b.len / 8;
        if (row < 0 || row >= cap_rows || max_run < 1 || max_run > 1023 ||
            B[0].b.len / 8 < cap_rows * W || B[3].b.len / 8 < cap_rows * max_run ||
            B[5].b.len / 8 < max_run + 1 || B[9].b.len / 8 < max_run + 1) {
            PyErr_SetString(PyExc_ValueError, "bocpd.step: sizes do not match");
            goto done;
        }
        double out[1024];
        Py_ssize_t keep = step_row(B[0].b.buf, B[1].b.buf, B[2].b.buf, B[3].b.buf, n, row, x,
                                   B[5].b.buf, B[6].b.buf, B[7].b.buf, B[8].b.buf, B[9].b.buf,
                                   log_h, log_1mh, max_run, out);
        double mass = 0.0;
        for (Py_ssize_t j = 0; j < lag && j < keep; j++) mass += out[j];
        res = PyFloat_FromDouble(mass);
    }
done:
    for (int i = 0; i < 10; i++) rel(&B[i]);
    return res;
}

/* replay(mu, beta, log_beta, logpost, n, c, em, e, f, g, row, xs, lo, hi, log_h, log_1mh,
 *        max_run) -> None: one row stepped with each of xs (float64) in order, each first
 * clipped to [lo, hi] as Python's min(max(x, lo), hi) -- what ``ChangeDetector._start_bocpd``
 * feeds a new model (``BOCPDBank.replay``; its loop of update_mass calls is the reference). */
static PyObject *replay(PyObject *self, PyObject *args) {
    PyObject *o[11];
    Py_ssize_t row, max_run;
    double lo, hi, log_h, log_1mh;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOnOddddn", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5],
                          &o[6], &o[7], &o[8], &o[9], &row, &o[10], &lo, &hi, &log_h, &log_1mh,
                          &max_run))
        return NULL;
    Buf B[11];
    memset(B, 0, sizeof B);
    int wr[11] = {1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0};
    PyObject *res = NULL;
    for (int i = 0; i < 11; i++)
        if (get(o[i], &B[i], wr[i]) < 0) goto done;
    {
        int64_t *n = B[4].b.buf;
        Py_ssize_t W = max_run + 2, cap_rows = B[4].b.len / 8, k = B[10].b.len / 8;
        if (row < 0 || row >= cap_rows || max_run < 1 || max_run > 1023 ||
            B[0].b.len / 8 < cap_rows * W || B[3].b.len / 8 < cap_rows * max_run ||
            B[5].b.len / 8 < max_run + 1 || B[9].b.len / 8 < max_run + 1 ||
            B[10].b.itemsize != 8) {
            PyErr_SetString(PyExc_ValueError, "bocpd.replay: sizes do not match");
            goto done;
        }
        const double *xs = B[10].b.buf;
        double out[1024];
        for (Py_ssize_t i = 0; i < k; i++) {
            double v = lo > xs[i] ? lo : xs[i];  /* max(x, lo): x unless lo is greater */
            v = hi < v ? hi : v;                  /* min(v, hi): v unless hi is less */
            step_row(B[0].b.buf, B[1].b.buf, B[2].b.buf, B[3].b.buf, n, row, v, B[5].b.buf,
                     B[6].b.buf, B[7].b.buf, B[8].b.buf, B[9].b.buf, log_h, log_1mh, max_run,
                     out);
        }
        Py_INCREF(Py_None);
        res = Py_None;
    }
done:
    for (int i = 0; i < 11; i++) rel(&B[i]);
    return res;
}

static PyMethodDef methods[] = {
    {"update", update, METH_VARARGS, "One BOCPD step for rows of a bank (see the file)."},
    {"step", step, METH_VARARGS, "One row's step; the posterior mass of run lengths 1..lag."},
    {"replay", replay, METH_VARARGS, "One row stepped with each of xs, clipped (see the file)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "_bocpd", NULL, -1, methods};

PyMODINIT_FUNC PyInit__bocpd(void) { return PyModule_Create(&mod); }
