/* The reader's types, shared by reader.c and quick.c (quick misses). */
#ifndef STRATA_READER_H
#define STRATA_READER_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* O_DIRECT */
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>

#include "quick.h"

/* (the extension's own functions shared between its files: not exported from it) */
#define INTERNAL __attribute__((visibility("hidden")))

#define ALIGNMENT 4096
#define SHORT_READ (-1)
#define CHECKSUM_MISMATCH (-2)
#define DEVICE_COPY_FAILED (-3)
#define READY_PENDING (-1) /* a ready word's value from its request's submission until it lands */
#define READY_FAILED (-3)  /* ... and once its read failed (strata_mlx.stream.gate) */
#define MAX_CHUNK ((size_t)1 << 30)      /* one pread at most 1 GiB (Linux and macOS limits) */
#define WAIT_SLICE_NS 100000000ULL       /* wait() re-takes the GIL this often to see Ctrl-C */

/* A request read as several parts by several workers (split reads, see Reader_submit): one
 * completion, reported by the worker that finishes the last part, after it has verified the
 * whole record where a checksum is expected: from the parts' checksums, each taken where its
 * part was read (so a record whose parts land in device memory is verified too), combined in
 * order (checksum_combine). Guarded by mu; freed with its completion. */
typedef struct {
    long long tag;
    int parts, pending, started; /* parts in all; not finished; taken by a worker */
    int err;                     /* the first error of any part */
    long long nread;             /* bytes read by all parts */
    char *dest;
    Py_ssize_t length;
    uint32_t expected;
    char verify;
    int32_t *ready; /* the request's ready word (see Request), or NULL */
    int32_t ready_value;
    Py_ssize_t part;  /* bytes a part (the last may be shorter) */
    uint64_t submitted; /* now_ns() at an urgent submission, else 0 (Request.submitted) */
    uint32_t crcs[];  /* with verify: each part's checksum, taken by the thread that read it */
} Group;

typedef struct {
    long long tag;
    int file;
    long long offset;
    Py_ssize_t length;
    char *dest;
    uint32_t expected; /* the checksum of the `length` bytes, where `verify` */
    char verify;
    Group *group; /* a part of a split request (its checksum is the group's), or NULL */
    char lead;    /* the group's first part: queued() counts requests, not parts */
    /* Where the record's landing is announced to a device that waits for it (the decode
     * gate, strata_mlx.stream.gate), with release order: READY_PENDING as the request is
     * submitted; `ready_value` once the whole record sits verified in `dest` (a device copy
     * completed), before the completion is reported; READY_FAILED instead when the read
     * failed (an I/O error, a short read, a checksum mismatch, a failed device copy), so that
     * a device waiting for it gives up at once; nothing more for a request cancelled before
     * it started. NULL: no word. */
    int32_t *ready;
    int32_t ready_value;
    /* now_ns() at submission for a request submitted urgent (a miss), else 0: its latency to
     * landing (its ready word stored, its completion reported, the read failed or not) goes
     * into the urgent_* stats. (A read-ahead request promoted later does not count; urgent
     * requests never take copy_behind's deferred path, which would not count them.) */
    uint64_t submitted;
} Request;

typedef struct {
    long long tag;
    int err;
    long long nread;
} Completion;

typedef struct { /* FIFO: live items are items[head .. len) */
    Request *items;
    Py_ssize_t head, len, cap;
} Queue;

typedef struct ReaderObject ReaderObject;
typedef struct {
    ReaderObject *reader;
    int index;
} WorkerArg;

