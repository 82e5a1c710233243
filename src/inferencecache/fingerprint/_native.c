/*
 * inferencecache.fingerprint._native: the content fingerprint (contract spec section 8) in C.
 *
 * Same results as inferencecache.fingerprint.pure for every input (tests run both); the
 * rules are in docs/fingerprint.md. The module holds no state. Token ids are read straight
 * from list/tuple storage or from a buffer, written once as little-endian u32 into scratch
 * memory (skipped when a buffer already has that layout), then hashed block by block with
 * XXH3-64 seed 1337 (xxh3.h). No Python object is created per token or per block except the
 * results that are asked for.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "ic_pyargs.h"
#include "ic_wire.h"
#include "xxh3.h"

#define FP_SEED UINT64_C(1337)
/* Hash with the GIL released only when the work is big enough (about 25 us of hashing) to
 * be worth the cost of re-acquiring it under contention. */
#define FP_NOGIL_BYTES ((size_t)1 << 18)
/* Scratch on the C stack up to this many bytes, the heap above. */
#define FP_STACK_BYTES 8192

/* ======================================================================================= */
/* Argument parsing (METH_FASTCALL | METH_KEYWORDS, positional or keyword: ic_pyargs.h)      */
/* ======================================================================================= */

/* block_size: any int (via __index__). Sizes beyond what memory could hold are clamped, since
 * they can never fill a block; negative ones become 0 (no output). */
static int parse_block_size(PyObject *obj, Py_ssize_t *out) {
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL) return -1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
    Py_DECREF(idx);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow > 0 || v > (long long)(PY_SSIZE_T_MAX / 8)) v = (long long)(PY_SSIZE_T_MAX / 8);
    if (overflow < 0 || v < 0) v = 0;
    *out = (Py_ssize_t)v;
    return 0;
}

/* parent: None (fresh chain) or an int in 0..2**64-1 (ValueError outside). */
static int parse_parent(PyObject *obj, int *has_parent, uint64_t *out) {
    *has_parent = 0;
    *out = 0;
    if (obj == NULL || obj == Py_None) return 0;
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL) return -1;
    unsigned long long v = PyLong_AsUnsignedLongLong(idx);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%R is outside 0..18446744073709551615", idx);
        }
        Py_DECREF(idx);
        return -1;
    }
    Py_DECREF(idx);
    *has_parent = 1;
    *out = (uint64_t)v;
    return 0;
}

/* ======================================================================================= */
/* Token ids                                                                               */
/* ======================================================================================= */

/* Exact small non-negative int -> u32 without a call; 0 when the slow path must decide. */
static inline int fast_u32(PyObject *o, uint32_t *v) {
    if (!PyLong_CheckExact(o)) return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)o)) return 0;
    Py_ssize_t x = PyUnstable_Long_CompactValue((PyLongObject *)o); /* |x| < 2**30 */
    if (x < 0) return 0;
    *v = (uint32_t)x;
    return 1;
#else
    Py_ssize_t size = Py_SIZE(o);
    if (size == 1) {
        *v = (uint32_t)((PyLongObject *)o)->ob_digit[0];
        return 1;
    }
    if (size == 0) {
        *v = 0;
        return 1;
    }
    return 0;
#endif
}

static int bad_token(PyObject *value, Py_ssize_t i) {
    PyErr_Format(PyExc_ValueError, "token id %R at index %zd is outside 0..4294967295", value, i);
    return -1;
}

/* Anything else: __index__ (TypeError if absent), then the range check. */
static int slow_u32(PyObject *o, Py_ssize_t i, uint32_t *v) {
    PyObject *idx = PyNumber_Index(o);
    if (idx == NULL) return -1;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(idx, &overflow);
    if (x == -1 && PyErr_Occurred()) {
        Py_DECREF(idx);
        return -1;
    }
    if (overflow != 0 || x < 0 || x > (long long)UINT32_MAX) {
        bad_token(idx, i);
        Py_DECREF(idx);
        return -1;
    }
    Py_DECREF(idx);
    *v = (uint32_t)x;
    return 0;
}

/* Write tokens [0, n) of a list or tuple as le32 into out. The fast path runs no Python
 * code. The first id that needs __index__ could run code that changes the list, so a list is
 * first copied (its items as of the call, as the pure twin's slice sees them) and read from
 * the copy from there on. */
