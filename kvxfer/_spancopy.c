/* kvxfer._spancopy: copy a list of memory spans on the calling thread and native helper threads.
 *
 * Why: one thread copies at one core's speed (3.3-5.3 GB/s on the 2-core test machine); two
 * copy about twice as fast. Python threads cannot help the engine's own copy: each would need
 * the engine's GIL, which a busy engine thread holds. These helpers are plain pthreads that
 * never touch Python, so they help whether the GIL is kept or released.
 *
 * How: the caller cuts its spans into parts of at most CHUNK bytes, publishes them, wakes the
 * helpers and copies parts itself, one at a time, until none is left to take; then it waits only
 * for the parts a helper is copying at that moment (a memcpy of at most CHUNK bytes). A helper
 * that does not get a core in time finds nothing left, and the copy costs what it costs on one
 * thread. One copy at a time uses the helpers; a second caller meanwhile copies alone.
 *
 * A part is claimed with one fetch-add on a 64-bit ticket that holds the job's generation in its
 * high half, taken by compare-and-swap only while the generation is the taker's: a helper that wakes
 * late, after its job ended and the next began, can never take (or count) a part of a job whose
 * bounds it did not read. (The generation is 32 bits: a helper stalled between reading a job and
 * claiming its part for exactly 2^32 later jobs could match again. Accepted: days of copies.)
 *
 * Threads: helpers kvxfer-copy-<i> start on the first copy large enough to split (or with
 * `configure`); a forked child starts its own (pthread_atfork). Memory written by a helper is visible
 * to the caller when `copy` returns (release on each part's count, acquire on the caller's wait).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define CHUNK ((size_t)64 * 1024)  /* bytes per part: small enough to balance 2 MiB over two threads */
#define MAX_HELPERS 16
#define SPINS_BEFORE_YIELD 256

typedef struct {
    char *dst;
    const char *src;
    size_t len;
} part_t;

/* The one job the helpers may work on. `header` = generation << 32 | parts; `ticket` =
 * generation << 32 | next part. Both are set (header first) by the caller holding `slot`. */
static pthread_mutex_t slot = PTHREAD_MUTEX_INITIALIZER;
static const part_t *_Atomic job_parts;
static _Atomic uint64_t header;
static _Atomic uint64_t ticket;
static _Atomic uint64_t done;  /* generation << 32 | parts of that job copied */
static _Atomic uint32_t wake;  /* futex word the idle helpers wait on */

static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;
static int helpers_wanted = -1;  /* -1: not set (start picks from the CPU count) */
static _Atomic int helpers_running;
static _Atomic int helpers_tried;  /* start_helpers ran (in this process: reset in a forked child) */
static _Atomic int helpers_on = 1;  /* 0: configure(helpers=0); the running ones idle (a pthread is not taken back) */
static _Atomic int helpers_active = INT_MAX;  /* helpers with a lower index take parts; configure sets it */
static _Atomic Py_ssize_t min_split = 512 * 1024;  /* copies below this many bytes are not split */

static _Atomic uint64_t total_jobs;  /* copies split */
static _Atomic uint64_t helper_parts;

/* Take the next part of job `gen` (a compare-and-swap that leaves another generation's ticket
 * alone: a fetch-add by a helper still on an ended job would take a part of the next one). */
static int claim(uint32_t gen, uint32_t nparts, uint32_t *idx) {
    uint64_t t = atomic_load(&ticket);
    for (;;) {
        if ((uint32_t)(t >> 32) != gen || (uint32_t)t >= nparts)
            return 0;
        if (atomic_compare_exchange_weak(&ticket, &t, t + 1)) {
            *idx = (uint32_t)t;
            return 1;
        }
    }
}

/* Count a part of job `gen` copied (its release makes the bytes visible to the caller's acquire). */
static void count_done(uint32_t gen) {
    uint64_t d = atomic_load(&done);
    while ((uint32_t)(d >> 32) == gen && !atomic_compare_exchange_weak_explicit(&done, &d, d + 1, memory_order_release,
                                                                               memory_order_relaxed))
        ;
}

static void copy_parts(uint32_t gen, uint32_t nparts, const part_t *parts, int helper) {
    uint32_t i;
    while (claim(gen, nparts, &i)) {
        memcpy(parts[i].dst, parts[i].src, parts[i].len);
        if (helper)
            atomic_fetch_add_explicit(&helper_parts, 1, memory_order_relaxed);
        count_done(gen);
    }
}

