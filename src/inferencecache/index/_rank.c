/*
 * inferencecache.index._rank: the PREFIX_MATCH scoring step of LookupRoute (contract §5.4,
 * §5.5, §5.8 G1) in C. Pure-Python twin: inferencecache.index.ranking.PyRanker; both give
 * identical results (tests/index/test_rank_differential.py).
 *
 * Ranker(score_type).rank(rows, chain, names, now_us, ttl_us, total, stats, pressure_weight,
 *                         slo, min_matched, want_credit)
 *   -> (scored, [score_type], [(replica, blocks)] | None), or None
 *
 * takes the store's answer (walk Runs on the chain path, holders tuples on the exact path) and
 * does everything up to the ranked ReplicaScores: freshness, the run/hold filters, the DP
 * factor, the stats-row pressure, the SLO bias, the float32 score, the (-score, replica_id)
 * order and the G1 floor. `scored` is the number of rows before G1 (orchestration needs it).
 * The same step is exported to the compiled store as a C function (capsule `_C_API`, see
 * _rank.h), which BlockMap.walk_ranked calls with its runs as C structs.
 *
 * Exactness. Every float32 step of ranking.py is a Python float (an IEEE double) rounded to
 * float32 by struct packing; here it is the same double operation followed by a (float) cast.
 * Both round to nearest-even once per step, so results are bit-identical provided doubles
 * are evaluated without excess precision (FLT_EVAL_METHOD == 0, checked at import) and no
 * multiply-add is contracted (-ffp-contract=off in pyproject.toml, and the pragma below).
 * Integer division `age / ttl` is Python's correctly rounded int/int, which equals the double
 * division when both fit 53 bits. Anything outside what is mirrored here exactly (a NaN score,
 * a TTL beyond 2**53 µs, values outside int64, unexpected types) returns None and the caller
 * runs the Python twin, so the twin's behaviour (including its exceptions) is the definition.
 *
 * score_type objects are created without calling __init__: the type must be a plain
 * __slots__ record of exactly (replica_id, score, matched_tokens, estimated_cache_hit_prob,
 * tier) deriving from object (model.ReplicaScore is), checked once in Ranker().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <float.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "_rank.h"
#include "_slots.h"

#if defined(__GNUC__) || defined(__clang__)
#define RK_UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define RK_UNLIKELY(x) (x)
#endif

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD == 0 && FLT_MANT_DIG == 24 && DBL_MANT_DIG == 53
#define RK_EXACT_FLOATS 1
#else
#define RK_EXACT_FLOATS 0
#endif

#define RK_LOCAL 16
#define RK_FIELDS 5
#define RK_MAX_EXACT_TTL ((int64_t)1 << 53)
#define FALLBACK 1

/* One row while ranking. The object pointers are borrowed from `src` (the input tuple, owned
 * by the row) or NULL when the input was a C struct (created when output needs them). */
typedef struct {
    double score;
    double prob; /* freshness, narrowed to float32 */
    long long rid, matched, tier, blocks;
    PyObject *rid_obj, *tok_obj, *tier_obj, *blocks_obj;
    PyObject *name; /* owned: the replica name (a str, "" for a missing name) */
    PyObject *src;  /* owned or NULL */
} RRow;

/* The arguments after (rows, chain). */
typedef struct {
    PyObject *names; /* list: replica id -> name */
    PyObject *stats; /* dict replica id -> StatsRow, or None */
    long long now, ttl, total, min_matched, fresh_after;
    double weight, slo;
    int want_credit;
} Params;

typedef struct {
    PyObject_HEAD
    PyTypeObject *cls;
    Py_ssize_t off[RK_FIELDS]; /* replica_id, score, matched_tokens, prob, tier */
} Ranker;

static PyTypeObject RankerType;

static PyObject *s_stats_reported = NULL;
static PyObject *s_pressure = NULL;
static PyObject *s_empty = NULL;
static PyObject *s_zero = NULL;

static const char *const field_names[RK_FIELDS] = {
    "replica_id", "score", "matched_tokens", "estimated_cache_hit_prob", "tier"};

