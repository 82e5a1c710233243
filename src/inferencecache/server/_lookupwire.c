/*
 * inferencecache.server._lookupwire: the LookupRoute request parser and response encoder in C.
 * Without this build, protobuf itself parses and serializes (server/lookup_wire.py); tests compare the
 * two on every input (tests/server/test_wire_differential.py, test_lookupwire.py).
 *
 * parse(buf) -> tuple of the LookupRequest fields, or None
 *   Any LookupRouteRequest protobuf decodes, read exactly as protobuf reads it (see
 *   include/ic_wire.h for the wire rules), with the hot fields kept packed: 8-byte block hashes
 *   as one bytes of their concatenation, token_ids as the raw varint payload, counts that fit a
 *   byte as one bytes. None for anything it does not read (groups) and for everything protobuf
 *   rejects (corrupt varints, tags or lengths, invalid UTF-8, a truncated field): the caller
 *   then runs protobuf, which decides. So this never accepts what protobuf rejects.
 *
 * encode(result) -> bytes, or None
 *   The LookupRouteResponse bytes protobuf produces for a LookupResult (fields in number order,
 *   proto3 defaults omitted, packed token_ids, float32 fields as their bit patterns), read by
 *   attribute name. None for values protobuf would convert or reject (non-exact types,
 *   out-of-range integers, floats beyond float32, unencodable strings): the caller then builds
 *   the protobuf message, which converts or raises as it always did.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

#include "ic_wire.h"

#define FIELDS_REQ 14 /* LookupRequest */

/* ======================================================================================= */
/* Request parser                                                                          */
/* ======================================================================================= */

typedef struct {
    const uint8_t *p;
    Py_ssize_t n;
} Span;

/* A growable array of spans (block hashes, repeated chunks) with a small inline part. */
typedef struct {
    Span local[8];
    Span *v;
    Py_ssize_t n, cap;
    Py_ssize_t bytes; /* total length */
} Spans;

static void spans_init(Spans *s) {
    s->v = s->local;
    s->n = 0;
    s->cap = 8;
    s->bytes = 0;
}

/* Grow an array of n items of `size` bytes at *v (the inline `local` or the heap) to cap. */
static int grow(void **v, void *local, Py_ssize_t n, Py_ssize_t *cap_out, Py_ssize_t cap,
                size_t size) {
    void *nv = PyMem_Malloc((size_t)cap * size);
    if (nv == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(nv, *v, (size_t)n * size);
    if (*v != local) PyMem_Free(*v);
    *v = nv;
    *cap_out = cap;
    return 0;
}

static void spans_free(Spans *s) {
    if (s->v != s->local) PyMem_Free(s->v);
}

static int spans_grow(Spans *s, Py_ssize_t cap) {
    return grow((void **)&s->v, s->local, s->n, &s->cap, cap, sizeof(Span));
}

static inline int spans_add(Spans *s, const uint8_t *p, Py_ssize_t n) {
    if (s->n == s->cap && spans_grow(s, s->cap * 4) < 0) return -1;
    s->v[s->n].p = p;
    s->v[s->n].n = n;
    s->n++;
    s->bytes += n;
    return 0;
}

/* 8-byte spans (block hashes) concatenated: fixed-size copies. */
static PyObject *spans_join8(const Spans *s) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, 8 * s->n);
    if (out == NULL) return NULL;
    char *dst = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < s->n; i++) memcpy(dst + 8 * i, s->v[i].p, 8);
    return out;
}

/* The spans concatenated into one bytes object. */
static PyObject *spans_join(const Spans *s) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, s->bytes);
    if (out == NULL) return NULL;
    char *dst = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < s->n; i++) {
        memcpy(dst, s->v[i].p, (size_t)s->v[i].n);
        dst += s->v[i].n;
    }
    return out;
}

/* The spans as a list of bytes objects. */
static PyObject *spans_list(const Spans *s) {
    PyObject *out = PyList_New(s->n);
    for (Py_ssize_t i = 0; out != NULL && i < s->n; i++) {
        PyObject *h = PyBytes_FromStringAndSize((const char *)s->v[i].p, s->v[i].n);
        if (h == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, h);
    }
    return out;
}

