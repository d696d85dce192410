/* nextuse-duel in C: strata_mlx.stream.policies.PyNextUseDuel, set dueling over NextUse trusting
 * the profile, NextUse trusting recent routing and LRU, with miniature shadow arenas.
 *
 * The Python class (policies.Adaptive with those three components) is the reference and
 * documents the policy; tests replay traces through both and compare every victim and each
 * shadow's weighted misses. Here the two NextUse components of the real arena and of the
 * shadows are nextuse.c's cores (called without Python in between), the two LRUs are linked
 * lists over key numbers, and a shadow's "not used by the call that just ended" is a mark,
 * not a Python callable. Live decode calls the policy ~30 times a layer; in Python the duel
 * fanned each call out to three policies and replayed each call's sampled uses through three
 * more: 2-7 ms a token on the H200 (docs/benchmarks.md, "NextUse in C").
 */
#include "nextuse.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define NCOMP 3 /* nextuse, nextuse-recent, lru: the components' order (ties go to the first) */
#define LRU_COMP 2

typedef struct {
    int32_t head, tail; /* key numbers, oldest first; 0: none */
    int32_t *prev, *next;
    uint8_t *in;
} Lru;

typedef struct {
    PyObject_HEAD
    PyObject *core[2][2]; /* [real, shadow][nextuse, nextuse-recent] */
    Lru lru[2];           /* [real, shadow] */
    /* keys by number (from 1, in order of first sight) */
    int32_t **number; /* layer -> expert -> number (0: not seen) */
    Py_ssize_t *number_cap, layers_cap;
    long *layer;
    int32_t *expert;
    uint8_t *resident, *in_call, *held[NCOMP];
    int8_t *sampled; /* 0 not asked yet, 1 the shadows follow the key, -1 not */
    uint32_t *pinned; /* == pin: used by the call the shadows take now */
    Py_ssize_t n_keys, keys_cap;
    Py_ssize_t n_resident, n_held[NCOMP];
    int32_t *call; /* the running call's keys (in_call set) */
    Py_ssize_t call_len, call_cap;
    int64_t *sorted;
    Py_ssize_t sorted_cap;
    uint32_t pin;
    double misses[NCOMP], weight, half_life, growth, sample, rate;
    Py_ssize_t min_shadow_slots, capacity, shadow_slots; /* -1: not known yet */
    int order[NCOMP];
    int has_current;
    long current;
    int searching; /* a victim search runs (search_idle) */
} Duel;

/* ---- keys ------------------------------------------------------------------------------ */

static int32_t find_key(Duel *d, long layer, long expert) {
    if (layer >= d->layers_cap || expert >= d->number_cap[layer]) return 0;
    return d->number[layer][expert];
}

static void *zeroed(void *buf, Py_ssize_t old, Py_ssize_t cap, size_t item) {
    char *p = realloc(buf, (size_t)cap * item);
    if (!p) return PyErr_NoMemory();
    memset(p + (size_t)old * item, 0, (size_t)(cap - old) * item);
    return p;
}

/* one array of the per-key arrays grown; a failure returns from grow_keys, the arrays grown
 * so far larger and keys_cap as it was (each array's size is only ever read from keys_cap) */
#define GROW(field, old, cap)                                                        \
    do {                                                                             \
        if (!(p = zeroed((field), (old), (cap), sizeof(*(field))))) return -1;       \
        (field) = p;                                                                 \
    } while (0)

static int grow_keys(Duel *d) {
    Py_ssize_t k = d->keys_cap, cap = k ? 2 * k : 1024;
    void *p;
    GROW(d->layer, k, cap);
    GROW(d->expert, k, cap);
    GROW(d->resident, k, cap);
    GROW(d->in_call, k, cap);
    GROW(d->sampled, k, cap);
    GROW(d->pinned, k, cap);
    for (int c = 0; c < NCOMP; c++) {
        GROW(d->held[c], k, cap);
    }
    for (int w = 0; w < 2; w++) {
        GROW(d->lru[w].prev, k, cap);
        GROW(d->lru[w].next, k, cap);
        GROW(d->lru[w].in, k, cap);
    }
    d->keys_cap = cap;
    return 0;
}

