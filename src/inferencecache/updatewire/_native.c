/* inferencecache.updatewire._native: the contract's CacheStateUpdate in compact form.
 *
 * parse_update(buf)      -> (replica, model, tenant, scheme, ts, adapter, entries, stats) or None
 * encode_entries(tuples) -> bytes of the `prefixes` field (6), as protobuf writes it
 *
 * Why: the subscriber reports one legacy PrefixEntry per engine block, thousands per update.
 * Building and reading those as protobuf objects costs ~1-3 us of Python per entry on each side;
 * here a run of legacy entries becomes one packed bytes of 8-byte hashes plus a list of token
 * counts (the index stores it with one upsert_many call), and the subscriber writes its entries
 * straight into wire bytes. parse_update reads any CacheStateUpdate protobuf decodes, exactly as
 * protobuf reads it (include/ic_wire.h has the wire rules); it returns None for groups and for
 * everything protobuf rejects (corrupt varints, tags or lengths, a truncated field, invalid
 * UTF-8), and the caller lets protobuf decide. Without this build, protobuf parses and writes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "ic_wire.h"

#define OK IC_OK
#define DECLINE IC_DECLINE
#define FAIL (-1)

/* ---- reading ------------------------------------------------------------------------------ */

/* Strict UTF-8 (what protobuf checks for proto3 strings). New reference, NULL+DECLINE on
 * invalid input, NULL+FAIL on memory errors. */
static PyObject *rd_text(const uint8_t *b, Py_ssize_t start, Py_ssize_t stop, int *rc) {
    PyObject *s = PyUnicode_DecodeUTF8((const char *)b + start, stop - start, "strict");
    if (s == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
            PyErr_Clear();
            *rc = DECLINE;
        } else {
            *rc = FAIL;
        }
    }
    return s;
}

static int check_text(const uint8_t *b, Py_ssize_t start, Py_ssize_t stop) {
    for (Py_ssize_t i = start; i < stop; i++) {
        if (b[i] >= 0x80) {
            int rc = OK;
            PyObject *s = rd_text(b, start, stop, &rc);
            if (s == NULL) return rc;
            Py_DECREF(s);
            return OK;
        }
    }
    return OK;
}

/* One PrefixEntry. Scalars last-wins, repeated fields append (protobuf's merge). hashes and
 * counts are created only when the chain fields appear. */
typedef struct {
    Py_ssize_t ph0, ph1; /* prefix_hash bytes [ph0, ph1) */
    int32_t tc, tier;
    Py_ssize_t ad0, ad1; /* adapter_id bytes */
    PyObject *hashes;    /* list or NULL */
    PyObject *counts;    /* list or NULL */
} Entry;

static int append_i32(PyObject **list, int32_t v) {
    if (*list == NULL && (*list = PyList_New(0)) == NULL) return FAIL;
    PyObject *o = PyLong_FromLong(v);
    if (o == NULL) return FAIL;
    int r = PyList_Append(*list, o);
    Py_DECREF(o);
    return r < 0 ? FAIL : OK;
}