/* block_token_counts (repeated int32, packed or not) as decoded values. */
typedef struct {
    int32_t local[64];
    int32_t *v;
    Py_ssize_t n, cap;
    int bytes_ok; /* every value fits a byte: handed out as one bytes object */
} Ints;

static void ints_init(Ints *c) {
    c->v = c->local;
    c->n = 0;
    c->cap = 64;
    c->bytes_ok = 1;
}

static void ints_free(Ints *c) {
    if (c->v != c->local) PyMem_Free(c->v);
}

static int ints_add(Ints *c, int32_t x) {
    if (c->n == c->cap &&
        grow((void **)&c->v, c->local, c->n, &c->cap, 4 * c->cap, sizeof(int32_t)) < 0)
        return -1;
    c->v[c->n++] = x;
    c->bytes_ok &= x >= 0 && x <= 255;
    return 0;
}

/* bytes of the values when they all fit one, else a list of ints. */
static PyObject *ints_out(const Ints *c) {
    if (c->bytes_ok) {
        PyObject *out = PyBytes_FromStringAndSize(NULL, c->n);
        if (out == NULL) return NULL;
        char *dst = PyBytes_AS_STRING(out);
        for (Py_ssize_t i = 0; i < c->n; i++) dst[i] = (char)(uint8_t)c->v[i];
        return out;
    }
    PyObject *out = PyList_New(c->n);
    for (Py_ssize_t i = 0; out != NULL && i < c->n; i++) {
        PyObject *x = PyLong_FromLong(c->v[i]);
        if (x == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, x);
    }
    return out;
}

/* One packed payload of int32 varints into c. IC_OK, IC_DECLINE or -1. */
static int ints_packed(Ints *c, const uint8_t *b, Py_ssize_t pos, Py_ssize_t stop) {
    while (pos < stop) {
        uint64_t v;
        if (b[pos] < 0x80) { /* one-byte varints: the common counts */
            v = b[pos++];
        } else if (ic_varint(b, stop, &pos, &v) != IC_OK) {
            return IC_DECLINE;
        }
        if (ints_add(c, ic_as_int32(v)) < 0) return -1;
    }
    return IC_OK;
}

/* The SLO message(s) as protobuf merges them: ttft_ms = the last field 1. IC_OK or
 * IC_DECLINE. */
static int slo_ttft(const Spans *slo, int32_t *ttft) {
    *ttft = 0;
    for (Py_ssize_t i = 0; i < slo->n; i++) {
        const uint8_t *b = slo->v[i].p;
        Py_ssize_t n = slo->v[i].n, pos = 0;
        while (pos < n) {
            uint32_t field;
            int wire;
            uint64_t v;
            if (ic_tag(b, n, &pos, &field, &wire) != IC_OK) return IC_DECLINE;
            if (field == 1 && wire == IC_WIRE_VARINT) {
                if (ic_varint(b, n, &pos, &v) != IC_OK) return IC_DECLINE;
                *ttft = ic_as_int32(v);
            } else if (ic_skip(b, n, &pos, wire) != IC_OK) { /* tbt_ms and unknown fields */
                return IC_DECLINE;
            }
        }
    }
    return IC_OK;
}

static PyObject *s_empty_str = NULL;
static PyObject *s_empty_bytes = NULL;

/* A string field's text into *slot (last wins). IC_OK, IC_DECLINE (invalid UTF-8) or -1. */
static int set_text(PyObject **slot, const uint8_t *p, Py_ssize_t n) {
    PyObject *s;
    if (n == 0) {
        s = Py_NewRef(s_empty_str);
    } else if ((s = PyUnicode_DecodeUTF8((const char *)p, n, "strict")) == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) return -1;
        PyErr_Clear();
        return IC_DECLINE;
    }
    Py_XSETREF(*slot, s);
    return IC_OK;
}