static int convert_objects(PyObject *seq, Py_ssize_t n, uint8_t *out) {
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *snapshot = NULL;
    int rc = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t v;
        if (IC_UNLIKELY(!fast_u32(items[i], &v))) {
            if (snapshot == NULL && PyList_Check(seq)) {
                snapshot = PyList_GetSlice(seq, 0, n);
                if (snapshot == NULL) return -1;
                items = PySequence_Fast_ITEMS(snapshot);
            }
            if (slow_u32(items[i], i, &v) < 0) {
                rc = -1;
                break;
            }
        }
        ic_write32(out + 4 * i, v);
    }
    Py_XDECREF(snapshot);
    return rc;
}

enum { TOK_OBJECTS, TOK_LE32, TOK_BE32 };

/* A resolved `tokens` argument: either a list/tuple of objects, or a buffer of u32 words in
 * a known byte order. Release with tokens_release. */
typedef struct {
    int kind;
    Py_ssize_t count;
    ic_input in; /* TOK_OBJECTS: in.seq, an owned list or tuple; TOK_LE32/TOK_BE32: in.view */
} tokens_t;

static void tokens_release(tokens_t *t) { ic_input_release(&t->in); }

/* Byte order of a buffer format "I"/"L" of itemsize 4, possibly with a struct prefix. Returns
 * TOK_LE32/TOK_BE32, or -1 for "raw bytes" formats, or -2 for any other format. */
static int classify_format(const char *fmt, Py_ssize_t itemsize) {
    if (fmt == NULL) return itemsize == 1 ? -1 : -2;
    int little = PY_LITTLE_ENDIAN;
    if (*fmt == '@' || *fmt == '=') {
        fmt++;
    } else if (*fmt == '<') {
        little = 1;
        fmt++;
    } else if (*fmt == '>' || *fmt == '!') {
        little = 0;
        fmt++;
    }
    if (fmt[0] == '\0' || fmt[1] != '\0') return -2;
    if (itemsize == 1 && (fmt[0] == 'B' || fmt[0] == 'b' || fmt[0] == 'c')) return -1;
    if (itemsize == 4 && (fmt[0] == 'I' || fmt[0] == 'L')) return little ? TOK_LE32 : TOK_BE32;
    return -2;
}

/* Resolve `tokens`: list/tuple -> objects; a 1-D contiguous buffer of bytes -> le32 words; of
 * unsigned 4-byte ints ('I'/'L') -> u32 words in the buffer's byte order; any other buffer
 * or iterable -> list(tokens). Mirrors pure._resolve. */
static int tokens_open(PyObject *obj, tokens_t *t) {
    memset(t, 0, sizeof(*t));
    if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) {
        Py_INCREF(obj);
        t->in.seq = obj;
        t->kind = TOK_OBJECTS;
        t->count = PySequence_Fast_GET_SIZE(obj);
        return 0;
    }
    if (PyObject_CheckBuffer(obj)) {
        if (ic_input_view(&t->in, obj, PyBUF_RECORDS_RO) < 0) return -1;
        int cls = classify_format(t->in.view.format, t->in.view.itemsize);
        if (cls != -2) {
            if (t->in.view.ndim != 1 || !PyBuffer_IsContiguous(&t->in.view, 'C')) {
                PyErr_SetString(PyExc_TypeError, "a token buffer must be one-dimensional and contiguous");
                tokens_release(t);
                return -1;
            }
            if (cls == -1) {
                if (t->in.view.len % 4 != 0) {
                    PyErr_Format(PyExc_ValueError,
                                 "a token byte buffer holds little-endian u32 ids; its length %zd "
                                 "is not a multiple of 4",
                                 t->in.view.len);
                    tokens_release(t);
                    return -1;
                }
                cls = TOK_LE32;
            }
            t->kind = cls;
            t->count = t->in.view.len / 4;
            return 0;
        }
        tokens_release(t);
    }
    PyObject *list = PySequence_List(obj);
    if (list == NULL) return -1;
    t->in.seq = list;
    t->kind = TOK_OBJECTS;
    t->count = PyList_GET_SIZE(list);
    return 0;
}

