/*
 * inferencecache.index._rank: the PREFIX_MATCH scoring step of LookupRoute (contract-and-index.md §5.4,
 * contract-and-index.md §5.5, §5.8 G1) in C. Pure-Python reference: inferencecache.index.ranking.PyRanker; both give
 * identical results (tests/index/test_rank_differential.py).
 *
 * Ranker(names, settings): settings is a ranking.RankSettings (read by attribute name, once);
 * names the index's replica id -> name list.
 * Ranker.bind(now_us, total, stats, ttft_ms) -> BoundRanker: one lookup's facts.
 * BoundRanker.rank(rows, chain) -> (scored, [ReplicaScore], [(replica, blocks)] | None), or None
 *
 * rank takes the store's answer (walk Runs on the chain path, holders tuples on the exact path)
 * and does everything up to the ranked ReplicaScores: freshness, the run/hold filters, the DP
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
 * a TTL beyond 2**53 us, values outside int64, unexpected types) makes rank return None and the
 * caller runs the Python reference (and counts it), so its behaviour, exceptions included, is
 * the definition.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "_rank.h"
#include "ic_named.h"

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

/* Ranker: the RankSettings of one policy, read once. */
typedef struct {
    PyObject_HEAD
    PyObject *names; /* list: replica id -> name */
    long long ttl, min_matched, slo_tight;
    double weight, slo_bias;
    int credit;
    int mirrored; /* 0: a setting this file does not mirror exactly; every rank declines */
} Ranker;

/* BoundRanker: a Ranker and one lookup's facts. */
typedef struct {
    PyObject_HEAD
    Ranker *rk;
    PyObject *stats; /* dict replica id -> StatsRow, or None */
    long long now, total, fresh_after;
    double slo;
    int mirrored;
} Bound;

static PyTypeObject RankerType, BoundType;

static PyObject *s_stats_reported = NULL;
static PyObject *s_pressure = NULL;
static PyObject *s_empty = NULL;
static PyObject *s_zero = NULL;
static PyObject *score_type = NULL; /* inferencecache.index.model.ReplicaScore */
static int score_fast = 0;          /* a plain NamedTuple: built through the tuple API */

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

/* An int as long long: 0 = done, 1 = not an int or out of range (Python decides). */
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

/* ---- construction ---- */

/* settings.<name> as a long long / a float / a bool; 1 = not mirrored, -1 = error. */
static int attr_ll(PyObject *settings, const char *name, long long *out) {
    PyObject *v = PyObject_GetAttrString(settings, name);
    if (v == NULL) return -1;
    int rc = as_ll(v, out);
    Py_DECREF(v);
    return rc;
}

static int attr_double(PyObject *settings, const char *name, double *out) {
    PyObject *v = PyObject_GetAttrString(settings, name);
    if (v == NULL) return -1;
    int rc = PyFloat_CheckExact(v) ? 0 : 1;
    if (rc == 0) *out = PyFloat_AS_DOUBLE(v);
    Py_DECREF(v);
    return rc;
}

static int attr_bool(PyObject *settings, const char *name, int *out) {
    PyObject *v = PyObject_GetAttrString(settings, name);
    if (v == NULL) return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (t < 0) return -1;
    *out = t;
    return 0;
}

static PyObject *Ranker_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *names, *settings;
    static char *kwlist[] = {"names", "settings", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:Ranker", kwlist, &names, &settings))
        return NULL;
    Ranker *self = (Ranker *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->names = Py_NewRef(names);
    /* ranking.RankSettings, field by field (a new knob: read it here, use it below) */
    int rc[6] = {
        attr_ll(settings, "ttl_us", &self->ttl),
        attr_double(settings, "pressure_weight", &self->weight),
        attr_ll(settings, "slo_tight_ttft_ms", &self->slo_tight),
        attr_double(settings, "slo_bias", &self->slo_bias),
        attr_ll(settings, "min_matched", &self->min_matched),
        attr_bool(settings, "credit", &self->credit),
    };
    self->mirrored = PyList_CheckExact(names) && self->ttl <= RK_MAX_EXACT_TTL;
    for (int i = 0; i < 6; i++) {
        if (rc[i] < 0) {
            Py_DECREF(self);
            return NULL;
        }
        if (rc[i] > 0) self->mirrored = 0;
    }
    return (PyObject *)self;
}

static void Ranker_dealloc(Ranker *self) {
    Py_XDECREF(self->names);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Ranker.bind(now_us, total, stats, ttft_ms) */
static PyObject *Ranker_bind(Ranker *rk, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "bind() takes 4 positional arguments (%zd given)", nargs);
        return NULL;
    }
    Bound *b = (Bound *)BoundType.tp_alloc(&BoundType, 0);
    if (b == NULL) return NULL;
    b->rk = (Ranker *)Py_NewRef((PyObject *)rk);
    b->stats = Py_NewRef(args[2]);
    long long ttft = 0;
    b->mirrored = rk->mirrored && !as_ll(args[0], &b->now) && !as_ll(args[1], &b->total) &&
                  !as_ll(args[3], &ttft) &&
                  (b->stats == Py_None || PyDict_CheckExact(b->stats)) &&
                  !sub_overflows(b->now, rk->ttl, &b->fresh_after);
    b->slo = 0 < ttft && ttft < rk->slo_tight ? rk->slo_bias : 0.0;
    return (PyObject *)b;
}

