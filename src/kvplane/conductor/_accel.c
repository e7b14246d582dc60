/* The conductor's hot loops in C: vLLM's block-hash chain over a whole prompt, the token-id
 * array of a JSON query body, and the prefix walk's run between two cursor stops.
 *
 * Optional: kvplane.conductor.hashing uses it when it was built and falls back to its numpy path
 * otherwise. Both functions take only the happy path and return None for anything else, so the
 * Python side keeps the exact semantics (and error messages) of the generic encoders:
 *
 *   chain(tokens, block_size, parent, cbor) -> bytes | None
 *       tokens: a C-contiguous buffer of int64 token ids; the digests of every complete block,
 *       32 bytes each, chained from the 32-byte ``parent``. A block's hash input is what
 *       pickle protocol 5 (or canonical CBOR) makes of (parent, tuple(block), None): see the
 *       comment above _FIRST_BATCH in hashing.py. None when an id is negative or too large for
 *       the short encodings (>= 2**31 pickle, >= 2**32 CBOR) or a pickle frame would reach 64 KiB.
 *       The GIL is released while hashing.
 *
 *   continue_run(blocks, hashes, start, gpu, groups) -> int
 *       The prefix walk's inner loop (indexer._walk): the first index i >= start of the list
 *       ``hashes`` at which some running cursor stops, i.e. where ``held = blocks.get(h, 0)``
 *       misses a bit of ``gpu`` or has no bit of one of the ``groups`` masks; len(hashes) if
 *       none. -1 when a mask or a held value does not fit in 64 bits (the caller walks in Python).
 *
 *   parse_ids(text) -> bytes | None
 *       text: a JSON array of integers in [0, 2**32) (no signs, fractions, exponents or leading
 *       zeros), whitespace allowed; the ids as native int64 bytes. None for any other text.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <openssl/sha.h>
#include <stdint.h>
#include <string.h>

#define FRAME_LIMIT (1u << 16)

static size_t put_pickle_id(unsigned char *p, int64_t t) {
    if (t < 256) { p[0] = 0x4B; p[1] = (unsigned char)t; return 2; }          /* BININT1 */
    if (t < 65536) { p[0] = 0x4D; p[1] = t & 0xFF; p[2] = (t >> 8) & 0xFF; return 3; } /* BININT2 */
    p[0] = 0x4A;                                                                 /* BININT */
    p[1] = t & 0xFF; p[2] = (t >> 8) & 0xFF; p[3] = (t >> 16) & 0xFF; p[4] = (t >> 24) & 0xFF;
    return 5;
}

static size_t put_cbor_head(unsigned char *p, int major, uint64_t n) {
    unsigned char m = (unsigned char)(major << 5);
    if (n < 24) { p[0] = m | (unsigned char)n; return 1; }
    if (n < 256) { p[0] = m | 24; p[1] = (unsigned char)n; return 2; }
    if (n < 65536) { p[0] = m | 25; p[1] = (n >> 8) & 0xFF; p[2] = n & 0xFF; return 3; }
    p[0] = m | 26; p[1] = (n >> 24) & 0xFF; p[2] = (n >> 16) & 0xFF; p[3] = (n >> 8) & 0xFF;
    p[4] = n & 0xFF;
    return 5;
}