static int32_t key_number(Duel *d, long layer, long expert) {
    /* the key's number, given one at its first sight; -1 an error */
    void *p;
    if (layer >= d->layers_cap) {
        Py_ssize_t k = d->layers_cap, cap = k ? k : 64;
        while (cap <= layer) cap *= 2;
        if (!(p = zeroed(d->number, k, cap, sizeof(int32_t *)))) return -1;
        d->number = p;
        if (!(p = zeroed(d->number_cap, k, cap, sizeof(Py_ssize_t)))) return -1;
        d->number_cap = p;
        d->layers_cap = cap;
    }
    if (expert >= d->number_cap[layer]) {
        Py_ssize_t k = d->number_cap[layer], cap = k ? k : 64;
        while (cap <= expert) cap *= 2;
        if (!(p = zeroed(d->number[layer], k, cap, sizeof(int32_t)))) return -1;
        d->number[layer] = p;
        d->number_cap[layer] = cap;
    }
    int32_t n = d->number[layer][expert];
    if (n) return n;
    /* key numbers are int32: the next would wrap negative, an index before the arrays */
    if (d->n_keys == INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "Duel: more keys than int32 key numbers");
        return -1;
    }
    if (d->n_keys + 1 >= d->keys_cap && grow_keys(d) < 0) return -1;
    n = (int32_t)++d->n_keys;
    d->layer[n] = layer;
    d->expert[n] = (int32_t)expert;
    d->number[layer][expert] = n;
    return n;
}

static double sample_hash(long layer, int32_t expert) {
    /* policies.sample_hash: MurmurHash3's 64-bit finaliser of layer and expert, in [0, 1) */
    uint64_t h = (uint64_t)layer << 32 | (uint64_t)(uint32_t)expert;
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDULL;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ULL;
    h ^= h >> 33;
    return (double)h / 0x1p64;
}

static int follows(Duel *d, int32_t n) {
    if (!d->sampled[n]) d->sampled[n] = sample_hash(d->layer[n], d->expert[n]) < d->rate ? 1 : -1;
    return d->sampled[n] > 0;
}

/* ---- LRU ------------------------------------------------------------------------------- */

static void lru_remove(Lru *q, int32_t n) {
    if (!q->in[n]) return;
    int32_t a = q->prev[n], b = q->next[n];
    if (a) q->next[a] = b; else q->head = b;
    if (b) q->prev[b] = a; else q->tail = a;
    q->in[n] = 0;
}

static void lru_touch(Lru *q, int32_t n) {
    lru_remove(q, n);
    q->prev[n] = q->tail;
    q->next[n] = 0;
    if (q->tail) q->next[q->tail] = n; else q->head = n;
    q->tail = n;
    q->in[n] = 1;
}

static int lru_victims(Duel *d, Lru *q, const Pred *p, Py_ssize_t want, Keys *out) {
    /* arena.LRU.victims: the first evictable keys in one walk, oldest first */
    if (want <= 0) return 0;
    for (int32_t n = q->head; n; n = q->next[n]) {
        int ok = is_evictable(p, d->layer[n], d->expert[n]);
        if (ok < 0) return -1;
        if (ok) {
            if (keys_append(out, d->layer[n], d->expert[n]) < 0) return -1;
            if (out->len == want) break;
        }
    }
    return 0;
}

/* ---- the components -------------------------------------------------------------------- */

static int comp_touch(Duel *d, int w, int c, int32_t n) {
    if (c == LRU_COMP) {
        lru_touch(&d->lru[w], n);
        return 0;
    }
    return nu_touch((Core *)d->core[w][c], d->layer[n], d->expert[n]);
}

