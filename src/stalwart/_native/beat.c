/* stalwart._beat: the heartbeat's sender (heartbeat.py) as a native thread that never takes
 * the GIL. A rank's main thread can hold the GIL for seconds (a dlopen during a lazy import
 * scales with the load and its CPU quota); a Python beat thread then goes silent and the
 * launcher takes a slow rank for a hung one. This thread stops only when the whole process
 * does (SIGSTOP, a frozen host) or its datagrams stop arriving (a cut link) -- what the
 * launcher must see.
 *
 * start(fd, ip, port, pid, period_ms): beats on the UDP socket ``fd`` (the caller keeps it
 * open) to ip:port every period_ms; set_phase(p) (0 starting, 1 ready, 2 leaving) and
 * send_now() beat at once. Datagram: heartbeat._FMT "!4sIIB" (magic, pid, seq, phase).
 * Cost: one 13-byte sendto per period; no Python on that path.
 *
 * fan_add(fd, period_ms) / fan_remove(fd): the elastic membership's peer beats (below), on a
 * second native thread for the same reason.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

static atomic_int g_fd = -1;
static atomic_uint g_seq = 0;
static atomic_uint g_phase = 0;
static uint32_t g_pid = 0;
static long g_period_ms = 500;
static struct sockaddr_in g_to;
static pthread_mutex_t g_send_lock = PTHREAD_MUTEX_INITIALIZER;

static void send_one(void) {
    int fd = atomic_load(&g_fd);
    if (fd < 0) return;
    unsigned char buf[13];
    uint32_t pid = htonl(g_pid);
    uint32_t seq = htonl(atomic_fetch_add(&g_seq, 1) + 1);
    memcpy(buf, "stwh", 4);
    memcpy(buf + 4, &pid, 4);
    memcpy(buf + 8, &seq, 4);
    buf[12] = (unsigned char)atomic_load(&g_phase);
    pthread_mutex_lock(&g_send_lock);
    (void)sendto(fd, buf, sizeof buf, MSG_DONTWAIT, (struct sockaddr *)&g_to, sizeof g_to);
    pthread_mutex_unlock(&g_send_lock);  /* a failed send (no route) is skipped */
}

static void *loop(void *arg) {
    (void)arg;
    struct timespec ts = {g_period_ms / 1000, (g_period_ms % 1000) * 1000000L};
    for (;;) {
        send_one();
        nanosleep(&ts, NULL);
    }
    return NULL;
}

static PyObject *start(PyObject *self, PyObject *args) {
    int fd, port;
    const char *ip;
    unsigned int pid;
    long period_ms;
    if (!PyArg_ParseTuple(args, "isiIl", &fd, &ip, &port, &pid, &period_ms)) return NULL;
    if (atomic_load(&g_fd) >= 0) {
        PyErr_SetString(PyExc_RuntimeError, "the native heartbeat is already running");
        return NULL;
    }
    memset(&g_to, 0, sizeof g_to);
    g_to.sin_family = AF_INET;
    g_to.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, ip, &g_to.sin_addr) != 1) {
        PyErr_Format(PyExc_ValueError, "not an IPv4 address: %s", ip);
        return NULL;
    }
    g_pid = pid;
    g_period_ms = period_ms > 0 ? period_ms : 500;
    atomic_store(&g_fd, fd);
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &attr, loop, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        atomic_store(&g_fd, -1);
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *set_phase(PyObject *self, PyObject *args) {
    unsigned int p;
    if (!PyArg_ParseTuple(args, "I", &p)) return NULL;
    atomic_store(&g_phase, p);
    Py_RETURN_NONE;
}

static PyObject *send_now(PyObject *self, PyObject *noargs) {
    send_one();
    Py_RETURN_NONE;
}

/* ---- peer beats: one byte every period on each registered TCP socket ------------------------
 * The elastic membership's liveness connections (elastic/peerbeat.py): every member holds a
 * connection to every other; the accepting side writes a byte per period, the connecting side
 * reads it as that member's beat. A socket is removed (fan_remove) before the caller closes it,
 * under the same lock as the sends, so a reused descriptor is never written. Cost: one
 * 1-byte non-blocking send per socket per period; a full send buffer (a peer not reading)
 * skips the beat. */
static pthread_mutex_t g_fan_lock = PTHREAD_MUTEX_INITIALIZER;
static int *g_fan = NULL;
static size_t g_fan_n = 0, g_fan_cap = 0;
static atomic_long g_fan_period_ms = 0;
static int g_fan_started = 0;

static void *fan_loop(void *arg) {
    (void)arg;
    const char one = 1;
    for (;;) {
        pthread_mutex_lock(&g_fan_lock);
        for (size_t i = 0; i < g_fan_n; i++)
            (void)send(g_fan[i], &one, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
        pthread_mutex_unlock(&g_fan_lock);
        long ms = atomic_load(&g_fan_period_ms);
        struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

static PyObject *fan_add(PyObject *self, PyObject *args) {
    int fd;
    long period_ms;
    if (!PyArg_ParseTuple(args, "il", &fd, &period_ms)) return NULL;
    if (period_ms < 1) period_ms = 1;
    pthread_mutex_lock(&g_fan_lock);
    long cur = atomic_load(&g_fan_period_ms);
    if (cur == 0 || period_ms < cur) atomic_store(&g_fan_period_ms, period_ms);
    if (g_fan_n == g_fan_cap) {
        size_t cap = g_fan_cap ? 2 * g_fan_cap : 16;
        int *p = realloc(g_fan, cap * sizeof *p);
        if (p == NULL) {
            pthread_mutex_unlock(&g_fan_lock);
            return PyErr_NoMemory();
        }
        g_fan = p;
        g_fan_cap = cap;
    }
    g_fan[g_fan_n++] = fd;
    int rc = 0;
    if (!g_fan_started) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        rc = pthread_create(&t, &attr, fan_loop, NULL);
        pthread_attr_destroy(&attr);
        if (rc == 0) g_fan_started = 1; else g_fan_n--;
    }
    pthread_mutex_unlock(&g_fan_lock);
    if (rc != 0) {
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *fan_remove(PyObject *self, PyObject *args) {
    int fd;
    if (!PyArg_ParseTuple(args, "i", &fd)) return NULL;
    pthread_mutex_lock(&g_fan_lock);
    for (size_t i = 0; i < g_fan_n; i++) {
        if (g_fan[i] == fd) {
            g_fan[i] = g_fan[--g_fan_n];
            break;
        }
    }
    pthread_mutex_unlock(&g_fan_lock);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"fan_add", fan_add, METH_VARARGS,
     "fan_add(fd, period_ms): beat a byte on the TCP socket fd every period (the shortest asked)"},
    {"fan_remove", fan_remove, METH_VARARGS, "fan_remove(fd): stop beating on fd (before closing it)"},
    {"start", start, METH_VARARGS, "start(fd, ip, port, pid, period_ms): the beat thread"},
    {"set_phase", set_phase, METH_VARARGS, "set_phase(p): the phase the next beats carry"},
    {"send_now", send_now, METH_NOARGS, "send_now(): one beat at once"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_beat", NULL, -1, methods};

PyMODINIT_FUNC PyInit__beat(void) { return PyModule_Create(&module); }