struct ReaderObject {
    PyObject_HEAD
    int nworkers, nstarted, sync_ready, closing;
    /* threads: nworkers, or 2 x nworkers with overlap (a pread slot is let go of before the
     * bounce copy and the checksum, so `nworkers` preads stay in flight while other threads
     * finish theirs); per-thread arrays below are nthreads long */
    int nthreads, overlap;
    int preading, preading_max; /* threads inside a pread now; the most at once (mu) */
    int bounce; /* read into a per-worker buffer, then copy into dest (see worker_main) */
    int device_copy; /* that copy by the GPU's copy engine from pinned memory (devcopy.h) */
    int copy_behind; /* read-ahead's copy waited for after the worker's next read (worker_main) */
    /* copy_behind: a read-ahead record's ready word stored by the driver's host function as
     * its copy lands (a gate waiting for it sees it at once), else by the worker once it has
     * waited for the copy (after its next read): no host function queued on the copy's
     * stream, whose next copy then waits for none. Read by the workers with no lock. */
    int words_by_driver;
    /* A record copied by the device and waited for at once (a miss, a split part): its
     * checksum taken while the copy engine reads the same buffer, not before the copy starts
     * (a mismatched record then reaches its slot, its read still failed). Read by the
     * workers with no lock. */
    int verify_in_copy;
    /* Split reads: each request of an urgent batch of at most `idle` requests in up to
     * `idle` parts, not `idle / n` (the batch's parts spread over every idle worker, queued
     * beyond them where there are more: a batch of misses lands when its last part does, so
     * its bytes over every worker set its time; read-ahead and prefill's large batches of
     * misses keep their larger parts). */
    int spread;
    /* Parts of spread batches queued and not yet woken for (mu): the submitter wakes a worker
     * for each once it lets go of mu (wake_spread), not one that wakes the next as it takes a
     * part, so a miss's parts start one wake-up after they are queued, not one after another;
     * `spread_wakes` counts those wake-ups (atomic). */
    Py_ssize_t wake_owed;
    unsigned long long spread_wakes;
    /* A device copy whose ready word a gate may wait on, still not done this long after it
     * was queued (ns; 0: never), is held behind the device, and so behind that gate (another
     * thread freeing device or pinned memory while the gate spins waits in the driver for the
     * device to go idle, holding copies queued meanwhile: benchmarks/held_copy_probe.py): the
     * watcher thread turns its word from pending to READY_FAILED, and those of the reads
     * still queued, the gates give up at once (their token is recomputed) instead of after
     * their timeout, and the copies land once the device is idle. copies_held counts them.
     * Per worker, its copy in flight: the word (NULL: none) and when it was queued, stored by
     * the worker, read by the watcher (atomics).
     * While a copy is held, stop_word (NULL: none; a word of the gate table's mapped memory
     * that every gate polls beside its own) is set to 1: a gate waiting on a word no read
     * has been submitted for yet (its check's thread waiting on the thread held in the
     * driver) gives up too, the device goes idle and the hold ends. The decoder clears it
     * once its token's gates have run. gates_stopped counts its rises from 0. */
    unsigned long long held_ns, copies_held, gates_stopped;
    int32_t *stop_word;
    int32_t **copy_word;
    uint64_t *copy_since;
    pthread_t watcher; /* (with device_copy) */
    int watching, watch_stop;
    pthread_mutex_t watch_mu;
    pthread_cond_t watch_cv;
    Py_ssize_t split; /* smallest part of a split request in bytes; 0: never split */
    pthread_t *threads;
    WorkerArg *args;
    pthread_mutex_t mu;
    pthread_cond_t work; /* workers sleep here: queued work, resume or stop */
    pthread_cond_t done; /* wait() sleeps here: a completion, a cancel or close */
    /* --- guarded by mu --- */
    int paused, stopping;
    Queue urgent, ahead;
    Completion *done_items;
    Py_ssize_t n_done, cap_done;
    long long *current; /* per worker: tag being read, valid while reading[w] */
    char *reading;
    long long *behind; /* copy_behind, per worker: the tag whose copy runs, valid while behind_on[w] */
    char *behind_on;
    int *fds, nfiles, cap_files;
    char *direct, *checksum; /* per file: opened O_DIRECT; CHECKSUM_* of its records */
    unsigned long long bytes_read, requests_done, errors, verified, *busy_ns, *verify_ns;
    unsigned long long split_requests; /* requests read in parts */
    unsigned long long device_copies, device_copy_ns; /* copies by the copy engine, their time */
    /* requests submitted urgent and landed (or failed): how many; their ns from submission
     * to landing, in all and the longest; their ns from submission to a worker taking them
     * (or their first part) up (mu) */
    unsigned long long urgent_reads, urgent_ns, urgent_max_ns, urgent_queued_ns;
    /* their reads (or parts) by a thread: how many; ns in the pread, the checksum, the copy
     * into the destination (mu) */
    unsigned long long urgent_parts, urgent_pread_ns, urgent_verify_ns, urgent_copy_ns;
    /* bounce buffers are made at least this large (bytes; 0: as large as the read needing
     * them), and how many were let go of for a larger one since (mu) */
    Py_ssize_t bounce_min;
    unsigned long long bounce_regrown;
    unsigned long long words_queued; /* ready words left to the driver's host function */
    unsigned long long words_given_up; /* queued reads' words given up while a copy was held */
    int notify_r, notify_w; /* the completion pipe (-1 until notify_fd()), its ends */
    int notified;           /* a byte was written since the last ack() */
    Py_ssize_t notify_below; /* announce only while fewer requests are queued (-1: always) */
    /* Spinning: a worker with nothing to read polls `posted` for up to spin_ns before it
     * sleeps, while fewer than `spinners` do. A sleeping thread's wake-up is a round trip
     * through the OS scheduler (38-107 us measured on H100 machines before a decode miss's
     * read was taken up, 14-18 with threads polling); a polling one takes the read at once.
     * `posted` (atomic) counts wake-ups of r->work: work queued, resumed, stopping. */
    uint64_t spin_ns;
    int spinners, spinning; /* spinning: changed under mu, atomically (read without mu) */
    unsigned long long posted;
    unsigned long long spin_takes; /* reads taken by a worker that was spinning (mu) */
    Quick quick; /* quick misses (quick.c) */
};


