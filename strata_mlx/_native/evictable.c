/* Evictable: the arena's "may this resident expert give up its slot" as a C object.
 *
 * A victim search (NextUse's core, the duel) asks it of each candidate in turn, and a search
 * in decode passes over every resident expert of the layers still computing before it finds
 * one: ~24 candidates a victim, each a Python call of a lambda (a key tuple built, two frames,
 * a dict and two set lookups) where this is a C function over the same containers. Python
 * callers (the policies written in Python, the arena) call it as they called the lambda.
 *
 * Evictable(slot_of, pinned, loading, protect=None, keep=None)(key) is
 *     key[0] not in protect and key not in keep
 *     and slot_of[key] not in pinned and slot_of[key] not in loading
 * (KeyError for a key not in slot_of, as the arena's dict lookup raises). The containers are
 * held, not copied: the arena's own dict and sets, read as they stand at each call.
 */
#include "nextuse.h"

typedef struct {
    PyObject_HEAD
    PyObject *slot_of, *pinned, *loading; /* dict, set, set */
    PyObject *protect, *keep;             /* containers of layers / keys, or NULL */
} Evictable;

static int layer_allowed(void *ctx, long layer) {
    Evictable *v = ctx;
    if (!v->protect) return 1;
    PyObject *l = PyLong_FromLong(layer);
    if (!l) return -1;
    int in = PySequence_Contains(v->protect, l);
    Py_DECREF(l);
    return in < 0 ? -1 : !in;
}

static int check_key(Evictable *v, PyObject *key) {
    if (v->keep) {
        int in = PySequence_Contains(v->keep, key);
        if (in) return in < 0 ? -1 : 0;
    }
    PyObject *slot = PyDict_GetItemWithError(v->slot_of, key); /* borrowed */
    if (!slot) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    int in = PySet_Contains(v->pinned, slot);
    if (in) return in < 0 ? -1 : 0;
    in = PySet_Contains(v->loading, slot);
    return in < 0 ? -1 : !in;
}

static int evictable_check(void *ctx, long layer, int32_t expert) {
    int ok = layer_allowed(ctx, layer);
    if (ok <= 0) return ok;
    PyObject *key = Py_BuildValue("(li)", layer, (int)expert);
    if (!key) return -1;
    ok = check_key(ctx, key);
    Py_DECREF(key);
    return ok;
}

static PyObject *Evictable_call(Evictable *v, PyObject *args, PyObject *kw) {
    PyObject *key;
    if (kw && PyDict_GET_SIZE(kw)) {
        PyErr_SetString(PyExc_TypeError, "Evictable(key) takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O:Evictable", &key)) return NULL;
    if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 2) {
        PyErr_SetString(PyExc_TypeError, "a key is a (layer, expert) tuple");
        return NULL;
    }
    int ok = 1;
    if (v->protect) {
        int in = PySequence_Contains(v->protect, PyTuple_GET_ITEM(key, 0));
        ok = in < 0 ? -1 : !in;
    }
    if (ok > 0) ok = check_key(v, key);
    if (ok < 0) return NULL;
    return PyBool_FromLong(ok);
}

static PyObject *Evictable_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"slot_of", "pinned", "loading", "protect", "keep", NULL};
    PyObject *slot_of, *pinned, *loading, *protect = Py_None, *keep = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!O!O!|OO:Evictable", names, &PyDict_Type,
                                     &slot_of, &PySet_Type, &pinned, &PySet_Type, &loading,
                                     &protect, &keep))
        return NULL;
    Evictable *v = (Evictable *)type->tp_alloc(type, 0);
    if (!v) return NULL;
    Py_INCREF(slot_of), Py_INCREF(pinned), Py_INCREF(loading);
    v->slot_of = slot_of, v->pinned = pinned, v->loading = loading;
    v->protect = protect == Py_None ? NULL : (Py_INCREF(protect), protect);
    v->keep = keep == Py_None ? NULL : (Py_INCREF(keep), keep);
    return (PyObject *)v;
}

static int Evictable_traverse(Evictable *v, visitproc visit, void *arg) {
    Py_VISIT(v->slot_of);
    Py_VISIT(v->pinned);
    Py_VISIT(v->loading);
    Py_VISIT(v->protect);
    Py_VISIT(v->keep);
    return 0;
}

static int Evictable_clear(Evictable *v) {
    Py_CLEAR(v->slot_of);
    Py_CLEAR(v->pinned);
    Py_CLEAR(v->loading);
    Py_CLEAR(v->protect);
    Py_CLEAR(v->keep);
    return 0;
}

static void Evictable_dealloc(Evictable *v) {
    PyObject_GC_UnTrack(v);
    Evictable_clear(v);
    Py_TYPE(v)->tp_free((PyObject *)v);
}

PyTypeObject EvictableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "strata_mlx._nextuse.Evictable",
    .tp_basicsize = sizeof(Evictable),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Evictable(slot_of, pinned, loading, protect=None, keep=None)(key) -> bool: "
              "whether a resident expert may give up its slot (strata_mlx.stream.arena).",
    .tp_new = Evictable_new,
    .tp_call = (ternaryfunc)Evictable_call,
    .tp_traverse = (traverseproc)Evictable_traverse,
    .tp_clear = (inquiry)Evictable_clear,
    .tp_dealloc = (destructor)Evictable_dealloc,
};

Pred pred_of(PyObject *evictable) {
    if (Py_TYPE(evictable) == &EvictableType)
        return (Pred){NULL, evictable_check, layer_allowed, evictable};
    return (Pred){evictable, NULL, NULL, NULL};
}
