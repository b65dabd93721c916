/* The BOCPD step of one bank row, shared by bocpd.c (``update``, ``step``) and channels.c
 * (``rel_rows``: the per-rank channels' models updated inside the batched row step), so both
 * extensions do the same arithmetic in the same order. Included, not linked: each extension
 * is built on its own (setup.py). Needs <Python.h>, <math.h>, <stdint.h> first. */
#ifndef STALWART_BOCPD_STEP_H
#define STALWART_BOCPD_STEP_H

/* One row's step: its parameters and log posterior after x; writes the posterior (run lengths
 * 1..keep) to out and returns keep. n[r] + 1 <= 1024 (checked by the callers). */
static Py_ssize_t step_row(double *mu, double *beta, double *lbeta, double *lpost, int64_t *n,
                           Py_ssize_t r, double x, const double *c, const double *em,
                           const double *e, const double *f, const double *g, double log_h,
                           double log_1mh, Py_ssize_t max_run, double *out) {
    Py_ssize_t W = max_run + 2, nr = n[r], wi = nr + 1;
    double *m = mu + r * W, *bt = beta + r * W, *lb = lbeta + r * W;
    double *lp = lpost + r * max_run;
    double mx = -INFINITY, logs[1025];
    /* new segment (j = 0) and growth (j >= 1), from the parameters before x */
    double nm[1025], nb[1025], nlb[1025], pr[1025];
    for (Py_ssize_t j = 0; j < wi; j++) {
        double d = x - m[j];
        nb[j] = bt[j] + f[j] * d * d;
        nlb[j] = log(nb[j]);
        nm[j] = m[j] + d * g[j];
        double l = c[j] + em[j] * lb[j] - e[j] * nlb[j];
        logs[j] = j == 0 ? log_h + l : lp[j - 1] + (log_1mh + l);
        if (logs[j] > mx) mx = logs[j];
    }
    double total = 0.0;
    for (Py_ssize_t j = 0; j < wi; j++) {
        logs[j] -= mx;
        pr[j] = exp(logs[j]);
        total += pr[j];
    }
    double ltot = log(total);
    for (Py_ssize_t j = 0; j < wi; j++) { pr[j] /= total; logs[j] -= ltot; }
    for (Py_ssize_t j = 0; j < wi; j++) { m[j + 1] = nm[j]; bt[j + 1] = nb[j]; lb[j + 1] = nlb[j]; }
    Py_ssize_t keep = wi;
    if (wi > max_run) {  /* fold the longest run into the cap */
        pr[max_run - 1] += pr[max_run];
        logs[max_run - 1] = pr[max_run - 1] > 0 ? log(pr[max_run - 1]) : -INFINITY;
        keep = max_run;
    }
    for (Py_ssize_t j = 0; j < keep; j++) { lp[j] = logs[j]; out[j] = pr[j]; }
    n[r] = keep;
    return keep;
}

#endif