static void comp_remove(Duel *d, int w, int c, long layer, int32_t expert) {
    if (c == LRU_COMP) {
        int32_t n = find_key(d, layer, expert);
        if (n) lru_remove(&d->lru[w], n);
    } else
        nu_remove((Core *)d->core[w][c], layer, expert);
}

static int comp_victims(Duel *d, int w, int c, const Pred *p, const long *layers, Py_ssize_t want,
                        Keys *out) {
    if (c == LRU_COMP) return lru_victims(d, &d->lru[w], p, want, out);
    return nu_victims((Core *)d->core[w][c], p, layers, want, out);
}

static int comp_victim(Duel *d, int c, const Pred *p, long *layer, int32_t *expert) {
    if (c != LRU_COMP) return nu_victim((Core *)d->core[0][c], p, layer, expert);
    Keys one = {0};
    int got = lru_victims(d, &d->lru[0], p, 1, &one);
    if (got == 0 && one.len) {
        *layer = one.layer[0];
        *expert = one.expert[0];
        got = 1;
    }
    free(one.layer);
    free(one.expert);
    return got;
}

/* ---- the shadows ----------------------------------------------------------------------- */

static int not_pinned(void *ctx, long layer, int32_t expert) {
    Duel *d = ctx;
    int32_t n = find_key(d, layer, expert);
    return !(n && d->pinned[n] == d->pin);
}

static void hold(Duel *d, int c, int32_t n, int on) {
    if (d->held[c][n] != on) {
        d->held[c][n] = (uint8_t)on;
        d->n_held[c] += on ? 1 : -1;
    }
}

