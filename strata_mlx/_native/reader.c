/* strata_mlx._reader: a pool of native threads that pread expert records into caller memory.
 *
 * Python decides what to read and submits batches of (tag, file, offset, length, dest address
 * [, expected checksum]); worker pthreads take requests off two queues (urgent always before
 * read-ahead), pread them and, where a checksum is expected, verify the bytes (checksum.c),
 * without ever touching the GIL. Python collects (tag, error, bytes_read) completions through
 * wait(), which releases the GIL while it blocks, or poll(). An event loop can instead watch
 * notify_fd(): the read end of a pipe that gets a byte when a completion arrives after the
 * last ack() (one byte per ack, however many completions), so it wakes without polling; with
 * notify_below(n), when fewer than n requests are queued instead (a loop that keeps the queue
 * topped up wakes only when there is room, not at each of thousands of completions).
 *
 * Locking: one mutex guards everything below it in ReaderObject. Worker threads never call the
 * Python API. Python-side methods take the mutex while holding the GIL, but never wait for the
 * GIL while holding the mutex, so the two cannot deadlock. The file arrays are only changed
 * with both the GIL and the mutex held, so submit() may validate against them with the GIL only.
 *
 * Error codes in completions: 0, a positive errno from pread, SHORT_READ (-1) when the file
 * ended before `length` bytes (a truncated store; bytes_read says how far the read got), or
 * CHECKSUM_MISMATCH (-2) when every byte was read but their checksum is not the one expected.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* O_DIRECT */
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "checksum.h"
#include "devcopy.h"

#include "reader.h"

static Py_ssize_t q_size(const Queue *q);

/* Work for r->work's waiters, queued under mu before (this called with mu held or not):
 * polling workers see `posted` move; one sleeper is woken only where none polls (a polling
 * worker looks at the queues under mu once it stops, and it counts itself out of
 * `spinning` only under mu, so work queued before this call is seen), or all with `all`.
 * (A sleeper woken beside a poller, run first on a busy CPU, would take the read from it.) */
void wake_work(ReaderObject *r, int all) {
    __atomic_add_fetch(&r->posted, 1, __ATOMIC_SEQ_CST);
    if (all)
        pthread_cond_broadcast(&r->work);
    else if (__atomic_load_n(&r->spinning, __ATOMIC_SEQ_CST) == 0)
        pthread_cond_signal(&r->work);
}

Py_ssize_t take_owed(ReaderObject *r) {
    Py_ssize_t owed = r->wake_owed;
    r->wake_owed = 0;
    return owed;
}