static inline double f32(double x) { return (double)(float)x; }

/* a - b, or 1 when it does not fit a long long. */
static inline int sub_overflows(long long a, long long b, long long *out) {
#if defined(__GNUC__) || defined(__clang__)
    return __builtin_sub_overflow(a, b, out);
#else
    if ((b > 0 && a < LLONG_MIN + b) || (b < 0 && a > LLONG_MAX + b)) return 1;
    *out = a - b;
    return 0;
#endif
}

/* ---- construction ---- */

static PyObject *Ranker_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *cls;
    static char *kwlist[] = {"score_type", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Ranker", kwlist, &cls)) return NULL;
    PyObject *names = Py_BuildValue("(sssss)", field_names[0], field_names[1], field_names[2],
                                    field_names[3], field_names[4]);
    if (names == NULL) return NULL;
    Py_ssize_t off[RK_FIELDS];
    int rc = slots_layout(cls, names, off);
    Py_DECREF(names);
    if (rc < 0) return NULL;
    Ranker *self = (Ranker *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    memcpy(self->off, off, sizeof(off));
    self->cls = (PyTypeObject *)Py_NewRef(cls);
    return (PyObject *)self;
}

static void Ranker_dealloc(Ranker *self) {
    Py_XDECREF(self->cls);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ---- the arithmetic of ranking.py ---- */

/* An int as long long: 0 = done, 1 = not an int or out of range (the twin decides). */
static inline int as_ll(PyObject *o, long long *out) {
    if (RK_UNLIKELY(!PyLong_Check(o))) return 1;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (RK_UNLIKELY(v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 1;
    }
    if (RK_UNLIKELY(overflow)) return 1;
    *out = v;
    return 0;
}

/* ranking.freshness narrowed to float32; age and ttl fit 53 bits (ttl checked by the caller). */
static inline double freshness32(long long age, long long ttl) {
    if (age <= 0) return 1.0;
    if (age >= ttl) return 0.0;
    return f32(1.0 - (double)age / (double)ttl);
}

static inline double dp_factor(long long match, long long total) {
    if (total <= 1 || match < 0) return 1.0;
    if (match >= total) return 0.0;
    return 1.0 - (double)match / (double)total;
}

/* ranking._pressure_factor. */
static inline double pressure_factor(double weight, double pressure) {
    double pf = 1.0 - weight * pressure;
    if (pf <= 0.0) return 0.0;
    if (pf >= 1.0) return 1.0;
    return f32(pf);
}

/* ranking.prefix_match_score: matched * f * pf * (1 + f*slo) * DP, float32 after each step. */
static inline double match_score(double matched, double f, double pf, double slo, double dp) {
    double s = f != 1.0 ? f32(f32(matched) * f) : f32(matched);
    if (pf != 1.0) s = f32(s * pf);
    if (slo != 0.0) s = f32(s * f32(1.0 + f32(f * slo)));
    if (dp != 1.0) s = f32(s * f32(dp));
    return s;
}

/* Order of ranking.rank: score descending, then replica_id ascending (str order). Equal keys
 * keep their input order: both sorts below are stable. */
static inline int row_before(const RRow *a, const RRow *b) {
    if (a->score != b->score) return a->score > b->score;
    if (a->name == b->name) return 0;
    return PyUnicode_Compare(a->name, b->name) < 0;
}

static void sort_rows(RRow *v, RRow *tmp, Py_ssize_t n) {
    if (n <= 16) {
        for (Py_ssize_t i = 1; i < n; i++) {
            RRow x = v[i];
            Py_ssize_t j = i;
            while (j > 0 && row_before(&x, &v[j - 1])) {
                v[j] = v[j - 1];
                j--;
            }
            v[j] = x;
        }
        return;
    }
    Py_ssize_t h = n / 2;
    sort_rows(v, tmp, h);
    sort_rows(v + h, tmp, n - h);
    memcpy(tmp, v, (size_t)h * sizeof(RRow));
    Py_ssize_t i = 0, j = h, k = 0;
    while (i < h && j < n) v[k++] = row_before(&v[j], &tmp[i]) ? v[j++] : tmp[i++];
    while (i < h) v[k++] = tmp[i++];
}

static int cmp_ll(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

/* The pressure of ranking.fresh_pressure: 0 without a row or with stats_reported <=
 * fresh_after. 0 = ok, 1 = fallback (anything unexpected: the twin decides, exceptions
 * included). */
static int fresh_pressure(PyObject *stats, PyObject *rid, long long fresh_after, double *out) {
    *out = 0.0;
    if (stats == Py_None) return 0;
    PyObject *row = PyDict_GetItemWithError(stats, rid);
    if (row == NULL) {
        if (!PyErr_Occurred()) return 0;
        PyErr_Clear();
        return 1;
    }
    Py_INCREF(row);
    int rc = 1;
    PyObject *rep = PyObject_GetAttr(row, s_stats_reported);
    if (rep == NULL) goto done;
    long long reported;
    rc = as_ll(rep, &reported);
    Py_DECREF(rep);
    if (rc != 0) goto done;
    if (reported <= fresh_after) goto done; /* rc == 0, pressure 0 */
    rc = 1;
    PyObject *p = PyObject_GetAttr(row, s_pressure);
    if (p == NULL) goto done;
    if (PyFloat_CheckExact(p)) {
        *out = PyFloat_AS_DOUBLE(p);
        rc = 0;
    }
    Py_DECREF(p);
done:
    if (rc != 0) {
        PyErr_Clear();
        rc = 1;
    }
    Py_DECREF(row);
    return rc;
}

/* ---- the ranking step ---- */

/* The RANK_NARGS arguments after (rows, chain). 0 = ok, 1 = fallback, -1 = error. */
static int parse_params(PyObject *const *a, Params *p) {
    int t = PyObject_IsTrue(a[8]);
    if (t < 0) return -1;
    p->want_credit = t;
    p->names = a[0];
    p->stats = a[4];
    if (as_ll(a[1], &p->now) || as_ll(a[2], &p->ttl) || as_ll(a[3], &p->total) ||
        as_ll(a[7], &p->min_matched))
        return FALLBACK;
    if (!PyList_CheckExact(p->names) || !(p->stats == Py_None || PyDict_CheckExact(p->stats)) ||
        !PyFloat_CheckExact(a[5]) || !PyFloat_CheckExact(a[6]) || p->ttl > RK_MAX_EXACT_TTL ||
        sub_overflows(p->now, p->ttl, &p->fresh_after))
        return FALLBACK;
    p->weight = PyFloat_AS_DOUBLE(a[5]);
    p->slo = PyFloat_AS_DOUBLE(a[6]);
    return 0;
}

/* The per-row filters of the twin (chain: tokens > 0; both: freshness > 0) and the name.
 * Fills v[*n] and bumps *n when the row is kept; 0 = ok, 1 = fallback. */
static inline int add_row(const Params *p, int chain, RRow *v, Py_ssize_t *n, long long rid,
                          long long tokens, long long seen, long long tier, long long blocks) {
    if (chain && tokens <= 0) return 0;
    long long age;
    if (sub_overflows(p->now, seen, &age)) return FALLBACK;
    double f = freshness32(age, p->ttl);
    if (f <= 0.0) return 0;
    if (rid < 0 || rid >= PyList_GET_SIZE(p->names)) return FALLBACK; /* Python: [-1] or raise */
    PyObject *name = PyList_GET_ITEM(p->names, rid);
    if (name == Py_None || (PyUnicode_CheckExact(name) && PyUnicode_GET_LENGTH(name) == 0)) {
        name = s_empty;
    } else if (!PyUnicode_CheckExact(name)) {
        return FALLBACK;
    }
    RRow *r = &v[*n];
    memset(r, 0, sizeof(*r));
    r->prob = f;
    r->rid = rid;
    r->matched = tokens;
    r->tier = tier;
    r->blocks = chain ? blocks : (tokens > 0 ? 1 : 0);
    r->name = Py_NewRef(name);
    (*n)++;
    return 0;
}

static inline PyObject *obj_or_new(PyObject *o, long long v) {
    return o != NULL ? Py_NewRef(o) : PyLong_FromLongLong(v);
}

static PyObject *make_score(const Ranker *rk, const RRow *r) {
    PyObject *score = PyFloat_FromDouble(r->score);
    PyObject *prob = PyFloat_FromDouble(r->prob);
    PyObject *tokens = obj_or_new(r->tok_obj, r->matched);
    /* ingest.report_tier: T1..T3 (any value <= 3) as is, anything colder UNSPECIFIED */
    PyObject *tier = r->tier <= 3 ? obj_or_new(r->tier_obj, r->tier) : Py_NewRef(s_zero);
    PyObject *obj = NULL;
    if (score != NULL && prob != NULL && tokens != NULL && tier != NULL)
        obj = rk->cls->tp_alloc(rk->cls, 0);
    if (obj == NULL) {
        Py_XDECREF(score);
        Py_XDECREF(prob);
        Py_XDECREF(tokens);
        Py_XDECREF(tier);
        return NULL;
    }
    char *base = (char *)obj;
    *(PyObject **)(base + rk->off[0]) = Py_NewRef(r->name);
    *(PyObject **)(base + rk->off[1]) = score;
    *(PyObject **)(base + rk->off[2]) = tokens;
    *(PyObject **)(base + rk->off[3]) = prob;
    *(PyObject **)(base + rk->off[4]) = tier;
    return obj;
}

static PyObject *make_credit(const RRow *r) {
    PyObject *rid = obj_or_new(r->rid_obj, r->rid);
    PyObject *blocks = rid != NULL ? obj_or_new(r->blocks_obj, r->blocks) : NULL;
    if (blocks == NULL) {
        Py_XDECREF(rid);
        return NULL;
    }
    PyObject *pair = PyTuple_New(2);
    if (pair == NULL) {
        Py_DECREF(rid);
        Py_DECREF(blocks);
        return NULL;
    }
    PyTuple_SET_ITEM(pair, 0, rid);
    PyTuple_SET_ITEM(pair, 1, blocks);
    return pair;
}

/* DP, pressure, score, order, G1 and the output of the n kept rows (n_in = input rows, the
 * exact path's DP match). Returns the result tuple, or NULL with *rc = FALLBACK or -1. */
static PyObject *finish(const Ranker *rk, const Params *p, int chain, RRow *v, RRow *tmp,
                        long long *ms, Py_ssize_t n, Py_ssize_t n_in, int *rc) {
    if (n > 0) {
        double dp_exact = chain ? 1.0 : dp_factor(n_in, p->total);
        int chain_dp = chain && p->total > 1;
        if (chain_dp) {
            for (Py_ssize_t i = 0; i < n; i++) ms[i] = v[i].matched;
            if (n > 1) qsort(ms, (size_t)n, sizeof(long long), cmp_ll);
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            RRow *r = &v[i];
            double dp = dp_exact;
            if (chain_dp) {
                /* match = rows with matched >= this row's: n - bisect_left(sorted, matched) */
                Py_ssize_t lo = 0, hi = n;
                while (lo < hi) {
                    Py_ssize_t mid = (lo + hi) / 2;
                    if (ms[mid] < r->matched)
                        lo = mid + 1;
                    else
                        hi = mid;
                }
                dp = dp_factor((long long)(n - lo), p->total);
            }
            double pressure = 0.0;
            if (p->stats != Py_None) {
                PyObject *rid = obj_or_new(r->rid_obj, r->rid);
                if (rid == NULL) {
                    *rc = -1;
                    return NULL;
                }
                int frc = fresh_pressure(p->stats, rid, p->fresh_after, &pressure);
                Py_DECREF(rid);
                if (frc != 0) {
                    *rc = FALLBACK;
                    return NULL;
                }
            }
            double pf = pressure_factor(p->weight, pressure);
            double s = match_score((double)r->matched, r->prob, pf, p->slo, dp);
            if (RK_UNLIKELY(s != s)) { /* NaN: Python's sort of NaN keys is not mirrored */
                *rc = FALLBACK;
                return NULL;
            }
            r->score = s;
        }
        sort_rows(v, tmp, n);
    }
    long long floor = p->min_matched;
    Py_ssize_t kept = 0;
    for (Py_ssize_t i = 0; i < n; i++) kept += floor <= 0 || v[i].matched >= floor;
    PyObject *scores = PyList_New(kept);
    PyObject *credit = p->want_credit ? PyList_New(kept) : Py_NewRef(Py_None);
    PyObject *scored = PyLong_FromSsize_t(n);
    PyObject *out = NULL;
    if (scores == NULL || credit == NULL || scored == NULL) goto fail;
    for (Py_ssize_t i = 0, k = 0; i < n; i++) {
        if (floor > 0 && v[i].matched < floor) continue; /* G1 */
        PyObject *obj = make_score(rk, &v[i]);
        if (obj == NULL) goto fail;
        PyList_SET_ITEM(scores, k, obj);
        if (credit != Py_None) {
            PyObject *pair = make_credit(&v[i]);
            if (pair == NULL) goto fail;
            PyList_SET_ITEM(credit, k, pair);
        }
        k++;
    }
    out = PyTuple_New(3);
    if (out == NULL) goto fail;
    PyTuple_SET_ITEM(out, 0, scored);
    PyTuple_SET_ITEM(out, 1, scores);
    PyTuple_SET_ITEM(out, 2, credit);
    return out;
fail:
    Py_XDECREF(scores);
    Py_XDECREF(credit);
    Py_XDECREF(scored);
    *rc = -1;
    return NULL;
}

/* Row buffers: on the stack up to RK_LOCAL rows. */
typedef struct {
    RRow local[RK_LOCAL], tmp_local[RK_LOCAL];
    long long ms_local[RK_LOCAL];
    RRow *v, *tmp;
    long long *ms;
    Py_ssize_t n; /* rows holding references */
} Rows;

static int rows_open(Rows *b, Py_ssize_t n_in) {
    b->v = b->local;
    b->tmp = b->tmp_local;
    b->ms = b->ms_local;
    b->n = 0;
    if (n_in <= RK_LOCAL) return 0;
    b->v = (RRow *)PyMem_Malloc((size_t)n_in * sizeof(RRow));
    b->tmp = (RRow *)PyMem_Malloc((size_t)n_in * sizeof(RRow));
    b->ms = (long long *)PyMem_Malloc((size_t)n_in * sizeof(long long));
    if (b->v == NULL || b->tmp == NULL || b->ms == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void rows_close(Rows *b) {
    for (Py_ssize_t i = 0; i < b->n; i++) {
        Py_DECREF(b->v[i].name);
        Py_XDECREF(b->v[i].src);
    }
    if (b->v != b->local) PyMem_Free(b->v);
    if (b->tmp != b->tmp_local) PyMem_Free(b->tmp);
    if (b->ms != b->ms_local) PyMem_Free(b->ms);
}

static PyObject *result_of(PyObject *out, int rc) {
    if (out != NULL) return out;
    if (rc == FALLBACK) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return NULL;
}

static PyObject *Ranker_rank(Ranker *rk, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 + RANK_NARGS) {
        PyErr_Format(PyExc_TypeError, "rank() takes %d positional arguments (%zd given)",
                     2 + RANK_NARGS, nargs);
        return NULL;
    }
    int chain = PyObject_IsTrue(args[1]);
    if (chain < 0) return NULL;
    Params p;
    int rc = parse_params(args + 2, &p);
    if (rc < 0) return NULL;
    PyObject *rows = args[0];
    if (rc == FALLBACK || !PyList_CheckExact(rows)) Py_RETURN_NONE;
    Py_ssize_t n_in = PyList_GET_SIZE(rows);
    Py_ssize_t width = chain ? 5 : 4;
    Rows b;
    PyObject *out = NULL;
    if (rows_open(&b, n_in) < 0) {
        rc = -1;
        goto done;
    }
    for (Py_ssize_t i = 0; i < n_in; i++) {
        PyObject *t = PyList_GET_ITEM(rows, i);
        long long f[5] = {0, 0, 0, 0, 0};
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != width) {
            rc = FALLBACK;
            goto done;
        }
        for (Py_ssize_t j = 0; j < width; j++) {
            if (as_ll(PyTuple_GET_ITEM(t, j), &f[j])) {
                rc = FALLBACK;
                goto done;
            }
        }
        Py_ssize_t before = b.n;
        if (add_row(&p, chain, b.v, &b.n, f[0], f[1], f[2], f[3], f[4])) {
            rc = FALLBACK;
            goto done;
        }
        if (b.n != before) { /* kept: reuse the input's int objects */
            RRow *r = &b.v[before];
            r->src = Py_NewRef(t);
            r->rid_obj = PyTuple_GET_ITEM(t, 0);
            r->tok_obj = PyTuple_GET_ITEM(t, 1);
            r->tier_obj = PyTuple_GET_ITEM(t, 3);
            r->blocks_obj = chain ? PyTuple_GET_ITEM(t, 4) : NULL;
        }
    }
    out = finish(rk, &p, chain, b.v, b.tmp, b.ms, b.n, n_in, &rc);
done:
    rows_close(&b);
    return result_of(out, rc);
}

/* The C API: Ranker.rank(runs, True, *args) over C structs (BlockMap.walk_ranked). */
static PyObject *rank_runs(PyObject *ranker, const RankRun *runs, Py_ssize_t n,
                           PyObject *const *args) {
    if (!Py_IS_TYPE(ranker, &RankerType)) {
        PyErr_SetString(PyExc_TypeError, "rank_runs: not a compiled Ranker");
        return NULL;
    }
    Params p;
    int rc = parse_params(args, &p);
    if (rc < 0) return NULL;
    if (rc == FALLBACK) Py_RETURN_NONE;
    Rows b;
    PyObject *out = NULL;
    if (rows_open(&b, n) < 0) {
        rc = -1;
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const RankRun *x = &runs[i];
        if (add_row(&p, 1, b.v, &b.n, x->replica, x->tokens, x->oldest, x->tier, x->blocks)) {
            rc = FALLBACK;
            goto done;
        }
    }
    out = finish((Ranker *)ranker, &p, 1, b.v, b.tmp, b.ms, b.n, n, &rc);
done:
    rows_close(&b);
    return result_of(out, rc);
}

static RankCAPI rank_capi = {RANK_CAPI_ABI, &RankerType, rank_runs};

static PyMethodDef Ranker_methods[] = {
    {"rank", (PyCFunction)(void (*)(void))Ranker_rank, METH_FASTCALL,
     "rank(rows, chain, names, now_us, ttl_us, total, stats, pressure_weight, slo, "
     "min_matched, want_credit) -> (scored, scores, credit) | None (run the Python twin)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RankerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "inferencecache.index._rank.Ranker",
    .tp_doc = PyDoc_STR("Ranker(score_type): the compiled PREFIX_MATCH scoring step."),
    .tp_basicsize = sizeof(Ranker),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Ranker_new,
    .tp_dealloc = (destructor)Ranker_dealloc,
    .tp_methods = Ranker_methods,
};

/* ---- Record: a fast constructor of plain __slots__ records (model.LookupResult) ---- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyTypeObject *cls;
    Py_ssize_t n;
    Py_ssize_t off[SLOTS_MAX];
} Record;

static PyObject *Record_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                                   PyObject *kwnames) {
    Record *rec = (Record *)self;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != rec->n || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_Format(PyExc_TypeError, "%.100s record takes exactly %zd positional arguments",
                     rec->cls->tp_name, rec->n);
        return NULL;
    }
    PyObject *obj = rec->cls->tp_alloc(rec->cls, 0);
    if (obj == NULL) return NULL;
    for (Py_ssize_t i = 0; i < nargs; i++)
        *(PyObject **)((char *)obj + rec->off[i]) = Py_NewRef(args[i]);
    return obj;
}

static PyObject *Record_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *cls, *names;
    static char *kwlist[] = {"cls", "fields", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!:Record", kwlist, &cls, &PyTuple_Type,
                                     &names))
        return NULL;
    Py_ssize_t off[SLOTS_MAX];
    if (slots_layout(cls, names, off) < 0) return NULL;
    Record *self = (Record *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->n = PyTuple_GET_SIZE(names);
    memcpy(self->off, off, (size_t)self->n * sizeof(Py_ssize_t));
    self->cls = (PyTypeObject *)Py_NewRef(cls);
    self->vectorcall = Record_vectorcall;
    return (PyObject *)self;
}

static void Record_dealloc(Record *self) {
    Py_XDECREF(self->cls);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject RecordType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "inferencecache.index._rank.Record",
    .tp_doc = PyDoc_STR("Record(cls, fields): cls(*values) without running cls.__init__, for "
                        "plain __slots__ records whose __init__ only assigns the fields."),
    .tp_basicsize = sizeof(Record),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Record, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = Record_new,
    .tp_dealloc = (destructor)Record_dealloc,
};

/* ---- the affinity seed of a packed chain (contract §5.9) ---- */

/* concat(u32_be(8) || h) over the 8-byte hashes of `packed` (a trailing partial hash is
 * ignored): ranking._seed_of_packed. */
static PyObject *packed_seed(PyObject *Py_UNUSED(module), PyObject *arg) {
    if (!PyBytes_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "packed_seed() needs bytes, not %.100s",
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
    Py_ssize_t n = PyBytes_GET_SIZE(arg) / 8;
    PyObject *out = PyBytes_FromStringAndSize(NULL, 12 * n);
    if (out == NULL) return NULL;
    const char *src = PyBytes_AS_STRING(arg);
    char *dst = PyBytes_AS_STRING(out);
    static const char len8[4] = {0, 0, 0, 8};
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(dst + 12 * i, len8, 4);
        memcpy(dst + 12 * i + 4, src + 8 * i, 8);
    }
    return out;
}

static PyMethodDef rk_functions[] = {
    {"packed_seed", (PyCFunction)packed_seed, METH_O,
     "packed_seed(packed) -> concat(u32_be(8) || h) of its 8-byte hashes (the affinity seed)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef rk_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "inferencecache.index._rank",
    .m_doc = "Compiled PREFIX_MATCH scoring of the routing index (see docs/index.md).",
    .m_size = -1,
    .m_methods = rk_functions,
};

PyMODINIT_FUNC PyInit__rank(void) {
    if (!RK_EXACT_FLOATS) {
        PyErr_SetString(PyExc_ImportError,
                        "inferencecache.index._rank needs IEEE float/double without excess "
                        "precision; the Python twin is used instead");
        return NULL;
    }
    if (PyType_Ready(&RankerType) < 0 || PyType_Ready(&RecordType) < 0) return NULL;
    if (s_empty == NULL) {
        s_stats_reported = PyUnicode_InternFromString("stats_reported");
        s_pressure = PyUnicode_InternFromString("pressure");
        s_empty = PyUnicode_FromString("");
        s_zero = PyLong_FromLong(0);
        if (s_stats_reported == NULL || s_pressure == NULL || s_empty == NULL || s_zero == NULL)
            return NULL;
    }
    PyObject *mod = PyModule_Create(&rk_module);
    if (mod == NULL) return NULL;
    PyObject *capsule = PyCapsule_New(&rank_capi, RANK_CAPI_NAME, NULL);
    if (capsule == NULL || PyModule_AddObjectRef(mod, "Ranker", (PyObject *)&RankerType) < 0 ||
        PyModule_AddObjectRef(mod, "Record", (PyObject *)&RecordType) < 0 ||
        PyModule_AddObjectRef(mod, "_C_API", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(mod);
        return NULL;
    }
    Py_DECREF(capsule);
    return mod;
}
