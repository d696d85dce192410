/* Quick misses: the reader takes a gated decode layer's misses off the routing board itself.
 *
 * With the device gate and the routing board (strata_mlx.stream.gate), a gated layer's
 * routing ids land in mapped host memory as the device computes them, and the layer's experts
 * wait on the device until the gate table shows their records landed. The layer's check, in
 * Python on a thread of its own, reads the board, finds the misses and submits their reads;
 * on an H100 it waited ~105 us a layer for the GIL once the ids were in, and took ~60 us more
 * to its reads, while the device stood at the gate. Here a native thread watches the boards
 * of the layers posted to it (`quick_watch`), in order, and for each of a layer's ids whose
 * gate-table word reads -1 (not landed) and whose record no read is for (`flight`), takes a
 * slot from a reserve the scheduler set aside (victims it evicted under its own rules) and
 * queues an urgent read into it, the expert's gate-table word its ready word: the device then
 * waits for the read alone. The scheduler makes those reads its own from `quick_claims`
 * ((layer position, expert, slot, tag)) before it looks at residency or completions, as if
 * it had submitted them; each layer's check waits for the watch of its layer to be done
 * (`quick_wait`) before it claims, so the two never both read a record.
 *
 * `flight`, a byte per gate-table word (the reader's memory; `quick_arm` returns a view of it):
 * set under the reader's mutex as a request whose ready word is that word is queued, here or
 * by `submit` (which skips a request whose byte is set, returning its tag), and cleared by the
 * scheduler once the read is finished in its books.
 *
 * The watcher never calls the Python API and never waits for the GIL; it takes the reader's
 * mutex only to queue, never while it polls a board. */
#include "reader.h"

#include <errno.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

/* A board polled this long without pause before the watcher sleeps between looks. */
#define QUICK_SPIN_NS 50000ULL

static int abandoned(Quick *q, unsigned long long gen) {
    return __atomic_load_n(&q->stop, __ATOMIC_ACQUIRE) ||
           __atomic_load_n(&q->gen, __ATOMIC_ACQUIRE) != gen;
}

/* Until `w`'s board row holds its number (1), or its watch is dropped or the watcher stops
 * (0). `waited`: the number was not there at the first look. */
static int wait_board(Quick *q, const Watch *w, unsigned long long gen, int *waited) {
    uint64_t start = 0;
    struct timespec pause = {0, 2000};
    *waited = 0;
    while (__atomic_load_n(&w->board[0], __ATOMIC_ACQUIRE) != w->seq) {
        if (abandoned(q, gen)) return 0;
        if (!*waited) {
            *waited = 1;
            start = now_ns();
        } else if (now_ns() - start > QUICK_SPIN_NS) {
            nanosleep(&pause, NULL);
        }
    }
    return 1;
}

/* Reads of a group of `w`'s board ids, `n` from `from` (the first is 1), for layer position
 * `pos`, queued into the reserve's slots (mu held): urgent (the layer's own misses: every slot
 * the reserve has) or read-ahead (a lookahead router's predictions for a later layer: only
 * while more than `ahead_floor` slots are left). Their number. */
static Py_ssize_t claim_ids(ReaderObject *r, const Watch *w, int from, int n, int pos,
                            int urgent) {
    Quick *q = &r->quick;
    Request reqs[QUICK_MAX_IDS];
    Py_ssize_t m = 0, floor = urgent ? 0 : q->ahead_floor;
    uint64_t submitted = urgent ? now_ns() : 0;
    for (int j = from; j < from + n; j++) {
        int32_t e = __atomic_load_n(&w->board[j], __ATOMIC_RELAXED);
        if (e < 0 || e >= q->nexp) continue;
        Py_ssize_t at = (Py_ssize_t)pos * q->nexp + e;
        if (__atomic_load_n(&q->table[at], __ATOMIC_ACQUIRE) != READY_PENDING) continue;
        if (q->flight[at]) { /* being read: where that is read-ahead still queued, its layer's
                              * gate waits for it now */
            if (urgent) q->promoted += promote_word(r, &q->table[at]);
            continue;
        }
        if (q->nfree <= floor) {
            q->dry += urgent;
            if (urgent) continue;
            break;
        }
        q->nfree--;
        q->flight[at] = 1;
        long long tag = --q->tag;
        reqs[m++] = (Request){.tag = tag,
                              .file = q->file,
                              .offset = q->offsets[at],
                              .length = q->length,
                              .dest = q->dests[q->nfree],
                              .expected = q->sums ? q->sums[at] : 0,
                              .verify = q->sums != NULL,
                              .group = NULL,
                              .lead = 0,
                              .ready = &q->table[at],
                              .ready_value = (int32_t)q->slots[q->nfree],
                              .submitted = submitted};
        q->log[q->nlog++] = (Claim){pos, e, q->slots[q->nfree], tag, urgent};
    }
    if (m && queue_locked(r, reqs, m, urgent, 0, NULL, NULL) < 0) {
        /* no memory to queue them: their slots back in the reserve (taken from its top, where
         * they still sit), their records left to the scheduler */
        q->nfree += m;
        q->nlog -= m;
        for (Py_ssize_t i = 0; i < m; i++) {
            const Claim *c = &q->log[q->nlog + i];
            q->flight[(Py_ssize_t)c->pos * q->nexp + c->expert] = 0;
        }
        return 0;
    }
    if (urgent) q->reads += (unsigned long long)m;
    else q->ahead_reads += (unsigned long long)m;
    return m;
}