static int rd_entry(const uint8_t *b, Py_ssize_t pos, Py_ssize_t end, Entry *e) {
    memset(e, 0, sizeof(*e));
    while (pos < end) {
        uint32_t field;
        int wire;
        uint64_t v;
        Py_ssize_t s0, s1;
        if (ic_tag(b, end, &pos, &field, &wire) != OK) return DECLINE;
        if (wire == IC_WIRE_LEN && (field == 1 || field == 3 || field == 4 || field == 6)) {
            if (ic_payload(b, end, &pos, &s0, &s1) != OK) return DECLINE;
            if (field == 1) { /* prefix_hash */
                e->ph0 = s0;
                e->ph1 = s1;
            } else if (field == 3) { /* block_hashes */
                if (e->hashes == NULL && (e->hashes = PyList_New(0)) == NULL) return FAIL;
                PyObject *h = PyBytes_FromStringAndSize((const char *)b + s0, s1 - s0);
                if (h == NULL) return FAIL;
                int r = PyList_Append(e->hashes, h);
                Py_DECREF(h);
                if (r < 0) return FAIL;
            } else if (field == 4) { /* block_token_counts, packed repeated int32 */
                if (e->counts == NULL && (e->counts = PyList_New(0)) == NULL) return FAIL;
                while (s0 < s1) {
                    if (ic_varint(b, s1, &s0, &v) != OK) return DECLINE;
                    if (append_i32(&e->counts, ic_as_int32(v)) != OK) return FAIL;
                }
            } else { /* adapter_id */
                int rc = check_text(b, s0, s1);
                if (rc != OK) return rc;
                e->ad0 = s0;
                e->ad1 = s1;
            }
        } else if (wire == IC_WIRE_VARINT && (field == 2 || field == 4 || field == 5)) {
            if (ic_varint(b, end, &pos, &v) != OK) return DECLINE;
            if (field == 2) { /* token_count */
                e->tc = ic_as_int32(v);
            } else if (field == 4) { /* an unpacked block_token_counts value */
                if (append_i32(&e->counts, ic_as_int32(v)) != OK) return FAIL;
            } else { /* tier */
                e->tier = ic_as_int32(v);
            }
        } else if (ic_skip(b, end, &pos, wire) != OK) { /* unknown, or another wire type */
            return DECLINE;
        }
    }
    return OK;
}

static void entry_clear(Entry *e) {
    Py_CLEAR(e->hashes);
    Py_CLEAR(e->counts);
}

/* The current run of legacy entries (8-byte prefix_hash, no chain fields). */
typedef struct {
    int open;
    char *hashes;
    Py_ssize_t n, cap; /* entries */
    PyObject *counts;
    int32_t tier;
    Py_ssize_t ad0, ad1;
} Run;

static int run_close(Run *r, const uint8_t *b, PyObject *items) {
    if (!r->open) return OK;
    int rc = FAIL;
    PyObject *hashes = PyBytes_FromStringAndSize(r->hashes, 8 * r->n);
    PyObject *tier = PyLong_FromLong(r->tier);
    PyObject *ad = PyUnicode_DecodeUTF8((const char *)b + r->ad0, r->ad1 - r->ad0, "strict");
    if (hashes != NULL && tier != NULL && ad != NULL) {
        PyObject *t = PyTuple_Pack(4, hashes, r->counts, tier, ad);
        if (t != NULL) {
            rc = PyList_Append(items, t) < 0 ? FAIL : OK;
            Py_DECREF(t);
        }
    }
    Py_XDECREF(hashes);
    Py_XDECREF(tier);
    Py_XDECREF(ad);
    Py_CLEAR(r->counts);
    r->open = 0;
    r->n = 0;
    return rc;
}

static int run_add(Run *r, const uint8_t *b, const Entry *e, PyObject *items) {
    Py_ssize_t alen = e->ad1 - e->ad0;
    if (r->open && (e->tier != r->tier || alen != r->ad1 - r->ad0 ||
                    memcmp(b + e->ad0, b + r->ad0, (size_t)alen) != 0)) {
        if (run_close(r, b, items) != OK) return FAIL;
    }
    if (!r->open) {
        if ((r->counts = PyList_New(0)) == NULL) return FAIL;
        r->open = 1;
        r->n = 0;
        r->tier = e->tier;
        r->ad0 = e->ad0;
        r->ad1 = e->ad1;
    }
    if (r->n == r->cap) {
        Py_ssize_t ncap = r->cap ? 2 * r->cap : 256;
        char *nh = (char *)PyMem_Realloc(r->hashes, (size_t)ncap * 8);
        if (nh == NULL) {
            PyErr_NoMemory();
            return FAIL;
        }
        r->hashes = nh;
        r->cap = ncap;
    }
    memcpy(r->hashes + 8 * r->n, b + e->ph0, 8);
    r->n++;
    return append_i32(&r->counts, e->tc);
}