static int shadow_misses(Duel *d, int c, const int32_t *miss, Py_ssize_t nm, long *layers) {
    /* Adaptive._shadow_misses: each miss given a slot, evicting the shadow's victims (one
     * victims call for the misses that evict) where the shadow is full */
    Pred pred = {NULL, not_pinned, NULL, d};
    Py_ssize_t j = 0;
    while (j < nm) {
        if (d->shadow_slots < 0 || d->n_held[c] < d->shadow_slots) {
            hold(d, c, miss[j], 1);
            if (comp_touch(d, 1, c, miss[j]) < 0) return -1;
            j++;
            continue;
        }
        for (Py_ssize_t k = j; k < nm; k++) layers[k - j] = d->layer[miss[k]];
        Keys out = {0};
        if (comp_victims(d, 1, c, &pred, layers, nm - j, &out) < 0) {
            free(out.layer);
            free(out.expert);
            return -1;
        }
        Py_ssize_t given = out.len ? out.len : 1; /* none: the miss takes a slot */
        if (given > nm - j) given = nm - j;
        for (Py_ssize_t k = 0; k < out.len; k++) {
            comp_remove(d, 1, c, out.layer[k], out.expert[k]);
            int32_t n = find_key(d, out.layer[k], out.expert[k]);
            if (n) hold(d, c, n, 0);
        }
        free(out.layer);
        free(out.expert);
        for (Py_ssize_t k = j; k < j + given; k++) hold(d, c, miss[k], 1);
        for (Py_ssize_t k = j; k < j + given; k++)
            if (comp_touch(d, 1, c, miss[k]) < 0) return -1;
        j += given;
    }
    return 0;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static void lead(Duel *d) {
    int leader = 0;
    for (int c = 1; c < NCOMP; c++)
        if (d->misses[c] < d->misses[leader]) leader = c;
    d->order[0] = leader;
    for (int c = 0, k = 1; c < NCOMP; c++)
        if (c != leader) d->order[k++] = c;
}

static int shadow_call(Duel *d) {
    /* Adaptive._shadow_call: the ended call's (sampled) uses, in key order, through each
     * shadow arena, counting its misses there */
    Py_ssize_t n = 0;
    if (d->call_len > d->sorted_cap) {
        int64_t *p = realloc(d->sorted, (size_t)d->call_len * sizeof(int64_t));
        if (!p) return PyErr_NoMemory(), -1;
        d->sorted = p;
        d->sorted_cap = d->call_len;
    }
    for (Py_ssize_t j = 0; j < d->call_len; j++) {
        int32_t k = d->call[j];
        d->in_call[k] = 0;
        if (d->rate < 1.0 && !follows(d, k)) continue;
        d->sorted[n++] = (int64_t)d->layer[k] << 24 | d->expert[k];
    }
    d->call_len = 0;
    if (!n) return 0;
    qsort(d->sorted, (size_t)n, sizeof(int64_t), cmp_i64);
    int32_t *use = malloc((size_t)n * 2 * sizeof(int32_t));
    long *layers = malloc((size_t)n * sizeof(long));
    int rc = -1;
    if (!use || !layers) {
        PyErr_NoMemory();
        goto done;
    }
    if (!++d->pin) { /* wrapped: clear the marks */
        memset(d->pinned, 0, (size_t)d->keys_cap * sizeof(uint32_t));
        d->pin = 1;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        use[j] = find_key(d, (long)(d->sorted[j] >> 24), (long)(d->sorted[j] & 0xFFFFFF));
        d->pinned[use[j]] = d->pin;
    }
    d->weight *= pow(d->growth, (double)n); /* later misses weigh more: old ones fade */
    int32_t *miss = use + n;
    for (int c = 0; c < NCOMP; c++) {
        Py_ssize_t nm = 0;
        for (Py_ssize_t j = 0; j < n; j++) /* hits first, in order */
            if (d->held[c][use[j]]) {
                if (comp_touch(d, 1, c, use[j]) < 0) goto done;
            } else
                miss[nm++] = use[j];
        for (Py_ssize_t j = 0; j < nm; j++) d->misses[c] += d->weight; /* one addition a miss */
        if (shadow_misses(d, c, miss, nm, layers) < 0) goto done;
    }
    if (d->weight > 0x1p500) { /* rescale before floats overflow */
        for (int c = 0; c < NCOMP; c++) d->misses[c] *= 0x1p-500;
        d->weight *= 0x1p-500;
    }
    lead(d);
    rc = 0;
done:
    free(use);
    free(layers);
    return rc;
}

static int learn_capacity(Duel *d) {
    /* Adaptive._learn_capacity: the arena is full: its size, the sampling rate and each
     * shadow's share of it */
    d->capacity = d->n_resident;
    if (d->sample < 1.0 && d->capacity) {
        double q = (double)d->min_shadow_slots / (double)d->capacity;
        double m = q > d->sample ? q : d->sample;
        d->rate = m < 1.0 ? m : 1.0;
    }
    if (d->rate >= 1.0) {
        d->shadow_slots = d->capacity;
        return 0;
    }
    Py_ssize_t count = 0;
    for (int32_t n = 1; n <= d->n_keys; n++)
        if (d->resident[n]) count += follows(d, n);
    d->shadow_slots = count > 1 ? count : 1;
    d->growth = pow(2.0, 1.0 / (d->half_life * d->rate));
    for (int c = 0; c < NCOMP; c++)
        for (int32_t n = 1; n <= d->n_keys; n++)
            if (d->held[c][n] && !follows(d, n)) {
                comp_remove(d, 1, c, d->layer[n], d->expert[n]);
                hold(d, c, n, 0);
            }
    return 0;
}

/* ---- the policy's calls ---------------------------------------------------------------- */

static int touch(Duel *d, long layer, long expert) {
    int32_t n = key_number(d, layer, expert);
    if (n < 0) return -1;
    if (!d->resident[n]) {
        d->resident[n] = 1;
        d->n_resident++;
    }
    for (int c = 0; c < NCOMP; c++)
        if (comp_touch(d, 0, c, n) < 0) return -1;
    if (!d->in_call[n]) {
        if (d->call_len == d->call_cap) {
            Py_ssize_t cap = d->call_cap ? 2 * d->call_cap : 256;
            int32_t *p = realloc(d->call, (size_t)cap * sizeof(int32_t));
            if (!p) return PyErr_NoMemory(), -1;
            d->call = p;
            d->call_cap = cap;
        }
        d->in_call[n] = 1;
        d->call[d->call_len++] = n;
    }
    return 0;
}

static void remove_key(Duel *d, long layer, long expert) {
    int32_t n = find_key(d, layer, expert);
    if (n && d->resident[n]) {
        d->resident[n] = 0;
        d->n_resident--;
    }
    for (int c = 0; c < NCOMP; c++) comp_remove(d, 0, c, layer, (int32_t)expert);
}

static PyObject *Duel_touch(Duel *d, PyObject *key) {
    long layer, expert;
    if (search_idle(d->searching) < 0) return NULL;
    if (parse_key(key, &layer, &expert) < 0 || touch(d, layer, expert) < 0) return NULL;
    Py_RETURN_NONE;
}

static int touch_one(void *d, long layer, long expert) { return touch(d, layer, expert); }

static PyObject *Duel_touch_all(Duel *d, PyObject *keys) {
    if (search_idle(d->searching) < 0 || each_key(keys, d, touch_one) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Duel_remove(Duel *d, PyObject *key) {
    long layer, expert;
    if (search_idle(d->searching) < 0) return NULL;
    if (parse_key(key, &layer, &expert) < 0) return NULL;
    remove_key(d, layer, expert);
    Py_RETURN_NONE;
}

static int remove_one(void *d, long layer, long expert) {
    remove_key(d, layer, expert);
    return 0;
}

static PyObject *Duel_remove_all(Duel *d, PyObject *keys) {
    if (search_idle(d->searching) < 0 || each_key(keys, d, remove_one) < 0) return NULL;
    Py_RETURN_NONE;
}

static int victim(Duel *d, PyObject *evictable, long *layer, int32_t *expert) {
    /* the leader's victim, else the next component's that has one */
    if (d->capacity < 0 && learn_capacity(d) < 0) return -1;
    Pred p = pred_of(evictable);
    for (int k = 0; k < NCOMP; k++) {
        int got = comp_victim(d, d->order[k], &p, layer, expert);
        if (got) return got;
    }
    return 0;
}

static PyObject *Duel_victim(Duel *d, PyObject *evictable) {
    long layer;
    int32_t expert;
    if (search_idle(d->searching) < 0) return NULL;
    d->searching = 1;
    int got = victim(d, evictable, &layer, &expert);
    d->searching = 0;
    if (got < 0) return NULL;
    if (!got) Py_RETURN_NONE;
    return Py_BuildValue("(li)", layer, (int)expert);
}

static PyObject *Duel_victims(Duel *d, PyObject *const *args, Py_ssize_t nargs) {
    /* the leader's victims for `keys` (the leader does not change before the call ends), or
     * one victim where the leader has none */
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "victims(evictable, keys)");
        return NULL;
    }
    if (search_idle(d->searching) < 0) return NULL;
    Py_ssize_t n;
    long *layers = key_layers(args[1], &n);
    if (!layers) return NULL;
    Keys out = {0};
    PyObject *res = NULL;
    if (!n) { /* (LRU's walk, stopping at as many victims as keys, would take every key) */
        res = PyList_New(0);
        goto done;
    }
    if (d->capacity < 0 && learn_capacity(d) < 0) goto done;
    Pred p = pred_of(args[0]);
    d->searching = 1;
    int rc = comp_victims(d, 0, d->order[0], &p, layers, n, &out);
    if (rc == 0 && !out.len) {
        long layer;
        int32_t expert;
        int got = victim(d, args[0], &layer, &expert);
        if (got < 0 || (got && keys_append(&out, layer, expert) < 0)) rc = -1;
    }
    d->searching = 0;
    if (rc == 0) res = keys_list(&out);
done:
    free(layers);
    free(out.layer);
    free(out.expert);
    return res;
}

static PyObject *Duel_distance(Duel *d, PyObject *key) {
    /* the profile-trusting NextUse's (Adaptive.distance: the first component's) */
    long layer, expert;
    if (parse_key(key, &layer, &expert) < 0) return NULL;
    return PyFloat_FromDouble(nu_distance((Core *)d->core[0][0], layer, expert));
}

static PyObject *Duel_get_current(Duel *d, void *closure) {
    (void)closure;
    if (!d->has_current) Py_RETURN_NONE;
    return PyLong_FromLong(d->current);
}

static int Duel_set_current(Duel *d, PyObject *value, void *closure) {
    (void)closure;
    if (!value) {
        PyErr_SetString(PyExc_AttributeError, "current cannot be deleted");
        return -1;
    }
    if (search_idle(d->searching) < 0) return -1;
    int has = value != Py_None;
    long layer = has ? PyLong_AsLong(value) : 0;
    if (layer == -1 && PyErr_Occurred()) return -1;
    /* refused before anything changes: a core's own refusal came after the shadows took the
     * call and the cores before it were told, leaving the cores on different layers */
    if (layer < 0 || layer >= MAX_LAYER) {
        PyErr_Format(PyExc_ValueError, "layer %ld out of range", layer);
        return -1;
    }
    if (shadow_call(d) < 0) return -1;
    d->has_current = has;
    d->current = layer;
    for (int w = 0; w < 2; w++)
        for (int c = 0; c < 2; c++)
            if (nu_set_current((Core *)d->core[w][c], has, layer) < 0) return -1;
    return 0;
}

static PyObject *Duel_get_misses(Duel *d, void *closure) {
    (void)closure;
    return Py_BuildValue("[ddd]", d->misses[0], d->misses[1], d->misses[2]);
}

static PyObject *Duel_get_leader(Duel *d, void *closure) {
    (void)closure;
    return PyLong_FromLong(d->order[0]);
}

static PyObject *Duel_get_rate(Duel *d, void *closure) {
    (void)closure;
    return PyFloat_FromDouble(d->rate);
}

static PyObject *maybe(Py_ssize_t v) {
    if (v < 0) Py_RETURN_NONE;
    return PyLong_FromSsize_t(v);
}

static PyObject *Duel_get_slots(Duel *d, void *closure) {
    (void)closure;
    return maybe(d->shadow_slots);
}

static PyObject *Duel_get_capacity(Duel *d, void *closure) {
    (void)closure;
    return maybe(d->capacity);
}

static PyObject *Duel_get_followed(Duel *d, void *closure) {
    /* (keys the shadows follow, keys asked) */
    (void)closure;
    Py_ssize_t yes = 0, asked = 0;
    for (int32_t n = 1; n <= d->n_keys; n++) {
        asked += d->sampled[n] != 0;
        yes += d->sampled[n] > 0;
    }
    return Py_BuildValue("(nn)", yes, asked);
}

/* ---- the type ---------------------------------------------------------------------------- */

static PyObject *Duel_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    /* made whole here, not in __init__: a duel without its cores (Duel.__new__) would
     * dereference them at its first call, and a second __init__ would half-overwrite it */
    static char *names[] = {"real", "real_recent", "shadow", "shadow_recent", "sample",
                            "min_shadow_slots", "half_life", NULL};
    PyObject *c[4];
    double sample, half_life;
    Py_ssize_t min_shadow_slots;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!O!O!O!dnd", names, &NuCoreType, &c[0],
                                     &NuCoreType, &c[1], &NuCoreType, &c[2], &NuCoreType, &c[3],
                                     &sample, &min_shadow_slots, &half_life))
        return NULL;
    if (c[0] == c[1] || c[0] == c[2] || c[0] == c[3] || c[1] == c[2] || c[1] == c[3] ||
        c[2] == c[3]) {
        PyErr_SetString(PyExc_ValueError, "Duel: four distinct cores");
        return NULL;
    }
    if (!(sample > 0) || !(half_life > 0)) { /* the growth divides by both */
        /* (PyErr_Format has no float conversion: Python >= 3.12 raises SystemError on one) */
        char text[96];
        snprintf(text, sizeof text, "Duel: sample %g and half_life %g must be above 0", sample,
                 half_life);
        PyErr_SetString(PyExc_ValueError, text);
        return NULL;
    }
    Duel *d = (Duel *)type->tp_alloc(type, 0);
    if (!d) return NULL;
    for (int k = 0; k < 4; k++) {
        Py_INCREF(c[k]);
        d->core[k / 2][k % 2] = c[k];
    }
    d->sample = sample;
    d->min_shadow_slots = min_shadow_slots;
    d->half_life = half_life;
    d->weight = 1.0;
    d->growth = pow(2.0, 1.0 / half_life);
    d->rate = 1.0;
    d->capacity = d->shadow_slots = -1;
    for (int k = 0; k < NCOMP; k++) d->order[k] = k;
    if (grow_keys(d) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return (PyObject *)d;
}