/* `w`'s misses, then (with `ahead`) its predictions' reads: how many were queued (or
 * promoted: one more where any was) (mu held). */
static Py_ssize_t claim_layer(ReaderObject *r, const Watch *w) {
    unsigned long long promoted = r->quick.promoted;
    Py_ssize_t n = claim_ids(r, w, 1, w->k, w->pos, 1) + (r->quick.promoted > promoted);
    for (int t = 0, from = 1 + w->k; t < w->nahead; from += w->ahead_n[t++])
        n += claim_ids(r, w, from, w->ahead_n[t], w->ahead_pos[t], 0);
    return n;
}

static void *quick_main(void *p) {
    ReaderObject *r = p;
    Quick *q = &r->quick;
#ifdef __APPLE__
    pthread_setname_np("strata-quick");
#elif defined(__linux__)
    pthread_setname_np(pthread_self(), "strata-quick");
    prctl(PR_SET_TIMERSLACK, 1000UL); /* its 2 us pauses, not the default 50 us of slack */
#endif
    pthread_mutex_lock(&r->mu);
    while (!q->stop) {
        if (q->whead == q->wlen) {
            pthread_cond_wait(&q->cv, &r->mu);
            continue;
        }
        Watch w = q->watch[q->whead];
        unsigned long long gen = q->gen;
        pthread_mutex_unlock(&r->mu);
        int waited, seen = wait_board(q, &w, gen, &waited);
        pthread_mutex_lock(&r->mu);
        if (!seen || q->gen != gen) continue; /* dropped (drop emptied the watches) */
        q->whead++;
        q->boards++;
        q->late_boards += waited;
        Py_ssize_t n = claim_layer(r, &w), owed = take_owed(r);
        __atomic_store_n(&q->watched, q->watched + 1, __ATOMIC_RELEASE);
        if (n) {
            pthread_mutex_unlock(&r->mu);
            wake_spread(r, owed);
            pthread_mutex_lock(&r->mu);
        }
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

/* The watcher stopped and joined (the GIL held or not: it never takes it). */
void quick_stop(ReaderObject *r) {
    Quick *q = &r->quick;
    if (!q->running) return;
    pthread_mutex_lock(&r->mu);
    __atomic_store_n(&q->stop, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&r->mu);
    pthread_join(q->thread, NULL);
    q->running = 0;
}

void quick_free(ReaderObject *r) {
    Quick *q = &r->quick;
    free(q->offsets);
    free(q->sums);
    free(q->slots);
    free(q->dests);
    free(q->watch);
    free(q->log);
    free(q->flight);
    if (q->armed) pthread_cond_destroy(&q->cv);
    memset(q, 0, sizeof *q);
}

/* 0 where armed (-1 and an exception where not): a closed reader's watcher has stopped, and
 * its calls that only look or give back answer as for nothing left (`closing`). */
static int quick_ready(ReaderObject *r) {
    if (!r->quick.armed) {
        PyErr_SetString(PyExc_RuntimeError, "quick misses are not armed (quick_arm)");
        return -1;
    }
    return 0;
}

/* A contiguous buffer of `count` items of `size` bytes, copied into malloc'd memory. */
static void *copy_buffer(PyObject *obj, Py_ssize_t count, Py_ssize_t size, const char *name) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    void *out = NULL;
    if (view.len != count * size)
        PyErr_Format(PyExc_ValueError, "quick_arm: %s holds %zd bytes, not %zd", name, view.len,
                     count * size);
    else if (!(out = malloc((size_t)view.len ? (size_t)view.len : 1)))
        PyErr_NoMemory();
    else
        memcpy(out, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return out;
}

PyObject *Reader_quick_arm(ReaderObject *r, PyObject *args) {
    unsigned long long table;
    int npos, nexp, file;
    Py_ssize_t length;
    PyObject *offsets_obj, *sums_obj;
    Py_ssize_t ahead_floor = -1;
    if (!PyArg_ParseTuple(args, "KiiinOO|n:quick_arm", &table, &npos, &nexp, &file, &length,
                          &offsets_obj, &sums_obj, &ahead_floor))
        return NULL;
    if (check_open(r) < 0) return NULL;
    Quick *q = &r->quick;
    if (q->armed) {
        PyErr_SetString(PyExc_RuntimeError, "quick_arm: already armed");
        return NULL;
    }
    const char *bad = NULL;
    if (!table || table % sizeof(int32_t)) bad = "a NULL or unaligned table";
    else if (npos < 1 || nexp < 1) bad = "npos and nexp must be >= 1";
    else if (file < 0 || file >= r->nfiles) bad = "file is not an open file";
    else if (length < 1) bad = "length must be >= 1";
    else if (sums_obj != Py_None && !r->checksum[file])
        bad = "checksums given for a file opened without a checksum";
    else if (r->direct[file] && length % ALIGNMENT)
        bad = "length is not a multiple of the direct file's alignment";
    if (bad) {
        PyErr_Format(PyExc_ValueError, "quick_arm: %s", bad);
        return NULL;
    }
    Py_ssize_t count = (Py_ssize_t)npos * nexp;
    long long *offsets = copy_buffer(offsets_obj, count, sizeof(long long), "offsets");
    if (!offsets) return NULL;
    uint32_t *sums = NULL;
    if (sums_obj != Py_None && !(sums = copy_buffer(sums_obj, count, sizeof(uint32_t), "sums"))) {
        free(offsets);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++)
        if (offsets[i] < 0 || (r->direct[file] && offsets[i] % ALIGNMENT)) {
            PyErr_Format(PyExc_ValueError, "quick_arm: offset %zd (%lld) is negative or not "
                         "aligned for direct I/O", i, offsets[i]);
            free(offsets);
            free(sums);
            return NULL;
        }
    /* (the reader's own: its watcher reads it until it is stopped, whatever Python frees) */
    uint8_t *flight = calloc((size_t)count, 1);
    if (!flight) {
        free(offsets);
        free(sums);
        return PyErr_NoMemory();
    }
    pthread_mutex_lock(&r->mu);
    *q = (Quick){.armed = 1,
                 .table = (int32_t *)(uintptr_t)table,
                 .flight = flight,
                 .npos = npos,
                 .nexp = nexp,
                 .file = file,
                 .length = length,
                 .offsets = offsets,
                 .sums = sums,
                 .ahead_floor = ahead_floor < 0 ? PY_SSIZE_T_MAX : ahead_floor};
    pthread_cond_init(&q->cv, NULL);
    pthread_mutex_unlock(&r->mu);
    int rc = pthread_create(&q->thread, NULL, quick_main, r);
    if (rc) {
        quick_free(r);
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    q->running = 1;
    return PyMemoryView_FromMemory((char *)flight, count, PyBUF_WRITE);
}

/* Grow the reserve's arrays to hold `extra` more slots, and the log as many claims (mu). */
static int grow_reserve(Quick *q, Py_ssize_t extra) {
    Py_ssize_t want = q->nfree + extra;
    if (want > q->capfree) {
        long long *s = realloc(q->slots, sizeof(long long) * (size_t)want);
        if (!s) return -1;
        q->slots = s;
        char **d = realloc(q->dests, sizeof(char *) * (size_t)want);
        if (!d) return -1;
        q->dests = d;
        q->capfree = want;
    }
    if (q->nlog + want > q->caplog) {
        Claim *c = realloc(q->log, sizeof(Claim) * (size_t)(q->nlog + want));
        if (!c) return -1;
        q->log = c;
        q->caplog = q->nlog + want;
    }
    return 0;
}

PyObject *Reader_quick_give(ReaderObject *r, PyObject *arg) {
    if (quick_ready(r) < 0 || check_open(r) < 0) return NULL;
    PyObject *seq = PySequence_Fast(arg, "quick_give takes a sequence of (slot, address)");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    long long *slots = PyMem_RawMalloc(sizeof(long long) * (size_t)(n + 1));
    unsigned long long *at = PyMem_RawMalloc(sizeof(unsigned long long) * (size_t)(n + 1));
    PyObject *out = NULL;
    if (!slots || !at) {
        PyErr_NoMemory();
        goto done;
    }
    int direct = r->direct[r->quick.file];
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "LK", &slots[i], &at[i])) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "quick_give: item %zd is not (slot, address)", i);
            goto done;
        }
        if (slots[i] < 0 || slots[i] > INT32_MAX || !at[i] || (direct && at[i] % ALIGNMENT)) {
            PyErr_Format(PyExc_ValueError, "quick_give: item %zd: a negative slot, or a NULL "
                         "address (or one unaligned for direct I/O)", i);
            goto done;
        }
    }
    Quick *q = &r->quick;
    pthread_mutex_lock(&r->mu);
    if (grow_reserve(q, n) < 0) {
        pthread_mutex_unlock(&r->mu);
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        q->slots[q->nfree] = slots[i];
        q->dests[q->nfree++] = (char *)(uintptr_t)at[i];
    }
    pthread_mutex_unlock(&r->mu);
    out = Py_None;
    Py_INCREF(out);