static void Bound_dealloc(Bound *self) {
    Py_XDECREF((PyObject *)self->rk);
    Py_XDECREF(self->stats);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ---- the arithmetic of ranking.py ---- */


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

/* The per-row filters of the twin (chain: tokens > 0; both: freshness > 0) and the name.
 * Fills v[*n] and bumps *n when the row is kept; 0 = ok, 1 = fallback. */
static inline int add_row(const Bound *p, int chain, RRow *v, Py_ssize_t *n, long long rid,
                          long long tokens, long long seen, long long tier, long long blocks) {
    if (chain && tokens <= 0) return 0;
    long long age;
    if (sub_overflows(p->now, seen, &age)) return FALLBACK;
    double f = freshness32(age, p->rk->ttl);
    if (f <= 0.0) return 0;
    PyObject *names = p->rk->names;
    if (rid < 0 || rid >= PyList_GET_SIZE(names)) return FALLBACK; /* Python: [-1] or raise */
    PyObject *name = PyList_GET_ITEM(names, rid);
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

/* ReplicaScore(replica_id, score, matched_tokens, estimated_cache_hit_prob, tier) */
static PyObject *make_score(const RRow *r) {
    PyObject *a[5];
    a[0] = Py_NewRef(r->name);
    a[1] = PyFloat_FromDouble(r->score);
    a[2] = obj_or_new(r->tok_obj, r->matched);
    a[3] = PyFloat_FromDouble(r->prob);
    /* apply.report_tier: T1..T3 (any value <= 3) as is, anything colder UNSPECIFIED */
    a[4] = r->tier <= 3 ? obj_or_new(r->tier_obj, r->tier) : Py_NewRef(s_zero);
    return ic_make_named(score_type, score_fast, a, 5);
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
static PyObject *finish(const Bound *p, int chain, RRow *v, RRow *tmp, long long *ms,
                        Py_ssize_t n, Py_ssize_t n_in, int *rc) {
    const Ranker *rk = p->rk;
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
            double pf = pressure_factor(rk->weight, pressure);
            double s = match_score((double)r->matched, r->prob, pf, p->slo, dp);
            if (RK_UNLIKELY(s != s)) { /* NaN: Python's sort of NaN keys is not mirrored */
                *rc = FALLBACK;
                return NULL;
            }
            r->score = s;
        }
        sort_rows(v, tmp, n);
    }
    long long floor = rk->min_matched;
    Py_ssize_t kept = 0;
    for (Py_ssize_t i = 0; i < n; i++) kept += floor <= 0 || v[i].matched >= floor;
    PyObject *scores = PyList_New(kept);
    PyObject *credit = rk->credit ? PyList_New(kept) : Py_NewRef(Py_None);
    PyObject *scored = PyLong_FromSsize_t(n);
    PyObject *out = NULL;
    if (scores == NULL || credit == NULL || scored == NULL) goto fail;
    for (Py_ssize_t i = 0, k = 0; i < n; i++) {
        if (floor > 0 && v[i].matched < floor) continue; /* G1 */
        PyObject *obj = make_score(&v[i]);
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

/* BoundRanker.rank(rows, chain) */
static PyObject *Bound_rank(Bound *p, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "rank() takes 2 positional arguments (%zd given)", nargs);
        return NULL;
    }
    int chain = PyObject_IsTrue(args[1]);
    if (chain < 0) return NULL;
    PyObject *rows = args[0];
    if (!p->mirrored || !PyList_CheckExact(rows)) Py_RETURN_NONE;
    Py_ssize_t n_in = PyList_GET_SIZE(rows);
    Py_ssize_t width = chain ? 5 : 4;
    Rows b;
    PyObject *out = NULL;
    int rc = 0;
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
        if (add_row(p, chain, b.v, &b.n, f[0], f[1], f[2], f[3], f[4])) {
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
    out = finish(p, chain, b.v, b.tmp, b.ms, b.n, n_in, &rc);
done:
    rows_close(&b);
    return result_of(out, rc);
}

/* The C API: BoundRanker.rank(runs, True) over C structs (BlockMap.walk_ranked). */
static PyObject *rank_runs(PyObject *bound, const RankRun *runs, Py_ssize_t n) {
    if (!Py_IS_TYPE(bound, &BoundType)) {
        PyErr_SetString(PyExc_TypeError, "rank_runs: not a compiled BoundRanker");
        return NULL;
    }
    Bound *p = (Bound *)bound;
    if (!p->mirrored) Py_RETURN_NONE;
    Rows b;
    PyObject *out = NULL;
    int rc = 0;
    if (rows_open(&b, n) < 0) {
        rc = -1;
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const RankRun *x = &runs[i];
        if (add_row(p, 1, b.v, &b.n, x->replica, x->tokens, x->oldest, x->tier, x->blocks)) {
            rc = FALLBACK;
            goto done;
        }
    }
    out = finish(p, 1, b.v, b.tmp, b.ms, b.n, n, &rc);
done:
    rows_close(&b);
    return result_of(out, rc);
}

static RankCAPI rank_capi = {RANK_CAPI_ABI, &BoundType, rank_runs};

static PyMethodDef Ranker_methods[] = {
    {"bind", (PyCFunction)(void (*)(void))Ranker_bind, METH_FASTCALL,
     "bind(now_us, total, stats, ttft_ms) -> BoundRanker: the ranker of one lookup"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RankerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "inferencecache.index._rank.Ranker",
    .tp_doc = PyDoc_STR("Ranker(names, settings): the compiled PREFIX_MATCH scoring step."),
    .tp_basicsize = sizeof(Ranker),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Ranker_new,
    .tp_dealloc = (destructor)Ranker_dealloc,
    .tp_methods = Ranker_methods,
};

static PyMethodDef Bound_methods[] = {
    {"rank", (PyCFunction)(void (*)(void))Bound_rank, METH_FASTCALL,
     "rank(rows, chain) -> (scored, scores, credit) | None (run the Python reference)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BoundType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "inferencecache.index._rank.BoundRanker",
    .tp_doc = PyDoc_STR("A Ranker bound to one lookup (Ranker.bind)."),
    .tp_basicsize = sizeof(Bound),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Bound_dealloc,
    .tp_methods = Bound_methods,
};

/* ---- the affinity seed of a packed chain (contract-and-index.md §5.9) ---- */

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
                        "precision; the Python reference is used instead");
        return NULL;
    }
    if (PyType_Ready(&RankerType) < 0 || PyType_Ready(&BoundType) < 0) return NULL;
    if (s_empty == NULL) {
        s_stats_reported = PyUnicode_InternFromString("stats_reported");
        s_pressure = PyUnicode_InternFromString("pressure");
        s_empty = PyUnicode_FromString("");
        s_zero = PyLong_FromLong(0);
        if (s_stats_reported == NULL || s_pressure == NULL || s_empty == NULL || s_zero == NULL)
            return NULL;
        PyObject *model = PyImport_ImportModule("inferencecache.index.model");
        if (model == NULL) return NULL;
        score_type = PyObject_GetAttrString(model, "ReplicaScore");
        Py_DECREF(model);
        if (score_type == NULL) return NULL;
        score_fast = ic_named_fast(score_type, 5);
    }
    PyObject *mod = PyModule_Create(&rk_module);
    if (mod == NULL) return NULL;
    PyObject *capsule = PyCapsule_New(&rank_capi, RANK_CAPI_NAME, NULL);
    if (capsule == NULL || PyModule_AddObjectRef(mod, "Ranker", (PyObject *)&RankerType) < 0 ||
        PyModule_AddObjectRef(mod, "BoundRanker", (PyObject *)&BoundType) < 0 ||
        PyModule_AddObjectRef(mod, "_C_API", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(mod);
        return NULL;
    }
    Py_DECREF(capsule);
    return mod;
}