void wake_spread(ReaderObject *r, Py_ssize_t owed) {
    if (owed <= 1) {
        wake_work(r, 0);
        return;
    }
    __atomic_add_fetch(&r->posted, 1, __ATOMIC_SEQ_CST);
    /* (a polling worker takes a part without a wake-up; at most nworkers read at once) */
    Py_ssize_t n = owed - __atomic_load_n(&r->spinning, __ATOMIC_SEQ_CST);
    if (n > r->nworkers) n = r->nworkers;
    for (Py_ssize_t i = 0; i < n; i++) pthread_cond_signal(&r->work);
    if (n > 0) __atomic_add_fetch(&r->spread_wakes, (unsigned long long)n, __ATOMIC_RELAXED);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* A completion arrived (mu held): wake an event loop watching notify_fd(), once per ack. */
static void notify(ReaderObject *r) {
    if (r->notify_w >= 0 && !r->notified) {
        r->notified = 1;
        ssize_t rc = write(r->notify_w, "c", 1); /* non-blocking; a full pipe is awake anyway */
        (void)rc;
    }
}

/* A completion arrived or a request was started (mu held): notify() where the queue is below
 * notify_below (an event loop that tops the queue up wakes only when it has room to fill),
 * or at every completion where notify_below < 0. */
static void announce(ReaderObject *r, int completion) {
    if (r->notify_below < 0 ? completion
                            : q_size(&r->urgent) + q_size(&r->ahead) < r->notify_below)
        notify(r);
}

uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* A worker with nothing to read (mu held, let go of meanwhile): polls `posted` for up to
 * r->spin_ns; whether it moved. */
static int poll_for_work(ReaderObject *r) {
    unsigned long long seen = __atomic_load_n(&r->posted, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&r->spinning, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&r->mu);
    uint64_t end = now_ns() + r->spin_ns;
    int woke;
    while (!(woke = __atomic_load_n(&r->posted, __ATOMIC_SEQ_CST) != seen) && now_ns() < end)
        cpu_relax();
    pthread_mutex_lock(&r->mu);
    __atomic_sub_fetch(&r->spinning, 1, __ATOMIC_SEQ_CST);
    return woke;
}

/* An emulated drive (stream/reader.py's limit_drive): every reader of the process shares one
 * drive of a set bandwidth. A read of n bytes occupies it for n / bandwidth from when the read
 * started or the drive came free, whichever is later, and its worker returns no sooner (the
 * real pread may land earlier: a tmpfs copy is faster than the drive it stands in for). Reads
 * queue on it first come, first served, so the bytes read a second never exceed the
 * bandwidth; a read's latency is its transfer and its queueing, with no seek time. */
static pthread_mutex_t drive_mu = PTHREAD_MUTEX_INITIALIZER;
static double drive_ns_per_byte = 0.0; /* 0: no limit (drive_mu) */
static uint64_t drive_free_ns = 0;     /* when the emulated drive is free (drive_mu) */

static void drive_hold(uint64_t start_ns, long long nbytes) {
    if (nbytes <= 0) return;
    pthread_mutex_lock(&drive_mu);
    double per_byte = drive_ns_per_byte;
    uint64_t end = 0;
    if (per_byte > 0) {
        uint64_t begin = drive_free_ns > start_ns ? drive_free_ns : start_ns;
        end = begin + (uint64_t)((double)nbytes * per_byte);
        drive_free_ns = end;
    }
    pthread_mutex_unlock(&drive_mu);
    for (uint64_t now = now_ns(); now < end; now = now_ns()) {
        struct timespec ts = {(time_t)((end - now) / 1000000000ULL),
                              (long)((end - now) % 1000000000ULL)};
        nanosleep(&ts, NULL);
    }
}

/* Wait on `cond` until `target` on the monotonic clock (the cond's clock on Linux). */
static void cond_wait_until(pthread_cond_t *cond, pthread_mutex_t *mu, uint64_t target) {
    struct timespec ts;
#ifdef __APPLE__ /* no pthread_condattr_setclock: convert to the realtime clock */
    uint64_t now = now_ns(), rel = target > now ? target - now : 0;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t abs_ns = (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec + rel;
#else
    uint64_t abs_ns = target;
#endif
    ts.tv_sec = (time_t)(abs_ns / 1000000000ULL);
    ts.tv_nsec = (long)(abs_ns % 1000000000ULL);
    pthread_cond_timedwait(cond, mu, &ts);
}

/* ---------------------------------------------------------------- huge pages */

#define HUGE_PAGE (2u << 20)

/* Ask Linux to back the whole huge pages inside [addr, addr + len) (2 MB blocks, 2 MB
 * aligned: only those can become huge) with transparent huge pages from their next fault on
 * (MADV_HUGEPAGE; "madvise" is the common default). `zeroed`: the range is private anonymous
 * memory holding only zeros, so those blocks are given back (MADV_DONTNEED: they read as
 * zeros again) and fault back in as huge pages; collapsing them in place (MADV_COLLAPSE)
 * took 3.6 s a GB on the dev machine. A direct read's DMA into 4 KB pages pins and maps each
 * one; into huge pages it ran 2x faster there (benchmarks/read_path.py). 1 if the kernel
 * took the advice, 0 if not (another OS, no 2 MB block inside the range): a hint. */
static int advise_huge(void *addr, size_t len, int zeroed) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    uintptr_t a = ((uintptr_t)addr + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    uintptr_t end = ((uintptr_t)addr + len) / HUGE_PAGE * HUGE_PAGE;
    if (end <= a) return 0;
    if (madvise((void *)a, end - a, MADV_HUGEPAGE) != 0) return 0;
    if (zeroed) madvise((void *)a, end - a, MADV_DONTNEED);
    return 1;
#else
    (void)addr;
    (void)len;
    (void)zeroed;
    return 0;
#endif
}

/* ---------------------------------------------------------------- queues */

static Py_ssize_t q_size(const Queue *q) { return q->len - q->head; }

static int q_reserve(Queue *q, Py_ssize_t extra) {
    if (q->len + extra > q->cap && q->head > 0) { /* slide live items to the front */
        memmove(q->items, q->items + q->head, (size_t)q_size(q) * sizeof(Request));
        q->len -= q->head;
        q->head = 0;
    }
    if (q->len + extra > q->cap) {
        Py_ssize_t cap = q->cap * 2 > q->len + extra ? q->cap * 2 : q->len + extra + 64;
        Request *items = realloc(q->items, (size_t)cap * sizeof(Request));
        if (!items) return -1;
        q->items = items;
        q->cap = cap;
    }
    return 0;
}

static void q_push(Queue *q, const Request *r) { q->items[q->len++] = *r; } /* after q_reserve */

static Request q_pop(Queue *q) {
    Request r = q->items[q->head++];
    if (q->head == q->len) q->head = q->len = 0;
    return r;
}

static Py_ssize_t q_find(const Queue *q, long long tag) {
    for (Py_ssize_t i = q->head; i < q->len; i++)
        if (q->items[i].tag == tag) return i;
    return -1;
}

static void q_remove(Queue *q, Py_ssize_t i) {
    memmove(q->items + i, q->items + i + 1, (size_t)(q->len - i - 1) * sizeof(Request));
    q->len--;
    if (q->head == q->len) q->head = q->len = 0;
}

/* The read-ahead requests queued for the record whose ready word is `word` (a split one's
 * parts too) moved to the back of the urgent queue: a gate waits for it now. Whether any
 * moved (mu held). */
int promote_word(ReaderObject *r, const int32_t *word) {
    Queue *a = &r->ahead;
    int moved = 0;
    for (Py_ssize_t i = a->head; i < a->len;) {
        Request rq = a->items[i];
        if ((rq.group ? rq.group->ready : rq.ready) != word) {
            i++;
            continue;
        }
        if (q_reserve(&r->urgent, 1) < 0) break;
        q_push(&r->urgent, &rq);
        q_remove(a, i);
        moved = 1;
    }
    return moved;
}

/* ---------------------------------------------------------------- workers */

/* pread until `length` bytes or EOF. Returns 0, an errno, or SHORT_READ. */
static int read_fully(int fd, int direct, const Request *rq, long long *nread) {
    Py_ssize_t got = 0;
    int err = 0;
    while (got < rq->length) {
        size_t want = (size_t)(rq->length - got);
        if (want > MAX_CHUNK) want = MAX_CHUNK;
        ssize_t n = pread(fd, rq->dest + got, want, (off_t)(rq->offset + got));
        if (n < 0) {
            if (errno == EINTR) continue;
            err = errno;
            break;
        }
        if (n == 0) {
            err = SHORT_READ;
            break;
        }
        got += n;
        /* Direct I/O returns a partial block only at end of file; the next pread at the
         * unaligned offset would fail with EINVAL, so check the size and call it EOF. */
        if (direct && (n % ALIGNMENT) && got < rq->length) {
            struct stat st;
            if (fstat(fd, &st) == 0 && st.st_size <= rq->offset + got) {
                err = SHORT_READ;
                break;
            }
        }
    }
    *nread = got;
    return err;
}

/* A read that has landed where it goes (and been verified): its completion (mu held).
 * `behind`: the worker's copy_behind read (its current read, if any, goes on). */
static void complete(ReaderObject *r, int w, long long tag, int err, long long nread, int checked,
                     uint64_t verify_ns, int behind) {
    if (behind)
        r->behind_on[w] = 0;
    else
        r->reading[w] = 0;
    /* capacity was reserved by submit(): workers never allocate */
    r->done_items[r->n_done++] = (Completion){tag, err, nread};
    r->requests_done++;
    r->errors += err != 0;
    r->verified += checked;
    r->verify_ns[w] += verify_ns;
    pthread_cond_broadcast(&r->done);
    announce(r, 1);
}

/* The record is in place, or (`failed`) will not be: tell a device waiting on its ready word
 * (Request.ready). */
static void mark_ready(int32_t *ready, int32_t value, int failed) {
    if (ready) __atomic_store_n(ready, failed ? READY_FAILED : value, __ATOMIC_RELEASE);
}

/* A request submitted at `submitted` (0: not urgent then) landed now: the urgent_* stats (mu) */
static void landed_urgent(ReaderObject *r, uint64_t submitted) {
    if (!submitted) return;
    uint64_t ns = now_ns() - submitted;
    r->urgent_reads++;
    r->urgent_ns += ns;
    if (ns > r->urgent_max_ns) r->urgent_max_ns = ns;
}

/* A ready word stored by the CUDA driver's thread once a queued copy is done (devcopy_then):
 * a gate waiting on a read-ahead record sees it land then, not when its worker next waits. */
typedef struct {
    int32_t *ready;
    int32_t value;
} ReadyLater;

/* (A queued copy that fails asynchronously leaves the CUDA context unusable: no kernel after
 * it reads the record.) */
static void ready_later(void *p) {
    ReadyLater *l = p;
    __atomic_store_n(l->ready, l->value, __ATOMIC_RELEASE);
    free(l);
}

/* Queue the store of rq's ready word behind its device copy: 1 if queued (else the worker
 * stores it when it waits for the copy). */
static int mark_ready_later(DevCopyThread *dc, const Request *rq) {
    ReadyLater *l = rq->ready ? malloc(sizeof *l) : NULL;
    if (!l) return 0;
    *l = (ReadyLater){rq->ready, rq->ready_value};
    if (devcopy_then(dc, ready_later, l) == 0) return 1;
    free(l);
    return 0;
}

/* Worker w's copy, whose ready word is `word` (NULL: no gate waits on it), queued at `since`
 * (now_ns), for the watcher; disarmed once it is waited for. */
static void arm_copy(ReaderObject *r, int w, int32_t *word, uint64_t since) {
    __atomic_store_n(&r->copy_since[w], since, __ATOMIC_RELAXED);
    __atomic_store_n(&r->copy_word[w], word, __ATOMIC_RELEASE);
}

/* (Under the watcher's lock, which it holds through a scan: once this returns no
 * compare-and-swap on the old word is under way, which could otherwise land after the word
 * was stored, or set pending again for a later read.) */
static void disarm_copy(ReaderObject *r, int w) {
    pthread_mutex_lock(&r->watch_mu);
    __atomic_store_n(&r->copy_word[w], NULL, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&r->watch_mu);
}

/* A pending word made READY_FAILED: 1, or 0 where the landing or anything else changed it
 * first (compare-and-swap). */
static int give_up_word(int32_t *word) {
    int32_t pending = READY_PENDING;
    return word && __atomic_compare_exchange_n(word, &pending, READY_FAILED, 0, __ATOMIC_ACQ_REL,
                                               __ATOMIC_ACQUIRE);
}

/* While a copy is held, the words of the reads still queued behind the held workers: a gate
 * waiting on one of them (a later layer's, already on the device) would keep the device busy
 * its whole timeout, and the device going idle is what ends the hold. */
static void give_up_queued(ReaderObject *r) {
    pthread_mutex_lock(&r->mu);
    Queue *qs[2] = {&r->urgent, &r->ahead};
    for (int i = 0; i < 2; i++)
        for (Py_ssize_t j = qs[i]->head; j < qs[i]->len; j++) {
            const Request *rq = &qs[i]->items[j];
            if (give_up_word(rq->group ? rq->group->ready : rq->ready)) r->words_given_up++;
        }
    pthread_mutex_unlock(&r->mu);
}

/* The watcher: while held_ns is set, every quarter of it (1 ms at least), a copy armed longer
 * than held_ns has its word, still pending, made READY_FAILED (a word the landing or anything
 * else changed meanwhile is left alone), and while any is, so have the reads still queued,
 * and stop_word is set (every gate gives up, whatever word it waits on). A
 * thread of its own, so that a worker held anywhere in the driver (queueing its copy or
 * waiting for it) is seen. (Lock order: watch_mu, then mu.) */
static void *watch_main(void *p) {
    ReaderObject *r = p;
#ifdef __APPLE__
    pthread_setname_np("strata-held");
#elif defined(__linux__)
    pthread_setname_np(pthread_self(), "strata-held");
#endif
    pthread_mutex_lock(&r->watch_mu);
    while (!r->watch_stop) {
        uint64_t held = __atomic_load_n(&r->held_ns, __ATOMIC_RELAXED);
        if (!held) {
            pthread_cond_wait(&r->watch_cv, &r->watch_mu);
            continue;
        }
        uint64_t step = held / 4 > 1000000 ? held / 4 : 1000000;
        struct timespec until; /* (on watch_cv's clock) */
#ifdef __APPLE__
        clock_gettime(CLOCK_REALTIME, &until);
#else
        clock_gettime(CLOCK_MONOTONIC, &until);
#endif
        uint64_t ns = (uint64_t)until.tv_nsec + step;
        until.tv_sec += (time_t)(ns / 1000000000ULL);
        until.tv_nsec = (long)(ns % 1000000000ULL);
        pthread_cond_timedwait(&r->watch_cv, &r->watch_mu, &until);
        held = __atomic_load_n(&r->held_ns, __ATOMIC_RELAXED);
        if (r->watch_stop || !held) continue;
        uint64_t now = now_ns();
        int any = 0;
        for (int w = 0; w < r->nthreads; w++) {
            int32_t *word = __atomic_load_n(&r->copy_word[w], __ATOMIC_ACQUIRE);
            uint64_t since = __atomic_load_n(&r->copy_since[w], __ATOMIC_RELAXED);
            if (!word || now <= since || now - since < held) continue;
            /* (a read-ahead copy whose word the driver stored stays armed until the worker's
             * next read is done: landed, not held) */
            int32_t v = __atomic_load_n(word, __ATOMIC_ACQUIRE);
            if (v != READY_PENDING && v != READY_FAILED) continue;
            any = 1;
            if (give_up_word(word)) __atomic_add_fetch(&r->copies_held, 1, __ATOMIC_RELAXED);
        }
        if (!any) continue;
        give_up_queued(r);
        int32_t *stop = __atomic_load_n(&r->stop_word, __ATOMIC_ACQUIRE);
        if (stop && __atomic_exchange_n(stop, 1, __ATOMIC_ACQ_REL) == 0)
            __atomic_add_fetch(&r->gates_stopped, 1, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&r->watch_mu);
    return NULL;
}

/* copy_behind: a read whose device copy was queued and not waited for yet. */
typedef struct {
    int active, err, checked;
    long long tag, nread;
    uint64_t verify_ns;
    int32_t *ready;
    int32_t ready_value;
} Behind;

/* The checksum a read owes, of its buffer: a whole record's against its expected value
 * (CHECKSUM_MISMATCH where it differs), or a verified split request's part its own, in
 * *part_crc (combined once the last part is in); 0 otherwise. */
static int take_checksum(int kind, const Request *rq, const void *buf, size_t nread,
                         uint32_t *part_crc) {
    if (rq->verify)
        return checksum_update(kind, 0, buf, (size_t)rq->length) != rq->expected
                   ? CHECKSUM_MISMATCH
                   : 0;
    if (rq->group && rq->group->verify) *part_crc = checksum_update(kind, 0, buf, nread);
    return 0;
}

/* Wait for the thread's queued copy and complete its read (mu not held; taken here). */
static void finish_behind(ReaderObject *r, int w, DevCopyThread *dc, Behind *b) {
    if (!b->active) return;
    uint64_t c0 = now_ns();
    /* (a word the worker stores is watched while it waits: it pends till then, landed or
     * not; one the driver stores stayed armed since the copy was queued) */
    if (b->ready) arm_copy(r, w, b->ready, c0);
    int e = devcopy_wait(dc);
    disarm_copy(r, w);
    uint64_t c1 = now_ns();
    int err = e && !b->err ? DEVICE_COPY_FAILED : b->err;
    mark_ready(b->ready, b->ready_value, err);
    pthread_mutex_lock(&r->mu);
    r->device_copy_ns += c1 - c0;
    complete(r, w, b->tag, err, b->nread, b->checked, b->verify_ns, 1);
    pthread_mutex_unlock(&r->mu);
    b->active = 0;
}

/* A worker's bounce buffer made at least `need` bytes (and the reader's record size): the old
 * one let go of, a new one allocated, huge where the system allows, and pinned for the device
 * copy. NULL (cap 0) where no memory is left for it. */
static void grow_bounce(ReaderObject *r, DevCopyThread *dc, void **buf, size_t *cap_out,
                        size_t need) {
    if (*buf) devcopy_unpin(dc, *buf);
    free(*buf);
    *buf = NULL;
    *cap_out = 0;
    size_t want = need > (size_t)r->bounce_min ? need : (size_t)r->bounce_min;
    size_t cap = (want + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    int got = posix_memalign(buf, HUGE_PAGE, cap) == 0;
    if (!got && want > need && need > 0) { /* no room for a record: this read's */
        cap = (need + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
        got = posix_memalign(buf, HUGE_PAGE, cap) == 0;
    }
    if (!got) {
        *buf = NULL;
        return;
    }
    *cap_out = cap;
    advise_huge(*buf, cap, 0); /* before the first touch: huge at fault */
    devcopy_pin(dc, *buf, cap); /* device copy: registered, still huge */
}

static void *worker_main(void *p) {
    WorkerArg *arg = p;
    ReaderObject *r = arg->reader;
    int w = arg->index;
    /* this worker's buffers in bounce mode, grown to the longest read; copy_behind uses both
     * in turn (one is read into while the other's copy runs), else only the first */
    void *bounces[2] = {NULL, NULL};
    size_t caps[2] = {0, 0};
    int cur = 0;
    Behind behind = {0};
    /* named, so that top -H, a profiler or /proc/PID/task tells the reader's threads apart
     * (one waiting in the CUDA driver, say) */
#ifdef __APPLE__
    pthread_setname_np("strata-reader");
#elif defined(__linux__)
    pthread_setname_np(pthread_self(), "strata-reader"); /* (15 characters at most) */
#endif
    /* device_copy: this thread's stream; NULL if it could not be made (its reads fail) */
    DevCopyThread *dc = r->device_copy ? devcopy_thread_new() : NULL;
    int copy_behind = r->copy_behind && dc;
    /* A thread that copies with the device pins its record-sized buffers now, before any
     * gate can wait for it: letting go of a pinned buffer for a larger one waits in the
     * driver for the device to go idle and holds other threads' copies meanwhile (on an
     * H100, cuMemHostUnregister did while a gate spun; cuMemHostRegister did not). */
    if (r->bounce && dc && r->bounce_min > 0)
        for (int i = 0; i < 1 + copy_behind; i++) grow_bounce(r, dc, &bounces[i], &caps[i], 0);
    int spun_out = 0; /* spun its whole window with nothing posted: sleeps until woken */
    int spun = 0;     /* came from spinning: the read it takes next needed no wake-up */
    pthread_mutex_lock(&r->mu);
    while (!r->stopping) {
        Queue *q = NULL;
        if (!r->paused && r->preading < r->nworkers)
            q = q_size(&r->urgent) ? &r->urgent : q_size(&r->ahead) ? &r->ahead : NULL;
        if (!q) {
            if (behind.active) { /* nothing to read meanwhile: the copy's read completes now */
                pthread_mutex_unlock(&r->mu);
                finish_behind(r, w, dc, &behind);
                pthread_mutex_lock(&r->mu);
                continue;
            }
            if (r->spin_ns && !spun_out && !r->paused &&
                __atomic_load_n(&r->spinning, __ATOMIC_SEQ_CST) < r->spinners) {
                spun = poll_for_work(r);
                spun_out = !spun;
                continue;
            }
            spun = 0;
            pthread_cond_wait(&r->work, &r->mu);
            spun_out = 0;
            continue;
        }
        spun_out = 0;
        if (spun) {
            r->spin_takes++;
            spun = 0;
        }
        int urgent = q == &r->urgent;
        Request rq = q_pop(q);
        if (rq.submitted && (rq.lead || !rq.group)) r->urgent_queued_ns += now_ns() - rq.submitted;
        int fd = r->fds[rq.file], direct = r->direct[rq.file], kind = r->checksum[rq.file];
        if (rq.group) rq.group->started++;
        r->current[w] = rq.tag;
        r->reading[w] = 1;
        if (++r->preading > r->preading_max) r->preading_max = r->preading;
        int more = (q_size(&r->urgent) || q_size(&r->ahead)) && r->preading < r->nworkers;
        announce(r, 0);
        pthread_mutex_unlock(&r->mu);
        if (more) wake_work(r, 0); /* the next worker takes the next read */

        uint64_t t0 = now_ns();
        long long nread = 0;
        int err = 0;
        /* Bounce mode: the device may read other slots of the same memory while this read
         * lands (CUDA managed memory migrates in blocks larger than a slot; DMA from O_DIRECT
         * into such pages is not coherent with it). The drive writes a buffer of this worker;
         * the CPU copies it into dest, which the driver keeps coherent. */
        Request into = rq;
        if (r->bounce) {
            if ((size_t)rq.length > caps[cur]) {
                /* (a pinned buffer let go of waits for the device to go idle, behind whatever
                 * it runs: a decode gate waiting for this very read included) */
                if (bounces[cur]) {
                    pthread_mutex_lock(&r->mu);
                    r->bounce_regrown++;
                    pthread_mutex_unlock(&r->mu);
                }
                grow_bounce(r, dc, &bounces[cur], &caps[cur], (size_t)rq.length);
            }
            if (bounces[cur])
                into.dest = (char *)bounces[cur];
            else
                err = ENOMEM;
        }
        if (!err) err = read_fully(fd, direct, &into, &nread);
        if (!err) drive_hold(t0, nread);
        uint64_t t1 = now_ns(), t2 = t1;
        if (r->overlap || copy_behind) { /* the drive's slot is free: the next read starts now */
            pthread_mutex_lock(&r->mu);
            r->preading--;
            if (q_size(&r->urgent) || q_size(&r->ahead)) wake_work(r, 0);
            pthread_mutex_unlock(&r->mu);
        }
        int checked = !err && rq.verify;
        int verifies = checked || (!err && rq.group && rq.group->verify);
        /* (the synchronous device copy below: the checksum taken while it runs) */
        int in_copy = verifies && dc && r->bounce && nread > 0 &&
                      __atomic_load_n(&r->verify_in_copy, __ATOMIC_RELAXED) &&
                      !(copy_behind && !urgent && !rq.group);
        uint32_t part_crc = 0; /* a part of a verified split request: its own checksum */
        if (verifies && !in_copy) {
            err = take_checksum(kind, &rq, into.dest, (size_t)nread, &part_crc);
            t2 = now_ns();
        }
        /* The previous read's copy ran while this one was read: it completes first, and
         * its buffer is the one the next read goes into. */
        finish_behind(r, w, dc, &behind);
        uint64_t copy_ns = 0, memcpy_ns = 0; /* the copy engine's, the CPU's */
        int queued = 0;
        if (r->bounce && nread > 0 && err != CHECKSUM_MISMATCH) {
            if (dc) { /* from pageable memory too, where registering failed: staged */
                uint64_t c0 = now_ns();
                /* the word a gate may wait on (a part's group lives until its last part is
                 * done; the word itself is the gate table's) */
                arm_copy(r, w, rq.group ? rq.group->ready : rq.ready, c0);
                if (copy_behind && !urgent && !rq.group) {
                    /* read-ahead: queued, waited for after the next read (or before this
                     * thread sleeps); an urgent read is waited for at once */
                    if (devcopy_start(dc, rq.dest, into.dest, (size_t)nread))
                        err = DEVICE_COPY_FAILED;
                    else {
                        queued = 1;
                        /* a verified, whole record: its word can go out with the copy */
                        if (!err && nread == rq.length &&
                            __atomic_load_n(&r->words_by_driver, __ATOMIC_RELAXED) &&
                            mark_ready_later(dc, &rq)) {
                            rq.ready = NULL;
                            __atomic_add_fetch(&r->words_queued, 1, __ATOMIC_RELAXED);
                        }
                    }
                } else if (in_copy) {
                    if (devcopy_start(dc, rq.dest, into.dest, (size_t)nread)) {
                        err = DEVICE_COPY_FAILED;
                        checked = 0; /* (no checksum taken) */
                    } else {
                        uint64_t v0 = now_ns();
                        err = take_checksum(kind, &rq, into.dest, (size_t)nread, &part_crc);
                        t2 = t1 + (now_ns() - v0); /* (the checksum's own time) */
                        /* (a failed copy wins: the context may be unusable, not the record) */
                        if (devcopy_wait(dc)) err = DEVICE_COPY_FAILED;
                    }
                } else if (devcopy_copy(dc, rq.dest, into.dest, (size_t)nread))
                    err = DEVICE_COPY_FAILED;
                /* (waited for; or left running with its word the worker's: watched again in
                 * finish_behind) */
                if (!queued || rq.ready) disarm_copy(r, w);
                copy_ns = now_ns() - c0;
                /* (in_copy: the copy's time beyond the checksum it overlapped, which counts as
                 * verifying; 1 ns at least, so that the copy is still counted) */
                if (in_copy) copy_ns -= copy_ns > t2 - t1 ? t2 - t1 : copy_ns - 1;
            } else if (r->device_copy) /* no stream: the slot may be device memory */
                err = DEVICE_COPY_FAILED;
            else {
                uint64_t c0 = now_ns();
                memcpy(rq.dest, into.dest, (size_t)nread);
                memcpy_ns = now_ns() - c0;
            }
        }

        pthread_mutex_lock(&r->mu);
        if (!r->overlap && !copy_behind) r->preading--;
        r->bytes_read += (unsigned long long)nread;
        r->busy_ns[w] += t1 - t0;
        if (rq.submitted) {
            r->urgent_parts++;
            r->urgent_pread_ns += t1 - t0;
            r->urgent_verify_ns += t2 - t1;
            r->urgent_copy_ns += copy_ns + memcpy_ns;
        }
        if (copy_ns) {
            r->device_copies++;
            r->device_copy_ns += copy_ns;
        }
        if (queued) { /* outstanding as behind[w] until its copy is waited for */
            behind = (Behind){1, err, checked, rq.tag, nread, t2 - t1, rq.ready, rq.ready_value};
            r->behind[w] = rq.tag;
            r->behind_on[w] = 1;
            r->reading[w] = 0;
            cur = !cur;
            continue;
        }
        Group *g = rq.group;
        if (g) { /* a part: the last one to finish completes the request */
            if (err && !g->err) g->err = err;
            g->nread += nread;
            if (g->verify) g->crcs[(rq.dest - g->dest) / g->part] = part_crc;
            r->verify_ns[w] += t2 - t1;
            if (--g->pending > 0) {
                r->reading[w] = 0;
                continue;
            }
            err = g->err;
            nread = g->nread;
            checked = !err && g->verify;
            t1 = t2 = 0;
            if (checked) { /* the parts' checksums, in order (reading[w] stays set) */
                uint32_t crc = g->crcs[0];
                for (int k = 1; k < g->parts; k++) {
                    Py_ssize_t at = (Py_ssize_t)k * g->part;
                    Py_ssize_t len = g->length - at < g->part ? g->length - at : g->part;
                    crc = checksum_combine(kind, crc, g->crcs[k], (uint64_t)len);
                }
                if (crc != g->expected) err = CHECKSUM_MISMATCH;
            }
            mark_ready(g->ready, g->ready_value, err || nread != g->length);
            landed_urgent(r, g->submitted);
            free(g);
        } else {
            mark_ready(rq.ready, rq.ready_value, err || nread != rq.length);
            landed_urgent(r, rq.submitted);
        }
        complete(r, w, rq.tag, err, nread, checked, t2 - t1, 0);
    }
    pthread_mutex_unlock(&r->mu);
    finish_behind(r, w, dc, &behind);
    for (int i = 0; i < 2; i++) {
        if (bounces[i]) devcopy_unpin(dc, bounces[i]);
        free(bounces[i]);
    }
    devcopy_thread_free(dc);
    return NULL;
}

/* ---------------------------------------------------------------- helpers */

/* None, "crc32" or "crc32c" -> CHECKSUM_*; -1 with an exception set otherwise. */
static int checksum_kind(PyObject *name) {
    if (name == NULL || name == Py_None) return CHECKSUM_NONE;
    if (PyUnicode_Check(name)) {
        if (PyUnicode_CompareWithASCIIString(name, "crc32c") == 0) return CHECKSUM_CRC32C;
        if (PyUnicode_CompareWithASCIIString(name, "crc32") == 0) return CHECKSUM_CRC32;
    }
    PyErr_Format(PyExc_ValueError, "checksum must be None, 'crc32' or 'crc32c', not %R", name);
    return -1;
}

int check_open(ReaderObject *r) {
    if (r->closing) {
        PyErr_SetString(PyExc_ValueError, "Reader is closed");
        return -1;
    }
    return 0;
}

/* A sequence of ints -> malloc'd array (caller frees). */
static long long *parse_tags(PyObject *seq_obj, Py_ssize_t *n) {
    PyObject *seq = PySequence_Fast(seq_obj, "tags must be a sequence of ints");
    if (!seq) return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    long long *tags = PyMem_RawMalloc(sizeof(long long) * (size_t)(*n + 1));
    if (!tags) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        tags[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (tags[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            PyMem_RawFree(tags);
            return NULL;
        }
    }
    Py_DECREF(seq);
    return tags;
}

PyObject *tag_list(const long long *tags, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *t = PyLong_FromLongLong(tags[i]);
        if (!t) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, t);
    }
    return out;
}

static PyObject *completion_list(const Completion *c, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *t = Py_BuildValue("(LiL)", c[i].tag, c[i].err, c[i].nread);
        if (!t) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, t);
    }
    return out;
}

static Py_ssize_t find_done(ReaderObject *r, long long tag) {
    for (Py_ssize_t i = 0; i < r->n_done; i++)
        if (r->done_items[i].tag == tag) return i;
    return -1;
}

static int is_outstanding(ReaderObject *r, long long tag) {
    if (q_find(&r->urgent, tag) >= 0 || q_find(&r->ahead, tag) >= 0) return 1;
    for (int w = 0; w < r->nthreads; w++)
        if ((r->reading[w] && r->current[w] == tag) || (r->behind_on[w] && r->behind[w] == tag))
            return 1;
    return 0;
}

/* Move completions out (all, or those with `tags`) into `out`; keeps the rest in order. */
static Py_ssize_t take_done(ReaderObject *r, const long long *tags, Py_ssize_t ntags,
                            Completion *out) {
    Py_ssize_t nout = 0, keep = 0;
    if (!tags) {
        memcpy(out, r->done_items, (size_t)r->n_done * sizeof(Completion));
        nout = r->n_done;
        r->n_done = 0;
        return nout;
    }
    for (Py_ssize_t t = 0; t < ntags; t++) { /* in the order asked */
        Py_ssize_t i = find_done(r, tags[t]);
        if (i < 0) continue;
        out[nout++] = r->done_items[i];
        r->done_items[i].err = INT_MIN; /* mark taken */
    }
    for (Py_ssize_t i = 0; i < r->n_done; i++)
        if (r->done_items[i].err != INT_MIN) r->done_items[keep++] = r->done_items[i];
    r->n_done = keep;
    return nout;
}

/* ---------------------------------------------------------------- lifecycle */

/* Drop every queued request (workers stopped): a split request's group goes with its last
 * part, whether that part was queued or read. */
static void drop_queued(Queue *q) {
    for (Py_ssize_t i = q->head; i < q->len; i++) {
        Group *g = q->items[i].group;
        if (g && --g->pending == 0) free(g);
    }
    q->head = q->len = 0;
}

static void stop_workers(ReaderObject *r, int release_gil) {
    if (release_gil) { /* (the watcher queues reads: stopped before the workers) */
        Py_BEGIN_ALLOW_THREADS
        quick_stop(r);
        Py_END_ALLOW_THREADS
    } else {
        quick_stop(r); /* (it never needs the GIL) */
    }
    pthread_mutex_lock(&r->mu);
    r->stopping = 1; /* workers finish their read and exit: what is queued stays queued */
    wake_work(r, 1);
    pthread_cond_broadcast(&r->done);
    pthread_mutex_unlock(&r->mu);
    if (release_gil) {
        Py_BEGIN_ALLOW_THREADS
        for (int i = 0; i < r->nstarted; i++) pthread_join(r->threads[i], NULL);
        Py_END_ALLOW_THREADS
    } else { /* workers never need the GIL, so joining while holding it is safe */
        for (int i = 0; i < r->nstarted; i++) pthread_join(r->threads[i], NULL);
    }
    r->nstarted = 0;
    if (r->watching) { /* (after the workers: no copy is left for it to watch) */
        pthread_mutex_lock(&r->watch_mu);
        r->watch_stop = 1;
        pthread_cond_signal(&r->watch_cv);
        pthread_mutex_unlock(&r->watch_mu);
        pthread_join(r->watcher, NULL); /* (never needs the GIL; wakes at once) */
        r->watching = 0;
    }
    drop_queued(&r->urgent);
    drop_queued(&r->ahead);
    for (int i = 0; i < r->nfiles; i++) close(r->fds[i]);
    r->nfiles = 0;
    if (r->notify_r >= 0) close(r->notify_r);
    if (r->notify_w >= 0) close(r->notify_w);
    r->notify_r = r->notify_w = -1;
}

static void Reader_dealloc(ReaderObject *r) {
    if (r->sync_ready) {
        if (!r->closing) {
            r->closing = 1;
            stop_workers(r, 0);
        }
        pthread_mutex_destroy(&r->mu);
        pthread_cond_destroy(&r->work);
        pthread_cond_destroy(&r->done);
        pthread_mutex_destroy(&r->watch_mu);
        pthread_cond_destroy(&r->watch_cv);
    }
    free(r->threads);
    free(r->args);
    free(r->urgent.items);
    free(r->ahead.items);
    free(r->done_items);
    free(r->current);
    free(r->reading);
    free(r->behind);
    free(r->behind_on);
    free(r->fds);
    free(r->direct);
    free(r->checksum);
    free(r->busy_ns);
    free(r->verify_ns);
    free(r->copy_word);
    free(r->copy_since);
    quick_free(r);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *Reader_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"workers", "start_paused", "bounce", "split", "overlap",
                             "device_copy", "copy_behind", "record_bytes", "spin_us",
                             "spinners", NULL};
    int nworkers = 8, paused = 0, bounce = 0, overlap = 0, device_copy = 0, copy_behind = 0;
    int spin_us = 0, spinners = -1;
    Py_ssize_t split = 0, record_bytes = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|ippnpppnii:Reader", kwlist, &nworkers, &paused,
                                     &bounce, &split, &overlap, &device_copy, &copy_behind,
                                     &record_bytes, &spin_us, &spinners))
        return NULL;
    if (spin_us < 0 || spin_us > 1000000) {
        PyErr_Format(PyExc_ValueError, "spin_us must be in 0..1000000, got %d", spin_us);
        return NULL;
    }
    if (spinners < -1) {
        PyErr_Format(PyExc_ValueError, "spinners must be >= 0 (-1: every thread), got %d",
                     spinners);
        return NULL;
    }
    if (record_bytes < 0) {
        PyErr_Format(PyExc_ValueError, "record_bytes must be >= 0, got %zd", record_bytes);
        return NULL;
    }
    if (device_copy && devcopy_init(0)) {
        PyErr_Format(PyExc_RuntimeError, "device_copy: %s", devcopy_error());
        return NULL;
    }
    if (split < 0 || split % ALIGNMENT) {
        PyErr_Format(PyExc_ValueError, "split must be 0 or a multiple of %d bytes, got %zd",
                     ALIGNMENT, split);
        return NULL;
    }
    if (nworkers < 1 || nworkers > 1024) {
        PyErr_Format(PyExc_ValueError, "workers must be in 1..1024, got %d", nworkers);
        return NULL;
    }
    ReaderObject *r = (ReaderObject *)type->tp_alloc(type, 0); /* zero-filled */
    if (!r) return NULL;
    r->nworkers = nworkers;
    r->overlap = overlap;
    int nthreads = r->nthreads = overlap ? 2 * nworkers : nworkers;
    r->bounce = bounce || device_copy;
    r->device_copy = device_copy;
    r->copy_behind = copy_behind && device_copy;
    r->words_by_driver = 1;
    r->bounce_min = record_bytes;
    r->split = split;
    r->spin_ns = (uint64_t)spin_us * 1000;
    r->spinners = spinners < 0 || spinners > nthreads ? nthreads : spinners;
    r->notify_r = r->notify_w = -1;
    r->notify_below = -1;
    r->paused = paused;
    r->threads = calloc((size_t)nthreads, sizeof(pthread_t));
    r->args = calloc((size_t)nthreads, sizeof(WorkerArg));
    r->current = calloc((size_t)nthreads, sizeof(long long));
    r->reading = calloc((size_t)nthreads, 1);
    r->behind = calloc((size_t)nthreads, sizeof(long long));
    r->behind_on = calloc((size_t)nthreads, 1);
    r->busy_ns = calloc((size_t)nthreads, sizeof(unsigned long long));
    r->verify_ns = calloc((size_t)nthreads, sizeof(unsigned long long));
    r->copy_word = calloc((size_t)nthreads, sizeof(int32_t *));
    r->copy_since = calloc((size_t)nthreads, sizeof(uint64_t));
    if (!r->threads || !r->args || !r->current || !r->reading || !r->behind || !r->behind_on ||
        !r->busy_ns || !r->verify_ns || !r->copy_word || !r->copy_since) {
        Py_DECREF(r);
        return PyErr_NoMemory();
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
#ifndef __APPLE__
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
#endif
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->work, NULL);
    pthread_cond_init(&r->done, &ca);
    pthread_mutex_init(&r->watch_mu, NULL);
    pthread_cond_init(&r->watch_cv, &ca);
    pthread_condattr_destroy(&ca);
    r->sync_ready = 1;
    for (int i = 0; i < nthreads; i++) {
        r->args[i] = (WorkerArg){r, i};
        int rc = pthread_create(&r->threads[i], NULL, worker_main, &r->args[i]);
        if (rc) {
            Py_DECREF(r); /* dealloc joins the ones started */
            errno = rc;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        r->nstarted++;
    }
    if (r->device_copy) { /* the watcher of held copies: asleep until copy_held_us is set */
        int rc = pthread_create(&r->watcher, NULL, watch_main, r);
        if (rc) {
            Py_DECREF(r);
            errno = rc;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        r->watching = 1;
    }
    return (PyObject *)r;
}

/* ---------------------------------------------------------------- methods */

static PyObject *Reader_open(ReaderObject *r, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"path", "direct", "checksum", NULL};
    PyObject *path = NULL, *checksum = NULL;
    int direct = 1, fd, err = 0, kind;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&|pO:open", kwlist, PyUnicode_FSConverter, &path,
                                     &direct, &checksum))
        return NULL;
    if ((kind = checksum_kind(checksum)) < 0 || check_open(r) < 0) goto fail;
    const char *cpath = PyBytes_AS_STRING(path);
    Py_BEGIN_ALLOW_THREADS