done:
    PyMem_RawFree(slots);
    PyMem_RawFree(at);
    Py_DECREF(seq);
    return out;
}

PyObject *Reader_quick_take(ReaderObject *r, PyObject *unused) {
    if (quick_ready(r) < 0) return NULL;
    Quick *q = &r->quick;
    pthread_mutex_lock(&r->mu);
    Py_ssize_t n = q->nfree;
    long long *slots = PyMem_RawMalloc(sizeof(long long) * (size_t)(n + 1));
    if (slots) {
        memcpy(slots, q->slots, sizeof(long long) * (size_t)n);
        q->nfree = 0;
    }
    pthread_mutex_unlock(&r->mu);
    if (!slots) return PyErr_NoMemory();
    PyObject *out = tag_list(slots, n);
    PyMem_RawFree(slots);
    return out;
}

PyObject *Reader_quick_free(ReaderObject *r, PyObject *unused) {
    if (quick_ready(r) < 0) return NULL;
    pthread_mutex_lock(&r->mu);
    Py_ssize_t n = r->quick.nfree;
    pthread_mutex_unlock(&r->mu);
    return PyLong_FromSsize_t(n);
}

PyObject *Reader_quick_watch(ReaderObject *r, PyObject *args) {
    unsigned long long board;
    int seq, k, pos;
    PyObject *ahead = NULL;
    if (!PyArg_ParseTuple(args, "Kiii|O:quick_watch", &board, &seq, &k, &pos, &ahead))
        return NULL;
    if (quick_ready(r) < 0 || check_open(r) < 0) return NULL;
    Quick *q = &r->quick;
    if (!board || board % sizeof(int32_t) || k < 1 || k > QUICK_MAX_IDS || pos < 0 ||
        pos >= q->npos) {
        PyErr_Format(PyExc_ValueError, "quick_watch: a NULL or unaligned board, k outside "
                     "1..%d or a position outside the table", QUICK_MAX_IDS);
        return NULL;
    }
    Watch watch = {(int32_t *)(uintptr_t)board, seq, k, pos, 0, {0}, {0}};
    PyObject *seq_ahead = NULL;
    if (ahead && ahead != Py_None) {
        seq_ahead = PySequence_Fast(ahead, "quick_watch: ahead is a sequence of (pos, n)");
        if (!seq_ahead) return NULL;
        Py_ssize_t na = PySequence_Fast_GET_SIZE(seq_ahead);
        int total = k;
        for (Py_ssize_t t = 0; t < na; t++) {
            PyObject *item = PySequence_Fast_GET_ITEM(seq_ahead, t);
            int tp, tn;
            if (t >= QUICK_MAX_AHEAD || !PyTuple_Check(item) ||
                !PyArg_ParseTuple(item, "ii", &tp, &tn) || tp < 0 || tp >= q->npos || tn < 1 ||
                (total += tn) > QUICK_MAX_IDS) {
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError, "quick_watch: ahead holds up to %d (position, "
                             "ids) pairs of positions in the table, %d ids in all",
                             QUICK_MAX_AHEAD, QUICK_MAX_IDS);
                Py_DECREF(seq_ahead);
                return NULL;
            }
            watch.ahead_pos[t] = tp;
            watch.ahead_n[t] = tn;
            watch.nahead++;
        }
        Py_DECREF(seq_ahead);
    }
    pthread_mutex_lock(&r->mu);
    if (q->wlen == q->wcap) {
        if (q->whead > 0) { /* (the watched ones at the front make room) */
            memmove(q->watch, q->watch + q->whead, sizeof(Watch) * (size_t)(q->wlen - q->whead));
            q->wlen -= q->whead;
            q->whead = 0;
        } else {
            Py_ssize_t cap = q->wcap ? 2 * q->wcap : 64;
            Watch *w = realloc(q->watch, sizeof(Watch) * (size_t)cap);
            if (!w) {
                pthread_mutex_unlock(&r->mu);
                return PyErr_NoMemory();
            }
            q->watch = w;
            q->wcap = cap;
        }
    }
    q->watch[q->wlen++] = watch;
    long long posted = ++q->posted;
    pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&r->mu);
    return PyLong_FromLongLong(posted);
}