/* Pointer to the first n tokens as le32 bytes: the buffer itself when it already is that,
 * else converted into scratch (n * 4 bytes). */
static const uint8_t *tokens_le32(tokens_t *t, Py_ssize_t n, uint8_t *scratch) {
    if (t->kind == TOK_LE32 && PY_LITTLE_ENDIAN) return (const uint8_t *)t->in.view.buf;
    if (t->kind == TOK_OBJECTS) {
        if (convert_objects(t->in.seq, n, scratch) < 0) return NULL;
        return scratch;
    }
    const uint8_t *src = (const uint8_t *)t->in.view.buf;
    if (t->kind == TOK_LE32) {
        memcpy(scratch, src, (size_t)n * 4);
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            const uint8_t *w = src + 4 * i;
            uint32_t v = ((uint32_t)w[0] << 24) | ((uint32_t)w[1] << 16) | ((uint32_t)w[2] << 8) | w[3];
            ic_write32(scratch + 4 * i, v);
        }
    }
    return scratch;
}

/* ======================================================================================= */
/* The chain                                                                               */
/* ======================================================================================= */

/* prefix[i] for `blocks` blocks of `blen` bytes each at data. */
static inline void chain_loop(const ic_xxh3_key *k, const uint8_t *data, Py_ssize_t blocks, size_t blen,
                              int has_parent, uint64_t parent, uint64_t *out) {
    uint64_t prev = parent;
    for (Py_ssize_t i = 0; i < blocks; i++) {
        uint64_t content = ic_xxh3_64(k, data + (size_t)i * blen, blen);
        prev = (i == 0 && !has_parent) ? content : ic_xxh3_64_pair(k, prev, content);
        out[i] = prev;
    }
}

static void chain_hashes(const uint8_t *data, Py_ssize_t blocks, Py_ssize_t block_size, int has_parent,
                         uint64_t parent, uint64_t *out) {
    ic_xxh3_key k;
    ic_xxh3_key_init(&k, FP_SEED);
    size_t blen = (size_t)block_size * 4;
    /* Common block sizes get a loop specialised for their length class. */
    switch (blen) {
    case 64: chain_loop(&k, data, blocks, 64, has_parent, parent, out); break;
    case 128: chain_loop(&k, data, blocks, 128, has_parent, parent, out); break;
    default: chain_loop(&k, data, blocks, blen, has_parent, parent, out); break;
    }
}

static void chain_hashes_maybe_nogil(const uint8_t *data, Py_ssize_t blocks, Py_ssize_t block_size,
                                     int has_parent, uint64_t parent, uint64_t *out) {
    if ((size_t)blocks * (size_t)block_size * 4 >= FP_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        chain_hashes(data, blocks, block_size, has_parent, parent, out);
        Py_END_ALLOW_THREADS
    } else {
        chain_hashes(data, blocks, block_size, has_parent, parent, out);
    }
}

enum { OUT_INTS, OUT_PACKED, OUT_CHAIN };

static PyObject *hashes_to_python(const uint64_t *h, Py_ssize_t n, Py_ssize_t block_size, int mode) {
    if (mode == OUT_PACKED) {
        PyObject *res = PyBytes_FromStringAndSize(NULL, n * 8);
        if (res == NULL) return NULL;
        uint8_t *p = (uint8_t *)PyBytes_AS_STRING(res);
        for (Py_ssize_t i = 0; i < n; i++) ic_write64_be(p + 8 * i, h[i]);
        return res;
    }
    if (mode == OUT_INTS) {
        PyObject *res = PyList_New(n);
        if (res == NULL) return NULL;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *v = PyLong_FromUnsignedLongLong(h[i]);
            if (v == NULL) {
                Py_DECREF(res);
                return NULL;
            }
            PyList_SET_ITEM(res, i, v);
        }
        return res;
    }
    PyObject *hashes = PyList_New(n);
    PyObject *counts = PyList_New(n);
    PyObject *bs = PyLong_FromSsize_t(block_size);
    if (hashes == NULL || counts == NULL || bs == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyBytes_FromStringAndSize(NULL, 8);
        if (b == NULL) goto fail;
        ic_write64_be((uint8_t *)PyBytes_AS_STRING(b), h[i]);
        PyList_SET_ITEM(hashes, i, b);
        Py_INCREF(bs);
        PyList_SET_ITEM(counts, i, bs);
    }
    Py_DECREF(bs);
    PyObject *res = PyTuple_Pack(2, hashes, counts);
    Py_DECREF(hashes);
    Py_DECREF(counts);
    return res;