#if defined(O_DIRECT) && !defined(__APPLE__)
    fd = open(cpath, O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
    if (fd < 0 && direct && errno == EINVAL) { /* e.g. a file system without direct I/O */
        direct = 0;
        fd = open(cpath, O_RDONLY | O_CLOEXEC);
    }
#else
    fd = open(cpath, O_RDONLY | O_CLOEXEC);
#ifdef __APPLE__
    if (fd >= 0 && direct && fcntl(fd, F_NOCACHE, 1) == -1) direct = 0;
#else
    direct = 0;
#endif
#endif
    err = errno;
    Py_END_ALLOW_THREADS
    if (fd < 0) {
        errno = err;
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, cpath);
        goto fail;
    }
    if (r->closing) { /* close() ran while the GIL was released above */
        close(fd);
        check_open(r);
        goto fail;
    }
    pthread_mutex_lock(&r->mu);
    if (r->nfiles == r->cap_files) {
        int cap = r->cap_files ? r->cap_files * 2 : 8;
        int *fds = realloc(r->fds, sizeof(int) * (size_t)cap);
        if (fds) r->fds = fds;
        char *dir = fds ? realloc(r->direct, (size_t)cap) : NULL;
        if (dir) r->direct = dir;
        char *sums = dir ? realloc(r->checksum, (size_t)cap) : NULL;
        if (sums) r->checksum = sums;
        if (!fds || !dir || !sums) {
            pthread_mutex_unlock(&r->mu);
            close(fd);
            PyErr_NoMemory();
            goto fail;
        }
        r->cap_files = cap;
    }
    int index = r->nfiles++;
    r->fds[index] = fd;
    r->direct[index] = (char)direct;
    r->checksum[index] = (char)kind;
    pthread_mutex_unlock(&r->mu);
    Py_DECREF(path);
    return PyLong_FromLong(index);
