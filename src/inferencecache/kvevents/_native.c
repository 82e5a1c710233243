/* inferencecache.kvevents._native: token ids and block hashes from raw msgpack arrays.
 *
 * token_array(raw) -> TokenIds | None     a msgpack array of ints in [0, 2^32), or nil
 * hash_keys(raw)   -> list[bytes] | None  a msgpack array of ints (8-byte BE of v mod 2^64)
 *
 * Compiled twin of kvevents/packed.py (which defines the results with msgspec's typed
 * decoding): the subscriber's typed decoder keeps these fields as msgspec.Raw, so a block's 16
 * token ids never become Python ints. None = not the plain shape (the caller falls back to the
 * reference decoder, which decides every rejection).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *array_type = NULL; /* packed.TokenIds (an array('I') subclass), once set */

static inline uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* Array header at *p: sets *n (nil: *n = 0, *nil = 1). Returns 0, or -1 if not an array/nil. */
static int rd_header(const uint8_t **p, const uint8_t *end, Py_ssize_t *n) {
    if (*p >= end) return -1;
    uint8_t b = *(*p)++;
    if (b >= 0x90 && b <= 0x9f) {
        *n = b & 0x0f;
    } else if (b == 0xdc) {
        if (end - *p < 2) return -1;
        *n = (Py_ssize_t)be(*p, 2);
        *p += 2;
    } else if (b == 0xdd) {
        if (end - *p < 4) return -1;
        *n = (Py_ssize_t)be(*p, 4);
        *p += 4;
    } else if (b == 0xc0) {
        *n = 0;
    } else {
        return -1;
    }
    /* every element takes at least one byte */
    if (*n > end - *p) return -1;
    return 0;
}

/* One msgpack int: *neg = 1 when negative (value in *v as two's complement). 0, or -1 if the
 * item is not an int. */
static inline int rd_int(const uint8_t **p, const uint8_t *end, uint64_t *v, int *neg) {
    if (*p >= end) return -1;
    uint8_t b = *(*p)++;
    *neg = 0;
    if (b < 0x80) {
        *v = b;
        return 0;
    }
    if (b >= 0xe0) { /* negative fixint */
        *v = (uint64_t)(int64_t)(int8_t)b;
        *neg = 1;
        return 0;
    }
    int w;
    int sign;
    switch (b) {
    case 0xcc: w = 1; sign = 0; break;
    case 0xcd: w = 2; sign = 0; break;
    case 0xce: w = 4; sign = 0; break;
    case 0xcf: w = 8; sign = 0; break;
    case 0xd0: w = 1; sign = 1; break;
    case 0xd1: w = 2; sign = 1; break;
    case 0xd2: w = 4; sign = 1; break;
    case 0xd3: w = 8; sign = 1; break;
    default: return -1;
    }
    if (end - *p < w) return -1;
    uint64_t u = be(*p, w);
    *p += w;
    if (sign && (u >> (8 * w - 1)) & 1) { /* sign-extend */
        if (w < 8) u |= ~(uint64_t)0 << (8 * w);
        *neg = 1;
    }
    *v = u;
    return 0;
}

static PyObject *py_token_array(PyObject *Py_UNUSED(mod), PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const uint8_t *p = (const uint8_t *)view.buf, *end = p + view.len;
    PyObject *result = NULL, *raw = NULL;
    Py_ssize_t n;
    if (rd_header(&p, end, &n) < 0) goto decline;
    raw = PyBytes_FromStringAndSize(NULL, n * 4);
    if (raw == NULL) goto done;
    uint32_t *out = (uint32_t *)PyBytes_AS_STRING(raw);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v;
        int neg;
        if (rd_int(&p, end, &v, &neg) < 0 || neg || v > 0xFFFFFFFFu) goto decline;
        uint32_t w = (uint32_t)v;
        memcpy(out + i, &w, 4); /* native order: what array('I') holds */
    }
    if (p != end) goto decline;
    if (array_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "set_token_type() was not called");
        goto done;
    }
    result = PyObject_CallOneArg(array_type, raw);
    goto done;
decline:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(raw);
    PyBuffer_Release(&view);
    return result;
}

static PyObject *py_hash_keys(PyObject *Py_UNUSED(mod), PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const uint8_t *p = (const uint8_t *)view.buf, *end = p + view.len;
    PyObject *result = NULL, *list = NULL;
    Py_ssize_t n;
    if (rd_header(&p, end, &n) < 0) goto decline;
    list = PyList_New(n);
    if (list == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v;
        int neg;
        if (rd_int(&p, end, &v, &neg) < 0) goto decline;
        char key[8];
        for (int j = 7; j >= 0; j--) {
            key[j] = (char)(v & 0xFF);
            v >>= 8;
        }
        PyObject *k = PyBytes_FromStringAndSize(key, 8);
        if (k == NULL) goto done;
        PyList_SET_ITEM(list, i, k);
    }
    if (p != end) goto decline;
    result = Py_NewRef(list);
    goto done;
decline:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(list);
    PyBuffer_Release(&view);
    return result;
}

static PyObject *py_set_token_type(PyObject *Py_UNUSED(mod), PyObject *arg) {
    Py_XSETREF(array_type, Py_NewRef(arg));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"set_token_type", py_set_token_type, METH_O,
     "set_token_type(cls): token_array returns cls(native u32 bytes) (packed.TokenIds)"},
    {"token_array", py_token_array, METH_O,
     "token_array(raw) -> array('I') | None: a msgpack array of u32 ints (or nil)"},
    {"hash_keys", py_hash_keys, METH_O,
     "hash_keys(raw) -> list[bytes] | None: a msgpack array of ints as 8-byte BE keys"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "inferencecache.kvevents._native",
    "Raw msgpack token/hash arrays (see kvevents/packed.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&moduledef); }