fail:
    Py_XDECREF(hashes);
    Py_XDECREF(counts);
    Py_XDECREF(bs);
    return NULL;
}

static PyObject *empty_result(int mode) {
    if (mode == OUT_PACKED) return PyBytes_FromStringAndSize(NULL, 0);
    if (mode == OUT_INTS) return PyList_New(0);
    return Py_BuildValue("([][])");
}

/* Shared body of prefix_hashes / chain / chain_packed. */
static PyObject *fingerprint_tokens(PyObject *tokens_obj, PyObject *bs_obj, PyObject *parent_obj, int mode) {
    Py_ssize_t block_size;
    int has_parent;
    uint64_t parent;
    if (parse_block_size(bs_obj, &block_size) < 0) return NULL;
    if (parse_parent(parent_obj, &has_parent, &parent) < 0) return NULL;
    tokens_t t;
    if (tokens_open(tokens_obj, &t) < 0) return NULL;
    if (block_size <= 0 || t.count < block_size) {
        tokens_release(&t);
        return empty_result(mode);
    }
    Py_ssize_t blocks = t.count / block_size;
    Py_ssize_t used = blocks * block_size;

    _Alignas(8) uint8_t stack[FP_STACK_BYTES];
    size_t need = (size_t)used * 4 + (size_t)blocks * 8;
    uint8_t *heap = NULL, *scratch = stack;
    if (need > sizeof(stack)) {
        heap = (uint8_t *)PyMem_Malloc(need);
        if (heap == NULL) {
            tokens_release(&t);
            return PyErr_NoMemory();
        }
        scratch = heap;
    }
    /* hashes first (8-aligned), token bytes after */
    uint64_t *hashes = (uint64_t *)(void *)scratch;
    uint8_t *words = scratch + (size_t)blocks * 8;
    PyObject *res = NULL;
    const uint8_t *data = tokens_le32(&t, used, words);
    if (data != NULL) {
        chain_hashes_maybe_nogil(data, blocks, block_size, has_parent, parent, hashes);
        res = hashes_to_python(hashes, blocks, block_size, mode);
    }
    PyMem_Free(heap);
    tokens_release(&t);
    return res;
}

static const char *const kw_tokens[] = {"tokens", "block_size", "parent"};

PyDoc_STRVAR(prefix_hashes_doc,
             "prefix_hashes($module, /, tokens, block_size, parent=None)\n--\n\n"
             "Prefix hash (uint64) of every full block of `block_size` tokens, as list[int].");

static PyObject *py_prefix_hashes(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwn) {
    (void)self;
    PyObject *a[3];
    if (ic_parse_args("prefix_hashes", kw_tokens, 3, 2, args, nargs, kwn, a) < 0) return NULL;
    return fingerprint_tokens(a[0], a[1], a[2], OUT_INTS);
}

PyDoc_STRVAR(chain_packed_doc,
             "chain_packed($module, /, tokens, block_size, parent=None)\n--\n\n"
             "Every prefix hash as 8-byte big-endian, concatenated (8 bytes per full block).");

static PyObject *py_chain_packed(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwn) {
    (void)self;
    PyObject *a[3];
    if (ic_parse_args("chain_packed", kw_tokens, 3, 2, args, nargs, kwn, a) < 0) return NULL;
    return fingerprint_tokens(a[0], a[1], a[2], OUT_PACKED);
}

PyDoc_STRVAR(chain_doc,
             "chain($module, /, tokens, block_size, parent=None)\n--\n\n"
             "The wire chain (list[bytes], list[int]): 8-byte big-endian prefix hashes and\n"
             "[block_size] * n counts.");

static PyObject *py_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwn) {
    (void)self;
    PyObject *a[3];
    if (ic_parse_args("chain", kw_tokens, 3, 2, args, nargs, kwn, a) < 0) return NULL;
    return fingerprint_tokens(a[0], a[1], a[2], OUT_CHAIN);
}