static inline PyObject *text_or_empty(PyObject *s) {
    return Py_NewRef(s != NULL ? s : s_empty_str);
}

static PyObject *wire_parse(PyObject *Py_UNUSED(module), PyObject *arg) {
    if (!PyBytes_CheckExact(arg)) Py_RETURN_NONE;
    const uint8_t *b = (const uint8_t *)PyBytes_AS_STRING(arg);
    Py_ssize_t n = PyBytes_GET_SIZE(arg), pos = 0;
    PyObject *model = NULL, *tenant = NULL, *scheme = NULL, *prompt = NULL, *adapter = NULL;
    const uint8_t *ph = NULL;
    Py_ssize_t ph_n = 0;
    int32_t prefix_count = 0;
    int all8 = 1;
    Spans hashes, tokens, slo;
    Ints counts;
    spans_init(&hashes);
    spans_init(&tokens);
    spans_init(&slo);
    ints_init(&counts);
    PyObject *out = NULL;
    int rc = IC_OK; /* or IC_DECLINE (protobuf decides), or -1 (error) */
    /* room for every block hash of a chain request (10-byte records) without growing */
    if (n / 10 > hashes.cap && spans_grow(&hashes, n / 10 + 8) < 0) rc = -1;
    while (pos < n && rc == IC_OK) {
        if (b[pos] == 0x3A && n - pos >= 10 && b[pos + 1] == 0x08) {
            /* `3a 08 <8 bytes>`: one block hash, the bulk of a chain request */
            rc = spans_add(&hashes, b + pos + 2, 8);
            pos += 10;
            continue;
        }
        uint32_t field;
        int wire;
        uint64_t v;
        Py_ssize_t s0, s1;
        if (ic_tag(b, n, &pos, &field, &wire) != IC_OK) {
            rc = IC_DECLINE;
            break;
        }
        if (wire == IC_WIRE_VARINT && (field == 4 || field == 8 || field == 9)) {
            Py_ssize_t at = pos;
            if (ic_varint(b, n, &pos, &v) != IC_OK) rc = IC_DECLINE;
            else if (field == 4) prefix_count = ic_as_int32(v);    /* prefix_token_count */
            else if (field == 8) rc = ints_add(&counts, ic_as_int32(v)); /* unpacked count */
            else rc = spans_add(&tokens, b + at, pos - at); /* unpacked token id: its varint */
            continue;
        }
        if (wire != IC_WIRE_LEN || field > 11 || field == 4) { /* unknown, or another wire type */
            rc = ic_skip(b, n, &pos, wire);
            continue;
        }
        if (ic_payload(b, n, &pos, &s0, &s1) != IC_OK) {
            rc = IC_DECLINE;
            break;
        }
        const uint8_t *p = b + s0;
        Py_ssize_t len = s1 - s0;
        switch (field) {
        case 1: rc = set_text(&model, p, len); break;
        case 2: rc = set_text(&tenant, p, len); break;
        case 3: ph = p; ph_n = len; break; /* prefix_hash */
        case 5: rc = set_text(&scheme, p, len); break;
        case 6: rc = spans_add(&slo, p, len); break; /* merged below */
        case 7: /* block_hashes */
            all8 &= len == 8;
            rc = spans_add(&hashes, p, len);
            break;
        case 8: rc = ints_packed(&counts, b, s0, s1); break; /* block_token_counts, packed */
        case 9: /* token_ids, packed: whole varints of at most 10 bytes, kept raw */
            rc = ic_packed_ok(p, len) ? spans_add(&tokens, p, len) : IC_DECLINE;
            break;
        case 10: rc = set_text(&prompt, p, len); break;
        case 11: rc = set_text(&adapter, p, len); break;
        }
    }
    int32_t ttft = 0;
    if (rc == IC_OK && slo.n > 0) rc = slo_ttft(&slo, &ttft);
    if (rc != IC_OK) goto done;
    {
        PyObject *f[FIELDS_REQ];
        f[0] = text_or_empty(tenant);
        f[1] = text_or_empty(model);
        f[2] = text_or_empty(scheme);
        f[3] = text_or_empty(adapter);
        f[4] = ph_n ? PyBytes_FromStringAndSize((const char *)ph, ph_n) : Py_NewRef(s_empty_bytes);
        f[5] = PyLong_FromLong(prefix_count);
        f[6] = all8 ? spans_join8(&hashes) : spans_list(&hashes);
        f[7] = Py_NewRef(all8 ? Py_True : Py_False);
        f[8] = ints_out(&counts);
        f[9] = spans_join(&tokens);
        f[10] = Py_NewRef(Py_True);
        f[11] = text_or_empty(prompt);
        f[12] = PyLong_FromLong(ttft);
        f[13] = Py_NewRef(Py_None);
        int ok = 1;
        for (int i = 0; i < FIELDS_REQ; i++) ok &= f[i] != NULL;
        if (ok) out = PyTuple_New(FIELDS_REQ);
        if (out == NULL) {
            for (int i = 0; i < FIELDS_REQ; i++) Py_XDECREF(f[i]);
            rc = -1;
        } else {
            for (int i = 0; i < FIELDS_REQ; i++) PyTuple_SET_ITEM(out, i, f[i]);
        }
    }
done:
    Py_XDECREF(model);
    Py_XDECREF(tenant);
    Py_XDECREF(scheme);
    Py_XDECREF(prompt);
    Py_XDECREF(adapter);
    spans_free(&hashes);
    spans_free(&tokens);
    spans_free(&slo);
    ints_free(&counts);
    if (rc < 0) return NULL;
    if (rc == IC_DECLINE) Py_RETURN_NONE;
    return out;
}