static int generic_add(const uint8_t *b, Entry *e, PyObject *items) {
    int rc = FAIL;
    PyObject *ph = PyBytes_FromStringAndSize((const char *)b + e->ph0, e->ph1 - e->ph0);
    PyObject *tc = PyLong_FromLong(e->tc);
    PyObject *tier = PyLong_FromLong(e->tier);
    PyObject *ad = PyUnicode_DecodeUTF8((const char *)b + e->ad0, e->ad1 - e->ad0, "strict");
    if (e->hashes == NULL) e->hashes = PyList_New(0);
    if (e->counts == NULL) e->counts = PyList_New(0);
    if (ph != NULL && tc != NULL && tier != NULL && ad != NULL && e->hashes != NULL &&
        e->counts != NULL) {
        PyObject *t = PyTuple_Pack(6, ph, tc, e->hashes, e->counts, tier, ad);
        if (t != NULL) {
            rc = PyList_Append(items, t) < 0 ? FAIL : OK;
            Py_DECREF(t);
        }
    }
    Py_XDECREF(ph);
    Py_XDECREF(tc);
    Py_XDECREF(tier);
    Py_XDECREF(ad);
    return rc;
}

/* ReplicaStats (field 7), merged over its occurrences as protobuf merges a message field. */
typedef struct {
    int present;
    int64_t memory, t2_hit, t2_query;
    float hit_rate, pressure;
} Stats;