/* ======================================================================================= */
/* Packed repeated uint32 (protobuf varints)                                               */
/* ======================================================================================= */

#define FP_LOW_BITS UINT64_C(0x0101010101010101)

/* Number of varints = number of bytes without the continuation bit; 8 bytes per step. */
static Py_ssize_t varint_terminators(const uint8_t *p, Py_ssize_t len) {
    Py_ssize_t count = 0, i = 0;
    while (len - i >= 8) {
        Py_ssize_t words = (len - i) / 8;
        if (words > 255) words = 255; /* per-byte lane sums stay below 256 */
        uint64_t lanes = 0;
        for (Py_ssize_t w = 0; w < words; w++, i += 8) lanes += (~ic_read64(p + i) >> 7) & FP_LOW_BITS;
        lanes = (lanes & UINT64_C(0x00FF00FF00FF00FF)) + ((lanes >> 8) & UINT64_C(0x00FF00FF00FF00FF));
        count += (Py_ssize_t)((lanes * UINT64_C(0x0001000100010001)) >> 48);
    }
    for (; i < len; i++) count += p[i] < 0x80;
    return count;
}

/* Exact decoder for one varint at *pp (< end). Protobuf allows up to 10 bytes, so an overlong
 * encoding of a value that fits u32 is accepted; a value bit at 2**32 or above is not.
 * Returns 0, or -1 with ValueError set. */
static int varint_exact(const uint8_t **pp, const uint8_t *end, const uint8_t *start, uint32_t *out) {
    const uint8_t *p = *pp;
    uint32_t v = 0;
    for (int i = 0; i < 10; i++) {
        if (p == end) {
            PyErr_Format(PyExc_ValueError, "truncated varint at byte offset %zd", (Py_ssize_t)(*pp - start));
            return -1;
        }
        uint32_t b = *p++;
        uint32_t payload = b & 0x7F;
        if (i < 4) {
            v |= payload << (7 * i);
        } else if (i == 4 && payload <= 0x0F) {
            v |= payload << 28;
        } else if (payload != 0) {
            PyErr_Format(PyExc_ValueError, "varint at byte offset %zd is above 4294967295",
                         (Py_ssize_t)(*pp - start));
            return -1;
        }
        if (b < 0x80) {
            *out = v;
            *pp = p;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError, "varint at byte offset %zd is longer than 10 bytes", (Py_ssize_t)(*pp - start));
    return -1;
}

/* Decode the `count` varints of buf[0, len) as le32 words into out. The caller has checked
 * that the last byte ends a varint, so no varint runs past the end and the 1..4-byte common
 * case needs no bounds checks; a 5th byte (values from 2**28, overlong or invalid encodings)
 * hands that varint to the exact decoder. A byte-at-a-time walk whose branches follow the
 * varint lengths measured faster here than branch-free 64-byte-mask decoding (see
 * docs/fingerprint.md). Returns 0, or -1 with ValueError set. */
static int varints_to_le32(const uint8_t *buf, Py_ssize_t len, Py_ssize_t count, uint8_t *out) {
    const uint8_t *p = buf, *end = buf + len;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint32_t b = p[0];
        uint32_t v = b;
        if (IC_LIKELY(b < 0x80)) {
            p += 1;
        } else {
            b = p[1];
            v = (v & 0x7F) | ((b & 0x7F) << 7);
            if (b < 0x80) {
                p += 2;
            } else {
                b = p[2];
                v |= (b & 0x7F) << 14;
                if (b < 0x80) {
                    p += 3;
                } else {
                    b = p[3];
                    if (IC_LIKELY(b < 0x80)) {
                        v |= b << 21;
                        p += 4;
                    } else if (varint_exact(&p, end, buf, &v) < 0) {
                        return -1;
                    }
                }
            }
        }
        ic_write32(out + 4 * i, v);
    }
    return 0;
}

/* Decoded payload: count words of le32 in `words` (the stack or heap; free with PyMem_Free
 * when words != stack). */