fail:
    Py_XDECREF(path);
    return NULL;
}

static PyObject *Reader_is_direct(ReaderObject *r, PyObject *arg) {
    long i = PyLong_AsLong(arg);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (i < 0 || i >= r->nfiles) return PyErr_Format(PyExc_ValueError, "no open file %ld", i);
    return PyBool_FromLong(r->direct[i]);
}

/* Parts a request is read in when `per` workers are free for it: each at least r->split
 * bytes (and ALIGNMENT-sized, as direct I/O needs). 1: read whole. */
static int split_parts(const ReaderObject *r, const Request *rq, Py_ssize_t per) {
    Py_ssize_t parts = rq->length / r->split;
    if (parts > per) parts = per;
    if (parts > 64) parts = 64;
    return parts >= 2 ? (int)parts : 1;
}

/* Queue `reqs` at the back of the urgent or the read-ahead queue (mu held): -1 without
 * memory (nothing queued), else the parts queued. With `check_flight` and quick misses armed,
 * a request whose ready word is a gate-table word whose record is in flight (Quick.flight)
 * is not queued but its tag put in `skipped`; the others mark theirs in flight. */
Py_ssize_t queue_locked(ReaderObject *r, Request *reqs, Py_ssize_t n, int urgent,
                        int check_flight, long long *skipped, Py_ssize_t *nskipped) {
    Queue *q = urgent ? &r->urgent : &r->ahead;
    /* Split reads: while workers would sit idle (few requests queued or in flight, as in
     * decode, where a layer misses a handful of records), each request of this batch is read
     * as up to idle / n parts of at least `split` bytes by as many workers (up to idle parts
     * where `spread`), so a record's latency is that of its parts, read side by side. Deep
     * queues (prefill) stay whole. */
    Py_ssize_t parts_total = n, per = 0;
    int spread = 0;
    if (r->split > 0 && n > 0) {
        Py_ssize_t busy = q_size(&r->urgent) + q_size(&r->ahead);
        if (r->overlap) busy += r->preading; /* threads finishing a read hold no slot */
        else
            for (int w = 0; w < r->nworkers; w++) busy += r->reading[w];
        Py_ssize_t idle = busy < r->nworkers ? r->nworkers - busy : 0;
        /* (spread: a batch of misses no larger than the idle workers; prefill's hundreds of
         * misses a layer stay whole, as read-ahead stays idle / n) */
        spread = urgent && n <= idle && __atomic_load_n(&r->spread, __ATOMIC_RELAXED);
        per = spread ? idle : idle / n;
        if (per >= 2) {
            parts_total = 0;
            for (Py_ssize_t i = 0; i < n; i++) parts_total += split_parts(r, &reqs[i], per);
        }
    }
    /* reserve completion slots for everything that can still complete, so workers never
     * allocate */
    Py_ssize_t need = r->n_done + q_size(&r->urgent) + q_size(&r->ahead) + r->nthreads + n;
    if (need > r->cap_done) {
        Completion *d = realloc(r->done_items, sizeof(Completion) * (size_t)(need * 2));
        if (d) {
            r->done_items = d;
            r->cap_done = need * 2;
        }
    }
    if (need > r->cap_done || q_reserve(q, parts_total) < 0) return -1;
    Quick *qm = &r->quick;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* (quick misses) a record another request reads already is skipped */
        int32_t *word = reqs[i].ready;
        if (check_flight && qm->armed && word >= qm->table &&
            word < qm->table + (Py_ssize_t)qm->npos * qm->nexp) {
            uint8_t *f = &qm->flight[word - qm->table];
            if (*f) {
                skipped[(*nskipped)++] = reqs[i].tag;
                continue;
            }
            *f = 1;
        }
        /* pending from here on (an earlier read of the same record may have failed); stored
         * once the batch is sure to be queued, before a worker can take it */
        if (reqs[i].ready) __atomic_store_n(reqs[i].ready, READY_PENDING, __ATOMIC_RELEASE);
        int parts = per >= 2 ? split_parts(r, &reqs[i], per) : 1;
        Group *g = NULL;
        Py_ssize_t part = parts > 1 ? ((reqs[i].length + parts - 1) / parts + ALIGNMENT - 1) /
                                          ALIGNMENT * ALIGNMENT
                                    : reqs[i].length;
        if (parts > 1 && (g = malloc(sizeof(Group) + sizeof(uint32_t) * (size_t)parts))) {
            parts = (int)((reqs[i].length + part - 1) / part);
            *g = (Group){reqs[i].tag, parts, parts, 0, 0, 0, reqs[i].dest, reqs[i].length,
                         reqs[i].expected, reqs[i].verify, reqs[i].ready, reqs[i].ready_value,
                         part, reqs[i].submitted};
            r->split_requests++;
        }
        if (!g) { /* whole (or no memory for a group: whole, too) */
            q_push(q, &reqs[i]);
            r->wake_owed += spread;
            continue;
        }
        r->wake_owed += spread ? parts : 0;
        for (int k = 0; k < parts; k++) {
            Request pr = reqs[i];
            Py_ssize_t at = (Py_ssize_t)k * part;
            pr.offset += at;
            pr.dest += at;
            pr.length = reqs[i].length - at < part ? reqs[i].length - at : part;
            pr.verify = 0;
            pr.ready = NULL; /* the group's, once every part is in */
            pr.group = g;
            pr.lead = k == 0;
            q_push(q, &pr);
        }
    }
    return parts_total;
}

