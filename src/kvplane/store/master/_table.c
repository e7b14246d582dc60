/* The object table's per-key hot spots in C: the key index's probe and the LRU move.
 *
 * Optional: kvplane.store.master.keys and .columns use it when it was built and their Python code
 * otherwise; both read and write the same arrays in the same way (tests/unit/store/
 * test_columns.py runs the same operations through both and compares).
 *
 *   find(shards, addrs, key) -> int
 *       KeyIndex.find: the row of the str ``key`` or -1. ``shards``: the list of SHARDS
 *       array('i') of slots (-1 empty); ``addrs``: array('Q') of the addresses of the key
 *       list's chunks (numpy object arrays of 1 << KEY_BITS items, kept alive by the key
 *       list), whose items are the keys' UTF-8 bytes (or None). The hash is Python's hash of
 *       the UTF-8 bytes, as in the Python code, so both find the same slots.
 *
 *   touch(nxt, prv, ends, row) -> None
 *       Columns.touch: make ``row`` the most recently used. ``nxt``/``prv``: array('i') of
 *       the LRU links (-1: none); ``ends``: array('i') [head, tail].
 *
 * Arguments are checked (types, item sizes, bounds); a bad one raises, never reads out of
 * bounds. The GIL is held throughout (each call is a few memory reads).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define SHARD_BITS 10
#define SHARD_MASK ((1 << SHARD_BITS) - 1)
#define KEY_BITS 16
#define KEY_MASK ((1 << KEY_BITS) - 1)

/* A writable buffer of ``itemsize`` items (an array.array of that type). */
static int get_items(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE) < 0)
        return -1;
    if (view->itemsize != itemsize || view->len % itemsize) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "%s: items of %zd bytes expected", what, itemsize);
        return -1;
    }
    return 0;
}

static PyObject *find(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[0]) || !PyUnicode_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "find(shards: list, addrs: array, key: str)");
        return NULL;
    }
    Py_ssize_t klen;
    const char *kp = PyUnicode_AsUTF8AndSize(args[2], &klen);
    if (kp == NULL)
        return NULL;
    Py_hash_t h = _Py_HashBytes(kp, klen);
    PyObject *shards = args[0];
    if (PyList_GET_SIZE(shards) != (1 << SHARD_BITS)) {
        PyErr_SetString(PyExc_ValueError, "find: shards must hold 1 << SHARD_BITS arrays");
        return NULL;
    }
    Py_buffer sv, av;
    if (get_items(PyList_GET_ITEM(shards, (size_t)h & SHARD_MASK), &sv, 4, "shard") < 0)
        return NULL;
    if (get_items(args[1], &av, 8, "addrs") < 0) {
        PyBuffer_Release(&sv);
        return NULL;
    }
    const int32_t *slots = (const int32_t *)sv.buf;
    const uint64_t *addrs = (const uint64_t *)av.buf;
    Py_ssize_t n = sv.len / 4, chunks = av.len / 8;
    long out = -1;
    if (n == 0 || (n & (n - 1))) {
        PyErr_SetString(PyExc_ValueError, "find: a shard's size must be a power of two");
        goto fail;
    }
    size_t mask = (size_t)n - 1, i = (size_t)(h >> SHARD_BITS) & mask;
    for (Py_ssize_t probes = 0; probes < n; probes++, i = (i + 1) & mask) {
        int32_t r = slots[i];
        if (r < 0)
            break;
        if ((r >> KEY_BITS) >= chunks) {
            PyErr_SetString(PyExc_IndexError, "find: a slot's row is past the key list");
            goto fail;
        }
        PyObject *kb = ((PyObject **)(uintptr_t)addrs[r >> KEY_BITS])[r & KEY_MASK];
        if (kb != NULL && PyBytes_CheckExact(kb) && PyBytes_GET_SIZE(kb) == klen
                && memcmp(PyBytes_AS_STRING(kb), kp, (size_t)klen) == 0) {
            out = r;
            break;
        }
    }
    PyBuffer_Release(&sv);
    PyBuffer_Release(&av);
    return PyLong_FromLong(out);
fail:
    PyBuffer_Release(&sv);
    PyBuffer_Release(&av);
    return NULL;
}

static PyObject *touch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "touch(nxt, prv, ends, row)");
        return NULL;
    }
    long row = PyLong_AsLong(args[3]);
    if (row == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer nv, pv, ev;
    if (get_items(args[0], &nv, 4, "nxt") < 0)
        return NULL;
    if (get_items(args[1], &pv, 4, "prv") < 0) {
        PyBuffer_Release(&nv);
        return NULL;
    }
    if (get_items(args[2], &ev, 4, "ends") < 0) {
        PyBuffer_Release(&nv);
        PyBuffer_Release(&pv);
        return NULL;
    }
    int32_t *nxt = (int32_t *)nv.buf, *prv = (int32_t *)pv.buf, *ends = (int32_t *)ev.buf;
    Py_ssize_t n = nv.len / 4;
    PyObject *out = NULL;
    if (pv.len / 4 != n || ev.len != 8 || row < 0 || row >= n) {
        PyErr_SetString(PyExc_IndexError, "touch: row out of range");
        goto done;
    }
    int32_t tail = ends[1];
    if (row != tail) {
        int32_t p = prv[row], nx = nxt[row];  /* nx >= 0: row is not the tail */
        if (nx < 0 || nx >= n || p >= n || tail < 0 || tail >= n) {
            PyErr_SetString(PyExc_ValueError, "touch: the LRU links are broken");
            goto done;
        }
        if (p >= 0)
            nxt[p] = nx;
        else
            ends[0] = nx;
        prv[nx] = p;
        prv[row] = tail;
        nxt[row] = -1;
        nxt[tail] = (int32_t)row;
        ends[1] = (int32_t)row;
    }
    out = Py_None;
    Py_INCREF(out);
done:
    PyBuffer_Release(&nv);
    PyBuffer_Release(&pv);
    PyBuffer_Release(&ev);
    return out;
}

static PyMethodDef methods[] = {
    {"find", (PyCFunction)(void (*)(void))find, METH_FASTCALL,
     "find(shards, addrs, key) -> row or -1 (KeyIndex.find)"},
    {"touch", (PyCFunction)(void (*)(void))touch, METH_FASTCALL,
     "touch(nxt, prv, ends, row): make row the most recently used (Columns.touch)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_table", "The object table's hot spots in C (see _table.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__table(void) { return PyModule_Create(&module); }