static int varints_decode_all(const Py_buffer *view, uint8_t *stack, size_t stack_len, uint8_t **words,
                              Py_ssize_t *count) {
    const uint8_t *buf = (const uint8_t *)view->buf;
    *words = NULL;
    if (view->len > 0 && buf[view->len - 1] >= 0x80) {
        PyErr_Format(PyExc_ValueError, "truncated varint at the end of a %zd-byte payload", view->len);
        return -1;
    }
    *count = varint_terminators(buf, view->len);
    size_t need = (size_t)*count * 4;
    *words = stack;
    if (need > stack_len) {
        *words = (uint8_t *)PyMem_Malloc(need);
        if (*words == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    if (varints_to_le32(buf, view->len, *count, *words) < 0) {
        if (*words != stack) PyMem_Free(*words);
        *words = NULL;
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(varint_count_doc,
             "varint_count($module, buf, /)\n--\n\n"
             "Number of token ids in a packed repeated uint32 payload (its varints), cheaply, so a\n"
             "request can be bounded before decoding. ValueError if the last varint is truncated or\n"
             "one is longer than 10 bytes (protobuf rejects both); values are checked by the decoders.");

static PyObject *py_varint_count(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const uint8_t *buf = (const uint8_t *)view.buf;
    Py_ssize_t len = view.len;
    Py_ssize_t n = varint_terminators(buf, len);
    int truncated = len > 0 && buf[len - 1] >= 0x80;
    Py_ssize_t overlong = truncated ? -1 : ic_varint_overlong(buf, len);
    PyBuffer_Release(&view);
    if (truncated) {
        PyErr_Format(PyExc_ValueError, "truncated varint at the end of a %zd-byte payload", len);
        return NULL;
    }
    if (overlong >= 0) {
        PyErr_Format(PyExc_ValueError, "varint at byte offset %zd is longer than 10 bytes", overlong);
        return NULL;
    }
    return PyLong_FromSsize_t(n);
}

PyDoc_STRVAR(decode_varints_doc,
             "decode_varints($module, buf, /)\n--\n\n"
             "The token ids of a packed repeated uint32 payload as array.array('I'). ValueError\n"
             "for a truncated varint or a value above 2**32-1.");

static PyObject *py_decode_varints(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    _Alignas(8) uint8_t stack[FP_STACK_BYTES];
    uint8_t *words;
    Py_ssize_t n;
    PyObject *raw = NULL, *res = NULL;
    if (varints_decode_all(&view, stack, sizeof(stack), &words, &n) == 0) {
        raw = PyBytes_FromStringAndSize(NULL, n * 4);
        if (raw != NULL) {
            uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(raw);
            for (Py_ssize_t i = 0; i < n; i++) { /* array('I') is native order */
                uint32_t v = ic_read32(words + 4 * i);
                memcpy(dst + 4 * i, &v, 4);
            }
        }
        if (words != stack) PyMem_Free(words);
    }
    PyBuffer_Release(&view);
    if (raw != NULL) {
        PyObject *mod = PyImport_ImportModule("array");
        if (mod != NULL) {
            res = PyObject_CallMethod(mod, "array", "sO", "I", raw);
            Py_DECREF(mod);
        }
        Py_DECREF(raw);
    }
    return res;
}

static const char *const kw_varints[] = {"buf", "block_size", "parent"};

PyDoc_STRVAR(chain_from_varints_doc,
             "chain_from_varints($module, /, buf, block_size, parent=None)\n--\n\n"
             "chain_packed() of the token ids in a packed repeated uint32 payload (protobuf\n"
             "varints), without a Python int per token. The whole payload is validated.");

static PyObject *py_chain_from_varints(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                       PyObject *kwn) {
    (void)self;
    PyObject *a[3];
    if (ic_parse_args("chain_from_varints", kw_varints, 3, 2, args, nargs, kwn, a) < 0) return NULL;
    Py_ssize_t block_size;
    int has_parent;
    uint64_t parent;
    if (parse_block_size(a[1], &block_size) < 0) return NULL;
    if (parse_parent(a[2], &has_parent, &parent) < 0) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(a[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    _Alignas(8) uint8_t stack[FP_STACK_BYTES];
    uint8_t *words;
    Py_ssize_t count;
    PyObject *res = NULL;
    if (varints_decode_all(&view, stack, sizeof(stack), &words, &count) == 0) {
        Py_ssize_t blocks = block_size > 0 ? count / block_size : 0;
        res = PyBytes_FromStringAndSize(NULL, blocks * 8);
        if (res != NULL && blocks > 0) {
            uint64_t *hashes = (uint64_t *)PyMem_Malloc((size_t)blocks * 8);
            if (hashes == NULL) {
                Py_CLEAR(res);
                PyErr_NoMemory();
            } else {
                chain_hashes_maybe_nogil(words, blocks, block_size, has_parent, parent, hashes);
                uint8_t *p = (uint8_t *)PyBytes_AS_STRING(res);
                for (Py_ssize_t i = 0; i < blocks; i++) ic_write64_be(p + 8 * i, hashes[i]);
                PyMem_Free(hashes);
            }
        }
        if (words != stack) PyMem_Free(words);
    }
    PyBuffer_Release(&view);
    return res;
}

/* ======================================================================================= */
/* Small helpers                                                                           */
/* ======================================================================================= */

PyDoc_STRVAR(split_packed_doc,
             "split_packed($module, packed, /)\n--\n\n"
             "Split concatenated 8-byte hashes into a list of 8-byte bytes.");

static PyObject *py_split_packed(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    if (view.len % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "packed hashes: length %zd is not a multiple of 8", view.len);
        PyBuffer_Release(&view);
        return NULL;
    }
    Py_ssize_t n = view.len / 8;
    PyObject *res = PyList_New(n);
    if (res != NULL) {
        const char *p = (const char *)view.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *b = PyBytes_FromStringAndSize(p + 8 * i, 8);
            if (b == NULL) {
                Py_CLEAR(res);
                break;
            }
            PyList_SET_ITEM(res, i, b);
        }
    }
    PyBuffer_Release(&view);
    return res;
}

static const char *const kw_xxh3[] = {"data", "seed"};

PyDoc_STRVAR(xxh3_64_doc,
             "xxh3_64($module, /, data, seed=0)\n--\n\n"
             "XXH3-64 of a bytes-like object; equals xxhash.xxh3_64_intdigest(data, seed).");

static PyObject *py_xxh3_64(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwn) {
    (void)self;
    PyObject *a[2];
    if (ic_parse_args("xxh3_64", kw_xxh3, 2, 1, args, nargs, kwn, a) < 0) return NULL;
    uint64_t seed = 0;
    if (a[1] != NULL) {
        int has;
        if (parse_parent(a[1], &has, &seed) < 0) return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(a[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    ic_xxh3_key k;
    ic_xxh3_key_init(&k, seed);
    uint64_t h;
    if ((size_t)view.len >= FP_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        h = ic_xxh3_64(&k, (const uint8_t *)view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        h = ic_xxh3_64(&k, (const uint8_t *)view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

/* ======================================================================================= */
/* Module                                                                                  */
/* ======================================================================================= */

static PyMethodDef fp_methods[] = {
    {"prefix_hashes", (PyCFunction)(void (*)(void))py_prefix_hashes, METH_FASTCALL | METH_KEYWORDS,
     prefix_hashes_doc},
    {"chain", (PyCFunction)(void (*)(void))py_chain, METH_FASTCALL | METH_KEYWORDS, chain_doc},
    {"chain_packed", (PyCFunction)(void (*)(void))py_chain_packed, METH_FASTCALL | METH_KEYWORDS,
     chain_packed_doc},
    {"chain_from_varints", (PyCFunction)(void (*)(void))py_chain_from_varints, METH_FASTCALL | METH_KEYWORDS,
     chain_from_varints_doc},
    {"varint_count", py_varint_count, METH_O, varint_count_doc},
    {"decode_varints", py_decode_varints, METH_O, decode_varints_doc},
    {"split_packed", py_split_packed, METH_O, split_packed_doc},
    {"xxh3_64", (PyCFunction)(void (*)(void))py_xxh3_64, METH_FASTCALL | METH_KEYWORDS, xxh3_64_doc},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot fp_slots[] = {
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef fp_module = {
    PyModuleDef_HEAD_INIT,
    "inferencecache.fingerprint._native",
    "Content fingerprint (XXH3-64 seed 1337 prefix chain) in C; see docs/fingerprint.md.",
    0,
    fp_methods,
    fp_slots,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModuleDef_Init(&fp_module); }
