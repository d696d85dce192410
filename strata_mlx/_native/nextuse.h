/* What nextuse.c's NextUse core offers duel.c (one extension module, strata_mlx._nextuse). */
#ifndef STRATA_NEXTUSE_H
#define STRATA_NEXTUSE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* a key's bounds: the cores' layer index is a table by layer, and duel.c sorts a call's keys
 * as layer << 24 | expert */
#define MAX_LAYER (1 << 20)
#define MAX_EXPERT (1 << 24)

typedef struct Core Core;
extern PyTypeObject NuCoreType;
extern PyTypeObject DuelType, EvictableType; /* duel.c, evictable.c: the module's other types */

/* Which resident keys a victim search may take: a Python callable of a (layer, expert) tuple,
 * or (check set) a C function of the same, which calls no Python; `layer_ok` (or NULL): 0
 * where no key of the layer may be taken, so a search passes the layer over whole. */
typedef struct {
    PyObject *fn;
    int (*check)(void *ctx, long layer, int32_t expert); /* 1 yes, 0 no, -1 an error */
    int (*layer_ok)(void *ctx, long layer);              /* 1 maybe, 0 no, -1 an error */
    void *ctx;
} Pred;

/* evictable.c: the Pred of a victim search's `evictable` argument (an Evictable's C check, or
 * the Python callable) */
Pred pred_of(PyObject *evictable);

/* (layer, expert) from a key tuple in range: 0, else -1 and an exception */
int parse_key(PyObject *key, long *layer, long *expert);
/* fn(self, layer, expert) for each key of the sequence `keys`, in order: 0, or -1 (an error
 * set, the keys before the bad one done) */
int each_key(PyObject *keys, void *self, int (*fn)(void *self, long layer, long expert));
/* the layers of the sequence `keys` (each key checked) in a malloc'd array, their number in
 * *n; NULL with an error set */
long *key_layers(PyObject *keys, Py_ssize_t *n);
/* 1 evictable, 0 not, -1 an error */
int is_evictable(const Pred *p, long layer, int32_t expert);

/* 0 where no victim search runs, else -1 and a RuntimeError: a search holds pointers into its
 * state across its evictable calls, and an evictable that changed that state (touched a new
 * layer, pushed to a heap) would move them under it */
int search_idle(int searching);

/* A growable list of keys. */
typedef struct {
    long *layer;
    int32_t *expert;
    Py_ssize_t len, cap;
} Keys;

int keys_append(Keys *k, long layer, int32_t expert);
PyObject *keys_list(const Keys *k);

int nu_touch(Core *s, long layer, long expert);
void nu_remove(Core *s, long layer, long expert);
/* the expected handshakes to the key's next use (inf: never seen, or its layer not in the cycle) */
double nu_distance(Core *s, long layer, long expert);
int nu_set_current(Core *s, int has, long layer); /* has 0: no running layer */
/* 1 and the key in *layer, *expert; 0 none; -1 an error */
int nu_victim(Core *s, const Pred *evictable, long *layer, int32_t *expert);
/* the victims of successive victim calls for `n` keys of these layers, appended to out */
int nu_victims(Core *s, const Pred *evictable, const long *key_layers, Py_ssize_t n, Keys *out);

#endif