static void *helper_main(void *arg) {
    int me = (int)(intptr_t)arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);  /* signals are the Python threads' to take */
    uint32_t seen = atomic_load(&wake);
    for (;;) {
        while (atomic_load(&wake) == seen)
            syscall(SYS_futex, &wake, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
        seen = atomic_load(&wake);
        if (me >= atomic_load(&helpers_active))
            continue;
        uint64_t h = atomic_load(&header);
        const part_t *parts = atomic_load(&job_parts);
        /* job_parts is stored before header: a header read after it names these parts or a later job,
         * whose generation the tickets then fail to match until its own parts are published */
        if (atomic_load(&header) != h || parts == NULL)
            continue;
        copy_parts((uint32_t)(h >> 32), (uint32_t)h, parts, 1);
    }
    return NULL;
}

/* The helpers to start: as configured, else the CPUs the calling thread may run on, less one, at
 * most 3 (memory bandwidth is spent by about four threads). A helper inherits the caller's CPU mask:
 * a thread pinned to one CPU (an engine's OpenMP binding) gets none, it would only take turns. */
static int wanted_helpers(void) {
    if (helpers_wanted >= 0)
        return helpers_wanted;
    cpu_set_t set;
    long cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : sysconf(_SC_NPROCESSORS_ONLN);
    long n = cpus - 1;
    return (int)(n < 0 ? 0 : n > 3 ? 3 : n);
}

/* Start the helpers still missing; the number started (0 on failure, with errno). */
static int start_helpers(void) {
    pthread_mutex_lock(&start_lock);
    int want = wanted_helpers();
    while (helpers_running < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 64 * 1024);
        int err = pthread_create(&t, &attr, helper_main, (void *)(intptr_t)helpers_running);
        pthread_attr_destroy(&attr);
        if (err != 0)
            break;
        char name[16];
        snprintf(name, sizeof name, "kvxfer-copy-%d", helpers_running);
        pthread_setname_np(t, name);
        helpers_running++;
    }
    int n = helpers_running;
    helpers_tried = 1;
    pthread_mutex_unlock(&start_lock);
    return n;
}

static void after_fork_child(void) {
    /* the helpers are not in the child; any lock a parent thread held is the child's now */
    pthread_mutex_init(&slot, NULL);
    pthread_mutex_init(&start_lock, NULL);
    helpers_running = 0;
    helpers_tried = 0;
    atomic_store(&job_parts, NULL);
    atomic_store(&header, 0);
    atomic_store(&ticket, 0);
}

/* Copy every part: split with the helpers when they exist and the slot is free, else alone. */
static void copy_all(const part_t *parts, uint32_t nparts, size_t nbytes, int *split) {
    *split = 0;
    if (nparts > 1 && (Py_ssize_t)nbytes >= min_split && helpers_running > 0 && helpers_on && pthread_mutex_trylock(&slot) == 0) {
        uint32_t gen = (uint32_t)(atomic_load(&header) >> 32) + 1;
        atomic_store(&done, (uint64_t)gen << 32);
        atomic_store(&job_parts, parts);
        atomic_store(&header, (uint64_t)gen << 32 | nparts);
        atomic_store(&ticket, (uint64_t)gen << 32);
        atomic_fetch_add(&wake, 1);
        syscall(SYS_futex, &wake, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
        copy_parts(gen, nparts, parts, 0);
        uint64_t all = (uint64_t)gen << 32 | nparts;
        for (unsigned spins = 0; atomic_load_explicit(&done, memory_order_acquire) != all; spins++) {
            if (spins >= SPINS_BEFORE_YIELD)
                sched_yield();  /* a helper mid-part lost its core: let it have this one */
        }
        /* no helper can take a part now (every ticket is past nparts); the next job's generation
         * keeps a late helper off that job's parts until it reads them */
        atomic_store(&job_parts, NULL);
        total_jobs++;
        pthread_mutex_unlock(&slot);
        *split = 1;
        return;
    }
    for (uint32_t i = 0; i < nparts; i++)
        memcpy(parts[i].dst, parts[i].src, parts[i].len);
}

static int as_address(PyObject *o, uintptr_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (uintptr_t)v;
    return 0;
}

PyDoc_STRVAR(copy_doc,
"copy(dst, src, size, release_gil=False) -> bool\n\n"
"memcpy(dst[i], src[i], size[i]) for every i (lists of ints: addresses in this process and byte\n"
"counts), on this thread and the helper threads. The caller checked every address. With\n"
"release_gil the GIL is released during the copy; otherwise it is kept throughout (a busy Python\n"
"thread cannot take it mid-copy). True when the copy was offered to the helpers (cut in parts\n"
"with helpers running and free); False when this thread copied it alone.");

static PyObject *spancopy_copy(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"dst", "src", "size", "release_gil", NULL};
    PyObject *dst, *src, *size;
    int release_gil = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|p", kwlist, &dst, &src, &size, &release_gil))
        return NULL;
    if (!PyList_Check(dst) || !PyList_Check(src) || !PyList_Check(size)) {
        PyErr_SetString(PyExc_TypeError, "copy: dst, src and size must be lists of ints");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(dst);
    if (PyList_GET_SIZE(src) != n || PyList_GET_SIZE(size) != n) {
        PyErr_Format(PyExc_ValueError, "copy: %zd destinations, %zd sources and %zd sizes differ in number", n,
                     PyList_GET_SIZE(src), PyList_GET_SIZE(size));
        return NULL;
    }
    /* first pass: sizes and the number of parts */
    size_t nparts = 0, nbytes = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uintptr_t len;
        if (as_address(PyList_GET_ITEM(size, i), &len) < 0)
            return NULL;
        if (len > (uintptr_t)PY_SSIZE_T_MAX || nbytes + len > (size_t)PY_SSIZE_T_MAX) {
            PyErr_Format(PyExc_ValueError, "copy: span %zd's size %zu (or the total) is not a size of memory", i,
                         (size_t)len);
            return NULL;
        }
        nparts += len / CHUNK + (len % CHUNK != 0);
        nbytes += len;
    }
    if (nparts > UINT32_MAX / 2) {
        PyErr_Format(PyExc_ValueError, "copy: %zu bytes in %zd spans is more than one call copies", nbytes, n);
        return NULL;
    }
    part_t local[64];
    part_t *parts = nparts <= 64 ? local : PyMem_RawMalloc(nparts * sizeof(part_t));
    if (parts == NULL)
        return PyErr_NoMemory();
    size_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uintptr_t d, s, len;
        if (as_address(PyList_GET_ITEM(dst, i), &d) < 0 || as_address(PyList_GET_ITEM(src, i), &s) < 0 ||
            as_address(PyList_GET_ITEM(size, i), &len) < 0) {
            if (parts != local)
                PyMem_RawFree(parts);
            return NULL;
        }
        for (size_t off = 0; off < len && k < nparts; off += CHUNK) {
            parts[k].dst = (char *)(d + off);
            parts[k].src = (const char *)(s + off);
            parts[k].len = len - off < CHUNK ? len - off : CHUNK;
            k++;
        }
    }
    if (!helpers_tried && helpers_on && nparts > 1 && (Py_ssize_t)nbytes >= min_split)
        start_helpers();
    int split;
    if (release_gil) {
        Py_BEGIN_ALLOW_THREADS
        copy_all(parts, (uint32_t)nparts, nbytes, &split);
        Py_END_ALLOW_THREADS
    } else {
        copy_all(parts, (uint32_t)nparts, nbytes, &split);
    }
    if (parts != local)
        PyMem_RawFree(parts);
    return PyBool_FromLong(split);
}