static PyObject *Reader_submit(ReaderObject *r, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"requests", "urgent", NULL};
    PyObject *reqs_obj, *seq = NULL;
    int urgent = 0;
    Request *reqs = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|p:submit", kwlist, &reqs_obj, &urgent))
        return NULL;
    if (check_open(r) < 0) return NULL;
    seq = PySequence_Fast(reqs_obj, "requests must be a sequence of tuples");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    reqs = PyMem_RawMalloc(sizeof(Request) * (size_t)(n + 1));
    if (!reqs) {
        PyErr_NoMemory();
        goto fail;
    }
    /* Parse and validate the whole batch before queueing any of it. */
    for (Py_ssize_t i = 0; i < n; i++) {
        Request *q = &reqs[i];
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i), *dest, *expected = Py_None;
        PyObject *ready = Py_None;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) < 5 || PyTuple_GET_SIZE(item) > 7) {
            PyErr_Format(PyExc_TypeError, "request %zd must be a tuple (tag, file_index, offset, "
                         "length, dest_address[, expected_checksum[, (ready_address, "
                         "ready_value)]])", i);
            goto fail;
        }
        if (!PyArg_ParseTuple(item, "LiLnO|OO", &q->tag, &q->file, &q->offset, &q->length, &dest,
                              &expected, &ready))
            goto fail;
        q->ready = NULL;
        q->ready_value = 0;
        if (ready != Py_None) {
            unsigned long long at;
            int value;
            if (!PyTuple_Check(ready) || !PyArg_ParseTuple(ready, "Ki", &at, &value)) {
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError, "request %zd: ready must be None or a tuple "
                             "(address, int32 value)", i);
                goto fail;
            }
            if (!at || at % sizeof(int32_t)) {
                PyErr_Format(PyExc_ValueError, "request %zd (tag %lld): ready address %p "
                             "is NULL or not 4-byte aligned", i, q->tag, (void *)(uintptr_t)at);
                goto fail;
            }
            q->ready = (int32_t *)(uintptr_t)at;
            q->ready_value = value;
        }
        unsigned long long address = PyLong_AsUnsignedLongLong(dest); /* rejects negatives */
        if (address == (unsigned long long)-1 && PyErr_Occurred()) goto fail;
        q->dest = (char *)(uintptr_t)address;
        q->verify = expected != Py_None;
        q->expected = 0;
        if (q->verify) {
            unsigned long long sum = PyLong_AsUnsignedLongLong(expected); /* rejects negatives */
            if (sum == (unsigned long long)-1 && PyErr_Occurred()) goto fail;
            q->expected = (uint32_t)sum;
            if (sum != q->expected) q->verify = 2; /* reported below */
        }
        const char *bad = NULL;
        if (q->file < 0 || q->file >= r->nfiles) bad = "file_index is not an open file";
        else if (q->offset < 0 || q->length < 0) bad = "offset and length must be >= 0";
        else if (!q->dest) bad = "dest_address is NULL";
        else if (q->verify == 2) bad = "expected_checksum does not fit in 32 bits";
        else if (q->verify && !r->checksum[q->file])
            bad = "expected_checksum given for a file opened without a checksum";
        if (bad) {
            PyErr_Format(PyExc_ValueError, "request %zd (tag %lld): %s", i, q->tag, bad);
            goto fail;
        }
        if (r->direct[q->file]) {
            const char *what = q->offset % ALIGNMENT ? "offset"
                               : q->length % ALIGNMENT ? "length"
                               : (uintptr_t)q->dest % ALIGNMENT ? "dest_address" : NULL;
            if (what) {
                PyErr_Format(PyExc_ValueError,
                             "request %zd (tag %lld): %s is not a multiple of %d, which direct "
                             "I/O on file %d requires (offset %lld, length %zd, dest %p)",
                             i, q->tag, what, ALIGNMENT, q->file, q->offset, q->length,
                             (void *)q->dest);
                goto fail;
            }
        }
    }
    uint64_t submitted = urgent ? now_ns() : 0;
    for (Py_ssize_t i = 0; i < n; i++)
        reqs[i].group = NULL, reqs[i].lead = 0, reqs[i].submitted = submitted;
    long long *skipped = PyMem_RawMalloc(sizeof(long long) * (size_t)(n + 1));
    Py_ssize_t nskipped = 0;
    if (!skipped) {
        PyErr_NoMemory();
        goto fail;
    }
    pthread_mutex_lock(&r->mu);
    Py_ssize_t parts_total = queue_locked(r, reqs, n, urgent, 1, skipped, &nskipped);
    Py_ssize_t owed = take_owed(r);
    pthread_mutex_unlock(&r->mu);
    if (parts_total < 0) {
        PyMem_RawFree(skipped);
        PyErr_NoMemory();
        goto fail;
    }
    /* One worker woken, after the lock is let go: each worker that takes a read wakes the
     * next while reads are queued. Waking one per read here cost the submitting thread (which
     * holds the GIL) ~4 us a worker: 33 us a submit with 8 workers against 5.6 with one; only
     * a spread batch (a handful of misses, `spread`) wakes one a part. */
    if (parts_total > 0) wake_spread(r, owed);
    PyMem_RawFree(reqs);
    Py_DECREF(seq);
    PyObject *out = tag_list(skipped, nskipped);
    PyMem_RawFree(skipped);
    return out;
fail:
    PyMem_RawFree(reqs);
    Py_XDECREF(seq);
    return NULL;
}

/* Whether every part of `g` is still queued in `q` (none started): it can be cancelled. */
static int all_queued(const Queue *q, const Group *g) {
    int n = 0;
    for (Py_ssize_t i = q->head; i < q->len; i++) n += q->items[i].group == g;
    return g->started == 0 && n == g->parts;
}