static float rd_float(const uint8_t *p) {
    uint32_t bits = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                    (uint32_t)p[3] << 24;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static int rd_stats(const uint8_t *b, Py_ssize_t pos, Py_ssize_t end, Stats *st) {
    st->present = 1;
    while (pos < end) {
        uint32_t field;
        int wire;
        uint64_t v;
        Py_ssize_t s0, s1;
        if (ic_tag(b, end, &pos, &field, &wire) != OK) return DECLINE;
        if (wire == IC_WIRE_VARINT && (field == 2 || field == 6 || field == 7)) {
            if (ic_varint(b, end, &pos, &v) != OK) return DECLINE;
            *(field == 2 ? &st->memory : field == 6 ? &st->t2_hit : &st->t2_query) = (int64_t)v;
        } else if (wire == IC_WIRE_FIXED32 && (field == 3 || field == 4)) {
            if (end - pos < 4) return DECLINE;
            *(field == 3 ? &st->hit_rate : &st->pressure) = rd_float(b + pos);
            pos += 4;
        } else if (wire == IC_WIRE_LEN && (field == 1 || field == 5)) { /* replica_id, version */
            if (ic_payload(b, end, &pos, &s0, &s1) != OK) return DECLINE;
            int rc = check_text(b, s0, s1);
            if (rc != OK) return rc;
        } else if (ic_skip(b, end, &pos, wire) != OK) {
            return DECLINE;
        }
    }
    return OK;
}

static int rd_update(const uint8_t *b, Py_ssize_t n, PyObject **strs, int64_t *ts,
                     PyObject *items, Stats *stats) {
    Py_ssize_t pos = 0;
    Run run;
    memset(&run, 0, sizeof(run));
    int rc = OK;
    while (pos < n && rc == OK) {
        uint32_t field;
        int wire;
        uint64_t v;
        Py_ssize_t s0, s1;
        if (ic_tag(b, n, &pos, &field, &wire) != OK) {
            rc = DECLINE;
        } else if (wire == IC_WIRE_VARINT && field == 5) { /* timestamp_us, int64 */
            rc = ic_varint(b, n, &pos, &v);
            *ts = (int64_t)v;
        } else if (wire != IC_WIRE_LEN || field == 5 || field > 8) { /* unknown, other wire type */
            rc = ic_skip(b, n, &pos, wire);
        } else if (ic_payload(b, n, &pos, &s0, &s1) != OK) {
            rc = DECLINE;
        } else if (field == 6) { /* prefixes */
            Entry e;
            rc = rd_entry(b, s0, s1, &e);
            if (rc == OK) {
                if (e.hashes == NULL && e.counts == NULL && e.ph1 - e.ph0 == 8) {
                    rc = run_add(&run, b, &e, items);
                } else if ((rc = run_close(&run, b, items)) == OK) {
                    rc = generic_add(b, &e, items);
                }
            }
            entry_clear(&e);
        } else if (field == 7) {
            rc = rd_stats(b, s0, s1, stats);
        } else { /* 1..4 and 8: strings, last wins */
            int slot = field == 8 ? 4 : (int)field - 1;
            PyObject *s = rd_text(b, s0, s1, &rc);
            if (s != NULL) Py_XSETREF(strs[slot], s);
        }
    }
    if (rc == OK) rc = run_close(&run, b, items);
    Py_CLEAR(run.counts);
    PyMem_Free(run.hashes);
    return rc;
}

static PyObject *py_parse_update(PyObject *Py_UNUSED(mod), PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *strs[5] = {NULL, NULL, NULL, NULL, NULL};
    int64_t ts = 0;
    Stats stats;
    memset(&stats, 0, sizeof(stats));
    PyObject *result = NULL, *st = NULL;
    PyObject *items = PyList_New(0);
    if (items == NULL) goto done;
    int rc = rd_update((const uint8_t *)view.buf, view.len, strs, &ts, items, &stats);
    if (rc == FAIL) goto done;
    if (rc == DECLINE) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    for (int i = 0; i < 5; i++) {
        if (strs[i] == NULL && (strs[i] = PyUnicode_FromStringAndSize("", 0)) == NULL) goto done;
    }
    if (!stats.present) {
        st = Py_NewRef(Py_None);
    } else {
        st = Py_BuildValue("(LddLL)", (long long)stats.memory, (double)stats.hit_rate,
                           (double)stats.pressure, (long long)stats.t2_hit,
                           (long long)stats.t2_query);
        if (st == NULL) goto done;
    }
    result = Py_BuildValue("(OOOOLOOO)", strs[0], strs[1], strs[2], strs[3], (long long)ts,
                           strs[4], items, st);
done:
    for (int i = 0; i < 5; i++) Py_XDECREF(strs[i]);
    Py_XDECREF(items);
    Py_XDECREF(st);
    PyBuffer_Release(&view);
    return result;
}


/* ---- packing into the index's batch form (index/batch.py: ICB1) -------------------------- */
/* pack_update(buf) -> bytes | None: a CacheStateUpdate whose entries are all legacy (8-byte
 * prefix_hash, no chain fields) with one tier and one adapter, as one ICB1 batch: a STORE
 * record of the run (if any entries) and a STATS record (if stats are present). None for any
 * other update (the caller takes parse_update's path) and for everything parse_update declines.
 * pack_event(buf) -> bytes | None: a PREFIX_EVICTED CacheEvent whose hashes are all 8 bytes as
 * one REMOVE record; None otherwise. The appender's timestamp is 0 (the applier's clock). */

typedef struct {
    char *p;
    Py_ssize_t n, cap;
} Grow;

static int grow_put(Grow *g, const void *src, Py_ssize_t len) {
    if (g->n + len > g->cap) {
        Py_ssize_t ncap = g->cap ? g->cap : 1024;
        while (ncap < g->n + len) ncap *= 2;
        char *np = (char *)PyMem_Realloc(g->p, (size_t)ncap);
        if (np == NULL) {
            PyErr_NoMemory();
            return FAIL;
        }
        g->p = np;
        g->cap = ncap;
    }
    memcpy(g->p + g->n, src, (size_t)len);
    g->n += len;
    return OK;
}

static inline void put_le32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static inline void put_le64(uint8_t *p, uint64_t v) {
    put_le32(p, (uint32_t)v);
    put_le32(p + 4, (uint32_t)(v >> 32));
}

typedef struct {
    const uint8_t *p;
    Py_ssize_t n;
} Span;

/* Size of a route of five strings. */
static Py_ssize_t route_size(const Span *s) {
    Py_ssize_t n = 0;
    for (int i = 0; i < 5; i++) n += 4 + s[i].n;
    return n;
}

static uint8_t *put_route(uint8_t *o, const Span *s) {
    for (int i = 0; i < 5; i++) {
        put_le32(o, (uint32_t)s[i].n);
        memcpy(o + 4, s[i].p, (size_t)s[i].n);
        o += 4 + s[i].n;
    }
    return o;
}

static uint8_t *put_rec_header(uint8_t *o, int kind, Py_ssize_t body) {
    o[0] = (uint8_t)kind;
    o[1] = o[2] = o[3] = 0;
    put_le32(o + 4, (uint32_t)body);
    return o + 8;
}

static const uint8_t EMPTY[1] = {0};

static PyObject *py_pack_update(PyObject *Py_UNUSED(mod), PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const uint8_t *b = (const uint8_t *)view.buf;
    Py_ssize_t n = view.len, pos = 0;
    Span str[5] = {{EMPTY, 0}, {EMPTY, 0}, {EMPTY, 0}, {EMPTY, 0}, {EMPTY, 0}};
    /* replica, model, tenant, scheme, update adapter: fields 1, 2, 3, 4, 8 */
    int64_t ts = 0;
    Stats stats;
    memset(&stats, 0, sizeof(stats));
    Grow hashes = {NULL, 0, 0}, counts = {NULL, 0, 0};
    Py_ssize_t entries = 0;
    int32_t tier = 0;
    Span ad = {EMPTY, 0};
    int rc = OK;
    PyObject *result = NULL;
    while (pos < n && rc == OK) {
        uint32_t field;
        int wire;
        uint64_t v;
        Py_ssize_t s0, s1;
        if (ic_tag(b, n, &pos, &field, &wire) != OK) {
            rc = DECLINE;
        } else if (wire == IC_WIRE_VARINT && field == 5) {
            rc = ic_varint(b, n, &pos, &v);
            ts = (int64_t)v;
        } else if (wire != IC_WIRE_LEN || field == 5 || field > 8) {
            rc = ic_skip(b, n, &pos, wire);
        } else if (ic_payload(b, n, &pos, &s0, &s1) != OK) {
            rc = DECLINE;
        } else if (field == 6) {
            Entry e;
            rc = rd_entry(b, s0, s1, &e);
            if (rc == OK) {
                if (e.hashes != NULL || e.counts != NULL || e.ph1 - e.ph0 != 8) {
                    rc = DECLINE; /* a chain or odd entry: parse_update's path */
                } else if (entries > 0 && (e.tier != tier || e.ad1 - e.ad0 != ad.n ||
                                           memcmp(b + e.ad0, ad.p, (size_t)ad.n) != 0)) {
                    rc = DECLINE; /* more than one run */
                } else {
                    tier = e.tier;
                    ad.p = b + e.ad0;
                    ad.n = e.ad1 - e.ad0;
                    uint8_t c[4];
                    put_le32(c, (uint32_t)e.tc);
                    if (grow_put(&hashes, b + e.ph0, 8) != OK || grow_put(&counts, c, 4) != OK)
                        rc = FAIL;
                    entries++;
                }
            }
            entry_clear(&e);
        } else if (field == 7) {
            rc = rd_stats(b, s0, s1, &stats);
        } else {
            rc = check_text(b, s0, s1);
            int slot = field == 8 ? 4 : (int)field - 1;
            str[slot].p = b + s0;
            str[slot].n = s1 - s0;
        }
    }
    if (rc == FAIL) goto done;
    if (rc == DECLINE || (entries > 0 && str[3].n == 0)) { /* empty scheme: drops, counted */
        result = Py_NewRef(Py_None);
        goto done;
    }
    {
        /* route order: tenant, model, scheme, adapter, replica */
        Span route[5] = {str[2], str[1], str[3], ad.n ? ad : str[4], str[0]};
        Span sroute[5] = {str[2], str[1], str[3], {EMPTY, 0}, str[0]};
        Py_ssize_t store_body = route_size(route) + 16 + 12 * entries;
        Py_ssize_t stats_body = route_size(sroute) + 8 + 8 + 4 + 4 + 8 + 8;
        Py_ssize_t total = 12 + (entries ? 8 + store_body : 0) + (stats.present ? 8 + stats_body : 0);
        result = PyBytes_FromStringAndSize(NULL, total);
        if (result == NULL) goto done;
        uint8_t *o = (uint8_t *)PyBytes_AS_STRING(result);
        memcpy(o, "ICB1", 4);
        put_le64(o + 4, 0);
        o += 12;
        if (entries) {
            o = put_rec_header(o, 1, store_body);
            o = put_route(o, route);
            put_le64(o, (uint64_t)ts);
            put_le32(o + 8, (uint32_t)tier);
            put_le32(o + 12, (uint32_t)entries);
            o += 16;
            memcpy(o, hashes.p, (size_t)(8 * entries));
            o += 8 * entries;
            memcpy(o, counts.p, (size_t)(4 * entries));
            o += 4 * entries;
        }
        if (stats.present) {
            o = put_rec_header(o, 4, stats_body);
            o = put_route(o, sroute);
            put_le64(o, (uint64_t)ts);
            put_le64(o + 8, (uint64_t)stats.memory);
            memcpy(o + 16, &stats.hit_rate, 4);
            memcpy(o + 20, &stats.pressure, 4);
            put_le64(o + 24, (uint64_t)stats.t2_hit);
            put_le64(o + 32, (uint64_t)stats.t2_query);
        }
    }
done:
    PyMem_Free(hashes.p);
    PyMem_Free(counts.p);
    PyBuffer_Release(&view);
    return result;
}

static PyObject *py_pack_event(PyObject *Py_UNUSED(mod), PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const uint8_t *b = (const uint8_t *)view.buf;
    Py_ssize_t n = view.len, pos = 0;
    Span str[5] = {{EMPTY, 0}, {EMPTY, 0}, {EMPTY, 0}, {EMPTY, 0}, {EMPTY, 0}};
    /* replica 2, model 3, tenant 4, adapter 7 */
    int64_t ts = 0, type = 0;
    Span ph = {EMPTY, 0};
    Grow more = {NULL, 0, 0};
    int rc = OK, odd = 0;
    PyObject *result = NULL;
    while (pos < n && rc == OK) {
        uint32_t field;
        int wire;
        uint64_t v;
        Py_ssize_t s0, s1;
        if (ic_tag(b, n, &pos, &field, &wire) != OK) {
            rc = DECLINE;
        } else if (wire == IC_WIRE_VARINT && (field == 1 || field == 6)) {
            rc = ic_varint(b, n, &pos, &v);
            if (field == 1) type = ic_as_int32(v);
            else ts = (int64_t)v;
        } else if (wire != IC_WIRE_LEN || field == 1 || field == 6 || field > 8) {
            rc = ic_skip(b, n, &pos, wire);
        } else if (ic_payload(b, n, &pos, &s0, &s1) != OK) {
            rc = DECLINE;
        } else if (field == 5) {
            ph.p = b + s0;
            ph.n = s1 - s0;
        } else if (field == 8) {
            if (s1 - s0 != 8) odd = 1;
            else if (grow_put(&more, b + s0, 8) != OK) rc = FAIL;
        } else {
            rc = check_text(b, s0, s1);
            int slot = field == 2 ? 0 : field == 3 ? 1 : field == 4 ? 2 : 3;
            str[slot].p = b + s0;
            str[slot].n = s1 - s0;
        }
    }
    if (rc == FAIL) goto done;
    if (rc == DECLINE || type != 2 || odd || ph.n != 8) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    {
        Span route[5] = {str[2], str[1], {EMPTY, 0}, str[3], str[0]};
        Py_ssize_t nh = 1 + more.n / 8;
        Py_ssize_t body = route_size(route) + 12 + 8 * nh;
        result = PyBytes_FromStringAndSize(NULL, 12 + 8 + body);
        if (result == NULL) goto done;
        uint8_t *o = (uint8_t *)PyBytes_AS_STRING(result);
        memcpy(o, "ICB1", 4);
        put_le64(o + 4, 0);
        o = put_rec_header(o + 12, 2, body);
        o = put_route(o, route);
        put_le64(o, (uint64_t)ts);
        put_le32(o + 8, (uint32_t)nh);
        memcpy(o + 12, ph.p, 8);
        if (more.n) memcpy(o + 20, more.p, (size_t)more.n);
    }
done:
    PyMem_Free(more.p);
    PyBuffer_Release(&view);
    return result;
}

/* ---- writing ------------------------------------------------------------------------------ */

#define varint_len ic_varint_size

static inline char *put_varint(char *p, uint64_t v) {
    return (char *)ic_put_varint((uint8_t *)p, v);
}

typedef struct {
    const char *ph;
    Py_ssize_t phl;
    int32_t tc, tier;
    const char *ad;
    Py_ssize_t adl;
    Py_ssize_t body;
} Out;

static int as_i32_checked(PyObject *o, int32_t *out) {
    if (!PyLong_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "an entry is (bytes, int, str, int)");
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow || v < INT32_MIN || v > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "token_count and tier are int32");
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

static PyObject *py_encode_entries(PyObject *Py_UNUSED(mod), PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "entries must be a sequence of tuples");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    PyObject *result = NULL;
    Out *outs = (Out *)PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Out));
    if (outs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = items[i];
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 4) {
            PyErr_SetString(PyExc_TypeError, "an entry is (bytes, int, str, int)");
            goto done;
        }
        PyObject *ph = PyTuple_GET_ITEM(t, 0), *ad = PyTuple_GET_ITEM(t, 2);
        if (!PyBytes_Check(ph) || !PyUnicode_Check(ad)) {
            PyErr_SetString(PyExc_TypeError, "an entry is (bytes, int, str, int)");
            goto done;
        }
        Out *o = &outs[i];
        if (as_i32_checked(PyTuple_GET_ITEM(t, 1), &o->tc) < 0 ||
            as_i32_checked(PyTuple_GET_ITEM(t, 3), &o->tier) < 0)
            goto done;
        o->ph = PyBytes_AS_STRING(ph);
        o->phl = PyBytes_GET_SIZE(ph);
        o->ad = PyUnicode_AsUTF8AndSize(ad, &o->adl);
        if (o->ad == NULL) goto done;
        Py_ssize_t body = 0;
        if (o->phl) body += 1 + varint_len((uint64_t)o->phl) + o->phl;
        if (o->tc) body += 1 + varint_len((uint64_t)(int64_t)o->tc);
        if (o->tier) body += 1 + varint_len((uint64_t)(int64_t)o->tier);
        if (o->adl) body += 1 + varint_len((uint64_t)o->adl) + o->adl;
        o->body = body;
        total += 1 + varint_len((uint64_t)body) + body;
    }
    result = PyBytes_FromStringAndSize(NULL, total);
    if (result == NULL) goto done;
    char *p = PyBytes_AS_STRING(result);
    for (Py_ssize_t i = 0; i < n; i++) {
        const Out *o = &outs[i];
        *p++ = 0x32;
        p = put_varint(p, (uint64_t)o->body);
        if (o->phl) {
            *p++ = 0x0A;
            p = put_varint(p, (uint64_t)o->phl);
            memcpy(p, o->ph, (size_t)o->phl);
            p += o->phl;
        }
        if (o->tc) {
            *p++ = 0x10;
            p = put_varint(p, (uint64_t)(int64_t)o->tc);
        }
        if (o->tier) {
            *p++ = 0x28;
            p = put_varint(p, (uint64_t)(int64_t)o->tier);
        }
        if (o->adl) {
            *p++ = 0x32;
            p = put_varint(p, (uint64_t)o->adl);
            memcpy(p, o->ad, (size_t)o->adl);
            p += o->adl;
        }
    }
done:
    PyMem_Free(outs);
    Py_DECREF(seq);
    return result;
}

/* ---- module ------------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"pack_update", py_pack_update, METH_O,
     "pack_update(buf) -> ICB1 batch bytes of a one-run legacy CacheStateUpdate, or None"},
    {"pack_event", py_pack_event, METH_O,
     "pack_event(buf) -> ICB1 batch bytes of a PREFIX_EVICTED CacheEvent, or None"},
    {"parse_update", py_parse_update, METH_O,
     "parse_update(buf) -> (replica, model, tenant, scheme, ts, adapter, entries, stats) | None"},
    {"encode_entries", py_encode_entries, METH_O,
     "encode_entries([(prefix_hash, token_count, adapter_id, tier)]) -> prefixes field bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "inferencecache.updatewire._native",
    "CacheStateUpdate in compact form (see updatewire/__init__.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&moduledef); }