PyObject *Reader_quick_wait(ReaderObject *r, PyObject *args) {
    long long n;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "Ld:quick_wait", &n, &timeout_s)) return NULL;
    if (quick_ready(r) < 0) return NULL;
    if (!(timeout_s >= 0)) {
        PyErr_SetString(PyExc_ValueError, "quick_wait: a negative timeout");
        return NULL;
    }
    if (timeout_s > 1e6) timeout_s = 1e6; /* (in ns, as uint64_t) */
    Quick *q = &r->quick;
    if (r->closing) Py_RETURN_TRUE; /* (its watcher stopped: nothing more is queued) */
    if (__atomic_load_n(&q->watched, __ATOMIC_ACQUIRE) >= n) Py_RETURN_TRUE; /* (GIL kept) */
    int done;
    Py_BEGIN_ALLOW_THREADS
    uint64_t start = now_ns(), end = start + (uint64_t)(timeout_s * 1e9), now = start;
    struct timespec pause = {0, 2000};
    while (!(done = __atomic_load_n(&q->watched, __ATOMIC_ACQUIRE) >= n) && now < end) {
        if (now - start > QUICK_SPIN_NS) nanosleep(&pause, NULL);
        now = now_ns();
    }
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(done);
}

PyObject *Reader_quick_claims(ReaderObject *r, PyObject *unused) {
    if (quick_ready(r) < 0) return NULL;
    Quick *q = &r->quick;
    if (!__atomic_load_n(&q->nlog, __ATOMIC_RELAXED)) return PyList_New(0); /* (a hint) */
    pthread_mutex_lock(&r->mu);
    Py_ssize_t n = q->nlog;
    Claim *c = PyMem_RawMalloc(sizeof(Claim) * (size_t)(n + 1));
    if (c) {
        memcpy(c, q->log, sizeof(Claim) * (size_t)n);
        q->nlog = 0;
    }
    pthread_mutex_unlock(&r->mu);
    if (!c) return PyErr_NoMemory();
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *t = Py_BuildValue("(iiLLO)", c[i].pos, c[i].expert, c[i].slot, c[i].tag,
                                    c[i].urgent ? Py_True : Py_False);
        if (!t) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, t);
    }
    PyMem_RawFree(c);
    return out;
}