/* cancel (to_urgent=0) or promote (to_urgent=1) queued read-ahead requests */
static PyObject *move_ahead(ReaderObject *r, PyObject *tags_obj, int to_urgent) {
    Py_ssize_t n;
    long long *tags = parse_tags(tags_obj, &n), *moved;
    if (!tags) return NULL;
    Py_ssize_t nmoved = 0;
    moved = PyMem_RawMalloc(sizeof(long long) * (size_t)(n + 1));
    pthread_mutex_lock(&r->mu);
    if (!moved || (to_urgent && q_reserve(&r->urgent, n) < 0)) {
        pthread_mutex_unlock(&r->mu);
        PyMem_RawFree(tags);
        PyMem_RawFree(moved);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t t = 0; t < n; t++) {
        Py_ssize_t i = q_find(&r->ahead, tags[t]);
        if (i < 0) continue;
        Group *g = r->ahead.items[i].group;
        if (g && !to_urgent && !all_queued(&r->ahead, g))
            continue; /* a part is being read: like a request in flight, not cancelled */
        if (g && to_urgent && q_reserve(&r->urgent, g->parts) < 0) continue;
        do { /* every queued part of a split request moves with it */
            if (to_urgent) q_push(&r->urgent, &r->ahead.items[i]);
            q_remove(&r->ahead, i);
        } while (g && (i = q_find(&r->ahead, tags[t])) >= 0);
        if (g && !to_urgent) free(g);
        moved[nmoved++] = tags[t];
    }
    if (to_urgent)
        wake_work(r, 1);
    else /* (waiters on cancelled tags) */
        pthread_cond_broadcast(&r->done);
    pthread_mutex_unlock(&r->mu);
    PyObject *out = tag_list(moved, nmoved);
    PyMem_RawFree(tags);
    PyMem_RawFree(moved);
    return out;
}

static PyObject *Reader_cancel(ReaderObject *r, PyObject *tags) { return move_ahead(r, tags, 0); }
static PyObject *Reader_promote(ReaderObject *r, PyObject *tags) { return move_ahead(r, tags, 1); }

enum { W_PENDING, W_READY, W_TIMEOUT, W_SLICE, W_UNKNOWN, W_CLOSED };

static PyObject *Reader_wait(ReaderObject *r, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"tags", "timeout", NULL};
    PyObject *tags_obj = Py_None, *timeout_obj = Py_None, *out = NULL;
    long long *tags = NULL, unknown = 0;
    Py_ssize_t ntags = 0, nout = 0;
    Completion *taken = NULL;
    int status = W_PENDING, nomem = 0;
    uint64_t deadline = UINT64_MAX;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|OO:wait", kwlist, &tags_obj, &timeout_obj))
        return NULL;
    if (timeout_obj != Py_None) {
        double t = PyFloat_AsDouble(timeout_obj);
        if (t == -1.0 && PyErr_Occurred()) return NULL;
        if (!(t >= 0)) return PyErr_Format(PyExc_ValueError, "timeout must be >= 0");
        deadline = t > 1e9 ? UINT64_MAX : now_ns() + (uint64_t)(t * 1e9);
    }
    if (tags_obj != Py_None && !(tags = parse_tags(tags_obj, &ntags))) return NULL;
    if (check_open(r) < 0) goto done;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        uint64_t slice_end = now_ns() + WAIT_SLICE_NS;
        pthread_mutex_lock(&r->mu);
        for (;;) {
            if (tags) { /* all present? else is any missing tag nowhere at all? */
                status = W_READY;
                for (Py_ssize_t t = 0; t < ntags && status != W_UNKNOWN; t++) {
                    if (find_done(r, tags[t]) >= 0) continue;
                    status = W_PENDING;
                    if (!is_outstanding(r, tags[t])) {
                        status = W_UNKNOWN;
                        unknown = tags[t];
                    }
                }
            } else { /* at least one completion; nothing outstanding at all returns [] */
                int outstanding = q_size(&r->urgent) || q_size(&r->ahead);
                for (int w = 0; w < r->nthreads; w++)
                    outstanding |= r->reading[w] | r->behind_on[w];
                status = r->n_done || !outstanding ? W_READY : W_PENDING;
            }
            if (status != W_READY && r->stopping) status = W_CLOSED;
            if (status != W_PENDING) break;
            uint64_t now = now_ns();
            if (now >= deadline) {
                status = W_TIMEOUT;
                break;
            }
            if (now >= slice_end) {
                status = W_SLICE;
                break;
            }
            cond_wait_until(&r->done, &r->mu, deadline < slice_end ? deadline : slice_end);
        }
        if (status == W_READY || status == W_TIMEOUT) {
            taken = malloc(sizeof(Completion) * (size_t)(r->n_done + 1));
            if (taken) nout = take_done(r, tags, ntags, taken);
            else nomem = 1;
        }
        pthread_mutex_unlock(&r->mu);
        Py_END_ALLOW_THREADS
        if (status != W_SLICE) break;
        if (PyErr_CheckSignals() < 0) goto done; /* e.g. KeyboardInterrupt; nothing taken */
    }
    if (nomem) PyErr_NoMemory();
    else if (status == W_UNKNOWN)
        PyErr_Format(PyExc_KeyError, "tag %lld is not queued, in flight or completed", unknown);
    else if (status == W_CLOSED) PyErr_SetString(PyExc_ValueError, "Reader closed during wait");
    else out = completion_list(taken, nout);
done:
    free(taken);
    PyMem_RawFree(tags);
    return out;
}

static PyObject *Reader_poll(ReaderObject *r, PyObject *unused) {
    pthread_mutex_lock(&r->mu);
    Completion *taken = malloc(sizeof(Completion) * (size_t)(r->n_done + 1));
    Py_ssize_t n = taken ? take_done(r, NULL, 0, taken) : 0;
    pthread_mutex_unlock(&r->mu);
    PyObject *out = taken ? completion_list(taken, n) : PyErr_NoMemory();
    free(taken);
    return out;
}

static PyObject *set_paused(ReaderObject *r, int paused) {
    pthread_mutex_lock(&r->mu);
    r->paused = paused;
    wake_work(r, 1);
    pthread_mutex_unlock(&r->mu);
    Py_RETURN_NONE;
}
static PyObject *Reader_pause(ReaderObject *r, PyObject *u) { return set_paused(r, 1); }
static PyObject *Reader_resume(ReaderObject *r, PyObject *u) { return set_paused(r, 0); }

static PyObject *Reader_stats(ReaderObject *r, PyObject *unused) {
    size_t per_worker = sizeof(unsigned long long) * (size_t)r->nthreads;
    unsigned long long *busy_ns = PyMem_RawMalloc(2 * per_worker), *verify_ns;
    if (!busy_ns) return PyErr_NoMemory();
    verify_ns = busy_ns + r->nthreads;
    pthread_mutex_lock(&r->mu);
    unsigned long long bytes = r->bytes_read, reqs = r->requests_done, errs = r->errors,
                       verified = r->verified, split = r->split_requests,
                       copies = r->device_copies, copy_ns = r->device_copy_ns,
                       regrown = r->bounce_regrown, urgent_reads = r->urgent_reads,
                       urgent_ns = r->urgent_ns, urgent_max = r->urgent_max_ns,
                       urgent_queued = r->urgent_queued_ns, spin_takes = r->spin_takes,
                       urgent_parts = r->urgent_parts, urgent_pread = r->urgent_pread_ns,
                       urgent_verify = r->urgent_verify_ns, urgent_copy = r->urgent_copy_ns,
                       queued_words = __atomic_load_n(&r->words_queued, __ATOMIC_RELAXED),
                       held = __atomic_load_n(&r->copies_held, __ATOMIC_RELAXED),
                       stopped = __atomic_load_n(&r->gates_stopped, __ATOMIC_RELAXED),
                       given_up = r->words_given_up,
                       spread_wakes = __atomic_load_n(&r->spread_wakes, __ATOMIC_RELAXED);
    Py_ssize_t nu = q_size(&r->urgent), na = q_size(&r->ahead), nd = r->n_done;
    int inflight = 0, preading_max = r->preading_max;
    for (int w = 0; w < r->nthreads; w++) inflight += r->reading[w] + r->behind_on[w];
    memcpy(busy_ns, r->busy_ns, per_worker);
    memcpy(verify_ns, r->verify_ns, per_worker);
    pthread_mutex_unlock(&r->mu);
    PyObject *busy = PyList_New(r->nthreads), *verify = PyList_New(r->nthreads);
    for (int w = 0; busy && verify && w < r->nthreads; w++) {
        PyObject *b = PyLong_FromUnsignedLongLong(busy_ns[w]);
        PyObject *v = PyLong_FromUnsignedLongLong(verify_ns[w]);
        PyList_SET_ITEM(busy, w, b); /* a NULL item is dropped with its list below */
        PyList_SET_ITEM(verify, w, v);
        if (!b || !v) Py_CLEAR(busy);
    }
    PyMem_RawFree(busy_ns);
    if (!busy || !verify) {
        Py_XDECREF(busy);
        Py_XDECREF(verify);
        return NULL;
    }
    PyObject *d = Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:N,s:N,s:n,s:n,s:i,s:n,s:i,s:K,s:K,s:K,s:K,"
                         "s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}",
                         "bytes_read", bytes, "requests_done", reqs, "errors", errs,
                         "verified", verified, "split", split, "busy_ns", busy,
                         "verify_ns", verify, "queued_urgent", nu, "queued_ahead", na,
                         "in_flight", inflight, "completions", nd, "preads_max", preading_max,
                         "device_copies", copies, "device_copy_ns", copy_ns,
                         "bounce_regrown", regrown, "words_by_driver", queued_words,
                         "urgent_reads", urgent_reads, "urgent_ns", urgent_ns,
                         "urgent_max_ns", urgent_max, "urgent_queued_ns", urgent_queued,
                         "spin_takes", spin_takes, "urgent_parts", urgent_parts,
                         "urgent_pread_ns", urgent_pread, "urgent_verify_ns", urgent_verify,
                         "urgent_copy_ns", urgent_copy, "copies_held", held,
                         "words_given_up", given_up, "spread_wakes", spread_wakes,
                         "gates_stopped", stopped);
    if (d && quick_stats(r, d) < 0) Py_CLEAR(d);
    return d;
}

static PyObject *Reader_reset_stats(ReaderObject *r, PyObject *unused) {
    pthread_mutex_lock(&r->mu);
    r->bytes_read = r->requests_done = r->errors = r->verified = r->split_requests = 0;
    r->device_copies = r->device_copy_ns = r->bounce_regrown = 0;
    r->urgent_reads = r->urgent_ns = r->urgent_max_ns = r->urgent_queued_ns = 0;
    r->spin_takes = r->urgent_parts = r->urgent_pread_ns = r->urgent_verify_ns = 0;
    r->urgent_copy_ns = r->words_given_up = 0;
    quick_reset_stats(r);
    __atomic_store_n(&r->words_queued, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&r->copies_held, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&r->gates_stopped, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&r->spread_wakes, 0, __ATOMIC_RELAXED);
    r->preading_max = r->preading;
    memset(r->busy_ns, 0, sizeof(unsigned long long) * (size_t)r->nthreads);
    memset(r->verify_ns, 0, sizeof(unsigned long long) * (size_t)r->nthreads);
    pthread_mutex_unlock(&r->mu);
    Py_RETURN_NONE;
}

static PyObject *Reader_close(ReaderObject *r, PyObject *unused) {
    if (!r->closing) {
        r->closing = 1; /* set with the GIL held: a second close() returns at once */
        stop_workers(r, 1);
    }
    Py_RETURN_NONE;
}

static int set_flags(int fd, int fd_flags, int fl_flags) {
    return fcntl(fd, F_SETFD, fcntl(fd, F_GETFD) | fd_flags) < 0 ||
           fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | fl_flags) < 0;
}