INTERNAL uint64_t now_ns(void);
INTERNAL int check_open(ReaderObject *r); /* -1 and ValueError where closed */
INTERNAL int promote_word(ReaderObject *r, const int32_t *word);
INTERNAL PyObject *tag_list(const long long *tags, Py_ssize_t n); /* a list of ints */
INTERNAL void wake_work(ReaderObject *r, int all);
/* The parts of spread batches queued since the last call, zeroed (mu held). */
INTERNAL Py_ssize_t take_owed(ReaderObject *r);
/* Work queued (mu not held): `owed` (take_owed's) sleeping workers woken, one a part of a
 * spread batch, else as wake_work(r, 0). */
INTERNAL void wake_spread(ReaderObject *r, Py_ssize_t owed);
/* Queue requests (mu held; see Reader_submit): -1 without memory, else the parts queued. */
INTERNAL Py_ssize_t queue_locked(ReaderObject *r, Request *reqs, Py_ssize_t n, int urgent,
                                 int check_flight, long long *skipped, Py_ssize_t *nskipped);

/* quick.c: quick misses (the methods of the same names, without the Reader_ prefix) */
INTERNAL void quick_stop(ReaderObject *r);
INTERNAL void quick_free(ReaderObject *r);
INTERNAL int quick_stats(ReaderObject *r, PyObject *d);
INTERNAL void quick_reset_stats(ReaderObject *r);
INTERNAL PyObject *Reader_quick_arm(ReaderObject *r, PyObject *args);
INTERNAL PyObject *Reader_quick_give(ReaderObject *r, PyObject *arg);
INTERNAL PyObject *Reader_quick_take(ReaderObject *r, PyObject *unused);
INTERNAL PyObject *Reader_quick_free(ReaderObject *r, PyObject *unused);
INTERNAL PyObject *Reader_quick_watch(ReaderObject *r, PyObject *args);
INTERNAL PyObject *Reader_quick_wait(ReaderObject *r, PyObject *args);
INTERNAL PyObject *Reader_quick_claims(ReaderObject *r, PyObject *unused);
INTERNAL PyObject *Reader_quick_drop(ReaderObject *r, PyObject *unused);

#endif