PyDoc_STRVAR(configure_doc,
"configure(helpers=-1, min_split=-1) -> None\n\n"
"helpers: helper threads to keep (0: every copy on its caller's thread alone; -1: leave as is;\n"
"the default is the CPUs the first caller may run on, less one, at most 3). Fewer than are\n"
"running stops none: the extra ones idle. min_split: copies of fewer bytes are never split (-1: leave as is).");

static PyObject *spancopy_configure(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"helpers", "min_split", NULL};
    int helpers = -1;
    Py_ssize_t split = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|in", kwlist, &helpers, &split))
        return NULL;
    if (helpers < -1 || helpers > MAX_HELPERS) {
        PyErr_Format(PyExc_ValueError, "configure: helpers must be 0 to %d (or -1), got %d", MAX_HELPERS, helpers);
        return NULL;
    }
    if (split < -1) {
        PyErr_Format(PyExc_ValueError, "configure: min_split must be at least 0 (or -1), got %zd", split);
        return NULL;
    }
    pthread_mutex_lock(&start_lock);
    if (helpers >= 0) {
        helpers_wanted = helpers;
        atomic_store(&helpers_on, helpers > 0);
        atomic_store(&helpers_active, helpers);
    }
    pthread_mutex_unlock(&start_lock);
    if (split >= 0)
        min_split = split;
    if (helpers > 0 && start_helpers() < helpers) {
        PyErr_Format(PyExc_OSError, "configure: %d of %d helper threads started", (int)helpers_running, helpers);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *spancopy_stats(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("{s:i,s:n,s:K,s:K}", "helpers", helpers_running, "min_split", min_split, "split_copies",
                         (unsigned long long)total_jobs, "helper_parts",
                         (unsigned long long)atomic_load(&helper_parts));
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))spancopy_copy, METH_VARARGS | METH_KEYWORDS, copy_doc},
    {"configure", (PyCFunction)(void (*)(void))spancopy_configure, METH_VARARGS | METH_KEYWORDS, configure_doc},
    {"stats", spancopy_stats, METH_NOARGS, "Helper threads running, min_split, copies split, parts helpers took."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_spancopy", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__spancopy(void) {
    static int once;
    if (!once) {
        pthread_atfork(NULL, NULL, after_fork_child);
        once = 1;
    }
    return PyModule_Create(&module);
}
