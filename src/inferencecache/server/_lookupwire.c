/*
 * inferencecache.server._lookupwire: the LookupRoute request parser and response encoder in C.
 * Pure-Python twins: server/wire.py `parse_fast` (requests) and the protobuf construction
 * `response_from_result(...).SerializeToString()` (responses); tests/server/
 * test_lookupwire.py checks both against them.
 *
 * parse(buf) -> tuple of the LookupRequest fields, or None
 *   The request shapes gateways send (one-byte tags of the known fields, one-byte varint
 *   counts, valid UTF-8); None for anything else (unknown or unpacked fields, multi-byte
 *   counts, SLO messages with other fields, a truncated token payload, ...), and the caller
 *   runs the Python parser, which decides exactly as before. So whenever this returns a value
 *   it is the value parse_fast returns.
 *
 * Encoder(result_type, score_type).encode(result) -> bytes, or None
 *   The LookupRouteResponse bytes protobuf produces for the result (fields in number order,
 *   proto3 defaults omitted, packed token_ids, float32 fields as their bit patterns), read by
 *   slot offset from the two record types. None for values protobuf would convert or reject
 *   (non-exact types, out-of-range integers, floats beyond float32, unencodable strings):
 *   the caller then builds the protobuf message, which converts or raises as it always did.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

#include "_slots.h"
#include "_varint.h"

#define FIELDS_REQ 14 /* LookupRequest */
#define FIELDS_RES 5  /* LookupResult */
#define FIELDS_SCORE 5

/* ======================================================================================= */
/* Request parser                                                                          */
/* ======================================================================================= */

