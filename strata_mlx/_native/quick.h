/* Quick misses (quick.c): the reader takes a gated decode layer's misses off the routing
 * board itself. Its state, a member of the reader (ReaderObject.quick), guarded by the
 * reader's mutex but where said. */
#ifndef STRATA_QUICK_H
#define STRATA_QUICK_H

#include <pthread.h>
#include <stdint.h>

#define QUICK_MAX_IDS 256 /* a layer's ids a watch reads at most (a board row holds fewer) */
#define QUICK_MAX_AHEAD 8 /* later layers a watch reads predictions for at most */

typedef struct {
    int32_t *board; /* the layer's board row: its sequence number, then its ids */
    int32_t seq;    /* the number its routing goes onto the board with */
    int k;          /* the layer's own ids: the first k after the number */
    int pos;        /* the layer's position: its row of the gate table */
    int nahead;     /* then the predictions of lookahead's routers for later layers: */
    int ahead_pos[QUICK_MAX_AHEAD]; /* each one's layer position */
    int ahead_n[QUICK_MAX_AHEAD];   /* and how many ids it has on the board, after k's */
} Watch;

typedef struct { /* a read the watcher queued, for the scheduler's books */
    int pos, expert;
    long long slot, tag;
    int urgent; /* a miss (else read-ahead for a prediction) */
} Claim;

typedef struct {
    int armed;
    int32_t *table;  /* the gate table, [npos][nexp] int32 words */
    uint8_t *flight; /* [npos][nexp]: a read of the record queued and not yet finished by the
                      * scheduler (set here as it is queued, cleared by the scheduler through
                      * the view quick_arm returns); the reader's own memory */
    int npos, nexp, file;
    Py_ssize_t length;    /* a record's bytes */
    long long *offsets;   /* [npos][nexp]: each record's offset in `file` */
    uint32_t *sums;       /* [npos][nexp]: each record's checksum, or NULL: not verified */
    long long *slots;     /* the reserve: free arena slots, their addresses in dests */
    char **dests;
    Py_ssize_t nfree, capfree;
    Py_ssize_t ahead_floor; /* predictions are read only while more slots than this are left */
    Watch *watch; /* layers posted and not yet watched: watch[whead .. wlen) */
    Py_ssize_t whead, wlen, wcap;
    Claim *log; /* reads queued since the scheduler last took them */
    Py_ssize_t nlog, caplog;
    long long posted, watched; /* watches posted; watches done (atomic: read without mu) */
    unsigned long long gen;    /* bumped by drop(): a watch under way is abandoned (atomic) */
    long long tag;             /* the last tag given a read (negative: the scheduler's are not) */
    pthread_t thread;
    int running, stop; /* stop: atomic */
    pthread_cond_t cv; /* a watch posted, a drop, stop */
    /* misses queued; misses left to the scheduler for want of a slot; boards read; boards
     * seen after a wait; predictions' reads queued; queued read-ahead a board's ids promoted */
    unsigned long long reads, dry, boards, late_boards, ahead_reads, promoted;
} Quick;

#endif