/* Hash every block; 0 on success, -1 when the fast encoding does not apply. */
static int run_chain(const int64_t *tok, Py_ssize_t nb, Py_ssize_t bs, const unsigned char *root,
                     int cbor, unsigned char *out, unsigned char *msg) {
    const unsigned char *parent = root;
    int64_t limit = cbor ? ((int64_t)1 << 32) : ((int64_t)1 << 31);
    for (Py_ssize_t b = 0; b < nb; b++) {
        const int64_t *t = tok + b * bs;
        size_t n = 0;
        if (cbor) {
            msg[n++] = 0x83; msg[n++] = 0x58; msg[n++] = 0x20;
            memcpy(msg + n, parent, 32); n += 32;
            n += put_cbor_head(msg + n, 4, (uint64_t)bs);
            for (Py_ssize_t i = 0; i < bs; i++) {
                if (t[i] < 0 || t[i] >= limit) return -1;
                n += put_cbor_head(msg + n, 0, (uint64_t)t[i]);
            }
            msg[n++] = 0xF6;
        } else {
            /* PROTO 5, FRAME <u64 filled below>, SHORT_BINBYTES 32 <parent>, MEMOIZE, ... */
            msg[0] = 0x80; msg[1] = 0x05; msg[2] = 0x95;
            n = 11;
            msg[n++] = 'C'; msg[n++] = 0x20;
            memcpy(msg + n, parent, 32); n += 32;
            msg[n++] = 0x94;
            if (bs > 3) msg[n++] = '(';                                          /* MARK */
            for (Py_ssize_t i = 0; i < bs; i++) {
                if (t[i] < 0 || t[i] >= limit) return -1;
                n += put_pickle_id(msg + n, t[i]);
            }
            msg[n++] = bs == 1 ? 0x85 : bs == 2 ? 0x86 : bs == 3 ? 0x87 : 't';     /* TUPLE(n) */
            msg[n++] = 0x94; msg[n++] = 'N'; msg[n++] = 0x87; msg[n++] = 0x94; msg[n++] = '.';
            uint64_t frame = n - 11;
            if (frame >= FRAME_LIMIT) return -1;
            for (int k = 0; k < 8; k++) msg[3 + k] = (frame >> (8 * k)) & 0xFF;
        }
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        SHA256_Update(&ctx, msg, n);
        SHA256_Final(out + 32 * b, &ctx);
        parent = out + 32 * b;
    }
    return 0;
}

static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer tokens, parent;
    Py_ssize_t bs;
    int cbor;
    if (!PyArg_ParseTuple(args, "y*ny*p", &tokens, &bs, &parent, &cbor)) return NULL;
    PyObject *result = NULL;
    if (bs <= 0 || parent.len != 32 || tokens.len % (Py_ssize_t)sizeof(int64_t) != 0) {
        PyErr_SetString(PyExc_ValueError, "chain: block_size > 0, a 32-byte parent, int64 tokens");
        goto done;
    }
    Py_ssize_t n = tokens.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t nb = n / bs;
    if (bs > (Py_ssize_t)(FRAME_LIMIT / 2)) { result = Py_NewRef(Py_None); goto done; }
    result = PyBytes_FromStringAndSize(NULL, nb * 32);
    if (result == NULL) goto done;
    unsigned char *msg = PyMem_RawMalloc((size_t)(64 + 5 * bs));
    if (msg == NULL) { Py_CLEAR(result); PyErr_NoMemory(); goto done; }
    int rc;
    unsigned char root[32];
    memcpy(root, parent.buf, 32);
    Py_BEGIN_ALLOW_THREADS
    rc = run_chain((const int64_t *)tokens.buf, nb, bs, root, cbor,
                   (unsigned char *)PyBytes_AS_STRING(result), msg);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(msg);
    if (rc != 0) { Py_DECREF(result); result = Py_NewRef(Py_None); }
done:
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&parent);
    return result;
}