static PyObject *Reader_notify_fd(ReaderObject *r, PyObject *unused) {
    if (check_open(r) < 0) return NULL;
    if (r->notify_r < 0) {
        int p[2];
        if (pipe(p) < 0) return PyErr_SetFromErrno(PyExc_OSError);
        if (set_flags(p[0], FD_CLOEXEC, O_NONBLOCK) || set_flags(p[1], FD_CLOEXEC, O_NONBLOCK)) {
            close(p[0]);
            close(p[1]);
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        pthread_mutex_lock(&r->mu);
        r->notify_r = p[0];
        r->notify_w = p[1];
        r->notified = 0;
        if (r->n_done) notify(r); /* completions already waiting */
        pthread_mutex_unlock(&r->mu);
    }
    return PyLong_FromLong(r->notify_r);
}

static PyObject *Reader_ack(ReaderObject *r, PyObject *unused) {
    if (r->notify_r < 0) Py_RETURN_NONE;
    char buf[64];
    /* Drain, then re-arm: a completion before the re-arm wrote no byte but is collected by
     * the caller's poll that follows; one after it writes a new byte. (Re-arming first
     * would let a byte written between the two be drained with the flag left set: every
     * later completion would go unannounced.) */
    while (read(r->notify_r, buf, sizeof buf) > 0) {
    }
    pthread_mutex_lock(&r->mu);
    r->notified = 0;
    pthread_mutex_unlock(&r->mu);
    Py_RETURN_NONE;
}

static PyObject *Reader_notify_below(ReaderObject *r, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    pthread_mutex_lock(&r->mu);
    r->notify_below = n < 0 ? -1 : n;
    if (n >= 0) announce(r, 0);
    pthread_mutex_unlock(&r->mu);
    Py_RETURN_NONE;
}

static PyObject *Reader_queued(ReaderObject *r, PyObject *unused) {
    pthread_mutex_lock(&r->mu);
    Py_ssize_t n = 0;
    if (!r->split) { /* no split request: every queued item is one request */
        n = q_size(&r->urgent) + q_size(&r->ahead);
        pthread_mutex_unlock(&r->mu);
        return PyLong_FromSsize_t(n);
    }
    for (int u = 0; u < 2; u++) { /* requests, not parts: a split one counts by its lead */
        const Queue *q = u ? &r->ahead : &r->urgent;
        for (Py_ssize_t i = q->head; i < q->len; i++)
            n += !q->items[i].group || q->items[i].lead;
    }
    pthread_mutex_unlock(&r->mu);
    return PyLong_FromSsize_t(n);
}

static PyObject *get_workers(ReaderObject *r, void *c) { return PyLong_FromLong(r->nworkers); }
static PyObject *get_closed(ReaderObject *r, void *c) { return PyBool_FromLong(r->closing); }
static PyObject *get_words_by_driver(ReaderObject *r, void *c) {
    return PyBool_FromLong(__atomic_load_n(&r->words_by_driver, __ATOMIC_RELAXED));
}
/* A switch the workers read with no lock, set from Python's truth of v. */
static int set_switch(int *field, PyObject *v, const char *name) {
    int on = v ? PyObject_IsTrue(v) : -1;
    if (on < 0) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "%s needs a bool", name);
        return -1;
    }
    __atomic_store_n(field, on, __ATOMIC_RELAXED);
    return 0;
}
static int set_words_by_driver(ReaderObject *r, PyObject *v, void *c) {
    return set_switch(&r->words_by_driver, v, "words_by_driver");
}

static PyObject *get_verify_in_copy(ReaderObject *r, void *c) {
    return PyBool_FromLong(__atomic_load_n(&r->verify_in_copy, __ATOMIC_RELAXED));
}
static int set_verify_in_copy(ReaderObject *r, PyObject *v, void *c) {
    return set_switch(&r->verify_in_copy, v, "verify_in_copy");
}

static PyObject *get_spread(ReaderObject *r, void *c) {
    return PyBool_FromLong(__atomic_load_n(&r->spread, __ATOMIC_RELAXED));
}
static int set_spread(ReaderObject *r, PyObject *v, void *c) {
    return set_switch(&r->spread, v, "spread");
}

static PyObject *get_copy_held_us(ReaderObject *r, void *c) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&r->held_ns, __ATOMIC_RELAXED) / 1000);
}
static int set_copy_held_us(ReaderObject *r, PyObject *v, void *c) {
    if (!v || !PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "copy_held_us needs an int, got %s",
                     v ? Py_TYPE(v)->tp_name : "nothing (it cannot be deleted)");
        return -1;
    }
    int overflow = 0;
    long long us = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (us == -1 && PyErr_Occurred()) return -1;
    if (overflow || us < 0 || us > 60000000) {
        PyErr_Format(PyExc_ValueError, "copy_held_us must be in 0..60000000, got %S", v);
        return -1;
    }
    __atomic_store_n(&r->held_ns, (unsigned long long)us * 1000, __ATOMIC_RELAXED);
    if (r->watching) {
        pthread_mutex_lock(&r->watch_mu);
        pthread_cond_signal(&r->watch_cv);
        pthread_mutex_unlock(&r->watch_mu);
    }
    return 0;
}

static PyObject *get_stop_word(ReaderObject *r, void *c) {
    return PyLong_FromVoidPtr(__atomic_load_n(&r->stop_word, __ATOMIC_ACQUIRE));
}
static int set_stop_word(ReaderObject *r, PyObject *v, void *c) {
    if (!v || !PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "stop_word needs an int address, got %s",
                     v ? Py_TYPE(v)->tp_name : "nothing (it cannot be deleted)");
        return -1;
    }
    void *at = PyLong_AsVoidPtr(v);
    if (!at && PyErr_Occurred()) return -1;
    if ((uintptr_t)at % sizeof(int32_t)) {
        PyErr_Format(PyExc_ValueError, "stop_word %S is not aligned for an int32", v);
        return -1;
    }
    __atomic_store_n(&r->stop_word, (int32_t *)at, __ATOMIC_RELEASE);
    return 0;
}

