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
 *
 *   query_ids(body) -> (start, stop, bytes) | None
 *       body: a JSON object; finds its top-level "token_ids" member, parses its array as
 *       parse_ids does, and gives where the array's text starts and stops. Other members are
 *       skipped by nesting and quotes only: the caller has msgspec decode the body with the
 *       array replaced by null, so everything but the array is validated there. None when the
 *       member is absent, not such an array, given twice, or when a key has an escape.
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

/* The eight bytes at p as a little-endian integer: one load on little-endian hosts, assembled
 * byte by byte elsewhere (swar_digits needs p[0] in the low byte). */
static inline uint64_t load_le64(const unsigned char *p) {
#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
#else
    uint64_t w = 0;
    for (int k = 7; k >= 0; k--) w = (w << 8) | p[k];
    return w;
#endif
}

/* The run of ASCII digits that starts the 8 bytes at p, as a number in *v (all eight bytes are
 * read): how many digits, or 8 when all eight are (the caller then parses the run byte by byte).
 * Byte-parallel, so a run of 1-7 digits costs no branch per digit: a byte is a digit when
 * neither it, it + 0x46 nor it - 0x30 has its top bit set; a borrow or carry only travels
 * towards later bytes, past the first non-digit, so that one is found exactly. */
static inline int swar_digits(const unsigned char *p, uint64_t *v) {
    const uint64_t ones = 0x0101010101010101ULL, high = 0x8080808080808080ULL;
    uint64_t w = load_le64(p);  /* p[0] is the low byte, whatever the host's byte order */
    uint64_t not_digit = (w | (w + 0x46 * ones) | (w - 0x30 * ones)) & high;
    if (not_digit == 0) return 8;
    int n = __builtin_ctzll(not_digit) >> 3;
    if (n == 0) { *v = 0; return 0; }
    uint64_t d = ((w - 0x30 * ones) << (8 * (8 - n)));  /* the n digits, most significant first, zeros before */
    d = (d * 10 + (d >> 8)) & 0x00FF00FF00FF00FFULL;    /* pairs */
    d = (d * 100 + (d >> 16)) & 0x0000FFFF0000FFFFULL;  /* quads */
    *v = (d * 10000 + (d >> 32)) & 0xFFFFFFFFULL;       /* all eight */
    return n;
}

/* Parse the JSON array of ids at p (no leading whitespace) into ids[0..most); the position after
 * its ']' and the count, or NULL when the text is not an array of integers in [0, 2**32). */
static const unsigned char *parse_array(const unsigned char *p, const unsigned char *end,
                                        int64_t *ids, Py_ssize_t most, Py_ssize_t *count_out) {
    Py_ssize_t count = 0;
    if (p == end || *p++ != '[') return NULL;
    while (p < end && is_ws(*p)) p++;
    if (p < end && *p == ']') { *count_out = 0; return p + 1; }
    for (;;) {
        const unsigned char *first = p;
        uint64_t v = 0;
        int n = end - p >= 8 ? swar_digits(p, &v) : 8;
        if (n < 8) p += n;
        else for (v = 0; p < end && (unsigned)(*p - '0') < 10u; ) v = v * 10 + (uint64_t)(*p++ - '0');
        Py_ssize_t digits = p - first;
        if (digits == 0 || digits > 10 || (digits > 1 && *first == '0')) return NULL;  /* JSON: no leading zeros */
        if (v >= ((uint64_t)1 << 32) || count >= most) return NULL;
        ids[count++] = (int64_t)v;
        if (p < end && *p == ',') { p++; }
        else {
            while (p < end && is_ws(*p)) p++;
            if (p == end) return NULL;
            if (*p == ']') { p++; break; }
            if (*p++ != ',') return NULL;
        }
        while (p < end && is_ws(*p)) p++;
    }
    *count_out = count;
    return p;
}

/* A bytes object for the ids of the array at p..end (at most one more id than commas), or
 * Py_None when it is not one; *after is set past the array. NULL on a Python error. */
static PyObject *ids_of(const unsigned char *p, const unsigned char *end, const unsigned char **after) {
    Py_ssize_t most = 1, count = 0;
    const unsigned char *close = memchr(p, ']', (size_t)(end - p));  /* ids hold no ']' */
    for (const unsigned char *q = p, *stop = close ? close : end; q < stop; q++) most += *q == ',';
    PyObject *out = PyBytes_FromStringAndSize(NULL, most * (Py_ssize_t)sizeof(int64_t));
    if (out == NULL) return NULL;
    *after = parse_array(p, end, (int64_t *)PyBytes_AS_STRING(out), most, &count);
    if (*after == NULL) { Py_DECREF(out); Py_RETURN_NONE; }
    if (count != most && _PyBytes_Resize(&out, count * (Py_ssize_t)sizeof(int64_t)) < 0) return NULL;
    return out;
}