static int is_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static PyObject *parse_ids(PyObject *self, PyObject *args) {
    Py_buffer text;
    if (!PyArg_ParseTuple(args, "y*", &text)) return NULL;
    const unsigned char *p = text.buf, *end = p + text.len;
    Py_ssize_t most = 1;  /* ids are separated by commas: at most one more id than commas */
    for (const unsigned char *q = p; q < end; q++) most += *q == ',';
    PyObject *out = PyBytes_FromStringAndSize(NULL, most * (Py_ssize_t)sizeof(int64_t));
    if (out == NULL) { PyBuffer_Release(&text); return NULL; }
    int64_t *ids = (int64_t *)PyBytes_AS_STRING(out);
    Py_ssize_t count = 0;
    while (p < end && is_ws(*p)) p++;
    if (p == end || *p++ != '[') goto fail;
    while (p < end && is_ws(*p)) p++;
    if (p < end && *p == ']') { p++; goto tail; }
    for (;;) {
        const unsigned char *first = p;
        uint64_t v = 0;
        while (p < end && (unsigned)(*p - '0') < 10u) v = v * 10 + (uint64_t)(*p++ - '0');
        Py_ssize_t digits = p - first;
        if (digits == 0 || digits > 10 || (digits > 1 && *first == '0')) goto fail;  /* JSON: no leading zeros */
        if (v >= ((uint64_t)1 << 32) || count >= most) goto fail;
        ids[count++] = (int64_t)v;
        if (p < end && *p == ',') { p++; }
        else {
            while (p < end && is_ws(*p)) p++;
            if (p == end) goto fail;
            if (*p == ']') { p++; break; }
            if (*p++ != ',') goto fail;
        }
        while (p < end && is_ws(*p)) p++;
    }
tail:
    while (p < end && is_ws(*p)) p++;
    if (p != end) goto fail;
    PyBuffer_Release(&text);
    if (count != most && _PyBytes_Resize(&out, count * (Py_ssize_t)sizeof(int64_t)) < 0) return NULL;
    return out;
fail:
    PyBuffer_Release(&text);
    Py_DECREF(out);
    Py_RETURN_NONE;
}

static int as_u64(PyObject *o, unsigned long long *out) {
    *out = PyLong_AsUnsignedLongLong(o);
    if (*out == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();  /* negative, too wide or not an int: not ours to decide */
        return -1;
    }
    return 0;
}

static PyObject *continue_run(PyObject *self, PyObject *args) {
    PyObject *blocks, *hashes, *gpu_obj, *groups;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "O!O!nOO!", &PyDict_Type, &blocks, &PyList_Type, &hashes, &start,
                          &gpu_obj, &PyTuple_Type, &groups))
        return NULL;
    unsigned long long gpu, masks[64];
    Py_ssize_t ng = PyTuple_GET_SIZE(groups);
    if (ng > 64 || as_u64(gpu_obj, &gpu) < 0) return PyLong_FromLong(-1);
    for (Py_ssize_t k = 0; k < ng; k++)
        if (as_u64(PyTuple_GET_ITEM(groups, k), &masks[k]) < 0) return PyLong_FromLong(-1);
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    for (Py_ssize_t i = start < 0 ? 0 : start; i < n; i++) {
        PyObject *held_obj = PyDict_GetItemWithError(blocks, PyList_GET_ITEM(hashes, i));  /* borrowed */
        unsigned long long held = 0;
        if (held_obj == NULL) {
            if (PyErr_Occurred()) return NULL;
        } else if (as_u64(held_obj, &held) < 0) {
            return PyLong_FromLong(-1);
        }
        if ((held & gpu) != gpu) return PyLong_FromSsize_t(i);
        for (Py_ssize_t k = 0; k < ng; k++)
            if (!(held & masks[k])) return PyLong_FromSsize_t(i);
    }
    return PyLong_FromSsize_t(n);
}

static PyMethodDef methods[] = {
    {"continue_run", continue_run, METH_VARARGS,
     "continue_run(blocks, hashes, start, gpu, groups) -> index of the next stop, or -1"},
    {"chain", chain, METH_VARARGS, "chain(tokens, block_size, parent, cbor) -> bytes | None"},
    {"parse_ids", parse_ids, METH_VARARGS, "parse_ids(json_array_text) -> int64 bytes | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvplane.conductor._accel",
    "The conductor's hot loops in C (optional accelerator).", -1, methods,
};

PyMODINIT_FUNC PyInit__accel(void) { return PyModule_Create(&module); }