/* ======================================================================================= */
/* Response encoder                                                                        */
/* ======================================================================================= */

typedef struct {
    uint8_t *p;
    Py_ssize_t n, cap;
    uint8_t local[512];
} Buf;

static void buf_init(Buf *b) {
    b->p = b->local;
    b->n = 0;
    b->cap = (Py_ssize_t)sizeof(b->local);
}

static void buf_free(Buf *b) {
    if (b->p != b->local) PyMem_Free(b->p);
}

static int buf_reserve(Buf *b, Py_ssize_t more) {
    if (b->n + more <= b->cap) return 0;
    Py_ssize_t cap = b->cap;
    while (cap < b->n + more) cap *= 2;
    uint8_t *p = (uint8_t *)PyMem_Malloc((size_t)cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(p, b->p, (size_t)b->n);
    if (b->p != b->local) PyMem_Free(b->p);
    b->p = p;
    b->cap = cap;
    return 0;
}

/* Callers reserve first: a varint is at most 10 bytes. */
static inline void put_varint(Buf *b, uint64_t v) { b->n = ic_put_varint(b->p + b->n, v) - b->p; }

/* An exact int in [lo, hi] as int64; 0 = ok, 1 = protobuf decides. */
static int int_in(PyObject *o, long long lo, long long hi, long long *out) {
    if (!PyLong_CheckExact(o)) return 1;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 1;
    }
    if (overflow || v < lo || v > hi) return 1;
    *out = v;
    return 0;
}

/* A str as UTF-8; 0 = ok, 1 = protobuf decides (not a str, or not encodable). */
static int text_of(PyObject *o, const char **p, Py_ssize_t *n) {
    if (!PyUnicode_CheckExact(o)) return 1;
    *p = PyUnicode_AsUTF8AndSize(o, n);
    if (*p == NULL) {
        PyErr_Clear();
        return 1;
    }
    return 0;
}

/* A Python float as the float32 protobuf stores (its bit pattern); 1 = protobuf decides
 * (not a float, or finite beyond float32's range, where C's conversion is not defined). */
static int float32_bits(PyObject *o, uint32_t *bits) {
    if (!PyFloat_CheckExact(o)) return 1;
    double d = PyFloat_AS_DOUBLE(o);
    if (d == d && (d > FLT_MAX || d < -FLT_MAX) && d - d == 0.0) return 1;
    float f = (float)d;
    memcpy(bits, &f, 4);
    return 0;
}