static PyMethodDef Reader_methods[] = {
    {"open", (PyCFunction)(void (*)(void))Reader_open, METH_VARARGS | METH_KEYWORDS,
     "open(path, direct=True, checksum=None) -> file index"},
    {"is_direct", (PyCFunction)Reader_is_direct, METH_O, "is_direct(file_index) -> bool"},
    {"submit", (PyCFunction)(void (*)(void))Reader_submit, METH_VARARGS | METH_KEYWORDS,
     "submit(requests, urgent=False); requests: [(tag, file, offset, length, dest_address"
     "[, expected_checksum[, (ready_address, ready_value)]])]"},
    {"cancel", (PyCFunction)Reader_cancel, METH_O, "cancel(tags) -> tags removed"},
    {"promote", (PyCFunction)Reader_promote, METH_O, "promote(tags) -> tags moved to urgent"},
    {"wait", (PyCFunction)(void (*)(void))Reader_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(tags=None, timeout=None) -> [(tag, err, bytes_read)]"},
    {"poll", (PyCFunction)Reader_poll, METH_NOARGS, "poll() -> [(tag, err, bytes_read)]"},
    {"pause", (PyCFunction)Reader_pause, METH_NOARGS, "stop starting new reads"},
    {"resume", (PyCFunction)Reader_resume, METH_NOARGS, "start reads again"},
    {"stats", (PyCFunction)Reader_stats, METH_NOARGS, "counters as a dict"},
    {"reset_stats", (PyCFunction)Reader_reset_stats, METH_NOARGS, "zero the counters"},
    {"close", (PyCFunction)Reader_close, METH_NOARGS, "stop workers, close files"},
    {"notify_fd", (PyCFunction)Reader_notify_fd, METH_NOARGS,
     "notify_fd() -> read end of the completion pipe"},
    {"ack", (PyCFunction)Reader_ack, METH_NOARGS, "re-arm notify_fd and drain it"},
    {"notify_below", (PyCFunction)Reader_notify_below, METH_O,
     "notify_below(n): notify_fd announces only while fewer than n requests are queued "
     "(n < 0: at every completion)"},
    {"queued", (PyCFunction)Reader_queued, METH_NOARGS, "requests queued, not yet started"},
    {"quick_arm", (PyCFunction)Reader_quick_arm, METH_VARARGS,
     "quick_arm(table, npos, nexp, file, length, offsets, sums[, ahead_floor]) -> the flight "
     "bytes"},
    {"quick_give", (PyCFunction)Reader_quick_give, METH_O,
     "quick_give([(slot, address)]): slots into the reserve"},
    {"quick_take", (PyCFunction)Reader_quick_take, METH_NOARGS,
     "quick_take() -> the reserve's slots, taken back"},
    {"quick_free", (PyCFunction)Reader_quick_free, METH_NOARGS,
     "quick_free() -> slots in the reserve"},
    {"quick_watch", (PyCFunction)Reader_quick_watch, METH_VARARGS,
     "quick_watch(board, seq, k, pos[, ahead]) -> watches posted"},
    {"quick_wait", (PyCFunction)Reader_quick_wait, METH_VARARGS,
     "quick_wait(n, timeout_s) -> whether n watches are done"},
    {"quick_claims", (PyCFunction)Reader_quick_claims, METH_NOARGS,
     "quick_claims() -> [(pos, expert, slot, tag, urgent)] queued since the last call"},
    {"quick_drop", (PyCFunction)Reader_quick_drop, METH_NOARGS, "quick_drop(): watches dropped"},
    {NULL},
};

static PyGetSetDef Reader_getset[] = {
    {"workers", (getter)get_workers, NULL, "number of worker threads", NULL},
    {"closed", (getter)get_closed, NULL, "True after close()", NULL},
    {"words_by_driver", (getter)get_words_by_driver, (setter)set_words_by_driver,
     "copy_behind: read-ahead's ready words stored by the driver as its copies land (True), "
     "or by the worker once it has waited for them", NULL},
    {"verify_in_copy", (getter)get_verify_in_copy, (setter)set_verify_in_copy,
     "device copies waited for at once: a record's checksum taken while its copy runs "
     "(a mismatched record reaches its slot, its read still failed)", NULL},
    {"spread", (getter)get_spread, (setter)set_spread,
     "split reads: each request of an urgent batch no larger than the idle workers in up to "
     "`idle` parts (not idle / n), a worker woken for each part", NULL},
    {"copy_held_us", (getter)get_copy_held_us, (setter)set_copy_held_us,
     "device copies: one a gate waits on, still not done this many us after it was queued, "
     "gives its gate up (its ready word READY_FAILED); 0: never", NULL},
    {"stop_word", (getter)get_stop_word, (setter)set_stop_word,
     "the address of an int32 set to 1 while a copy is held past copy_held_us (every gate "
     "polling it gives up); 0: none. It must outlive the reader or be set to 0 first", NULL},
    {NULL},
};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "strata_mlx._reader.Reader",
    .tp_basicsize = sizeof(ReaderObject),
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Reader(workers=8, start_paused=False, bounce=False, split=0, overlap=False, "
              "device_copy=False, copy_behind=False, record_bytes=0, spin_us=0, spinners=-1): "
              "native pread worker pool (strata_mlx.stream.reader.Reader documents each)",
    .tp_methods = Reader_methods,
    .tp_getset = Reader_getset,
    .tp_new = Reader_new,
};

/* ---------------------------------------------------------------- checksums */

#define CHECKSUM_GIL_BYTES 65536 /* smaller buffers keep the GIL: releasing costs more */

static PyObject *checksum_call(PyObject *args, int table) {
    PyObject *name;
    Py_buffer view;
    unsigned long value = 0;
    if (!PyArg_ParseTuple(args, "Oy*|k:checksum", &name, &view, &value)) return NULL;
    int kind = checksum_kind(name);
    if (kind <= 0) {
        if (kind == 0) PyErr_SetString(PyExc_ValueError, "checksum must be 'crc32' or 'crc32c'");
        PyBuffer_Release(&view);
        return NULL;
    }
    uint32_t crc = (uint32_t)value;
    if (view.len >= CHECKSUM_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        crc = table ? checksum_update_table(kind, crc, view.buf, (size_t)view.len)
                    : checksum_update(kind, crc, view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        crc = table ? checksum_update_table(kind, crc, view.buf, (size_t)view.len)
                    : checksum_update(kind, crc, view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *mod_checksum(PyObject *m, PyObject *args) { return checksum_call(args, 0); }
static PyObject *mod_checksum_table(PyObject *m, PyObject *args) { return checksum_call(args, 1); }

static PyObject *mod_checksum_combine(PyObject *m, PyObject *args) {
    PyObject *name;
    unsigned int crc1, crc2;
    unsigned long long len2;
    if (!PyArg_ParseTuple(args, "OIIK:checksum_combine", &name, &crc1, &crc2, &len2)) return NULL;
    int kind = checksum_kind(name);
    if (kind < 0) return NULL;
    if (kind == CHECKSUM_NONE) {
        PyErr_SetString(PyExc_ValueError, "checksum_combine: 'crc32' or 'crc32c'");
        return NULL;
    }
    return PyLong_FromUnsignedLong(checksum_combine(kind, crc1, crc2, len2));
}

static PyObject *mod_checksum_impl(PyObject *m, PyObject *name) {
    int kind = checksum_kind(name);
    if (kind <= 0) {
        if (kind == 0) PyErr_SetString(PyExc_ValueError, "checksum must be 'crc32' or 'crc32c'");
        return NULL;
    }
    return PyUnicode_FromString(checksum_impl(kind));
}

static PyObject *mod_advise_hugepages(PyObject *m, PyObject *args) {
    unsigned long long addr;
    Py_ssize_t len;
    int zeroed = 0;
    if (!PyArg_ParseTuple(args, "Kn|p:advise_hugepages", &addr, &len, &zeroed)) return NULL;
    if (!addr || len < 0) {
        PyErr_SetString(PyExc_ValueError, "advise_hugepages: a NULL address or a negative length");
        return NULL;
    }
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = advise_huge((void *)(uintptr_t)addr, (size_t)len, zeroed);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

static PyObject *mod_device_copy_error(PyObject *m, PyObject *unused) {
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = devcopy_init(0);
    Py_END_ALLOW_THREADS
    if (rc == 0) Py_RETURN_NONE;
    return PyUnicode_FromString(devcopy_error());
}

static PyObject *mod_prefer_device(PyObject *m, PyObject *args) {
    unsigned long long addr;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "Kn:prefer_device", &addr, &len)) return NULL;
    if (!addr || len <= 0) {
        PyErr_SetString(PyExc_ValueError, "prefer_device: a NULL address or an empty range");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = devcopy_init(0);
    if (rc == 0) rc = devcopy_prefer_device((void *)(uintptr_t)addr, (size_t)len, 0);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_Format(PyExc_RuntimeError, "prefer_device: CUDA error %d %s", rc, devcopy_error());
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *mod_map_host(PyObject *m, PyObject *args) {
    unsigned long long addr, device = 0;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "Kn:map_host", &addr, &len)) return NULL;
    if (!addr || len <= 0 || addr % 4096) {
        PyErr_SetString(PyExc_ValueError, "map_host: a NULL or unaligned address, or an empty range");
        return NULL;
    }
    int rc, init;
    Py_BEGIN_ALLOW_THREADS
    init = rc = devcopy_init(0);
    if (rc == 0) rc = devcopy_map_host((void *)(uintptr_t)addr, (size_t)len, &device);
    Py_END_ALLOW_THREADS
    if (init) {
        PyErr_Format(PyExc_RuntimeError, "map_host: %s", devcopy_error());
        return NULL;
    }
    if (rc) {
        PyErr_Format(PyExc_RuntimeError, "map_host: registering %zd bytes for the device "
                     "failed (CUresult %d)", len, rc);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(device);
}

static PyObject *mod_unmap_host(PyObject *m, PyObject *args) {
    unsigned long long addr;
    if (!PyArg_ParseTuple(args, "K:unmap_host", &addr)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = devcopy_unmap_host((void *)(uintptr_t)addr);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_Format(PyExc_RuntimeError, "unmap_host: CUDA error %d", rc);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* replace_words(address, count, from, to): each int32 word of the range that holds `from` takes
 * `to`, in one atomic step a word, so that a store another thread makes meanwhile (a reader's
 * thread landing a ready word) is never overwritten; the number replaced. */
static PyObject *mod_replace_words(PyObject *m, PyObject *args) {
    unsigned long long addr;
    Py_ssize_t count;
    int from, to;
    if (!PyArg_ParseTuple(args, "Knii:replace_words", &addr, &count, &from, &to)) return NULL;
    if (count < 0 || (count && (!addr || addr % sizeof(int32_t)))) {
        PyErr_SetString(PyExc_ValueError, "replace_words: a NULL or unaligned address, or a "
                                          "negative count");
        return NULL;
    }
    int32_t *w = (int32_t *)(uintptr_t)addr;
    Py_ssize_t replaced = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        int32_t expected = from;
        if (__atomic_load_n(&w[i], __ATOMIC_RELAXED) == from &&
            __atomic_compare_exchange_n(&w[i], &expected, to, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED))
            replaced++;
    }
    return PyLong_FromSsize_t(replaced);
}

/* wait_word(address, value, timeout_s): until the int32 word at address holds value or
 * timeout_s has passed (None), outside the GIL: a word a device stores into mapped host
 * memory. Polled without sleeping for its first 100 us (a sleep's wake-up takes tens of us
 * of timer slack, a fair share of a decode layer), then between sleeps of a few us. Seen: the
 * seconds from seeing it to holding the GIL again (what another thread's hold of the GIL
 * added to the wait); 0.0 for a word already in when called, the GIL never let go of. */
static PyObject *mod_wait_word(PyObject *m, PyObject *args) {
    unsigned long long addr;
    int value;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "Kid:wait_word", &addr, &value, &timeout_s)) return NULL;
    if (!addr || addr % sizeof(int32_t) || !(timeout_s >= 0)) {
        PyErr_SetString(PyExc_ValueError, "wait_word: a NULL or unaligned address, or a "
                                          "negative timeout");
        return NULL;
    }
    const int32_t *w = (const int32_t *)(uintptr_t)addr;
    /* Already in: the GIL is kept (let go of, a thread waiting for it would take it and this
     * one would wait for its turn: a check running behind the device finds its word in) */
    if (__atomic_load_n(w, __ATOMIC_ACQUIRE) == value) return PyFloat_FromDouble(0.0);
    int seen;
    uint64_t seen_at;
    Py_BEGIN_ALLOW_THREADS
    uint64_t start = now_ns(), end = start + (uint64_t)(timeout_s * 1e9), now = start;
    struct timespec pause = {0, 5000};
    while (!(seen = __atomic_load_n(w, __ATOMIC_ACQUIRE) == value) && now < end) {
        if (now - start > 100000)
            nanosleep(&pause, NULL);
        now = now_ns();
    }
    seen_at = now_ns();
    Py_END_ALLOW_THREADS
    if (!seen) Py_RETURN_NONE;
    return PyFloat_FromDouble((double)(now_ns() - seen_at) * 1e-9);
}

static PyObject *mod_limit_drive(PyObject *m, PyObject *arg) {
    double bps = PyFloat_AsDouble(arg);
    if (bps == -1.0 && PyErr_Occurred()) return NULL;
    if (!(bps >= 0) || bps == HUGE_VAL) {
        PyErr_SetString(PyExc_ValueError, "limit_drive: bytes a second must be >= 0 and finite");
        return NULL;
    }
    pthread_mutex_lock(&drive_mu);
    drive_ns_per_byte = bps > 0 ? 1e9 / bps : 0.0;
    drive_free_ns = 0;
    pthread_mutex_unlock(&drive_mu);
    Py_RETURN_NONE;
}

static PyObject *mod_drive_limit(PyObject *m, PyObject *unused) {
    pthread_mutex_lock(&drive_mu);
    double per_byte = drive_ns_per_byte;
    pthread_mutex_unlock(&drive_mu);
    return PyFloat_FromDouble(per_byte > 0 ? 1e9 / per_byte : 0.0);
}

static PyMethodDef module_methods[] = {
    {"device_copy_error", mod_device_copy_error, METH_NOARGS,
     "device_copy_error() -> None where CUDA copies can run, else why not"},
    {"prefer_device", mod_prefer_device, METH_VARARGS,
     "prefer_device(address, nbytes): keep managed memory on CUDA device 0 and move it there"},
    {"map_host", mod_map_host, METH_VARARGS,
     "map_host(address, nbytes) -> device address: page-locked host memory the CUDA device "
     "reads in place"},
    {"unmap_host", mod_unmap_host, METH_VARARGS, "unmap_host(address): undo map_host"},
    {"wait_word", mod_wait_word, METH_VARARGS,
     "wait_word(address, value, timeout_s) -> None if the int32 word did not come to hold "
     "value in time, else the seconds from seeing it to holding the GIL again"},
    {"replace_words", mod_replace_words, METH_VARARGS,
     "replace_words(address, count, old, new) -> int32 words that held old and now hold new"},
    {"advise_hugepages", mod_advise_hugepages, METH_VARARGS,
     "advise_hugepages(address, nbytes, zeroed=False) -> bool: huge pages from the next fault"},
    {"checksum", mod_checksum, METH_VARARGS,
     "checksum(name, data, value=0) -> int: 'crc32' (zlib's) or 'crc32c' of a buffer"},
    {"checksum_combine", mod_checksum_combine, METH_VARARGS,
     "checksum_combine(name, crc_a, crc_b, len_b) -> checksum(name, a + b)"},
    {"checksum_table", mod_checksum_table, METH_VARARGS,
     "checksum_table(name, data, value=0): the same by the portable tables (tests)"},
    {"limit_drive", mod_limit_drive, METH_O,
     "limit_drive(bytes_per_second): every reader's reads share a drive of that bandwidth (0: none)"},
    {"drive_limit", mod_drive_limit, METH_NOARGS, "drive_limit() -> bytes a second (0: none)"},
    {"checksum_impl", mod_checksum_impl, METH_O,
     "checksum_impl(name) -> 'sse4.2' | 'pclmul' | 'armv8-crc' | 'table'"},
    {NULL},
};

static struct PyModuleDef reader_module = {
    PyModuleDef_HEAD_INIT, "_reader", "Native direct-I/O reader threads (see strata_mlx.reader).",
    -1, module_methods,
};

PyMODINIT_FUNC PyInit__reader(void) {
    checksum_init();
    if (PyType_Ready(&ReaderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&reader_module);
    if (!m) return NULL;
    Py_INCREF(&ReaderType);
    if (PyModule_AddObject(m, "Reader", (PyObject *)&ReaderType) < 0 ||
        PyModule_AddIntConstant(m, "ALIGNMENT", ALIGNMENT) < 0 ||
        PyModule_AddIntConstant(m, "SHORT_READ", SHORT_READ) < 0 ||
        PyModule_AddIntConstant(m, "CHECKSUM_MISMATCH", CHECKSUM_MISMATCH) < 0 ||
        PyModule_AddIntConstant(m, "DEVICE_COPY_FAILED", DEVICE_COPY_FAILED) < 0 ||
        PyModule_AddIntConstant(m, "READY_FAILED", READY_FAILED) < 0 ||
        PyModule_AddIntConstant(m, "QUICK_MAX_AHEAD", QUICK_MAX_AHEAD) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