/* A varint of at most 10 bytes (parse_fast's _varint: protobuf's bound), low 64 bits. */
static inline int read_varint(const uint8_t *b, Py_ssize_t n, Py_ssize_t *pos, uint64_t *out) {
    uint64_t v = 0;
    for (int shift = 0; shift <= 63; shift += 7) {
        if (*pos >= n) return -1;
        uint8_t c = b[(*pos)++];
        v |= (uint64_t)(c & 0x7F) << shift;
        if (c < 0x80) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

static inline int32_t as_int32(uint64_t v) { return (int32_t)(uint32_t)v; }

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

static void spans_free(Spans *s) {
    if (s->v != s->local) PyMem_Free(s->v);
}

static int spans_grow(Spans *s, Py_ssize_t cap) {
    Span *v = (Span *)PyMem_Malloc((size_t)cap * sizeof(Span));
    if (v == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(v, s->v, (size_t)s->n * sizeof(Span));
    if (s->v != s->local) PyMem_Free(s->v);
    s->v = v;
    s->cap = cap;
    return 0;
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

/* The SLO message(s) as protobuf reads them, when they hold only fields 1 and 2 as varints:
 * ttft_ms = the last field 1 (int32). 0 = ok, 1 = let Python decide. */
static int slo_ttft(const Spans *slo, int32_t *ttft) {
    *ttft = 0;
    for (Py_ssize_t i = 0; i < slo->n; i++) {
        const uint8_t *b = slo->v[i].p;
        Py_ssize_t n = slo->v[i].n, pos = 0;
        while (pos < n) {
            uint8_t tag = b[pos++];
            uint64_t v;
            if ((tag != 0x08 && tag != 0x10) || read_varint(b, n, &pos, &v) < 0) return 1;
            if (tag == 0x08) *ttft = as_int32(v);
        }
    }
    return 0;
}

static PyObject *s_empty_str = NULL;
static PyObject *s_empty_bytes = NULL;

/* UTF-8 field text; NULL with no exception = invalid UTF-8 (Python decides). */
static PyObject *utf8(const uint8_t *p, Py_ssize_t n) {
    if (n == 0) return Py_NewRef(s_empty_str);
    PyObject *s = PyUnicode_DecodeUTF8((const char *)p, n, "strict");
    if (s == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) PyErr_Clear();
    return s;
}

static int set_text(PyObject **slot, const uint8_t *p, Py_ssize_t n) {
    PyObject *s = utf8(p, n);
    if (s == NULL) return PyErr_Occurred() ? -1 : 1;
    Py_XSETREF(*slot, s);
    return 0;
}

static PyObject *wire_parse(PyObject *Py_UNUSED(module), PyObject *arg) {
    if (!PyBytes_CheckExact(arg)) Py_RETURN_NONE;
    const uint8_t *b = (const uint8_t *)PyBytes_AS_STRING(arg);
    Py_ssize_t n = PyBytes_GET_SIZE(arg), pos = 0;
    PyObject *model = NULL, *tenant = NULL, *scheme = NULL, *prompt = NULL, *adapter = NULL;
    const uint8_t *ph = NULL;
    Py_ssize_t ph_n = 0;
    int32_t prefix_count = 0;
    int have_counts = 0, all8 = 1;
    Spans hashes, counts, tokens, slo;
    spans_init(&hashes);
    spans_init(&counts);
    spans_init(&tokens);
    spans_init(&slo);
    PyObject *out = NULL;
    int rc = 0; /* 0 ok, 1 let Python decide, -1 error */
    /* room for every block hash of a chain request (10-byte records) without growing */
    if (n / 10 > hashes.cap && spans_grow(&hashes, n / 10 + 8) < 0) rc = -1;
    while (pos < n && rc == 0) {
        uint8_t tag = b[pos++];
        uint64_t v;
        if (tag == 0x3A && n - pos >= 9 && b[pos] == 0x08) { /* `3a 08 <8 bytes>`: a hash */
            rc = spans_add(&hashes, b + pos + 1, 8);
            pos += 9;
            continue;
        }
        if (tag == 0x20) { /* 4 prefix_token_count, int32 varint */
            if (read_varint(b, n, &pos, &v) < 0) rc = 1;
            else prefix_count = as_int32(v);
            continue;
        }
        if ((tag & 7) != 2 || tag >= 0x80) {
            rc = 1;
            break;
        }
        Py_ssize_t len_at = pos;
        if (read_varint(b, n, &pos, &v) < 0 || v > (uint64_t)(n - pos)) {
            rc = 1;
            break;
        }
        int short_len = pos - len_at == 1; /* the length took one byte */
        const uint8_t *p = b + pos;
        Py_ssize_t len = (Py_ssize_t)v;
        pos += len;
        switch (tag) {
        case 0x0A: rc = set_text(&model, p, len); break;   /* 1 model_id */
        case 0x12: rc = set_text(&tenant, p, len); break;  /* 2 tenant_id */
        case 0x1A: ph = p; ph_n = len; break;              /* 3 prefix_hash */
        case 0x2A: rc = set_text(&scheme, p, len); break;  /* 5 hash_scheme */
        case 0x32: rc = spans_add(&slo, p, len); break;    /* 6 slo */
        case 0x3A: /* 7 block_hashes; parse_fast packs `3a 08 <8 bytes>` records only */
            all8 &= len == 8 && short_len;
            rc = spans_add(&hashes, p, len);
            break;
        case 0x42: { /* 8 block_token_counts, packed: one-byte varints only */
            uint8_t any = 0;
            for (Py_ssize_t i = 0; i < len; i++) any |= p[i];
            have_counts = 1;
            rc = any >= 0x80 ? 1 : spans_add(&counts, p, len);
            break;
        }
        case 0x4A: rc = spans_add(&tokens, p, len); break; /* 9 token_ids, packed */
        case 0x52: rc = set_text(&prompt, p, len); break;  /* 10 prompt_text */
        case 0x5A: rc = set_text(&adapter, p, len); break; /* 11 adapter_id */
        default: rc = 1;                                    /* unknown: Python decides */
        }
    }
    int32_t ttft = 0;
    if (rc == 0 && slo.n > 0) rc = slo_ttft(&slo, &ttft);
    /* varint_count per packed chunk: a varint cut at a chunk's end or longer than 10 bytes
     * makes protobuf reject the message, so the Python parser decides */
    for (Py_ssize_t i = 0; rc == 0 && i < tokens.n; i++) {
        const Span *s = &tokens.v[i];
        if (s->n > 0 && (s->p[s->n - 1] >= 0x80 || ic_varint_overlong(s->p, s->n) >= 0)) rc = 1;
    }
    if (rc != 0) goto done;
    {
        PyObject *f[FIELDS_REQ];
        memset(f, 0, sizeof(f));
        f[0] = tenant ? Py_NewRef(tenant) : Py_NewRef(s_empty_str);
        f[1] = model ? Py_NewRef(model) : Py_NewRef(s_empty_str);
        f[2] = scheme ? Py_NewRef(scheme) : Py_NewRef(s_empty_str);
        f[3] = adapter ? Py_NewRef(adapter) : Py_NewRef(s_empty_str);
        f[4] = ph_n ? PyBytes_FromStringAndSize((const char *)ph, ph_n) : Py_NewRef(s_empty_bytes);
        f[5] = PyLong_FromLong(prefix_count);
        if (all8) {
            f[6] = spans_join8(&hashes);
            f[7] = Py_NewRef(Py_True);
        } else {
            f[6] = PyList_New(hashes.n);
            for (Py_ssize_t i = 0; f[6] != NULL && i < hashes.n; i++) {
                PyObject *h = PyBytes_FromStringAndSize((const char *)hashes.v[i].p, hashes.v[i].n);
                if (h == NULL) Py_CLEAR(f[6]);
                else PyList_SET_ITEM(f[6], i, h);
            }
            f[7] = Py_NewRef(Py_False);
        }
        f[8] = have_counts ? spans_join(&counts) : PyList_New(0);
        f[9] = spans_join(&tokens);
        f[10] = Py_NewRef(Py_True);
        f[11] = prompt ? Py_NewRef(prompt) : Py_NewRef(s_empty_str);
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
    spans_free(&counts);
    spans_free(&tokens);
    spans_free(&slo);
    if (rc < 0) return NULL;
    if (rc == 1) Py_RETURN_NONE;
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
static inline void put_varint(Buf *b, uint64_t v) {
    while (v >= 0x80) {
        b->p[b->n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    b->p[b->n++] = (uint8_t)v;
}

static inline int varint_len(uint64_t v) {
    int n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

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

typedef struct {
    PyObject_HEAD
    PyTypeObject *res_cls, *score_cls;
    Py_ssize_t res_off[FIELDS_RES];
    Py_ssize_t score_off[FIELDS_SCORE];
} Encoder;

static PyObject *Encoder_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *res_cls, *score_cls;
    static char *kwlist[] = {"result_type", "score_type", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:Encoder", kwlist, &res_cls, &score_cls))
        return NULL;
    Encoder *self = (Encoder *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    PyObject *rn = Py_BuildValue("(sssss)", "reason_code", "replica_scores", "lookup_latency_us",
                                 "token_ids", "adapter_id");
    PyObject *sn = Py_BuildValue("(sssss)", "replica_id", "score", "matched_tokens",
                                 "estimated_cache_hit_prob", "tier");
    int rc = rn == NULL || sn == NULL || slots_layout(res_cls, rn, self->res_off) < 0 ||
             slots_layout(score_cls, sn, self->score_off) < 0;
    Py_XDECREF(rn);
    Py_XDECREF(sn);
    if (rc) {
        Py_DECREF(self);
        return NULL;
    }
    self->res_cls = (PyTypeObject *)Py_NewRef(res_cls);
    self->score_cls = (PyTypeObject *)Py_NewRef(score_cls);
    return (PyObject *)self;
}

static void Encoder_dealloc(Encoder *self) {
    Py_XDECREF(self->res_cls);
    Py_XDECREF(self->score_cls);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define INT32_LO (-2147483647LL - 1)
#define INT32_HI 2147483647LL

/* One ReplicaScore message body into b; 0 ok, 1 protobuf decides, -1 error. */
static int encode_score(const Encoder *e, PyObject *s, Buf *b) {
    const char *id;
    Py_ssize_t id_n;
    uint32_t score, prob;
    long long matched, tier;
    PyObject *f[FIELDS_SCORE];
    for (int i = 0; i < FIELDS_SCORE; i++)
        if ((f[i] = slot_get(s, e->score_off[i])) == NULL) return 1;
    if (text_of(f[0], &id, &id_n) || float32_bits(f[1], &score) ||
        int_in(f[2], INT32_LO, INT32_HI, &matched) || float32_bits(f[3], &prob) ||
        int_in(f[4], INT32_LO, INT32_HI, &tier))
        return 1;
    /* fields in number order, proto3 defaults (0, +0.0, "") omitted */
    if (put_bytes_field(b, 0x0A, id, id_n) < 0 || buf_reserve(b, 5 + 11 + 5 + 11) < 0)
        return -1;
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
    return 0;
}

static PyObject *Encoder_encode(Encoder *e, PyObject *res) {
    if (!Py_IS_TYPE(res, e->res_cls)) Py_RETURN_NONE;
    PyObject *f[FIELDS_RES];
    for (int i = 0; i < FIELDS_RES; i++)
        if ((f[i] = slot_get(res, e->res_off[i])) == NULL) Py_RETURN_NONE;
    PyObject *scores = f[1], *tokens = f[3];
    const char *reason, *adapter;
    Py_ssize_t reason_n, adapter_n;
    long long latency;
    if (!PyList_CheckExact(scores) || !(PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) ||
        text_of(f[0], &reason, &reason_n) || text_of(f[4], &adapter, &adapter_n) ||
        int_in(f[2], LLONG_MIN, LLONG_MAX, &latency))
        Py_RETURN_NONE;
    Buf b, sub;
    buf_init(&b);
    buf_init(&sub);
    int rc = 0;
    Py_ssize_t n_scores = PyList_GET_SIZE(scores);
    for (Py_ssize_t i = 0; i < n_scores && rc == 0; i++) {
        PyObject *s = PyList_GET_ITEM(scores, i);
        if (!Py_IS_TYPE(s, e->score_cls)) {
            rc = 1;
            break;
        }
        sub.n = 0;
        rc = encode_score(e, s, &sub);
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
            if (rc == 0) payload += varint_len((uint64_t)t);
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
    PyObject *out = NULL;
    if (rc == 0) out = PyBytes_FromStringAndSize((const char *)b.p, b.n);
    buf_free(&b);
    buf_free(&sub);
    if (rc == 1) Py_RETURN_NONE;
    return out;
}

static PyMethodDef Encoder_methods[] = {
    {"encode", (PyCFunction)Encoder_encode, METH_O,
     "encode(result) -> LookupRouteResponse bytes, or None (build the protobuf message)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EncoderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "inferencecache.server._lookupwire.Encoder",
    .tp_doc = PyDoc_STR("Encoder(result_type, score_type): LookupRouteResponse bytes."),
    .tp_basicsize = sizeof(Encoder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Encoder_new,
    .tp_dealloc = (destructor)Encoder_dealloc,
    .tp_methods = Encoder_methods,
};

static PyMethodDef module_methods[] = {
    {"parse", (PyCFunction)wire_parse, METH_O,
     "parse(buf) -> the LookupRequest fields as a tuple, or None (run the Python parser)"},
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
    if (PyType_Ready(&EncoderType) < 0) return NULL;
    if (s_empty_str == NULL) {
        s_empty_str = PyUnicode_FromString("");
        s_empty_bytes = PyBytes_FromStringAndSize(NULL, 0);
        if (s_empty_str == NULL || s_empty_bytes == NULL) return NULL;
    }
    PyObject *mod = PyModule_Create(&lw_module);
    if (mod == NULL) return NULL;
    if (PyModule_AddObjectRef(mod, "Encoder", (PyObject *)&EncoderType) < 0 ||
        PyModule_AddIntConstant(mod, "REQUEST_FIELDS", FIELDS_REQ) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