static inline void put_fixed32(Buf *b, uint32_t v) {
    for (int i = 0; i < 4; i++) b->p[b->n++] = (uint8_t)(v >> (8 * i));
}

static inline int put_bytes_field(Buf *b, uint8_t tag, const char *p, Py_ssize_t n) {
    if (n == 0) return 0;
    if (buf_reserve(b, 1 + 10 + n) < 0) return -1;
    b->p[b->n++] = tag;
    put_varint(b, (uint64_t)n);
    memcpy(b->p + b->n, p, (size_t)n);
    b->n += n;
    return 0;
}

#define FIELDS_RES 5
#define FIELDS_SCORE 5
/* Attribute names of LookupResult and ReplicaScore (index/model.py), in field-number order. */
static const char *const res_names[FIELDS_RES] = {"replica_scores", "reason_code",
                                                  "lookup_latency_us", "token_ids", "adapter_id"};
static const char *const score_names[FIELDS_SCORE] = {
    "replica_id", "score", "matched_tokens", "estimated_cache_hit_prob", "tier"};
static PyObject *res_attr[FIELDS_RES], *score_attr[FIELDS_SCORE]; /* interned */

/* The attributes `names` of o into f (new references); 0 ok, 1 missing (protobuf decides). */
static int get_attrs(PyObject *o, PyObject *const *names, int n, PyObject **f) {
    for (int i = 0; i < n; i++) {
        f[i] = PyObject_GetAttr(o, names[i]);
        if (f[i] == NULL) {
            PyErr_Clear();
            for (int j = 0; j < i; j++) Py_DECREF(f[j]);
            return 1;
        }
    }
    return 0;
}

static void put_attrs(PyObject **f, int n) {
    for (int i = 0; i < n; i++) Py_DECREF(f[i]);
}

#define INT32_LO (-2147483647LL - 1)
#define INT32_HI 2147483647LL

/* One ReplicaScore message body into b; 0 ok, 1 protobuf decides, -1 error. */
static int encode_score(PyObject *s, Buf *b) {
    const char *id;
    Py_ssize_t id_n;
    uint32_t score, prob;
    long long matched, tier;
    PyObject *f[FIELDS_SCORE];
    if (get_attrs(s, score_attr, FIELDS_SCORE, f)) return 1;
    int rc = 1;
    if (text_of(f[0], &id, &id_n) || float32_bits(f[1], &score) ||
        int_in(f[2], INT32_LO, INT32_HI, &matched) || float32_bits(f[3], &prob) ||
        int_in(f[4], INT32_LO, INT32_HI, &tier))
        goto done;
    /* fields in number order, proto3 defaults (0, +0.0, "") omitted */
    rc = -1;
    if (put_bytes_field(b, 0x0A, id, id_n) < 0 || buf_reserve(b, 5 + 11 + 5 + 11) < 0) goto done;
    if (score != 0) {
        b->p[b->n++] = 0x15;
        put_fixed32(b, score);
    }
    if (matched != 0) {
        b->p[b->n++] = 0x18;
        put_varint(b, (uint64_t)matched); /* negative int32: ten bytes, as protobuf */
    }
    if (prob != 0) {
        b->p[b->n++] = 0x25;
        put_fixed32(b, prob);
    }
    if (tier != 0) {
        b->p[b->n++] = 0x28;
        put_varint(b, (uint64_t)tier);
    }
    rc = 0;
done:
    put_attrs(f, FIELDS_SCORE);
    return rc;
}