static void Duel_dealloc(Duel *d) {
    for (int k = 0; k < 4; k++) Py_XDECREF(d->core[k / 2][k % 2]);
    for (Py_ssize_t l = 0; l < d->layers_cap; l++) free(d->number[l]);
    free(d->number);
    free(d->number_cap);
    free(d->layer);
    free(d->expert);
    free(d->resident);
    free(d->in_call);
    free(d->sampled);
    free(d->pinned);
    for (int c = 0; c < NCOMP; c++) free(d->held[c]);
    for (int w = 0; w < 2; w++) {
        free(d->lru[w].prev);
        free(d->lru[w].next);
        free(d->lru[w].in);
    }
    free(d->call);
    free(d->sorted);
    Py_TYPE(d)->tp_free((PyObject *)d);
}

static PyMethodDef Duel_methods[] = {
    {"touch", (PyCFunction)Duel_touch, METH_O, "touch(key)"},
    {"touch_all", (PyCFunction)Duel_touch_all, METH_O, "touch_all(keys)"},
    {"remove", (PyCFunction)Duel_remove, METH_O, "remove(key)"},
    {"remove_all", (PyCFunction)Duel_remove_all, METH_O, "remove_all(keys)"},
    {"victim", (PyCFunction)Duel_victim, METH_O, "victim(evictable) -> key or None"},
    {"victims", (PyCFunction)(void (*)(void))Duel_victims, METH_FASTCALL,
     "victims(evictable, keys) -> [key]"},
    {"distance", (PyCFunction)Duel_distance, METH_O, "distance(key) -> handshakes"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Duel_getset[] = {
    {"current", (getter)Duel_get_current, (setter)Duel_set_current, "the running layer", NULL},
    {"shadow_misses", (getter)Duel_get_misses, NULL, "each component's weighted misses", NULL},
    {"leader", (getter)Duel_get_leader, NULL, "the component followed now", NULL},
    {"rate", (getter)Duel_get_rate, NULL, "the share of keys the shadows follow", NULL},
    {"shadow_slots", (getter)Duel_get_slots, NULL, "each shadow arena's slots", NULL},
    {"capacity", (getter)Duel_get_capacity, NULL, "the arena's slots", NULL},
    {"followed", (getter)Duel_get_followed, NULL, "(keys followed, keys asked)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject DuelType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "strata_mlx._nextuse.Duel",
    .tp_basicsize = sizeof(Duel),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "nextuse-duel's state and calls (strata_mlx.stream.policies.NextUseDuel).",
    .tp_new = Duel_new,
    .tp_dealloc = (destructor)Duel_dealloc,
    .tp_methods = Duel_methods,
    .tp_getset = Duel_getset,
};