static PyObject *parse_ids(PyObject *self, PyObject *args) {
    Py_buffer text;
    if (!PyArg_ParseTuple(args, "y*", &text)) return NULL;
    const unsigned char *p = text.buf, *end = p + text.len, *after = NULL;
    while (p < end && is_ws(*p)) p++;
    PyObject *out = ids_of(p, end, &after);
    if (out != NULL && out != Py_None) {
        while (after < end && is_ws(*after)) after++;
        if (after != end) Py_SETREF(out, Py_NewRef(Py_None));
    }
    PyBuffer_Release(&text);
    return out;
}

/* Past the JSON string that starts at p (its opening quote); NULL if unterminated, including
 * when the text ends right after an escape's backslash (p never steps past end). */
static const unsigned char *skip_string(const unsigned char *p, const unsigned char *end, int *escaped) {
    for (p++; p < end; p++) {
        if (*p == '\\') {
            *escaped = 1;
            if (++p == end) return NULL;  /* the escaped byte is missing */
        } else if (*p == '"') {
            return p + 1;
        }
    }
    return NULL;
}

/* Past the JSON value at p, tracking nesting and strings only (the caller has msgspec validate
 * what is skipped); NULL if it runs off the end. */
static const unsigned char *skip_value(const unsigned char *p, const unsigned char *end) {
    int depth = 0, esc = 0;
    while (p < end) {
        unsigned char c = *p;
        if (c == '"') { if ((p = skip_string(p, end, &esc)) == NULL) return NULL; }
        else if (c == '[' || c == '{') { depth++; p++; }
        else if (c == ']' || c == '}') { if (depth == 0) return p; depth--; p++; }
        else if (c == ',' && depth == 0) return p;
        else p++;
        if (depth == 0 && p < end && (*p == ',' || *p == '}' || *p == ']' || is_ws(*p))) return p;
    }
    return depth == 0 ? p : NULL;
}

static PyObject *query_ids(PyObject *self, PyObject *args) {
    Py_buffer text;
    if (!PyArg_ParseTuple(args, "y*", &text)) return NULL;
    const unsigned char *base = text.buf, *p = base, *end = p + text.len;
    const unsigned char *start = NULL, *stop = NULL;
    PyObject *ids = NULL;
    while (p < end && is_ws(*p)) p++;
    if (p == end || *p++ != '{') goto none;
    while (p < end && is_ws(*p)) p++;
    if (p < end && *p == '}') goto none;
    for (;;) {
        if (p == end || *p != '"') goto none;
        int esc = 0;
        const unsigned char *key = p + 1, *q = skip_string(p, end, &esc);
        if (q == NULL || esc) goto none;  /* an escaped key may spell token_ids: not ours */
        int ours = (q - key - 1) == 9 && memcmp(key, "token_ids", 9) == 0;
        p = q;
        while (p < end && is_ws(*p)) p++;
        if (p == end || *p++ != ':') goto none;
        while (p < end && is_ws(*p)) p++;
        if (ours) {
            if (ids != NULL || p == end || *p != '[') goto none;  /* twice, or not an array */
            start = p;
            ids = ids_of(p, end, &stop);
            if (ids == NULL) goto error;
            if (ids == Py_None) goto none;
            p = stop;
        } else if ((p = skip_value(p, end)) == NULL) {
            goto none;
        }
        while (p < end && is_ws(*p)) p++;
        if (p < end && *p == ',') { p++; while (p < end && is_ws(*p)) p++; continue; }
        if (p < end && *p == '}') break;
        goto none;
    }
    if (ids == NULL) goto none;
    PyBuffer_Release(&text);
    PyObject *r = Py_BuildValue("nnN", (Py_ssize_t)(start - base), (Py_ssize_t)(stop - base), ids);
    return r;
none:
    Py_XDECREF(ids);
    PyBuffer_Release(&text);
    Py_RETURN_NONE;
error:
    PyBuffer_Release(&text);
    return NULL;
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
    {"query_ids", query_ids, METH_VARARGS,
     "query_ids(json_object_text) -> (start, stop, int64 bytes) of its token_ids array | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvplane.conductor._accel",
    "The conductor's hot loops in C (optional accelerator).", -1, methods,
};

PyMODINIT_FUNC PyInit__accel(void) { return PyModule_Create(&module); }