static PyObject *wire_encode(PyObject *Py_UNUSED(module), PyObject *res) {
    PyObject *f[FIELDS_RES];
    if (get_attrs(res, res_attr, FIELDS_RES, f)) Py_RETURN_NONE;
    PyObject *scores = f[0], *tokens = f[3];
    const char *reason, *adapter;
    Py_ssize_t reason_n, adapter_n;
    long long latency;
    PyObject *out = NULL;
    Buf b, sub;
    buf_init(&b);
    buf_init(&sub);
    int rc = 1;
    if (!PyList_CheckExact(scores) || !(PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) ||
        text_of(f[1], &reason, &reason_n) || text_of(f[4], &adapter, &adapter_n) ||
        int_in(f[2], LLONG_MIN, LLONG_MAX, &latency))
        goto done;
    rc = 0;
    Py_ssize_t n_scores = PyList_GET_SIZE(scores);
    for (Py_ssize_t i = 0; i < n_scores && rc == 0; i++) {
        sub.n = 0;
        rc = encode_score(PyList_GET_ITEM(scores, i), &sub);
        if (rc == 0) rc = buf_reserve(&b, 1 + 10 + sub.n);
        if (rc == 0) {
            b.p[b.n++] = 0x0A; /* 1 replica_scores: always present, even when empty */
            put_varint(&b, (uint64_t)sub.n);
            memcpy(b.p + b.n, sub.p, (size_t)sub.n);
            b.n += sub.n;
        }
    }
    if (rc == 0) rc = put_bytes_field(&b, 0x12, reason, reason_n);
    if (rc == 0 && latency != 0) {
        rc = buf_reserve(&b, 11);
        if (rc == 0) {
            b.p[b.n++] = 0x18;
            put_varint(&b, (uint64_t)latency);
        }
    }
    Py_ssize_t n_tokens = PySequence_Fast_GET_SIZE(tokens);
    if (rc == 0 && n_tokens > 0) { /* 4 token_ids: packed uint32 */
        PyObject *const *items = PySequence_Fast_ITEMS(tokens);
        Py_ssize_t payload = 0;
        for (Py_ssize_t i = 0; i < n_tokens && rc == 0; i++) {
            long long t;
            rc = int_in(items[i], 0, 0xFFFFFFFFLL, &t);
            if (rc == 0) payload += ic_varint_size((uint64_t)t);
        }
        if (rc == 0) rc = buf_reserve(&b, 1 + 10 + payload);
        if (rc == 0) {
            b.p[b.n++] = 0x22;
            put_varint(&b, (uint64_t)payload);
            for (Py_ssize_t i = 0; i < n_tokens; i++)
                put_varint(&b, (uint64_t)PyLong_AsUnsignedLongLong(items[i]));
        }
    }
    if (rc == 0) rc = put_bytes_field(&b, 0x2A, adapter, adapter_n);
    if (rc == 0) out = PyBytes_FromStringAndSize((const char *)b.p, b.n);
done:
    put_attrs(f, FIELDS_RES);
    buf_free(&b);
    buf_free(&sub);
    if (rc == 1) Py_RETURN_NONE;
    return out;
}

static PyMethodDef module_methods[] = {
    {"parse", (PyCFunction)wire_parse, METH_O,
     "parse(buf) -> the LookupRequest fields as a tuple, or None (protobuf decides)"},
    {"encode", (PyCFunction)wire_encode, METH_O,
     "encode(result) -> LookupRouteResponse bytes, or None (build the protobuf message)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef lw_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "inferencecache.server._lookupwire",
    .m_doc = "LookupRoute request parser and response encoder (see docs/server.md).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__lookupwire(void) {
    if (s_empty_str == NULL) {
        s_empty_str = PyUnicode_FromString("");
        s_empty_bytes = PyBytes_FromStringAndSize(NULL, 0);
        if (s_empty_str == NULL || s_empty_bytes == NULL) return NULL;
        for (int i = 0; i < FIELDS_RES; i++)
            if ((res_attr[i] = PyUnicode_InternFromString(res_names[i])) == NULL) return NULL;
        for (int i = 0; i < FIELDS_SCORE; i++)
            if ((score_attr[i] = PyUnicode_InternFromString(score_names[i])) == NULL) return NULL;
    }
    PyObject *mod = PyModule_Create(&lw_module);
    if (mod == NULL) return NULL;
    if (PyModule_AddIntConstant(mod, "REQUEST_FIELDS", FIELDS_REQ) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
