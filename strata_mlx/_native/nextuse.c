/* NextUse's state and victim search in C: strata_mlx.stream.nextuse.NextUse, the expected next
 * use policy, over flat per-layer arrays instead of dicts of (layer, expert) tuples.
 *
 * It is the Python class PyNextUse line for line (that class is the reference and documents
 * the model; tests replay traces through both and compare every victim): the same counts,
 * heaps of (count, use number, expert) lazily invalidated, the same candidate kept per layer
 * and refreshed when its layer changed, the same expected distances. Every float is the same
 * IEEE operation in the same order as Python's (no fused multiply-adds: setup.py builds it with
 * -ffp-contract=off), so ties and victims come out equal.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "nextuse.h"

#define SMALL_BATCH 16
#define DEAD_PER_LIVE 4
#define DEAD_SLACK 1024

typedef struct {
    double c;
    int64_t n;
    int32_t e;
} Entry;

static inline int entry_lt(const Entry *a, const Entry *b) {
    /* heapq's order over (count, use number, key): use numbers are unique per entry of a key
     * and never shared between keys, so the key itself never decides */
    if (a->c != b->c) return a->c < b->c;
    if (a->n != b->n) return a->n < b->n;
    return a->e < b->e;
}

/* buf (`old` items of `item` bytes) grown to `cap` items, the new ones zero; NULL (and
 * MemoryError set, buf untouched) where there is no memory */
static void *grown(void *buf, Py_ssize_t old, Py_ssize_t cap, size_t item) {
    char *p = realloc(buf, (size_t)cap * item);
    if (!p) return PyErr_NoMemory();
    memset(p + (size_t)old * item, 0, (size_t)(cap - old) * item);
    return p;
}

/* buf with room for `need` (>= 1) items, its capacity *cap doubled from 64 until they fit;
 * NULL as grown() */
static void *reserve(void *buf, Py_ssize_t *cap, Py_ssize_t need, size_t item) {
    if (need <= *cap) return buf;
    Py_ssize_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *p = grown(buf, *cap, c, item);
    if (p) *cap = c;
    return p;
}

typedef struct {
    Entry *h;
    Py_ssize_t len, cap;
} Heap; /* a binary heap, or (least's and victims' entries put aside) a plain list */

static int append(Heap *hp, Entry x) {
    Entry *h = reserve(hp->h, &hp->cap, hp->len + 1, sizeof(Entry));
    if (!h) return -1;
    hp->h = h;
    h[hp->len++] = x;
    return 0;
}