PyObject *Reader_quick_drop(ReaderObject *r, PyObject *unused) {
    if (quick_ready(r) < 0) return NULL;
    Quick *q = &r->quick;
    pthread_mutex_lock(&r->mu);
    __atomic_add_fetch(&q->gen, 1, __ATOMIC_RELEASE);
    q->whead = q->wlen = 0;
    __atomic_store_n(&q->watched, q->posted, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&r->mu);
    Py_RETURN_NONE;
}

/* Its counters into the reader's stats dict `d`: 0, or -1 with an exception. */
int quick_stats(ReaderObject *r, PyObject *d) {
    Quick *q = &r->quick;
    pthread_mutex_lock(&r->mu);
    struct {
        const char *name;
        unsigned long long v;
    } items[] = {{"quick_reads", q->reads},
                 {"quick_dry", q->dry},
                 {"quick_boards", q->boards},
                 {"quick_late_boards", q->late_boards},
                 {"quick_ahead_reads", q->ahead_reads},
                 {"quick_promoted", q->promoted}};
    pthread_mutex_unlock(&r->mu);
    for (size_t i = 0; i < sizeof items / sizeof *items; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(items[i].v);
        if (!v || PyDict_SetItemString(d, items[i].name, v) < 0) {
            Py_XDECREF(v);
            return -1;
        }
        Py_DECREF(v);
    }
    return 0;
}

void quick_reset_stats(ReaderObject *r) { /* (mu held) */
    Quick *q = &r->quick;
    q->reads = q->dry = q->boards = q->late_boards = q->ahead_reads = q->promoted = 0;
}