static int heap_push(Heap *hp, Entry x) {
    if (append(hp, x) < 0) return -1;
    Py_ssize_t i = hp->len - 1;
    Entry *h = hp->h;
    while (i > 0) {
        Py_ssize_t p = (i - 1) / 2;
        if (!entry_lt(&x, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = x;
    return 0;
}

static void sift_down(Entry *h, Py_ssize_t len, Py_ssize_t i) {
    Entry x = h[i];
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= len) break;
        if (c + 1 < len && entry_lt(&h[c + 1], &h[c])) c++;
        if (!entry_lt(&h[c], &x)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = x;
}

static Entry heap_pop(Heap *hp) {
    Entry top = hp->h[0];
    hp->len--;
    if (hp->len > 0) {
        hp->h[0] = hp->h[hp->len];
        sift_down(hp->h, hp->len, 0);
    }
    return top;
}

static void heapify(Heap *hp) {
    for (Py_ssize_t i = hp->len / 2 - 1; i >= 0; i--) sift_down(hp->h, hp->len, i);
}

typedef struct {
    long layer;
    double weight, calls, least_count, far;
    double *p0; /* the profile's prior row (NULL: none) */
    Py_ssize_t p0_len;
    Heap heap;
    int has_top; /* a candidate found at the last refresh (else None) */
    Entry top;
    int changed;
    /* per expert, grown as experts appear */
    Py_ssize_t cap;
    double *count;
    uint8_t *seen;     /* a count exists (the expert was used once) */
    int64_t *live;     /* its live entry's use number; 0: not resident */
    uint8_t *in_call;  /* used by the running call (its layer's only) */
    uint32_t *taken;   /* victims(): taken in the pass numbered so */
} Layer;

struct Core {
    PyObject_HEAD
    double growth, prior;
    Layer *L;
    Py_ssize_t n, cap_layers;
    int32_t *index; /* layer number -> index + 1 (0: not in the cycle) */
    Py_ssize_t index_cap;
    long current; /* the running layer */
    int has_current;
    int64_t *cycle; /* d(l) per layer from the running layer */
    double *dist;   /* cycle + far per layer */
    int dist_valid;
    int64_t uses;
    Py_ssize_t n_live;
    int32_t *call; /* the running call's experts (in_call set), in order */
    Py_ssize_t call_len, call_cap;
    int32_t *changed; /* layer indices with changed set */
    Py_ssize_t changed_len;
    uint32_t pass; /* victims()' pass number, for Layer.taken */
    double *scratch;
    Py_ssize_t scratch_cap;
    Heap skipped; /* least()'s entries passed over */
    int searching; /* a victim search runs (search_idle) */
};

/* ---- keys ------------------------------------------------------------------------------ */

int parse_key(PyObject *key, long *layer, long *expert) {
    if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 2) {
        PyErr_Format(PyExc_TypeError, "a key is a (layer, expert) tuple, not %R", key);
        return -1;
    }
    *layer = PyLong_AsLong(PyTuple_GET_ITEM(key, 0));
    if (*layer == -1 && PyErr_Occurred()) return -1;
    *expert = PyLong_AsLong(PyTuple_GET_ITEM(key, 1));
    if (*expert == -1 && PyErr_Occurred()) return -1;
    if (*layer < 0 || *layer >= MAX_LAYER || *expert < 0 || *expert >= MAX_EXPERT) {
        PyErr_Format(PyExc_ValueError, "key %R out of range", key);
        return -1;
    }
    return 0;
}

static PyObject *make_key(long layer, int32_t expert) { return Py_BuildValue("(li)", layer, (int)expert); }

/* ---- layers ---------------------------------------------------------------------------- */

static int find(Core *s, long layer) {
    /* the layer's index, -1 when it is not in the cycle */
    if (layer < 0 || layer >= s->index_cap) return -1;
    return s->index[layer] - 1;
}

static int grow_experts(Layer *l, long e) {
    if (e < l->cap) return 0;
    Py_ssize_t k = l->cap, cap = k ? k : 64;
    while (cap <= e) cap *= 2;
    /* each array grown on its own: one that fails leaves the others larger, and cap as it was */
    void *p;
    if (!(p = grown(l->count, k, cap, sizeof(double)))) return -1;
    l->count = p;
    if (!(p = grown(l->seen, k, cap, 1))) return -1;
    l->seen = p;
    if (!(p = grown(l->live, k, cap, sizeof(int64_t)))) return -1;
    l->live = p;
    if (!(p = grown(l->in_call, k, cap, 1))) return -1;
    l->in_call = p;
    if (!(p = grown(l->taken, k, cap, sizeof(uint32_t)))) return -1;
    l->taken = p;
    l->cap = cap;
    return 0;
}

static void mark_changed(Core *s, int i) {
    if (!s->L[i].changed) {
        s->L[i].changed = 1;
        s->changed[s->changed_len++] = i;
    }
}

static void place(Core *s) {
    /* the running layer changed: every layer's distance in the cycle with it */
    int at = s->has_current ? find(s, s->current) : -1;
    if (at < 0) at = 0;
    Py_ssize_t n = s->n;
    for (Py_ssize_t i = 0; i < n; i++) s->cycle[i] = ((i - at - 1) % n + n) % n + 1;
    s->dist_valid = 0;
}

static void refar(Core *s, int i) {
    Layer *l = &s->L[i];
    double far = l->far = (double)s->n * (l->calls / l->least_count - 1.0);
    if (s->dist_valid) s->dist[i] = (double)s->cycle[i] + far;
}

static int add_layer(Core *s, long layer) {
    if (layer < 0 || layer >= MAX_LAYER) {
        PyErr_Format(PyExc_ValueError, "layer %ld out of range", layer);
        return -1;
    }
    int32_t *index = reserve(s->index, &s->index_cap, layer + 1, sizeof(int32_t));
    if (!index) return -1;
    s->index = index;
    if (s->n == s->cap_layers) { /* (four arrays of one capacity, as grow_experts's) */
        Py_ssize_t k = s->cap_layers, cap = k ? 2 * k : 64;
        void *p;
        if (!(p = grown(s->L, k, cap, sizeof(Layer)))) return -1;
        s->L = p;
        if (!(p = grown(s->cycle, k, cap, sizeof(int64_t)))) return -1;
        s->cycle = p;
        if (!(p = grown(s->dist, k, cap, sizeof(double)))) return -1;
        s->dist = p;
        if (!(p = grown(s->changed, k, cap, sizeof(int32_t)))) return -1;
        s->changed = p;
        s->cap_layers = cap;
    }
    int i = (int)s->n++;
    Layer *l = &s->L[i];
    memset(l, 0, sizeof(Layer));
    l->layer = layer;
    l->calls = s->prior;
    l->least_count = INFINITY;
    s->index[layer] = i + 1;
    for (Py_ssize_t j = 0; j < s->n; j++) /* L changed: every layer's distance with it */
        s->L[j].far = (double)s->n * (s->L[j].calls / s->L[j].least_count - 1.0);
    place(s);
    return i;
}

static int layer_of(Core *s, long layer) {
    int i = find(s, layer);
    return i >= 0 ? i : add_layer(s, layer);
}

/* ---- uses ------------------------------------------------------------------------------ */

static void compact(Core *s, Layer *l) {
    /* drop the heap's dead entries (used again since their push, or evicted) */
    Py_ssize_t k = 0;
    for (Py_ssize_t j = 0; j < l->heap.len; j++) {
        Entry *e = &l->heap.h[j];
        if (l->live[e->e] == e->n) l->heap.h[k++] = *e;
    }
    l->heap.len = k;
    heapify(&l->heap);
}

static int push(Core *s, int i, int32_t e) {
    Layer *l = &s->L[i];
    if (heap_push(&l->heap, (Entry){l->count[e], l->live[e], e}) < 0) return -1;
    if (l->heap.len > DEAD_PER_LIVE * s->n_live + DEAD_SLACK) compact(s, l);
    mark_changed(s, i);
    return 0;
}

static int touch(Core *s, long layer, long expert) {
    int i = layer_of(s, layer);
    if (i < 0) return -1;
    Layer *l = &s->L[i];
    if (grow_experts(l, expert) < 0) return -1;
    double w = l->weight;
    if (w == 0.0) { /* used before any handshake of its layer (a read ahead) */
        w = l->weight = 1.0;
        l->calls += 1.0;
        refar(s, i);
    }
    if (l->in_call[expert]) return 0; /* a call counts once, however many tokens pick it */
    double c;
    if (l->seen[expert])
        c = l->count[expert];
    else if (l->p0) {
        if (expert >= l->p0_len) {
            PyErr_Format(PyExc_IndexError, "expert %ld beyond layer %ld's profile", expert, layer);
            return -1;
        }
        c = s->prior * l->p0[expert];
    } else
        c = s->prior * 0.5;
    c = l->count[expert] = c + w;
    l->seen[expert] = 1;
    if (!l->live[expert]) s->n_live++;
    l->live[expert] = ++s->uses;
    if (s->has_current && layer == s->current) {
        /* in use by the running call (pinned): in its heap only once the call ends */
        int32_t *call = reserve(s->call, &s->call_cap, s->call_len + 1, sizeof(int32_t));
        if (!call) return -1;
        s->call = call;
        l->in_call[expert] = 1;
        s->call[s->call_len++] = (int32_t)expert;
        return 0;
    }
    return push(s, i, (int32_t)expert);
}

int nu_touch(Core *s, long layer, long expert) { return touch(s, layer, expert); }

static void remove_key(Core *s, long layer, long expert) {
    int i = find(s, layer);
    if (i < 0) return;
    Layer *l = &s->L[i];
    if (expert >= l->cap) return;
    if (l->live[expert]) {
        l->live[expert] = 0;
        s->n_live--;
        mark_changed(s, i);
    }
    l->in_call[expert] = 0;
}

void nu_remove(Core *s, long layer, long expert) { remove_key(s, layer, expert); }

static int end_call(Core *s) {
    if (!s->call_len) return 0;
    int i = find(s, s->current);
    Layer *l = &s->L[i];
    Py_ssize_t fresh = 0;
    for (Py_ssize_t j = 0; j < s->call_len; j++) fresh += l->in_call[s->call[j]] && l->live[s->call[j]];
    /* many (a prefill call's ~500) or many dead: the dead dropped first, as Python rebuilds */
    if (fresh > l->heap.len / 2 || l->heap.len > DEAD_PER_LIVE * s->n_live + DEAD_SLACK)
        compact(s, l);
    for (Py_ssize_t j = 0; j < s->call_len; j++) {
        int32_t e = s->call[j];
        if (!l->in_call[e]) continue; /* removed since (or listed twice) */
        l->in_call[e] = 0;
        if (!l->live[e]) continue;
        if (heap_push(&l->heap, (Entry){l->count[e], l->live[e], e}) < 0) return -1;
    }
    s->call_len = 0;
    mark_changed(s, i);
    return 0;
}

static void rescale(Core *s, int i, double f) {
    Layer *l = &s->L[i];
    l->weight *= f;
    l->calls *= f;
    for (Py_ssize_t e = 0; e < l->cap; e++)
        if (l->seen[e]) l->count[e] *= f;
    for (Py_ssize_t j = 0; j < l->heap.len; j++) l->heap.h[j].c *= f;
    heapify(&l->heap);
    mark_changed(s, i);
}

int nu_set_current(Core *s, int has, long layer) {
    if (end_call(s) < 0) return -1;
    if (!has) {
        s->has_current = 0;
        place(s);
        return 0;
    }
    s->current = layer;
    s->has_current = 1;
    int i = layer_of(s, layer);
    if (i < 0) return -1;
    Layer *l = &s->L[i];
    double w = l->weight = l->weight != 0.0 ? l->weight * s->growth : 1.0;
    if (w > 0x1p500) rescale(s, i, 0x1p-500);
    l->calls += l->weight;
    place(s);
    refar(s, i);
    return 0;
}

/* ---- victims --------------------------------------------------------------------------- */

int is_evictable(const Pred *p, long layer, int32_t e) {
    if (p->check) return p->check(p->ctx, layer, e);
    PyObject *key = make_key(layer, e);
    if (!key) return -1;
    PyObject *r = PyObject_CallOneArg(p->fn, key);
    Py_DECREF(key);
    int ok = r ? PyObject_IsTrue(r) : -1;
    Py_XDECREF(r);
    return ok;
}

static int least(Core *s, int i, const Pred *evictable, Entry *out) {
    /* the live entry of least count in layer i (that is evictable, if given): 1 found, 0 none,
     * -1 an error */
    Layer *l = &s->L[i];
    Heap *hp = &l->heap;
    if (!evictable) {
        while (hp->len && l->live[hp->h[0].e] != hp->h[0].n) heap_pop(hp);
        if (!hp->len) return 0;
        *out = hp->h[0];
        return 1;
    }
    if (evictable->layer_ok) {
        int ok = evictable->layer_ok(evictable->ctx, l->layer);
        if (ok <= 0) return ok;
    }
    Heap *skipped = &s->skipped; /* the live entries passed over, pushed back after */
    skipped->len = 0;
    int found = 0;
    while (hp->len) {
        Entry x = heap_pop(hp);
        if (l->live[x.e] != x.n) continue;
        if (append(skipped, x) < 0) {
            found = -1;
            break;
        }
        int ok = is_evictable(evictable, l->layer, x.e);
        if (ok < 0) {
            found = -1;
            break;
        }
        if (ok) {
            *out = x;
            found = 1;
            break;
        }
    }
    for (Py_ssize_t j = 0; j < skipped->len; j++)
        if (heap_push(hp, skipped->h[j]) < 0) return -1;
    return found;
}

static void refresh(Core *s) {
    for (Py_ssize_t j = 0; j < s->changed_len; j++) {
        int i = s->changed[j];
        Layer *l = &s->L[i];
        l->changed = 0;
        Entry x;
        l->has_top = least(s, i, NULL, &x);
        if (l->has_top) l->top = x;
        double c = l->has_top ? x.c : INFINITY;
        if (c != l->least_count) {
            l->least_count = c;
            refar(s, i);
        }
    }
    s->changed_len = 0;
    if (!s->dist_valid) {
        for (Py_ssize_t i = 0; i < s->n; i++) s->dist[i] = (double)s->cycle[i] + s->L[i].far;
        s->dist_valid = 1;
    }
}

static Py_ssize_t argmax(const double *a, Py_ssize_t n) {
    Py_ssize_t best = 0;
    for (Py_ssize_t i = 1; i < n; i++)
        if (a[i] > a[best]) best = i;
    return best;
}

static int kept_candidate(Core *s, const Pred *evictable, int32_t *expert, int *layer_i) {
    /* the candidate of the layer of largest distance, where still live and evictable: 1, else
     * 0 (-1 an error) */
    Py_ssize_t i = argmax(s->dist, s->n);
    if (s->dist[i] <= 0) return 0;
    Layer *l = &s->L[i];
    if (!l->has_top || l->live[l->top.e] != l->top.n) return 0;
    int ok = is_evictable(evictable, l->layer, l->top.e);
    if (ok > 0) {
        *expert = l->top.e;
        *layer_i = (int)i;
    }
    return ok;
}

int keys_append(Keys *k, long layer, int32_t e) {
    if (k->len == k->cap) {
        Py_ssize_t cap = k->cap ? 2 * k->cap : 16;
        long *l = realloc(k->layer, (size_t)cap * sizeof(long));
        if (!l) return PyErr_NoMemory(), -1;
        k->layer = l;
        int32_t *x = realloc(k->expert, (size_t)cap * sizeof(int32_t));
        if (!x) return PyErr_NoMemory(), -1;
        k->expert = x;
        k->cap = cap;
    }
    k->layer[k->len] = layer;
    k->expert[k->len++] = e;
    return 0;
}

int search_idle(int searching) {
    if (!searching) return 0;
    PyErr_SetString(PyExc_RuntimeError, "a policy called from its own evictable");
    return -1;
}

static int victim(Core *s, const Pred *evictable, long *layer, int32_t *expert) {
    refresh(s);
    Py_ssize_t n = s->n;
    if (!n) return 0;
    int32_t e;
    int li;
    int got = kept_candidate(s, evictable, &e, &li);
    if (got < 0) return -1;
    if (got) {
        *layer = s->L[li].layer;
        *expert = e;
        return 1;
    }
    double most = s->dist[argmax(s->dist, n)];
    if (most <= 0) return 0;
    /* the candidate is pinned: rank the layers' next ones */
    double *far = reserve(s->scratch, &s->scratch_cap, n, sizeof(double));
    if (!far) return -1;
    s->scratch = far;
    memcpy(far, s->dist, (size_t)n * sizeof(double));
    Entry *instead = malloc((size_t)n * sizeof(Entry));
    uint8_t *has_instead = calloc((size_t)n, 1);
    int out = -1;
    if (!instead || !has_instead) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t round = 0; round < 2 * n; round++) {
        Py_ssize_t i = argmax(far, n);
        if (far[i] <= 0) break;
        Layer *l = &s->L[i];
        const Entry *x = has_instead[i] ? &instead[i] : (l->has_top ? &l->top : NULL);
        if (x && l->live[x->e] == x->n) {
            int ok = is_evictable(evictable, l->layer, x->e);
            if (ok < 0) goto done;
            if (ok) {
                *layer = l->layer;
                *expert = x->e;
                out = 1;
                goto done;
            }
        }
        Entry y; /* pinned or protected: its next one */
        int found = least(s, (int)i, evictable, &y);
        if (found < 0) goto done;
        if (!found)
            far[i] = -INFINITY;
        else {
            instead[i] = y;
            has_instead[i] = 1;
            far[i] = (double)s->cycle[i] + (double)n * (l->calls / y.c - 1.0);
        }
    }
    out = 0;
done:
    free(instead);
    free(has_instead);
    return out;
}

typedef struct {
    double neg_d;
    int i;
    int has_entry;
    Entry x;
} Ranked;

static int ranked_lt(const Ranked *a, const Ranked *b) {
    if (a->neg_d != b->neg_d) return a->neg_d < b->neg_d;
    return a->i < b->i; /* (a layer has one item at a time: the entry never decides) */
}

int nu_victim(Core *s, const Pred *evictable, long *layer, int32_t *expert) {
    s->searching = 1;
    int got = victim(s, evictable, layer, expert);
    s->searching = 0;
    return got;
}

static int victims(Core *s, const Pred *evictable, const long *key_layers, Py_ssize_t want,
                   Keys *out) {
    if (want <= 0) return 0; /* no keys, no victims (not the small batch's one) */
    for (Py_ssize_t j = 0; j < want; j++)
        if (find(s, key_layers[j]) < 0) { /* a new layer moves every distance: ask again after */
            want = j + 1;
            break;
        }
    refresh(s);
    Py_ssize_t n = s->n;
    if (!n) return 0;
    if (want < SMALL_BATCH) {
        int32_t e;
        int li;
        int got = kept_candidate(s, evictable, &e, &li);
        if (got < 0) return -1;
        if (got) return keys_append(out, s->L[li].layer, e);
    }
    Ranked *ranked = malloc((size_t)n * sizeof(Ranked));
    Py_ssize_t nr = 0;
    /* the live entries taken out of each layer's heap, put back at the end */
    uint8_t *touched = calloc((size_t)n, 1);
    Heap *back = calloc((size_t)n, sizeof(Heap));
    if (!ranked || !touched || !back) {
        PyErr_NoMemory();
        goto fail_free;
    }
    uint32_t pass = ++s->pass;
    if (!pass) { /* wrapped: clear every mark */
        for (Py_ssize_t i = 0; i < n; i++) memset(s->L[i].taken, 0, (size_t)s->L[i].cap * sizeof(uint32_t));
        pass = s->pass = 1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (s->dist[i] > 0) ranked[nr++] = (Ranked){-s->dist[i], (int)i, 0, {0, 0, 0}};
    Py_ssize_t taken = 0;
    while (nr && taken < want) {
        Py_ssize_t b = 0; /* pop the least: the largest distance, the lowest layer index */
        for (Py_ssize_t j = 1; j < nr; j++)
            if (ranked_lt(&ranked[j], &ranked[b])) b = j;
        Ranked r = ranked[b];
        ranked[b] = ranked[--nr];
        int i = r.i;
        Layer *l = &s->L[i];
        if (evictable->layer_ok) { /* none of the layer may go: passed over whole */
            int ok = evictable->layer_ok(evictable->ctx, l->layer);
            if (ok < 0) goto fail_back;
            if (!ok) continue;
        }
        int took = -1;
        if (!r.has_entry) {
            if (l->has_top && l->live[l->top.e] == l->top.n && l->taken[l->top.e] != pass) {
                int ok = is_evictable(evictable, l->layer, l->top.e);
                if (ok < 0) goto fail_back;
                if (ok) took = l->top.e;
            }
        } else
            took = r.x.e;
        if (took >= 0) {
            if (keys_append(out, l->layer, took) < 0) goto fail_back;
            l->taken[took] = pass;
            taken++;
        }
        /* the layer's next: its least live entry that is evictable and not taken */
        touched[i] = 1;
        Heap *hp = &l->heap;
        Heap *bk = &back[i];
        int found = 0;
        Entry nxt;
        while (hp->len) {
            Entry x = heap_pop(hp);
            if (l->live[x.e] != x.n) continue; /* dead */
            if (append(bk, x) < 0) goto fail_back;
            if (l->taken[x.e] != pass) {
                int ok = is_evictable(evictable, l->layer, x.e);
                if (ok < 0) goto fail_back;
                if (ok) {
                    nxt = x;
                    found = 1;
                    break;
                }
            }
        }
        if (found) {
            double d = (double)s->cycle[i] + (double)n * (l->calls / nxt.c - 1.0);
            if (d > 0) ranked[nr++] = (Ranked){-d, i, 1, nxt};
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* the live entries passed over, back */
        if (!touched[i]) continue;
        Layer *l = &s->L[i];
        for (Py_ssize_t j = 0; j < back[i].len; j++) {
            Entry x = back[i].h[j];
            /* cannot fail: the heap keeps the room of the entries popped from it */
            if (l->taken[x.e] != pass) (void)heap_push(&l->heap, x);
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) free(back[i].h);
    free(back);
    free(touched);
    free(ranked);
    return 0;
fail_back:
    for (Py_ssize_t i = 0; i < n; i++) { /* leave the heaps whole: every entry back */
        Layer *l = &s->L[i];
        for (Py_ssize_t j = 0; j < back[i].len; j++) heap_push(&l->heap, back[i].h[j]);
        free(back[i].h);
    }
fail_free:
    free(back);
    free(touched);
    free(ranked);
    return -1;
}

int nu_victims(Core *s, const Pred *evictable, const long *key_layers, Py_ssize_t want, Keys *out) {
    s->searching = 1;
    int rc = victims(s, evictable, key_layers, want, out);
    s->searching = 0;
    return rc;
}

PyObject *keys_list(const Keys *k) {
    PyObject *out = PyList_New(k->len);
    if (!out) return NULL;
    for (Py_ssize_t j = 0; j < k->len; j++) {
        PyObject *key = make_key(k->layer[j], k->expert[j]);
        if (!key) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, j, key);
    }
    return out;
}

/* ---- the type ---------------------------------------------------------------------------- */

static int Core_init(Core *s, PyObject *args, PyObject *kw) {
    static char *names[] = {"growth", "prior", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "dd", names, &s->growth, &s->prior)) return -1;
    return 0;
}

static void Core_dealloc(Core *s) {
    for (Py_ssize_t i = 0; i < s->n; i++) {
        Layer *l = &s->L[i];
        free(l->p0);
        free(l->heap.h);
        free(l->count);
        free(l->seen);
        free(l->live);
        free(l->in_call);
        free(l->taken);
    }
    free(s->L);
    free(s->index);
    free(s->cycle);
    free(s->dist);
    free(s->call);
    free(s->changed);
    free(s->scratch);
    free(s->skipped.h);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *Core_add_layer(Core *s, PyObject *arg) {
    if (search_idle(s->searching) < 0) return NULL;
    long layer = PyLong_AsLong(arg);
    if (layer == -1 && PyErr_Occurred()) return NULL;
    if (find(s, layer) < 0 && add_layer(s, layer) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_set_prior(Core *s, PyObject *args) {
    long layer;
    Py_buffer row;
    if (search_idle(s->searching) < 0) return NULL;
    if (!PyArg_ParseTuple(args, "ly*", &layer, &row)) return NULL;
    int i = find(s, layer);
    if (i < 0 || row.len % sizeof(double)) {
        PyBuffer_Release(&row);
        PyErr_SetString(PyExc_ValueError, "set_prior: a layer of the cycle and float64 values");
        return NULL;
    }
    Layer *l = &s->L[i];
    free(l->p0);
    l->p0 = malloc((size_t)row.len);
    if (!l->p0) {
        PyBuffer_Release(&row);
        return PyErr_NoMemory();
    }
    memcpy(l->p0, row.buf, (size_t)row.len);
    l->p0_len = row.len / (Py_ssize_t)sizeof(double);
    PyBuffer_Release(&row);
    Py_RETURN_NONE;
}

int each_key(PyObject *keys, void *self, int (*fn)(void *self, long layer, long expert)) {
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t j = 0; j < n; j++) {
        long layer, expert;
        if (parse_key(PySequence_Fast_GET_ITEM(seq, j), &layer, &expert) < 0 ||
            fn(self, layer, expert) < 0) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

long *key_layers(PyObject *keys, Py_ssize_t *n) {
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (!seq) return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    long *layers = malloc((size_t)(*n ? *n : 1) * sizeof(long));
    if (!layers) PyErr_NoMemory();
    for (Py_ssize_t j = 0; layers && j < *n; j++) {
        long expert;
        if (parse_key(PySequence_Fast_GET_ITEM(seq, j), &layers[j], &expert) < 0) {
            free(layers);
            layers = NULL;
        }
    }
    Py_DECREF(seq);
    return layers;
}

static int touch_one(void *s, long layer, long expert) { return touch(s, layer, expert); }

static int remove_one(void *s, long layer, long expert) {
    remove_key(s, layer, expert);
    return 0;
}

static PyObject *Core_touch(Core *s, PyObject *key) {
    long layer, expert;
    if (search_idle(s->searching) < 0) return NULL;
    if (parse_key(key, &layer, &expert) < 0 || touch(s, layer, expert) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_touch_all(Core *s, PyObject *keys) {
    if (search_idle(s->searching) < 0 || each_key(keys, s, touch_one) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_remove(Core *s, PyObject *key) {
    long layer, expert;
    if (search_idle(s->searching) < 0) return NULL;
    if (parse_key(key, &layer, &expert) < 0) return NULL;
    remove_key(s, layer, expert);
    Py_RETURN_NONE;
}

static PyObject *Core_remove_all(Core *s, PyObject *keys) {
    if (search_idle(s->searching) < 0 || each_key(keys, s, remove_one) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_victim(Core *s, PyObject *evictable) {
    if (search_idle(s->searching) < 0) return NULL;
    Pred p = pred_of(evictable);
    long layer;
    int32_t e;
    int got = nu_victim(s, &p, &layer, &e);
    if (got < 0) return NULL;
    if (!got) Py_RETURN_NONE;
    return make_key(layer, e);
}

static PyObject *Core_victims(Core *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "victims(evictable, keys)");
        return NULL;
    }
    if (search_idle(s->searching) < 0) return NULL;
    Py_ssize_t n;
    long *layers = key_layers(args[1], &n);
    if (!layers) return NULL;
    Keys out = {0};
    Pred p = pred_of(args[0]);
    PyObject *res = nu_victims(s, &p, layers, n, &out) == 0 ? keys_list(&out) : NULL;
    free(layers);
    free(out.layer);
    free(out.expert);
    return res;
}

double nu_distance(Core *s, long layer, long expert) {
    int i = find(s, layer);
    if (i < 0) return INFINITY;
    Layer *l = &s->L[i];
    if (expert >= l->cap || !l->seen[expert] || l->count[expert] == 0.0) return INFINITY;
    return (double)s->cycle[i] + (double)s->n * (l->calls / l->count[expert] - 1.0);
}

static PyObject *Core_distance(Core *s, PyObject *key) {
    long layer, expert;
    if (parse_key(key, &layer, &expert) < 0) return NULL;
    return PyFloat_FromDouble(nu_distance(s, layer, expert));
}

static PyObject *Core_get_current(Core *s, void *closure) {
    (void)closure;
    if (!s->has_current) Py_RETURN_NONE;
    return PyLong_FromLong(s->current);
}

static int Core_set_current(Core *s, PyObject *value, void *closure) {
    (void)closure;
    if (!value) {
        PyErr_SetString(PyExc_AttributeError, "current cannot be deleted");
        return -1;
    }
    if (search_idle(s->searching) < 0) return -1;
    if (value == Py_None) return nu_set_current(s, 0, 0);
    long layer = PyLong_AsLong(value);
    if (layer == -1 && PyErr_Occurred()) return -1;
    return nu_set_current(s, 1, layer);
}

static PyMethodDef Core_methods[] = {
    {"add_layer", (PyCFunction)Core_add_layer, METH_O, "add_layer(layer): a layer joins the cycle"},
    {"set_prior", (PyCFunction)Core_set_prior, METH_VARARGS,
     "set_prior(layer, row): the profile's prior for a layer of the cycle (float64 bytes)"},
    {"touch", (PyCFunction)Core_touch, METH_O, "touch(key)"},
    {"touch_all", (PyCFunction)Core_touch_all, METH_O, "touch_all(keys)"},
    {"remove", (PyCFunction)Core_remove, METH_O, "remove(key)"},
    {"remove_all", (PyCFunction)Core_remove_all, METH_O, "remove_all(keys)"},
    {"victim", (PyCFunction)Core_victim, METH_O, "victim(evictable) -> key or None"},
    {"victims", (PyCFunction)(void (*)(void))Core_victims, METH_FASTCALL,
     "victims(evictable, keys) -> [key]"},
    {"distance", (PyCFunction)Core_distance, METH_O, "distance(key) -> handshakes"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Core_getset[] = {
    {"current", (getter)Core_get_current, (setter)Core_set_current, "the running layer", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject NuCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "strata_mlx._nextuse.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "NextUse's state and victim search (strata_mlx.stream.nextuse).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_getset = Core_getset,
};

static struct PyModuleDef nextuse_module = {
    PyModuleDef_HEAD_INIT, "_nextuse", "NextUse's core in C (see strata_mlx.stream.nextuse).", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__nextuse(void) {
    PyObject *m = PyModule_Create(&nextuse_module);
    if (!m) return NULL;
    if (PyModule_AddType(m, &NuCoreType) < 0 || PyModule_AddType(m, &DuelType) < 0 ||
        PyModule_AddType(m, &EvictableType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
