/*
 * inferencecache.index._blockmap: the compiled PartitionStore (src/inferencecache/index/store.py).
 *
 * One BlockMap per partition: key bytes -> replica -> (tokens, last_seen, tier, access).
 * Design, slot layout and memory figures: docs/index-store.md. In short:
 *
 * - An open-addressing table of 32-byte slots (64-byte aligned: one cache line per probe),
 *   power-of-two capacity, linear probing, backward-shift deletion (no tombstones),
 *   load <= 3/4, doubling growth, shrink when the load falls under 1/8. The probe position is
 *   splitmix64(key) so sequential or structured 8-byte keys spread evenly. The inline hold's
 *   LFU count lives in a parallel 8-byte array that walks never read (40 bytes per slot).
 * - An 8-byte key (the fingerprint: nearly all traffic) is stored inline as its 8 bytes.
 *   Any other length goes to a side table of exact `bytes` objects (the slot keeps its index
 *   and a LONG flag); lookups compare those bytes exactly, never a hash of them.
 * - The first hold of a key lives in the slot; further holds of the same key live in an
 *   overflow arena of 32-byte entries linked from the slot, with a free list.
 * - walk resolves each block's slot through a two-stage software pipeline (prefetch the home
 *   slot PF_A blocks ahead, probe it and prefetch its first overflow entry PF_B blocks ahead)
 *   so the cache misses of a long chain overlap instead of queueing; credit and upsert_many
 *   prefetch home slots PF_A keys ahead. Request counts may come packed (bytes of one-byte
 *   counts, array('i')). walk_ranked hands the final runs to a compiled ranker of
 *   inferencecache.index._rank as C structs (its capsule API, _rank.h): no Run objects.
 * - cap_candidates / quota_candidates keep the smallest candidates of a full scan in a heap
 *   between calls (kept exact by hooks in upsert and remove_hold), so an index at its hold cap
 *   or a tenant at its quota does not pay a full scan per ingest.
 *
 * Every call runs with the GIL held and never releases it, so calls are atomic to each other.
 * A `busy` flag rejects re-entrant calls (e.g. from a finalizer that a garbage collection
 * started mid-call) instead of letting them move slots under the running call. All memory is
 * allocated with PyMem_Raw* so tracemalloc sees it too.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "ic_named.h"
#include "ic_pyargs.h"
#include "_rank.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__GNUC__) || defined(__clang__)
#define BM_PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 3)
#define BM_LIKELY(x) __builtin_expect(!!(x), 1)
#define BM_UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define BM_PREFETCH(p) ((void)(p))
#define BM_LIKELY(x) (x)
#define BM_UNLIKELY(x) (x)
#endif

/* Result bits, equal to the constants of inferencecache.index.store (checked by tests). */
#define NEW_KEY 1
#define NEW_HOLD 2
#define HOLD_REMOVED 1
#define KEY_REMOVED 2

#define BM_LONG UINT32_C(0x80000000) /* slot's key is a side-table index (not 8 bytes) */
#define IDX_MASK UINT32_C(0x7fffffff) /* overflow entry index + 1; 0 = end of chain */
#define MIN_CAP ((size_t)8)
#define OVF_MIN_CAP ((uint32_t)16)
#define LK_MIN_CAP ((size_t)4)
#define REP_MAX UINT32_C(0xfffffffe) /* largest replica; stored + 1, 0 marks an empty slot */
#define ACCESS_MAX INT64_MAX

/* Prefetch pipeline distances (blocks ahead) and ring size (power of two > PF_A + 1).
 * Measured on the bench shape (docs/index-store.md); -D overrides are for tuning only. */
#ifndef PF_A
#define PF_A 20
#endif
#ifndef PF_B
#define PF_B 10
#endif
#define RING 32

/* Eviction candidates kept between cap_candidates calls: max(CC_FACTOR * k, CC_MIN). */
#define CC_MIN 16384
#define CC_FACTOR 16

/* ======================================================================================= */
/* Layout                                                                                  */
/* ======================================================================================= */

/* The fields of a hold that a walk reads. In a slot, `next` also carries BM_LONG; in the
 * arena it never does. The LFU access count lives apart (see Slot and Ovf). */
typedef struct {
    int64_t last_seen;
    uint32_t rep1; /* replica + 1; 0 = empty slot / free arena entry */
    int32_t tokens;
    int32_t tier;
    uint32_t next; /* bit 31: LONG (slots only); bits 0..30: next overflow entry index + 1 */
} Hold;

/* 32 bytes, 64-byte aligned table: a probe touches one cache line. The inline hold's access
 * count is in the parallel array BlockMap.sacc, which walks never read. */
typedef struct {
    uint64_t key; /* the 8 key bytes (native-endian load), or the side-table index if LONG */
    Hold h;       /* first hold, inline */
} Slot;

/* An overflow arena entry: a further hold of a key, with its access count. */
typedef struct {
    Hold h;
    int64_t access; /* LFU count, saturating at INT64_MAX */
} Ovf;

typedef struct {
    uint64_t hash;   /* hash_long of the bytes; free-list link (index + 1) when bytes is NULL */
    PyObject *bytes; /* exact bytes object owned by the map, NULL = free entry */
} LongKey;

_Static_assert(sizeof(Hold) == 24, "Hold must be 24 bytes");
_Static_assert(sizeof(Slot) == 32, "Slot must be 32 bytes");
_Static_assert(sizeof(Ovf) == 32, "Ovf must be 32 bytes");

typedef struct {
    PyObject_HEAD
    Slot *slots;     /* 64-byte aligned inside slots_raw */
    void *slots_raw; /* allocation of slots */
    int64_t *sacc;   /* access count of each slot's inline hold */
    size_t mask;     /* capacity - 1 */
    size_t nkeys;
    size_t nholds;
    Ovf *ovf;
    uint32_t ovf_cap;
    uint32_t ovf_top;  /* high-water mark: entries [0, top) were handed out at least once */
    uint32_t ovf_free; /* free-list head (index + 1), 0 = empty */
    uint32_t ovf_live;
    LongKey *lk;
    size_t lk_cap;
    size_t lk_top;
    size_t lk_free; /* index + 1 */
    size_t lk_live;
    size_t lk_bytes; /* sizes of the side table's bytes objects */
    uint64_t version; /* bumped on every structural change (holds() iterators check it) */
    struct CandCache *cc; /* eviction candidates kept between cap_candidates calls, or NULL */
    struct CandCache *qc; /* the same for quota_candidates (keys by newest last_seen) */
    size_t cc_min;        /* candidates kept: max(cc_factor * k, cc_min) (tests lower them) */
    size_t cc_factor;
    int busy;
} BlockMap;

static PyTypeObject BlockMapType;
static PyTypeObject HoldsIterType;

static void cc_free(BlockMap *m);
static void qc_free(BlockMap *m);
static void qc_note(BlockMap *m, size_t pos);

/* The hold of arena entry idx1 (index + 1). */
#define OH(m, idx1) (&(m)->ovf[(idx1) - 1].h)

/* Set once at module init from inferencecache.index.store, never changed afterwards. */
static PyObject *RunType = NULL;
static PyObject *HoldType = NULL;
static int run_fast = 0;  /* the NamedTuple can be filled like a tuple (see ic_named.h) */
static int hold_fast = 0;

/* ======================================================================================= */
/* Hashing                                                                                 */
/* ======================================================================================= */

static inline uint64_t mix64(uint64_t z) { /* splitmix64 finalizer */
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

static inline uint64_t load64(const void *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* Keys that are not 8 bytes long (rare): any decent spread will do, equality is exact. */
static uint64_t hash_long(const char *p, Py_ssize_t n) {
    uint64_t h = UINT64_C(0x9e3779b97f4a7c15) ^ ((uint64_t)n * UINT64_C(0xff51afd7ed558ccd));
    while (n >= 8) {
        h = mix64(h ^ load64(p)) + UINT64_C(0x632be59bd9b4e019);
        p += 8;
        n -= 8;
    }
    uint64_t w = 0;
    if (n > 0) memcpy(&w, p, (size_t)n);
    return mix64(h ^ w ^ ((uint64_t)n << 59));
}

static inline uint64_t key_hash(const char *p, Py_ssize_t n) {
    return BM_LIKELY(n == 8) ? mix64(load64(p)) : hash_long(p, n);
}

static inline uint64_t slot_hash(const BlockMap *m, const Slot *s) {
    return BM_UNLIKELY(s->h.next & BM_LONG) ? m->lk[s->key].hash : mix64(s->key);
}

/* Two's complement view of the low 32 bits, without implementation-defined conversions. */
static inline int32_t wrap32(uint32_t v) {
    return v <= (uint32_t)INT32_MAX ? (int32_t)v : (int32_t)(-(int64_t)(UINT32_MAX - v) - 1);
}

/* ======================================================================================= */
/* Table primitives                                                                        */
/* ======================================================================================= */

/* Ask for transparent huge pages on a big table before it is first touched: lookups land on
 * random slots, and with 4 KiB pages nearly every block of a walk would also miss the TLB
 * (costly under virtualisation). Only a hint; a no-op where unsupported. */
static void advise_huge(void *p, size_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)1 << 21;
    if (n < 2 * huge) return;
    uintptr_t a = ((uintptr_t)p + huge - 1) & ~(huge - 1);
    uintptr_t b = ((uintptr_t)p + n) & ~(huge - 1);
    if (b > a) (void)madvise((void *)a, (size_t)(b - a), MADV_HUGEPAGE);
#else
    (void)p;
    (void)n;
#endif
}

/* 1 and *pos = the key's slot, or 0 and *pos = the first empty slot of its probe sequence. */
static inline int probe(const BlockMap *m, const char *kp, Py_ssize_t kl, uint64_t h,
                        size_t *pos) {
    size_t mask = m->mask;
    size_t i = (size_t)h & mask;
    const Slot *slots = m->slots;
    if (BM_LIKELY(kl == 8)) {
        uint64_t k = load64(kp);
        for (;;) {
            const Slot *s = &slots[i];
            if (s->h.rep1 == 0) break;
            if (s->key == k && !(s->h.next & BM_LONG)) {
                *pos = i;
                return 1;
            }
            i = (i + 1) & mask;
        }
    } else {
        for (;;) {
            const Slot *s = &slots[i];
            if (s->h.rep1 == 0) break;
            if (s->h.next & BM_LONG) {
                const LongKey *e = &m->lk[s->key];
                if (e->hash == h && PyBytes_GET_SIZE(e->bytes) == kl &&
                    memcmp(PyBytes_AS_STRING(e->bytes), kp, (size_t)kl) == 0) {
                    *pos = i;
                    return 1;
                }
            }
            i = (i + 1) & mask;
        }
    }
    *pos = i;
    return 0;
}

/* A zeroed table of ncap slots aligned to 64 bytes, and its zeroed access array. */
static int table_alloc(size_t ncap, void **raw, Slot **slots, int64_t **acc) {
    if (ncap > ((size_t)-1 - 64) / sizeof(Slot)) {
        PyErr_NoMemory();
        return -1;
    }
    *raw = PyMem_RawCalloc(1, ncap * sizeof(Slot) + 64);
    *acc = (int64_t *)PyMem_RawCalloc(ncap, sizeof(int64_t));
    if (*raw == NULL || *acc == NULL) {
        PyMem_RawFree(*raw);
        PyMem_RawFree(*acc);
        PyErr_NoMemory();
        return -1;
    }
    *slots = (Slot *)(((uintptr_t)*raw + 63) & ~(uintptr_t)63);
    advise_huge(*slots, ncap * sizeof(Slot));
    return 0;
}

static int bm_resize(BlockMap *m, size_t ncap) {
    void *raw;
    Slot *ns;
    int64_t *nacc;
    if (table_alloc(ncap, &raw, &ns, &nacc) < 0) return -1;
    size_t nmask = ncap - 1;
    size_t cap = m->mask + 1;
    for (size_t i = 0; i < cap; i++) {
        const Slot *s = &m->slots[i];
        if (s->h.rep1 == 0) continue;
        size_t j = (size_t)slot_hash(m, s) & nmask;
        while (ns[j].h.rep1 != 0) j = (j + 1) & nmask;
        ns[j] = *s;
        nacc[j] = m->sacc[i];
    }
    PyMem_RawFree(m->slots_raw);
    PyMem_RawFree(m->sacc);
    m->slots_raw = raw;
    m->slots = ns;
    m->sacc = nacc;
    m->mask = nmask;
    m->version++;
    return 0;
}

static inline int bm_reserve_one(BlockMap *m) {
    size_t cap = m->mask + 1;
    if (BM_UNLIKELY((m->nkeys + 1) * 4 > cap * 3)) return bm_resize(m, cap * 2);
    return 0;
}

/* Backward-shift deletion: empty slot i and pull later members of its cluster back. */
static void bm_delete_slot(BlockMap *m, size_t i) {
    size_t mask = m->mask;
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        Slot *s = &m->slots[j];
        if (s->h.rep1 == 0) break;
        size_t home = (size_t)slot_hash(m, s) & mask;
        /* s may move into the hole iff its home is not cyclically inside (i, j]. */
        if (((j - home) & mask) >= ((j - i) & mask)) {
            m->slots[i] = *s;
            m->sacc[i] = m->sacc[j];
            i = j;
        }
    }
    memset(&m->slots[i], 0, sizeof(Slot));
    m->sacc[i] = 0;
}

/* ---- overflow arena ---- */

static int ovf_alloc(BlockMap *m, uint32_t *idx1) {
    if (m->ovf_free != 0) {
        *idx1 = m->ovf_free;
        m->ovf_free = OH(m, *idx1)->next;
    } else {
        if (m->ovf_top == m->ovf_cap) {
            if (m->ovf_cap >= IDX_MASK / 2 + 1) {
                PyErr_SetString(PyExc_MemoryError, "BlockMap overflow arena is full");
                return -1;
            }
            uint32_t ncap = m->ovf_cap ? m->ovf_cap * 2 : OVF_MIN_CAP;
            if (ncap > IDX_MASK) ncap = IDX_MASK;
            Ovf *na = (Ovf *)PyMem_RawRealloc(m->ovf, (size_t)ncap * sizeof(Ovf));
            if (na == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            m->ovf = na;
            m->ovf_cap = ncap;
            advise_huge(na, (size_t)ncap * sizeof(Ovf));
        }
        *idx1 = ++m->ovf_top;
    }
    m->ovf_live++;
    return 0;
}

static inline void ovf_release(BlockMap *m, uint32_t idx1) {
    Hold *x = OH(m, idx1);
    x->rep1 = 0;
    x->next = m->ovf_free;
    m->ovf_free = idx1;
    m->ovf_live--;
}

/* Slide live entries down (keeping their order, hence the locality of chains ingested
 * together), fix every link and give the tail back. Runs when the arena is mostly free. */
static int ovf_compact(BlockMap *m) {
    uint32_t top = m->ovf_top;
    uint32_t *remap = (uint32_t *)PyMem_RawMalloc((size_t)(top ? top : 1) * sizeof(uint32_t));
    if (remap == NULL) return -1; /* keep the sparse arena: still correct */
    uint32_t w = 0;
    for (uint32_t r = 0; r < top; r++) {
        if (m->ovf[r].h.rep1 != 0) {
            if (w != r) m->ovf[w] = m->ovf[r];
            remap[r] = ++w;
        } else {
            remap[r] = 0;
        }
    }
    for (uint32_t r = 0; r < w; r++) {
        uint32_t nx = m->ovf[r].h.next;
        if (nx) m->ovf[r].h.next = remap[nx - 1];
    }
    size_t cap = m->mask + 1;
    for (size_t i = 0; i < cap; i++) {
        Slot *s = &m->slots[i];
        uint32_t nx = s->h.next & IDX_MASK;
        if (s->h.rep1 != 0 && nx) s->h.next = (s->h.next & BM_LONG) | remap[nx - 1];
    }
    PyMem_RawFree(remap);
    m->ovf_top = w;
    m->ovf_free = 0;
    uint32_t ncap = OVF_MIN_CAP;
    while (ncap < w * 2u && ncap < IDX_MASK / 2 + 1) ncap *= 2;
    if (w == 0) {
        PyMem_RawFree(m->ovf);
        m->ovf = NULL;
        m->ovf_cap = 0;
    } else if (ncap < m->ovf_cap) {
        Ovf *na = (Ovf *)PyMem_RawRealloc(m->ovf, (size_t)ncap * sizeof(Ovf));
        if (na != NULL) {
            m->ovf = na;
            m->ovf_cap = ncap;
        }
    }
    m->version++;
    return 0;
}

/* ---- side table of keys that are not 8 bytes ---- */

static int lk_alloc(BlockMap *m, uint64_t h, const char *kp, Py_ssize_t kl, PyObject *keyobj,
                    size_t *out) {
    PyObject *b;
    if (keyobj != NULL && PyBytes_CheckExact(keyobj)) {
        b = Py_NewRef(keyobj);
    } else {
        b = PyBytes_FromStringAndSize(kp, kl);
        if (b == NULL) return -1;
    }
    size_t idx;
    if (m->lk_free != 0) {
        idx = m->lk_free - 1;
        m->lk_free = (size_t)m->lk[idx].hash;
    } else {
        if (m->lk_top == m->lk_cap) {
            size_t ncap = m->lk_cap ? m->lk_cap * 2 : LK_MIN_CAP;
            LongKey *na = (LongKey *)PyMem_RawRealloc(m->lk, ncap * sizeof(LongKey));
            if (na == NULL) {
                Py_DECREF(b);
                PyErr_NoMemory();
                return -1;
            }
            m->lk = na;
            m->lk_cap = ncap;
        }
        idx = m->lk_top++;
    }
    m->lk[idx].hash = h;
    m->lk[idx].bytes = b;
    m->lk_live++;
    m->lk_bytes += (size_t)PyBytes_Type.tp_basicsize + (size_t)kl;
    *out = idx;
    return 0;
}

/* Detach side entry idx; the caller drops the returned reference once the table is sane. */
static PyObject *lk_release(BlockMap *m, size_t idx) {
    PyObject *b = m->lk[idx].bytes;
    m->lk_bytes -= (size_t)PyBytes_Type.tp_basicsize + (size_t)PyBytes_GET_SIZE(b);
    m->lk[idx].bytes = NULL;
    m->lk[idx].hash = (uint64_t)m->lk_free;
    m->lk_free = idx + 1;
    m->lk_live--;
    return b;
}

static int lk_compact(BlockMap *m) {
    size_t top = m->lk_top;
    size_t *remap = (size_t *)PyMem_RawMalloc((top ? top : 1) * sizeof(size_t));
    if (remap == NULL) return -1;
    size_t w = 0;
    for (size_t r = 0; r < top; r++) {
        if (m->lk[r].bytes != NULL) {
            if (w != r) m->lk[w] = m->lk[r];
            remap[r] = w++;
        } else {
            remap[r] = (size_t)-1;
        }
    }
    size_t cap = m->mask + 1;
    for (size_t i = 0; i < cap; i++) {
        Slot *s = &m->slots[i];
        if (s->h.rep1 != 0 && (s->h.next & BM_LONG)) s->key = remap[s->key];
    }
    PyMem_RawFree(remap);
    m->lk_top = w;
    m->lk_free = 0;
    size_t ncap = LK_MIN_CAP;
    while (ncap < w * 2) ncap *= 2;
    if (w == 0) {
        PyMem_RawFree(m->lk);
        m->lk = NULL;
        m->lk_cap = 0;
    } else if (ncap < m->lk_cap) {
        LongKey *na = (LongKey *)PyMem_RawRealloc(m->lk, ncap * sizeof(LongKey));
        if (na != NULL) {
            m->lk = na;
            m->lk_cap = ncap;
        }
    }
    return 0;
}

/* After removals: give memory back when the table or the arenas became sparse. A failure
 * here only keeps the memory, so errors are cleared. */
static void bm_maybe_shrink(BlockMap *m) {
    size_t cap = m->mask + 1;
    if (cap > MIN_CAP && m->nkeys * 8 < cap) {
        size_t ncap = MIN_CAP;
        while (ncap < m->nkeys * 2) ncap *= 2;
        if (ncap < cap && bm_resize(m, ncap) < 0) PyErr_Clear();
        cc_free(m); /* mass removal: most kept candidates are gone; rebuild when asked */
        qc_free(m);
    }
    if (m->ovf_cap >= 1024 && (uint64_t)m->ovf_live * 4 < m->ovf_cap) {
        if (ovf_compact(m) < 0) PyErr_Clear();
    }
    if (m->lk_cap >= 64 && m->lk_live * 4 < m->lk_cap) {
        if (lk_compact(m) < 0) PyErr_Clear();
    }
}

/* Remove the key in slot pos entirely (its inline hold must be its only hold). Returns the
 * side-table reference to drop, or NULL for an inline key. */
static PyObject *bm_drop_slot(BlockMap *m, size_t pos) {
    Slot *s = &m->slots[pos];
    PyObject *b = NULL;
    if (s->h.next & BM_LONG) b = lk_release(m, (size_t)s->key);
    bm_delete_slot(m, pos);
    m->nkeys--;
    m->nholds--;
    m->version++;
    return b;
}

/* Remove the inline hold of slot pos: promote the first overflow hold, or drop the key.
 * Returns 1 if the key went away. *dropped receives a reference to release (or NULL). */
static int bm_remove_inline(BlockMap *m, size_t pos, PyObject **dropped) {
    Slot *s = &m->slots[pos];
    uint32_t nx = s->h.next & IDX_MASK;
    *dropped = NULL;
    if (nx) {
        uint32_t flag = s->h.next & BM_LONG;
        s->h = m->ovf[nx - 1].h;
        s->h.next |= flag;
        m->sacc[pos] = m->ovf[nx - 1].access;
        ovf_release(m, nx);
        m->nholds--;
        m->version++;
        return 0;
    }
    *dropped = bm_drop_slot(m, pos);
    return 1;
}

/* ---- upsert ---- */

static void cc_note(BlockMap *m, const char *kp, Py_ssize_t kl, PyObject *keyobj, uint32_t rep1,
                    int64_t access, int64_t last_seen);

/* Returns NEW_KEY|NEW_HOLD bits, or -1 with an exception set. */
static int bm_upsert(BlockMap *m, const char *kp, Py_ssize_t kl, uint64_t h, PyObject *keyobj,
                     uint32_t rep1, int32_t tokens, int64_t last_seen, int32_t tier) {
    if (bm_reserve_one(m) < 0) return -1;
    size_t pos;
    if (probe(m, kp, kl, h, &pos)) {
        Slot *s = &m->slots[pos];
        Hold *x = &s->h;
        uint32_t at = 0; /* 0: inline, else arena index + 1 */
        for (;;) {
            if (x->rep1 == rep1) {
                x->tokens = tokens;
                x->last_seen = last_seen;
                x->tier = tier;
                if (BM_UNLIKELY(m->cc != NULL))
                    cc_note(m, kp, kl, keyobj, rep1,
                            at ? m->ovf[at - 1].access : m->sacc[pos], last_seen);
                if (BM_UNLIKELY(m->qc != NULL)) qc_note(m, pos);
                return 0;
            }
            uint32_t nx = x->next & IDX_MASK;
            if (!nx) break;
            x = OH(m, nx);
            at = nx;
        }
        uint32_t idx1;
        if (ovf_alloc(m, &idx1) < 0) return -1;
        m->ovf[idx1 - 1].access = 0;
        Hold *y = OH(m, idx1);
        y->last_seen = last_seen;
        y->rep1 = rep1;
        y->tokens = tokens;
        y->tier = tier;
        y->next = s->h.next & IDX_MASK;
        s->h.next = (s->h.next & BM_LONG) | idx1;
        m->nholds++;
        m->version++;
        if (BM_UNLIKELY(m->cc != NULL)) cc_note(m, kp, kl, keyobj, rep1, 0, last_seen);
        if (BM_UNLIKELY(m->qc != NULL)) qc_note(m, pos);
        return NEW_HOLD;
    }
    uint64_t key;
    uint32_t flag = 0;
    if (BM_LIKELY(kl == 8)) {
        key = load64(kp);
    } else {
        size_t idx;
        if (lk_alloc(m, h, kp, kl, keyobj, &idx) < 0) return -1;
        key = (uint64_t)idx;
        flag = BM_LONG;
    }
    Slot *s = &m->slots[pos];
    s->key = key;
    s->h.last_seen = last_seen;
    m->sacc[pos] = 0;
    s->h.rep1 = rep1;
    s->h.tokens = tokens;
    s->h.tier = tier;
    s->h.next = flag;
    m->nkeys++;
    m->nholds++;
    m->version++;
    if (BM_UNLIKELY(m->cc != NULL)) cc_note(m, kp, kl, keyobj, rep1, 0, last_seen);
    if (BM_UNLIKELY(m->qc != NULL)) qc_note(m, pos);
    return NEW_KEY | NEW_HOLD;
}

/* Full scans read slots in order (the hardware prefetcher follows) but jump to each key's
 * overflow holds at random: prefetch the first overflow hold SCAN_AHEAD slots ahead. */
#define SCAN_AHEAD 64
static inline void scan_prefetch(const BlockMap *m, size_t i) {
    /* Wrapping at the end is harmless, and without a bounds branch here GCC 12 keeps the
     * prefetch (with one, it dropped it from every scan loop). */
    const Slot *s = &m->slots[(i + SCAN_AHEAD) & m->mask];
    uint32_t nx = s->h.next & IDX_MASK;
    if (s->h.rep1 != 0 && nx) BM_PREFETCH(OH(m, nx));
}

/* Python bytes of the key in slot s (new reference). */
static PyObject *slot_key(const BlockMap *m, const Slot *s) {
    if (s->h.next & BM_LONG) return Py_NewRef(m->lk[s->key].bytes);
    return PyBytes_FromStringAndSize((const char *)&s->key, 8);
}

/* ======================================================================================= */
/* Argument helpers                                                                        */
/* ======================================================================================= */

/* Every parameter of a BlockMap method is required (parsing: ic_pyargs.h). */
static inline int parse_args(const char *fname, const char *const *names, int n,
                             PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                             PyObject **out) {
    return ic_parse_args(fname, names, n, n, args, nargs, kwnames, out);
}

/* Integer argument in [lo, hi]; OverflowError outside (the store has fixed-width fields). */
static int as_range(PyObject *o, const char *what, long long lo, long long hi, long long *out) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow != 0 || v < lo || v > hi) {
        PyErr_Format(PyExc_OverflowError, "%s=%R is outside %lld..%lld", what, o, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

/* Any int, clamped to the long long range (counts such as k or blocks). */
static int as_clamped(PyObject *o, long long *out) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = overflow > 0 ? LLONG_MAX : overflow < 0 ? LLONG_MIN : v;
    return 0;
}

/* A replica that may be outside the stored range (then it holds nothing): 1 with *out, 0 when
 * outside, -1 with an exception set when o is not an int. */
static int as_held_rep1(PyObject *o, uint32_t *out) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow != 0 || v < 0 || v > (long long)REP_MAX) return 0;
    *out = (uint32_t)v + 1;
    return 1;
}

static int as_rep1(PyObject *o, uint32_t *out) {
    long long v;
    if (as_range(o, "replica", 0, (long long)REP_MAX, &v) < 0) return -1;
    *out = (uint32_t)v + 1;
    return 0;
}

static int as_i32(PyObject *o, const char *what, int32_t *out) {
    long long v;
    if (as_range(o, what, INT32_MIN, INT32_MAX, &v) < 0) return -1;
    *out = (int32_t)v;
    return 0;
}

static int as_i64(PyObject *o, const char *what, int64_t *out) {
    long long v;
    if (as_range(o, what, INT64_MIN, INT64_MAX, &v) < 0) return -1;
    *out = (int64_t)v;
    return 0;
}

static int key_view(PyObject *o, const char **p, Py_ssize_t *n) {
    if (BM_LIKELY(PyBytes_Check(o))) {
        *p = PyBytes_AS_STRING(o);
        *n = PyBytes_GET_SIZE(o);
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "a key must be bytes, not %.100s", Py_TYPE(o)->tp_name);
    return -1;
}

/* A chain of keys: list/tuple (or any sequence) of bytes, or one packed bytes-like object of
 * concatenated 8-byte keys. */
typedef struct {
    const char *packed;
    PyObject *const *items;
    Py_ssize_t n;
    ic_input in; /* the sequence or the buffer (ic_pyargs.h); release with ic_input_release */
} Keys;

/* The items of a sequence argument, held by in: a list or tuple as it is, anything else
 * through PySequence_Fast (error message msg). */
static int input_items(ic_input *in, PyObject *obj, const char *msg, PyObject *const **items,
                       Py_ssize_t *n) {
    in->seq = PySequence_Fast(obj, msg);
    if (in->seq == NULL) return -1;
    *items = PySequence_Fast_ITEMS(in->seq);
    *n = PySequence_Fast_GET_SIZE(in->seq);
    return 0;
}

static int keys_open(PyObject *obj, Keys *k) {
    memset(k, 0, sizeof(*k));
    if (PyBytes_Check(obj)) {
        k->packed = PyBytes_AS_STRING(obj);
        k->n = PyBytes_GET_SIZE(obj);
    } else if (PyObject_CheckBuffer(obj)) {
        if (ic_input_view(&k->in, obj, PyBUF_SIMPLE) < 0) return -1;
        k->packed = (const char *)k->in.view.buf;
        k->n = k->in.view.len;
    } else {
        return input_items(&k->in, obj, "keys must be a sequence of bytes or packed 8-byte keys",
                           &k->items, &k->n);
    }
    k->n /= 8; /* a trailing partial key is ignored, as by the pure-Python twin */
    return 0;
}

static inline int keys_get(const Keys *k, Py_ssize_t i, const char **p, Py_ssize_t *n) {
    if (k->packed != NULL) {
        *p = k->packed + 8 * i;
        *n = 8;
        return 0;
    }
    return key_view(k->items[i], p, n);
}

/* ======================================================================================= */
/* Result construction                                                                     */
/* ======================================================================================= */

/* An instance of a NamedTuple class built from `items` (references stolen, all non-NULL).
 * NamedTuple classes are plain tuple subclasses with no extra fields, so they can be
 * allocated and filled like tuples (what CPython's tuple_subtype_new does); otherwise call
 * the class. */
static PyObject *make_hold(const BlockMap *m, const Slot *s, const Hold *x, int64_t access) {
    PyObject *it[6];
    it[0] = slot_key(m, s);
    it[1] = PyLong_FromUnsignedLong((unsigned long)(x->rep1 - 1));
    it[2] = PyLong_FromLong((long)x->tokens);
    it[3] = PyLong_FromLongLong((long long)x->last_seen);
    it[4] = PyLong_FromLong((long)x->tier);
    it[5] = PyLong_FromLongLong((long long)access);
    return ic_make_named(HoldType, hold_fast, it, 6);
}

/* ======================================================================================= */
/* A small replica -> (a, b) map for per-replica aggregates                                */
/* ======================================================================================= */

typedef struct {
    uint32_t rep1;
    int64_t a;
    int64_t b;
} RMEntry;

typedef struct {
    RMEntry *e;
    size_t cap; /* power of two */
    size_t n;
} RMap;

static int rmap_init(RMap *r) {
    r->cap = 16;
    r->n = 0;
    r->e = (RMEntry *)PyMem_RawCalloc(r->cap, sizeof(RMEntry));
    if (r->e == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void rmap_free(RMap *r) {
    PyMem_RawFree(r->e);
    r->e = NULL;
}

static RMEntry *rmap_get(RMap *r, uint32_t rep1) {
    size_t mask = r->cap - 1;
    size_t i = (size_t)mix64(rep1) & mask;
    while (r->e[i].rep1 != 0) {
        if (r->e[i].rep1 == rep1) return &r->e[i];
        i = (i + 1) & mask;
    }
    if ((r->n + 1) * 2 > r->cap) {
        size_t ncap = r->cap * 2;
        RMEntry *ne = (RMEntry *)PyMem_RawCalloc(ncap, sizeof(RMEntry));
        if (ne == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        for (size_t k = 0; k < r->cap; k++) {
            if (r->e[k].rep1 == 0) continue;
            size_t j = (size_t)mix64(r->e[k].rep1) & (ncap - 1);
            while (ne[j].rep1 != 0) j = (j + 1) & (ncap - 1);
            ne[j] = r->e[k];
        }
        PyMem_RawFree(r->e);
        r->e = ne;
        r->cap = ncap;
        mask = ncap - 1;
        i = (size_t)mix64(rep1) & mask;
        while (r->e[i].rep1 != 0) i = (i + 1) & mask;
    }
    r->e[i].rep1 = rep1;
    r->e[i].a = 0;
    r->e[i].b = INT64_MIN;
    r->n++;
    return &r->e[i];
}

/* {replica: a}, or {replica: (a, b)} when pairs; NULL with an exception set. */
static PyObject *rmap_dict(const RMap *r, int pairs) {
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    for (size_t k = 0; k < r->cap; k++) {
        const RMEntry *e = &r->e[k];
        if (e->rep1 == 0) continue;
        PyObject *key = PyLong_FromUnsignedLong((unsigned long)(e->rep1 - 1));
        PyObject *val = pairs ? Py_BuildValue("(LL)", (long long)e->a, (long long)e->b)
                              : PyLong_FromLongLong((long long)e->a);
        if (key == NULL || val == NULL || PyDict_SetItem(d, key, val) < 0) {
            Py_XDECREF(key);
            Py_XDECREF(val);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(key);
        Py_DECREF(val);
    }
    return d;
}

/* ======================================================================================= */
/* BlockMap: lifecycle                                                                     */
/* ======================================================================================= */

/* 0, or -1 with RuntimeError while another call runs (see the module doc). */
static int bm_check_idle(const BlockMap *m) {
    if (BM_UNLIKELY(m->busy)) {
        PyErr_SetString(PyExc_RuntimeError, "BlockMap called re-entrantly during another call");
        return -1;
    }
    return 0;
}

static int bm_enter(BlockMap *m) {
    if (bm_check_idle(m) < 0) return -1;
    m->busy = 1;
    return 0;
}

static PyObject *BM_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if ((args != NULL && PyTuple_GET_SIZE(args) != 0) || (kwds != NULL && PyDict_Size(kwds))) {
        PyErr_SetString(PyExc_TypeError, "BlockMap() takes no arguments");
        return NULL;
    }
    BlockMap *m = (BlockMap *)type->tp_alloc(type, 0);
    if (m == NULL) return NULL;
    if (table_alloc(MIN_CAP, &m->slots_raw, &m->slots, &m->sacc) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    m->mask = MIN_CAP - 1;
    m->cc_min = CC_MIN;
    m->cc_factor = CC_FACTOR;
    return (PyObject *)m;
}

static void bm_clear_all(BlockMap *m) {
    cc_free(m);
    qc_free(m);
    for (size_t i = 0; i < m->lk_top; i++) Py_CLEAR(m->lk[i].bytes);
    PyMem_RawFree(m->lk);
    PyMem_RawFree(m->ovf);
    PyMem_RawFree(m->slots_raw);
    PyMem_RawFree(m->sacc);
    m->lk = NULL;
    m->ovf = NULL;
    m->slots_raw = NULL;
    m->slots = NULL;
    m->sacc = NULL;
}

static void BM_dealloc(BlockMap *m) {
    bm_clear_all(m);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static size_t cc_bytes(const BlockMap *m);

static size_t bm_memory(const BlockMap *m) {
    return sizeof(BlockMap) + (m->mask + 1) * (sizeof(Slot) + sizeof(int64_t)) + 64 +
           (size_t)m->ovf_cap * sizeof(Ovf) + m->lk_cap * sizeof(LongKey) + m->lk_bytes +
           cc_bytes(m);
}

/* ======================================================================================= */
/* BlockMap: methods                                                                       */
/* ======================================================================================= */

static PyObject *BM_key_count(BlockMap *m, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromSize_t(m->nkeys);
}

static PyObject *BM_hold_count(BlockMap *m, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromSize_t(m->nholds);
}

static PyObject *BM_memory_bytes(BlockMap *m, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromSize_t(bm_memory(m));
}

static PyObject *BM_sizeof(BlockMap *m, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromSize_t(bm_memory(m));
}

/* Tests only: shrink the candidate cache so its threshold paths run on small stores. */
static PyObject *BM_tune_candidates(BlockMap *m, PyObject *args) {
    Py_ssize_t cmin, factor;
    if (!PyArg_ParseTuple(args, "nn:_tune_candidates", &cmin, &factor)) return NULL;
    if (cmin < 1 || factor < 1) {
        PyErr_SetString(PyExc_ValueError, "_tune_candidates: both values must be >= 1");
        return NULL;
    }
    if (bm_check_idle(m) < 0) return NULL;
    m->cc_min = (size_t)cmin;
    m->cc_factor = (size_t)factor;
    cc_free(m);
    qc_free(m);
    Py_RETURN_NONE;
}

static PyObject *BM_capacity(BlockMap *m, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromSize_t(m->mask + 1);
}

static const char *const upsert_names[] = {"key", "replica", "tokens", "last_seen", "tier"};

static PyObject *BM_upsert(BlockMap *m, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    PyObject *a[5];
    if (parse_args("upsert", upsert_names, 5, args, nargs, kwnames, a) < 0) return NULL;
    const char *kp;
    Py_ssize_t kl;
    uint32_t rep1;
    int32_t tokens, tier;
    int64_t last_seen;
    if (key_view(a[0], &kp, &kl) < 0 || as_rep1(a[1], &rep1) < 0 ||
        as_i32(a[2], "tokens", &tokens) < 0 || as_i64(a[3], "last_seen", &last_seen) < 0 ||
        as_i32(a[4], "tier", &tier) < 0)
        return NULL;
    if (bm_enter(m) < 0) return NULL;
    int r = bm_upsert(m, kp, kl, key_hash(kp, kl), a[0], rep1, tokens, last_seen, tier);
    m->busy = 0;
    if (r < 0) return NULL;
    return PyLong_FromLong(r);
}

static const char *const upsert_many_names[] = {"keys", "tokens", "replica", "last_seen", "tier"};

static PyObject *BM_upsert_many(BlockMap *m, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames) {
    PyObject *a[5];
    if (parse_args("upsert_many", upsert_many_names, 5, args, nargs, kwnames, a) < 0)
        return NULL;
    uint32_t rep1;
    int32_t tier;
    int64_t last_seen;
    if (as_rep1(a[2], &rep1) < 0 || as_i64(a[3], "last_seen", &last_seen) < 0 ||
        as_i32(a[4], "tier", &tier) < 0)
        return NULL;
    /* tokens first: turning a non-list into a list may run Python code, which must not see
     * (and change) the keys list after its storage was taken. */
    PyObject *tseq = PySequence_Fast(a[1], "tokens must be a sequence of int");
    if (tseq == NULL) return NULL;
    Keys ks;
    if (keys_open(a[0], &ks) < 0) {
        Py_DECREF(tseq);
        return NULL;
    }
    int32_t *tok = NULL;
    PyObject *result = NULL;
    /* Pairs up to the shorter sequence (zip), as the pure-Python twin does. */
    Py_ssize_t n = ks.n < PySequence_Fast_GET_SIZE(tseq) ? ks.n : PySequence_Fast_GET_SIZE(tseq);
    ks.n = n;
    /* Validate everything first so a bad element leaves the map untouched. */
    tok = (int32_t *)PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(int32_t));
    if (tok == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(tseq, i);
        if (!PyLong_Check(t)) { /* ints only: no __index__ code may run half-way */
            PyErr_Format(PyExc_TypeError, "tokens[%zd] must be int, not %.100s", i,
                         Py_TYPE(t)->tp_name);
            goto done;
        }
        if (as_i32(t, "tokens", &tok[i]) < 0) goto done;
        if (ks.packed == NULL && !PyBytes_Check(ks.items[i])) {
            const char *kp;
            Py_ssize_t kl;
            key_view(ks.items[i], &kp, &kl);
            goto done;
        }
    }
    if (bm_enter(m) < 0) goto done;
    {
        Py_ssize_t new_keys = 0, new_holds = 0;
        uint64_t hring[RING];
        Py_ssize_t a_next = 0;
        int failed = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t alim = i + PF_A < n ? i + PF_A : n - 1;
            for (; a_next <= alim; a_next++) {
                const char *kp = NULL;
                Py_ssize_t kl = 0;
                keys_get(&ks, a_next, &kp, &kl); /* validated above: cannot fail */
                uint64_t h = key_hash(kp, kl);
                hring[a_next & (RING - 1)] = h;
                BM_PREFETCH(&m->slots[(size_t)h & m->mask]);
            }
            const char *kp = NULL;
            Py_ssize_t kl = 0;
            keys_get(&ks, i, &kp, &kl);
            int r = bm_upsert(m, kp, kl, hring[i & (RING - 1)],
                              ks.packed ? NULL : ks.items[i], rep1, tok[i], last_seen, tier);
            if (BM_UNLIKELY(r < 0)) {
                failed = 1;
                break;
            }
            new_keys += (r & NEW_KEY) != 0;
            new_holds += (r & NEW_HOLD) != 0;
        }
        m->busy = 0;
        if (!failed) result = Py_BuildValue("(nn)", new_keys, new_holds);
    }
done:
    PyMem_RawFree(tok);
    Py_XDECREF(tseq);
    ic_input_release(&ks.in);
    return result;
}

static const char *const holders_names[] = {"key", "fresh_after"};

static PyObject *BM_holders(BlockMap *m, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames) {
    PyObject *a[2];
    if (parse_args("holders", holders_names, 2, args, nargs, kwnames, a) < 0) return NULL;
    const char *kp;
    Py_ssize_t kl;
    int64_t fresh;
    if (key_view(a[0], &kp, &kl) < 0 || as_i64(a[1], "fresh_after", &fresh) < 0) return NULL;
    if (bm_enter(m) < 0) return NULL;
    PyObject *out = PyList_New(0);
    size_t pos;
    if (out != NULL && probe(m, kp, kl, key_hash(kp, kl), &pos)) {
        /* Copy first: building the tuples allocates. */
        Hold found[16];
        Hold *buf = found;
        size_t nf = 0, capf = 16;
        const Hold *x = &m->slots[pos].h;
        for (;;) {
            if (x->last_seen > fresh) {
                if (nf == capf) {
                    Hold *nb = (Hold *)PyMem_RawMalloc(capf * 2 * sizeof(Hold));
                    if (nb == NULL) {
                        PyErr_NoMemory();
                        Py_CLEAR(out);
                        break;
                    }
                    memcpy(nb, buf, nf * sizeof(Hold));
                    if (buf != found) PyMem_RawFree(buf);
                    buf = nb;
                    capf *= 2;
                }
                buf[nf++] = *x;
            }
            uint32_t nx = x->next & IDX_MASK;
            if (!nx) break;
            x = OH(m, nx);
        }
        for (size_t i = 0; out != NULL && i < nf; i++) {
            PyObject *t = Py_BuildValue("(kiLi)", (unsigned long)(buf[i].rep1 - 1),
                                        (int)buf[i].tokens, (long long)buf[i].last_seen,
                                        (int)buf[i].tier);
            if (t == NULL || PyList_Append(out, t) < 0) Py_CLEAR(out);
            Py_XDECREF(t);
        }
        if (buf != found) PyMem_RawFree(buf);
    }
    m->busy = 0;
    return out;
}

/* ---- walk ---- */

typedef struct {
    uint32_t rep1;
    uint32_t tokens; /* wrapped sum of the request's counts over the run */
    int64_t oldest;
    int32_t tier;
    int32_t pad;
    Py_ssize_t stamp; /* last block the run covered */
} RunState;

#define RUNS_LOCAL 16
#define RDIRECT 64 /* direct-mapped replica -> run buckets (low bits of replica + 1) */

/* The runs of one walk, found by replica in O(1): interned replicas are small ints, so their
 * low bits nearly always tell runs apart; a shared bucket falls back to a hash of all runs. */
typedef struct {
    RunState *runs;
    Py_ssize_t nruns;
    int32_t direct[RDIRECT]; /* 0: no run; > 0: run index + 1; -1: shared, see rix */
    int32_t *rix;
    size_t rix_mask;
} RunTable;

static int runs_index(RunTable *t) {
    int shared = 0;
    memset(t->direct, 0, sizeof(t->direct));
    for (Py_ssize_t j = 0; j < t->nruns; j++) {
        int32_t *d = &t->direct[t->runs[j].rep1 & (RDIRECT - 1)];
        if (*d == 0) {
            *d = (int32_t)(j + 1);
        } else {
            *d = -1;
            shared = 1;
        }
    }
    if (!shared) return 0;
    size_t cap = 16;
    while (cap < (size_t)t->nruns * 2) cap *= 2;
    t->rix = (int32_t *)PyMem_RawCalloc(cap, sizeof(int32_t));
    if (t->rix == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->rix_mask = cap - 1;
    for (Py_ssize_t j = 0; j < t->nruns; j++) {
        size_t q = (size_t)mix64(t->runs[j].rep1) & t->rix_mask;
        while (t->rix[q] != 0) q = (q + 1) & t->rix_mask;
        t->rix[q] = (int32_t)(j + 1);
    }
    return 0;
}

static inline RunState *runs_find(const RunTable *t, uint32_t rep1) {
    int32_t d = t->direct[rep1 & (RDIRECT - 1)];
    if (BM_LIKELY(d > 0)) {
        RunState *r = &t->runs[d - 1];
        return r->rep1 == rep1 ? r : NULL;
    }
    if (d == 0) return NULL;
    size_t q = (size_t)mix64(rep1) & t->rix_mask;
    while (t->rix[q] != 0) {
        RunState *r = &t->runs[t->rix[q] - 1];
        if (r->rep1 == rep1) return r;
        q = (q + 1) & t->rix_mask;
    }
    return NULL;
}

/* counts[i] modulo 2**32, inline for compact ints. Only ints (and subclasses) are accepted,
 * so no Python code (__index__) runs while the table is being read. */
static inline int count_value(PyObject *o, Py_ssize_t i, uint32_t *out) {
    if (BM_LIKELY(PyLong_CheckExact(o))) {
#if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
            *out = (uint32_t)PyUnstable_Long_CompactValue((PyLongObject *)o);
            return 0;
        }
#else
        Py_ssize_t size = Py_SIZE(o);
        if (size == 1) {
            *out = (uint32_t)((PyLongObject *)o)->ob_digit[0];
            return 0;
        }
        if (size == 0) {
            *out = 0;
            return 0;
        }
        if (size == -1) {
            *out = (uint32_t)0 - (uint32_t)((PyLongObject *)o)->ob_digit[0];
            return 0;
        }
#endif
    } else if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "counts[%zd] must be int, not %.100s", i,
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLongMask(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint32_t)v;
    return 0;
}

/* A walk's request counts: a list/tuple (or any sequence) of ints, or packed: `bytes` of
 * one-byte counts (the server's wire form of one-byte varints) or an array('i'). */
typedef struct {
    PyObject *const *items; /* object counts (in.seq), else NULL */
    const uint8_t *u8;
    const int32_t *i32;
    Py_ssize_t n;
    ic_input in; /* the sequence or the buffer (ic_pyargs.h); release with ic_input_release */
} Counts;

static int counts_open(PyObject *obj, Counts *c) {
    memset(c, 0, sizeof(*c));
    if (PyBytes_CheckExact(obj)) {
        c->u8 = (const uint8_t *)PyBytes_AS_STRING(obj);
        c->n = PyBytes_GET_SIZE(obj);
        return 0;
    }
    if (PyObject_CheckBuffer(obj) && !PyBytes_Check(obj) && !PyByteArray_Check(obj)) {
        if (ic_input_view(&c->in, obj, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
        const Py_buffer *v = &c->in.view;
        if (v->itemsize == 4 && sizeof(int) == 4 && v->format != NULL &&
            strcmp(v->format, "i") == 0) {
            c->i32 = (const int32_t *)v->buf;
            c->n = v->len / 4;
            return 0;
        }
        ic_input_release(&c->in);
    }
    return input_items(&c->in, obj, "counts must be a sequence of int", &c->items, &c->n);
}

/* Stage A of the pipeline for block j: hash, remember, prefetch the home slot's lines. */
static inline int walk_stage_a(const BlockMap *m, const Keys *ks, Py_ssize_t j, const int packed,
                               uint64_t *hash, const char **kp, Py_ssize_t *kl) {
    int r = (int)(j & (RING - 1));
    const char *p;
    Py_ssize_t l;
    if (packed) {
        p = ks->packed + 8 * j;
        l = 8;
    } else if (BM_UNLIKELY(key_view(ks->items[j], &p, &l) < 0)) {
        return -1;
    }
    uint64_t h = packed ? mix64(load64(p)) : key_hash(p, l);
    hash[r] = h;
    kp[r] = p;
    kl[r] = l;
    BM_PREFETCH(&m->slots[(size_t)h & m->mask]); /* one line: slots are 64-byte aligned */
    return 0;
}

/* Stage B for block j: probe (its lines should be arriving) and prefetch its first overflow
 * hold, so the dependent miss of a second holder overlaps too. */
static inline void walk_stage_b(const BlockMap *m, Py_ssize_t j, const int packed,
                                const uint64_t *hash, const char *const *kp,
                                const Py_ssize_t *kl, Slot **slot) {
    int r = (int)(j & (RING - 1));
    size_t pos;
    Slot *s = NULL;
    if (probe(m, kp[r], packed ? 8 : kl[r], hash[r], &pos)) {
        s = &m->slots[pos];
        uint32_t nx = s->h.next & IDX_MASK;
        if (nx) BM_PREFETCH(OH(m, nx));
    }
    slot[r] = s;
}

/* The walk proper over ks->n blocks. Fills t->runs (seeded by block 0's fresh holders) with
 * their final state; returns -1 with an exception set on bad input. Specialised by `packed`
 * (constant at each call site) so the packed form has no per-block type checks. */
static inline int walk_core(const BlockMap *m, const Keys *ks, const Counts *cs,
                            int64_t fresh, const int packed, RunTable *t, RunState *local) {
    PyObject *const *citems = cs->items;
    Py_ssize_t n = ks->n;
    uint64_t hash[RING];
    const char *kp[RING];
    Py_ssize_t kl[RING];
    Slot *slot[RING];
    Py_ssize_t a = 0, b;
    Py_ssize_t a_end = n < PF_A ? n : PF_A;
    for (; a < a_end; a++)
        if (walk_stage_a(m, ks, a, packed, hash, kp, kl) < 0) return -1;
    /* Block 0 alone: a first-block miss costs one probe. */
    walk_stage_b(m, 0, packed, hash, kp, kl, slot);
    Slot *s = slot[0];
    if (s == NULL) return 0;
    const Hold *x = &s->h;
    Py_ssize_t holders = 1;
    for (uint32_t nx = x->next & IDX_MASK; nx; nx = OH(m, nx)->next) holders++;
    if (holders > RUNS_LOCAL) {
        t->runs = (RunState *)PyMem_RawMalloc((size_t)holders * sizeof(RunState));
        if (t->runs == NULL) {
            t->runs = local;
            PyErr_NoMemory();
            return -1;
        }
    }
    PyObject *last_obj = NULL;
    uint32_t last_c;
    if (citems != NULL) {
        last_obj = citems[0];
        if (count_value(last_obj, 0, &last_c) < 0) return -1;
    } else {
        last_c = cs->u8 != NULL ? cs->u8[0] : (uint32_t)cs->i32[0];
    }
    for (;;) {
        if (x->last_seen > fresh) {
            RunState *r = &t->runs[t->nruns++];
            r->rep1 = x->rep1;
            r->tokens = last_c;
            r->oldest = x->last_seen;
            r->tier = x->tier;
            r->stamp = 0;
        }
        uint32_t nx = x->next & IDX_MASK;
        if (!nx) break;
        x = OH(m, nx);
    }
    if (t->nruns == 0 || n == 1) return 0;
    if (runs_index(t) < 0) return -1;
    Py_ssize_t b_end = n < 1 + PF_B ? n : 1 + PF_B;
    for (b = 1; b < b_end; b++) walk_stage_b(m, b, packed, hash, kp, kl, slot);
    Py_ssize_t alive = t->nruns;
    RunState *only = alive == 1 ? &t->runs[0] : NULL; /* the run, while only one is alive */
    for (Py_ssize_t i = 1; i < n; i++) {
        if (a < n) {
            if (walk_stage_a(m, ks, a, packed, hash, kp, kl) < 0) return -1;
            a++;
        }
        if (b < n) {
            walk_stage_b(m, b, packed, hash, kp, kl, slot);
            b++;
        }
        s = slot[i & (RING - 1)];
        if (s == NULL) break;
        if (citems == NULL) {
            last_c = cs->u8 != NULL ? cs->u8[i] : (uint32_t)cs->i32[i];
        } else if (citems[i] != last_obj) { /* counts are mostly one repeated int object */
            last_obj = citems[i];
            if (count_value(last_obj, i, &last_c) < 0) return -1;
        }
        uint32_t c = last_c;
        x = &s->h;
        if (only != NULL) {
            /* One run alive (the common case): look for its replica only. */
            uint32_t want = only->rep1;
            for (;;) {
                if (x->rep1 == want) break;
                uint32_t nx = x->next & IDX_MASK;
                if (!nx) {
                    x = NULL;
                    break;
                }
                x = OH(m, nx);
            }
            if (x == NULL || x->last_seen <= fresh) break;
            only->stamp = i;
            only->tokens += c;
            if (x->last_seen < only->oldest) only->oldest = x->last_seen;
            if (x->tier > only->tier) only->tier = x->tier;
            continue;
        }
        Py_ssize_t cont = 0;
        RunState *last = NULL;
        for (;;) {
            if (x->last_seen > fresh) {
                RunState *r = runs_find(t, x->rep1);
                if (r != NULL && r->stamp == i - 1) {
                    r->stamp = i;
                    r->tokens += c;
                    if (x->last_seen < r->oldest) r->oldest = x->last_seen;
                    if (x->tier > r->tier) r->tier = x->tier;
                    last = r;
                    if (++cont == alive) break; /* every live run continued */
                }
            }
            uint32_t nx = x->next & IDX_MASK;
            if (!nx) break;
            x = OH(m, nx);
        }
        if (cont == 0) break;
        alive = cont;
        if (alive == 1) only = last;
    }
    return 0;
}

/* The walk of walk() and walk_ranked(): fills t with the final runs. Keys and counts are
 * opened and closed here, and the map is busy only inside. */
static int walk_collect(BlockMap *m, PyObject *keys, PyObject *counts, PyObject *fresh_obj,
                        RunTable *t, RunState *local) {
    t->runs = local;
    t->nruns = 0;
    t->rix = NULL;
    t->rix_mask = 0;
    int64_t fresh;
    if (as_i64(fresh_obj, "fresh_after", &fresh) < 0) return -1;
    Counts cs; /* counts first (see upsert_many) */
    if (counts_open(counts, &cs) < 0) return -1;
    Keys ks;
    if (keys_open(keys, &ks) < 0) {
        ic_input_release(&cs.in);
        return -1;
    }
    int rc = -1;
    /* Walks up to the shorter of keys and counts, as the pure-Python twin does. */
    if (cs.n < ks.n) ks.n = cs.n;
    if (bm_enter(m) == 0) {
        rc = 0;
        if (ks.n > 0)
            rc = ks.packed != NULL ? walk_core(m, &ks, &cs, fresh, 1, t, local)
                                   : walk_core(m, &ks, &cs, fresh, 0, t, local);
        m->busy = 0;
    }
    ic_input_release(&ks.in);
    ic_input_release(&cs.in);
    return rc;
}

static void walk_release(RunTable *t, RunState *local) {
    if (t->runs != local) PyMem_RawFree(t->runs);
    PyMem_RawFree(t->rix);
}

static PyObject *runs_list(const RunTable *t) {
    PyObject *out = PyList_New(t->nruns);
    if (out == NULL) return NULL;
    for (Py_ssize_t j = 0; j < t->nruns; j++) {
        const RunState *r = &t->runs[j];
        PyObject *it[5];
        it[0] = PyLong_FromUnsignedLong((unsigned long)(r->rep1 - 1));
        it[1] = PyLong_FromLong((long)wrap32(r->tokens));
        it[2] = PyLong_FromLongLong((long long)r->oldest);
        it[3] = PyLong_FromLong((long)r->tier);
        it[4] = PyLong_FromSsize_t(r->stamp + 1);
        PyObject *run = ic_make_named(RunType, run_fast, it, 5);
        if (run == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, j, run);
    }
    return out;
}

static const char *const walk_names[] = {"keys", "counts", "fresh_after"};

static PyObject *BM_walk(BlockMap *m, PyObject *const *args, Py_ssize_t nargs,
                         PyObject *kwnames) {
    PyObject *a[3];
    if (parse_args("walk", walk_names, 3, args, nargs, kwnames, a) < 0) return NULL;
    RunState local[RUNS_LOCAL];
    RunTable t;
    PyObject *out = NULL;
    if (walk_collect(m, a[0], a[1], a[2], &t, local) == 0) out = runs_list(&t);
    walk_release(&t, local);
    return out;
}

/* The ranker's C entry point (inferencecache.index._rank, see _rank.h), imported on first
 * use; NULL when that module is not available (walk_ranked then calls ranker.rank). */
static const RankCAPI *rank_capi = NULL;
static int rank_capi_tried = 0;

static const char *const walk_ranked_names[] = {"keys", "counts", "fresh_after", "ranker"};

/* ranker.rank(self.walk(keys, counts, fresh_after), True) for a ranker bound to one lookup
 * (ranking.PyBoundRanker, _rank.BoundRanker), without creating the Run objects when it is the
 * compiled one. */
static PyObject *BM_walk_ranked(BlockMap *m, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames) {
    PyObject *a[4];
    if (parse_args("walk_ranked", walk_ranked_names, 4, args, nargs, kwnames, a) < 0)
        return NULL;
    PyObject *ranker = a[3];
    if (!rank_capi_tried) {
        rank_capi_tried = 1;
        rank_capi = (const RankCAPI *)PyCapsule_Import(RANK_CAPI_NAME, 0);
        if (rank_capi == NULL || rank_capi->abi != RANK_CAPI_ABI) {
            rank_capi = NULL;
            PyErr_Clear();
        }
    }
    RunState local[RUNS_LOCAL];
    RunTable t;
    PyObject *out = NULL;
    if (walk_collect(m, a[0], a[1], a[2], &t, local) < 0) goto done;
    if (rank_capi != NULL && Py_IS_TYPE(ranker, rank_capi->bound_type)) {
        RankRun rlocal[RUNS_LOCAL];
        RankRun *rr = t.nruns <= RUNS_LOCAL
                          ? rlocal
                          : (RankRun *)PyMem_RawMalloc((size_t)t.nruns * sizeof(RankRun));
        if (rr == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t j = 0; j < t.nruns; j++) {
            const RunState *r = &t.runs[j];
            rr[j].replica = (int64_t)r->rep1 - 1;
            rr[j].tokens = wrap32(r->tokens);
            rr[j].oldest = r->oldest;
            rr[j].tier = r->tier;
            rr[j].blocks = (int64_t)r->stamp + 1;
        }
        out = rank_capi->rank_runs(ranker, rr, t.nruns);
        if (rr != rlocal) PyMem_RawFree(rr);
    } else {
        PyObject *runs = runs_list(&t);
        if (runs == NULL) goto done;
        PyObject *call[3] = {ranker, runs, Py_True};
        PyObject *name = PyUnicode_InternFromString("rank");
        if (name != NULL) out = PyObject_VectorcallMethod(name, call, 3, NULL);
        Py_XDECREF(name);
        Py_DECREF(runs);
    }
done:
    walk_release(&t, local);
    return out;
}

static const char *const credit_names[] = {"keys", "blocks", "replica"};

static PyObject *BM_credit(BlockMap *m, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    PyObject *a[3];
    if (parse_args("credit", credit_names, 3, args, nargs, kwnames, a) < 0) return NULL;
    long long blocks;
    if (as_clamped(a[1], &blocks) < 0) return NULL;
    uint32_t rep1;
    int held = as_held_rep1(a[2], &rep1);
    if (held < 0) return NULL;
    if (!held) Py_RETURN_NONE; /* nothing to credit */
    Keys ks;
    if (keys_open(a[0], &ks) < 0) return NULL;
    PyObject *result = NULL;
    if (bm_enter(m) < 0) goto done;
    {
        Py_ssize_t n = blocks < (long long)ks.n ? (Py_ssize_t)(blocks < 0 ? 0 : blocks) : ks.n;
        uint64_t hash[RING];
        const char *kp[RING];
        Py_ssize_t kl[RING];
        Py_ssize_t ahead = 0;
        int failed = 0;
        for (Py_ssize_t i = 0; i < n && !failed; i++) {
            Py_ssize_t alim = i + PF_A < n ? i + PF_A : n;
            for (; ahead < alim; ahead++) {
                if (walk_stage_a(m, &ks, ahead, ks.packed != NULL, hash, kp, kl) < 0) {
                    failed = 1;
                    break;
                }
            }
            if (failed) break;
            int r = (int)(i & (RING - 1));
            size_t pos;
            if (!probe(m, kp[r], kl[r], hash[r], &pos)) continue;
            Slot *s = &m->slots[pos];
            int64_t *acc = NULL;
            if (s->h.rep1 == rep1) {
                acc = &m->sacc[pos];
            } else {
                for (uint32_t nx = s->h.next & IDX_MASK; nx; nx = OH(m, nx)->next) {
                    if (OH(m, nx)->rep1 == rep1) {
                        acc = &m->ovf[nx - 1].access;
                        break;
                    }
                }
            }
            if (acc != NULL && *acc < ACCESS_MAX) (*acc)++;
        }
        m->busy = 0;
        if (!failed) result = Py_NewRef(Py_None);
    }
done:
    ic_input_release(&ks.in);
    return result;
}

/* Remove the hold of rep1 on one key; returns HOLD_REMOVED|KEY_REMOVED bits (0 if absent).
 * *dropped receives a reference to release once the map is no longer busy (or NULL). The
 * caller shrinks the map afterwards (bm_maybe_shrink) when anything was removed. */
static int bm_remove_one(BlockMap *m, const char *kp, Py_ssize_t kl, uint32_t rep1,
                         PyObject **dropped) {
    size_t pos;
    int bits = 0;
    *dropped = NULL;
    if (probe(m, kp, kl, key_hash(kp, kl), &pos)) {
        Slot *s = &m->slots[pos];
        if (s->h.rep1 == rep1) {
            bits = HOLD_REMOVED | (bm_remove_inline(m, pos, dropped) ? KEY_REMOVED : 0);
            if (m->qc != NULL && !(bits & KEY_REMOVED)) qc_note(m, pos);
        } else {
            Hold *prev = &s->h;
            uint32_t nx = prev->next & IDX_MASK;
            while (nx) {
                Hold *x = OH(m, nx);
                if (x->rep1 == rep1) {
                    prev->next = (prev->next & BM_LONG) | x->next;
                    ovf_release(m, nx);
                    m->nholds--;
                    m->version++;
                    bits = HOLD_REMOVED;
                    if (m->qc != NULL) qc_note(m, pos);
                    break;
                }
                prev = x;
                nx = x->next;
            }
        }
    }
    return bits;
}

static const char *const remove_hold_names[] = {"key", "replica"};

static PyObject *BM_remove_hold(BlockMap *m, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames) {
    PyObject *a[2];
    if (parse_args("remove_hold", remove_hold_names, 2, args, nargs, kwnames, a) < 0)
        return NULL;
    const char *kp;
    Py_ssize_t kl;
    if (key_view(a[0], &kp, &kl) < 0) return NULL;
    uint32_t rep1;
    int held = as_held_rep1(a[1], &rep1);
    if (held < 0) return NULL;
    if (!held) return PyLong_FromLong(0);
    if (bm_enter(m) < 0) return NULL;
    PyObject *dropped = NULL;
    int bits = bm_remove_one(m, kp, kl, rep1, &dropped);
    if (bits) bm_maybe_shrink(m);
    m->busy = 0;
    Py_XDECREF(dropped);
    return PyLong_FromLong(bits);
}

static const char *const remove_holds_names[] = {"keys", "replica"};

/* remove_hold for each key in order (a batched PREFIX_EVICTED); keys as a sequence of bytes or
 * one packed bytes of 8-byte keys. Returns (holds removed, keys removed). */
static PyObject *BM_remove_holds(BlockMap *m, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames) {
    PyObject *a[2];
    if (parse_args("remove_holds", remove_holds_names, 2, args, nargs, kwnames, a) < 0)
        return NULL;
    uint32_t rep1;
    int held = as_held_rep1(a[1], &rep1);
    if (held < 0) return NULL;
    Keys ks;
    if (keys_open(a[0], &ks) < 0) return NULL;
    PyObject *result = NULL;
    PyObject *dropped_all = NULL; /* references to release once the map is not busy */
    /* Validate everything first so a bad element leaves the map untouched. */
    if (ks.packed == NULL) {
        for (Py_ssize_t i = 0; i < ks.n; i++) {
            const char *kp;
            Py_ssize_t kl;
            if (key_view(ks.items[i], &kp, &kl) < 0) goto done;
        }
    }
    if (!held) { /* no such replica: nothing held */
        result = Py_BuildValue("(nn)", (Py_ssize_t)0, (Py_ssize_t)0);
        goto done;
    }
    dropped_all = PyList_New(0);
    if (dropped_all == NULL) goto done;
    if (bm_enter(m) < 0) goto done;
    {
        Py_ssize_t holds = 0, keys = 0;
        int failed = 0;
        for (Py_ssize_t i = 0; i < ks.n; i++) {
            const char *kp = NULL;
            Py_ssize_t kl = 0;
            keys_get(&ks, i, &kp, &kl); /* validated above: cannot fail */
            PyObject *dropped = NULL;
            int bits = bm_remove_one(m, kp, kl, rep1, &dropped);
            if (dropped != NULL) {
                int rc = PyList_Append(dropped_all, dropped);
                Py_DECREF(dropped); /* the list keeps it alive (or it is a plain bytes) */
                if (rc < 0) failed = 1;
            }
            holds += (bits & HOLD_REMOVED) != 0;
            keys += (bits & KEY_REMOVED) != 0;
        }
        if (holds) bm_maybe_shrink(m);
        m->busy = 0;
        if (!failed) result = Py_BuildValue("(nn)", holds, keys);
    }
done:
    Py_XDECREF(dropped_all);
    ic_input_release(&ks.in);
    return result;
}

static PyObject *BM_remove_key(BlockMap *m, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    static const char *const names[] = {"key"};
    PyObject *a[1];
    if (parse_args("remove_key", names, 1, args, nargs, kwnames, a) < 0) return NULL;
    const char *kp;
    Py_ssize_t kl;
    if (key_view(a[0], &kp, &kl) < 0) return NULL;
    if (bm_enter(m) < 0) return NULL;
    PyObject *out = PyList_New(0);
    size_t pos;
    if (out != NULL && probe(m, kp, kl, key_hash(kp, kl), &pos)) {
        /* Collect the replicas first (allocates), then remove (cannot fail). */
        const Hold *x = &m->slots[pos].h;
        for (;;) {
            PyObject *r = PyLong_FromUnsignedLong((unsigned long)(x->rep1 - 1));
            if (r == NULL || PyList_Append(out, r) < 0) {
                Py_XDECREF(r);
                Py_CLEAR(out);
                break;
            }
            Py_DECREF(r);
            uint32_t nx = x->next & IDX_MASK;
            if (!nx) break;
            x = OH(m, nx);
        }
        if (out != NULL) {
            Slot *s = &m->slots[pos];
            uint32_t nx = s->h.next & IDX_MASK;
            while (nx) {
                uint32_t nn = OH(m, nx)->next;
                ovf_release(m, nx);
                m->nholds--;
                nx = nn;
            }
            s->h.next &= BM_LONG;
            PyObject *dropped = bm_drop_slot(m, pos);
            bm_maybe_shrink(m);
            m->busy = 0;
            Py_XDECREF(dropped);
            return out;
        }
    }
    m->busy = 0;
    return out;
}

/* ---- scans that remove (sweep, remove_replica) ---- */

/* Remove every hold with last_seen <= stale (mode 0) or of replica rep1 (mode 1), then give
 * memory back. Slots are scanned in order; a backward shift only moves holds already looked
 * at, or moves a later hold into the current slot, which is then looked at again. */
static int bm_prune(BlockMap *m, int mode, int64_t stale, uint32_t rep1, RMap *per,
                    size_t *holds_removed, size_t *keys_removed) {
#define DOOMED(x) (mode == 0 ? (x)->last_seen <= stale : (x)->rep1 == rep1)
    size_t cap = m->mask + 1;
    size_t i = 0;
    int rc = 0;
    while (i < cap) {
        Slot *s = &m->slots[i];
        scan_prefetch(m, i);
        if (s->h.rep1 == 0) {
            i++;
            continue;
        }
        Hold *prev = &s->h;
        uint32_t nx = prev->next & IDX_MASK;
        while (nx) {
            Hold *x = OH(m, nx);
            uint32_t nn = x->next;
            if (DOOMED(x)) {
                if (per != NULL) {
                    RMEntry *e = rmap_get(per, x->rep1);
                    if (e == NULL) {
                        rc = -1;
                        goto out;
                    }
                    e->a++;
                }
                prev->next = (prev->next & BM_LONG) | nn;
                ovf_release(m, nx);
                m->nholds--;
                m->version++;
                (*holds_removed)++;
            } else {
                prev = x;
            }
            nx = nn;
        }
        if (DOOMED(&s->h)) {
            if (per != NULL) {
                RMEntry *e = rmap_get(per, s->h.rep1);
                if (e == NULL) {
                    rc = -1;
                    goto out;
                }
                e->a++;
            }
            (*holds_removed)++;
            PyObject *dropped;
            if (bm_remove_inline(m, i, &dropped)) {
                (*keys_removed)++;
                /* An exact bytes object: its deallocation runs no Python code. */
                Py_XDECREF(dropped);
                continue; /* slot i now holds the next cluster member: look again */
            }
            /* The promoted hold survived the chain pass above. */
        }
        i++;
    }
out:
    if (*holds_removed) {
        qc_free(m); /* surviving keys' newest may have dropped below the kept edge */
        bm_maybe_shrink(m);
    }
    return rc;
#undef DOOMED
}

static PyObject *BM_remove_replica(BlockMap *m, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames) {
    static const char *const names[] = {"replica"};
    PyObject *a[1];
    if (parse_args("remove_replica", names, 1, args, nargs, kwnames, a) < 0) return NULL;
    uint32_t rep1;
    int held = as_held_rep1(a[0], &rep1);
    if (held < 0) return NULL;
    if (!held) return Py_BuildValue("(ii)", 0, 0);
    if (bm_enter(m) < 0) return NULL;
    size_t hr = 0, kr = 0;
    int rc = bm_prune(m, 1, 0, rep1, NULL, &hr, &kr);
    m->busy = 0;
    if (rc < 0) return NULL;
    return Py_BuildValue("(nn)", (Py_ssize_t)hr, (Py_ssize_t)kr);
}

static PyObject *BM_sweep(BlockMap *m, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames) {
    static const char *const names[] = {"stale_at_or_before"};
    PyObject *a[1];
    if (parse_args("sweep", names, 1, args, nargs, kwnames, a) < 0) return NULL;
    int64_t stale;
    if (as_i64(a[0], "stale_at_or_before", &stale) < 0) return NULL;
    RMap per;
    if (rmap_init(&per) < 0) return NULL;
    PyObject *result = NULL;
    if (bm_enter(m) < 0) goto done;
    size_t hr = 0, kr = 0;
    int rc = bm_prune(m, 0, stale, 0, &per, &hr, &kr);
    m->busy = 0;
    /* Out of memory half-way: the removals so far stand (the map stays consistent) but the
     * counts would be incomplete, so raise MemoryError. */
    if (rc == 0) {
        PyObject *d = rmap_dict(&per, 0);
        if (d != NULL) result = Py_BuildValue("(Nn)", d, (Py_ssize_t)kr);
    }
done:
    rmap_free(&per);
    return result;
}

/* ---- candidate selection ---- */

typedef struct {
    int64_t a;
    int64_t b;
} Pair;

static inline int pair_lt(Pair x, Pair y) { return x.a < y.a || (x.a == y.a && x.b < y.b); }

/* Max-heap of the k smallest pairs seen so far. */
typedef struct {
    Pair *v;
    size_t n, k;
} TopK;

static inline void topk_push(TopK *t, Pair p) {
    if (t->n < t->k) {
        size_t i = t->n++;
        while (i > 0) {
            size_t up = (i - 1) / 2;
            if (!pair_lt(t->v[up], p)) break;
            t->v[i] = t->v[up];
            i = up;
        }
        t->v[i] = p;
    } else if (pair_lt(p, t->v[0])) {
        size_t i = 0, n = t->n;
        for (;;) {
            size_t c = 2 * i + 1;
            if (c >= n) break;
            if (c + 1 < n && pair_lt(t->v[c], t->v[c + 1])) c++;
            if (!pair_lt(p, t->v[c])) break;
            t->v[i] = t->v[c];
            i = c;
        }
        t->v[i] = p;
    }
}

/* ---- eviction candidates kept between calls (cap_candidates) ----
 *
 * Once the global cap is reached the index asks every partition for its k smallest holds after
 * each ingest; a full scan each time would cost O(holds) per update. So a scan keeps more than
 * was asked: the K = max(16 k, 16384) smallest holds plus ties, T = the largest value kept, as
 * a min-heap of (value, key, replica) recorded at scan time. Invariant: every hold whose
 * current value is <= T has an entry whose recorded value is <= its current value. Values only
 * go up (credit, refresh to a later time) except when an upsert writes a value <= T (a new
 * hold, or a refresh to an earlier time), and then cc_note pushes an entry for it. A call pops
 * entries in recorded order and checks each against the table: gone -> dropped; value changed
 * -> pushed again with its current value if that is still <= T; unchanged -> a candidate. So
 * holds come out in true current order, and after the k-th (value V <= T) every hold tied
 * with V comes out too. Candidates are pushed back (the index may not evict them all). If the
 * heap runs dry first, or the lfu flag changes, or upserts push more than 4 K entries, the
 * cache is dropped and rebuilt by a full scan.
 */

typedef struct {
    int64_t a; /* recorded effective count */
    int64_t b; /* recorded last_seen */
    uint64_t key;   /* the 8-byte key */
    PyObject *lkey; /* exact bytes of a key of another length (owned), NULL for 8-byte keys */
    uint32_t rep1;
} Cand;

struct CandCache {
    Cand *v; /* min-heap by (a, b) */
    size_t n, cap, limit;
    Pair thr; /* T */
    int lfu;
    int quota; /* 1: entries are keys valued (newest last_seen, 0); rep1 unused */
};


static inline int cand_lt(const Cand *x, const Cand *y) {
    return x->a < y->a || (x->a == y->a && x->b < y->b);
}

static void cc_sift_up(Cand *v, size_t i) {
    Cand e = v[i];
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (!cand_lt(&e, &v[up])) break;
        v[i] = v[up];
        i = up;
    }
    v[i] = e;
}

static void cc_sift_down(Cand *v, size_t n, size_t i) {
    Cand e = v[i];
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && cand_lt(&v[c + 1], &v[c])) c++;
        if (!cand_lt(&v[c], &e)) break;
        v[i] = v[c];
        i = c;
    }
    v[i] = e;
}

/* Push e: its reference moves into the heap, or is dropped when there is no memory (then -1
 * without an exception set). */
static int cc_push(struct CandCache *c, const Cand *e) {
    if (c->n == c->cap) {
        size_t ncap = c->cap ? c->cap * 2 : 1024;
        Cand *nv = (Cand *)PyMem_RawRealloc(c->v, ncap * sizeof(Cand));
        if (nv == NULL) {
            Py_XDECREF(e->lkey);
            return -1;
        }
        c->v = nv;
        c->cap = ncap;
    }
    c->v[c->n] = *e;
    cc_sift_up(c->v, c->n++);
    return 0;
}

static Cand cc_pop(struct CandCache *c) {
    Cand top = c->v[0];
    c->v[0] = c->v[--c->n];
    if (c->n > 0) cc_sift_down(c->v, c->n, 0);
    return top;
}

static void cache_drop(struct CandCache **pc) {
    struct CandCache *c = *pc;
    if (c == NULL) return;
    *pc = NULL;
    for (size_t i = 0; i < c->n; i++) Py_XDECREF(c->v[i].lkey); /* bytes: no Python code */
    PyMem_RawFree(c->v);
    PyMem_RawFree(c);
}

static void cc_free(BlockMap *m) { cache_drop(&m->cc); }
static void qc_free(BlockMap *m) { cache_drop(&m->qc); }

static size_t cc_bytes(const BlockMap *m) {
    size_t n = 0;
    if (m->cc != NULL) n += sizeof(struct CandCache) + m->cc->cap * sizeof(Cand);
    if (m->qc != NULL) n += sizeof(struct CandCache) + m->qc->cap * sizeof(Cand);
    return n;
}

static inline int64_t slot_newest(const BlockMap *m, const Slot *s) {
    const Hold *x = &s->h;
    int64_t best = x->last_seen;
    uint32_t nx = x->next & IDX_MASK;
    while (nx) {
        x = OH(m, nx);
        if (x->last_seen > best) best = x->last_seen;
        nx = x->next;
    }
    return best;
}

/* e's key: the key of slot s (a new reference for a key of another length). */
static inline void cand_set_key(const BlockMap *m, const Slot *s, Cand *e) {
    if (s->h.next & BM_LONG) {
        e->key = 0;
        e->lkey = Py_NewRef(m->lk[s->key].bytes);
    } else {
        e->key = s->key;
        e->lkey = NULL;
    }
}

/* Whether a value an upsert (or a removal) just wrote needs an entry in the cache *pc to keep
 * the invariant: only a value <= T does. Once upserts have pushed too many entries the cache
 * is dropped instead (the next call rebuilds it). */
static inline int cache_needs(struct CandCache **pc, Pair v) {
    struct CandCache *c = *pc;
    if (pair_lt(c->thr, v)) return 0; /* above T: nothing to keep */
    if (c->n >= c->limit) {
        cache_drop(pc);
        return 0;
    }
    return 1;
}

/* The key in slot pos changed its holds (upsert, or a removal it survived): if its newest
 * last_seen is now <= T, the quota cache needs an entry for it (see cc_note). */
static void qc_note(BlockMap *m, size_t pos) {
    const Slot *s = &m->slots[pos];
    Cand e;
    e.a = slot_newest(m, s);
    e.b = 0;
    if (!cache_needs(&m->qc, (Pair){e.a, e.b})) return;
    e.rep1 = 0;
    cand_set_key(m, s, &e);
    if (cc_push(m->qc, &e) < 0) qc_free(m);
}

/* An upsert wrote (access, last_seen) for rep1's hold of this key: keep the invariant. */
static void cc_note(BlockMap *m, const char *kp, Py_ssize_t kl, PyObject *keyobj, uint32_t rep1,
                    int64_t access, int64_t last_seen) {
    Cand e;
    e.a = m->cc->lfu ? access : 0;
    e.b = last_seen;
    if (!cache_needs(&m->cc, (Pair){e.a, e.b})) return;
    e.rep1 = rep1;
    if (kl == 8) {
        e.key = load64(kp);
        e.lkey = NULL;
    } else {
        e.key = 0;
        e.lkey = (keyobj != NULL && PyBytes_CheckExact(keyobj)) ? Py_NewRef(keyobj)
                                                                 : PyBytes_FromStringAndSize(kp, kl);
        if (e.lkey == NULL) {
            PyErr_Clear();
            cc_free(m);
            return;
        }
    }
    if (cc_push(m->cc, &e) < 0) cc_free(m);
}

/* The current hold (or, for the quota cache, key) of entry e: 1 with its value and identity,
 * 0 if it is gone. */
static int cc_lookup(const BlockMap *m, const Cand *e, const struct CandCache *c, Pair *cur,
                     const void **id) {
    int lfu = c->lfu;
    const char *kp;
    Py_ssize_t kl;
    uint64_t h;
    if (e->lkey != NULL) {
        kp = PyBytes_AS_STRING(e->lkey);
        kl = PyBytes_GET_SIZE(e->lkey);
        h = hash_long(kp, kl);
    } else {
        kp = (const char *)&e->key;
        kl = 8;
        h = mix64(e->key);
    }
    size_t pos;
    if (!probe(m, kp, kl, h, &pos)) return 0;
    const Slot *s = &m->slots[pos];
    if (c->quota) {
        cur->a = slot_newest(m, s);
        cur->b = 0;
        *id = s;
        return 1;
    }
    if (s->h.rep1 == e->rep1) {
        cur->a = lfu ? m->sacc[pos] : 0;
        cur->b = s->h.last_seen;
        *id = &s->h;
        return 1;
    }
    for (uint32_t nx = s->h.next & IDX_MASK; nx; nx = OH(m, nx)->next) {
        if (OH(m, nx)->rep1 == e->rep1) {
            cur->a = lfu ? m->ovf[nx - 1].access : 0;
            cur->b = OH(m, nx)->last_seen;
            *id = OH(m, nx);
            return 1;
        }
    }
    return 0;
}

/* One value p of a full scan: into the top-k heap t, or (t NULL) into cache c as an entry for
 * slot s's key and replica rep1 when p <= T. -1 on no memory (no exception set). */
static inline int scan_take(const BlockMap *m, TopK *t, struct CandCache *c, Pair p,
                            const Slot *s, uint32_t rep1) {
    if (t != NULL) {
        topk_push(t, p);
        return 0;
    }
    if (pair_lt(c->thr, p)) return 0;
    Cand e;
    e.a = p.a;
    e.b = p.b;
    e.rep1 = rep1;
    cand_set_key(m, s, &e);
    return cc_push(c, &e);
}

/* Full scan over every hold's value (lfu ? access : 0, last_seen), through scan_take. Inlined
 * with t constant at each call, so each use compiles to its own loop. */
static inline int scan_holds(const BlockMap *m, int lfu, TopK *t, struct CandCache *c) {
    size_t cap = m->mask + 1;
    for (size_t i = 0; i < cap; i++) {
        const Slot *s = &m->slots[i];
        scan_prefetch(m, i);
        if (s->h.rep1 == 0) continue;
        const Hold *x = &s->h;
        int64_t acc = m->sacc[i];
        for (;;) {
            Pair p = {lfu ? acc : 0, x->last_seen};
            if (scan_take(m, t, c, p, s, x->rep1) < 0) return -1;
            uint32_t nx = x->next & IDX_MASK;
            if (!nx) break;
            x = OH(m, nx);
            acc = m->ovf[nx - 1].access;
        }
    }
    return 0;
}

/* The same over every key's value (newest last_seen, 0), for quota_candidates. */
static inline int scan_keys(const BlockMap *m, TopK *t, struct CandCache *c) {
    size_t cap = m->mask + 1;
    for (size_t i = 0; i < cap; i++) {
        const Slot *s = &m->slots[i];
        scan_prefetch(m, i);
        if (s->h.rep1 == 0) continue;
        if (scan_take(m, t, c, (Pair){slot_newest(m, s), 0}, s, 0) < 0) return -1;
    }
    return 0;
}

/* The k-th smallest value (1 <= k <= values) of the holds, or of the keys when quota, as
 * cap_candidates and quota_candidates value them; -1 with MemoryError. */
static int kth_smallest(const BlockMap *m, size_t k, int lfu, int quota, Pair *kth) {
    TopK t = {NULL, 0, k};
    t.v = (Pair *)PyMem_RawMalloc(k * sizeof(Pair));
    if (t.v == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (quota)
        scan_keys(m, &t, NULL);
    else
        scan_holds(m, lfu, &t, NULL);
    *kth = t.v[0];
    PyMem_RawFree(t.v);
    return 0;
}

/* Full scans: keep the K smallest holds (m->cc), or keys when quota (m->qc), plus ties.
 * K = want = max(16 k, 16384), fewer than the values (else the caller scans directly). */
static int cache_build(BlockMap *m, size_t want, int lfu, int quota) {
    Pair thr;
    if (kth_smallest(m, want, lfu, quota, &thr) < 0) return -1;
    struct CandCache *c = (struct CandCache *)PyMem_RawCalloc(1, sizeof(struct CandCache));
    if (c == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    c->thr = thr;
    c->lfu = lfu;
    c->quota = quota;
    struct CandCache **pc = quota ? &m->qc : &m->cc;
    *pc = c;
    if ((quota ? scan_keys(m, NULL, c) : scan_holds(m, lfu, NULL, c)) < 0) {
        cache_drop(pc);
        PyErr_NoMemory();
        return -1;
    }
    c->limit = 4 * (c->n > m->cc_min ? c->n : m->cc_min);
    return 0;
}

/* A set of hold identities (addresses), open addressing; grows to stay under half full. */
typedef struct {
    const void **v;
    size_t mask, n;
} IdSet;

static inline size_t idset_slot(const void *id, size_t mask) {
    uint64_t q = mix64((uint64_t)(uintptr_t)id);
    return (size_t)q & mask;
}

/* 1 if id was added, 0 if it was there, -1 on no memory. */
static int idset_add(IdSet *t, const void *id) {
    if ((t->n + 1) * 2 > t->mask + 1) {
        size_t nmask = t->mask * 2 + 1;
        const void **nv = (const void **)PyMem_RawCalloc(nmask + 1, sizeof(void *));
        if (nv == NULL) return -1;
        for (size_t i = 0; i <= t->mask; i++) {
            if (t->v[i] == NULL) continue;
            size_t q = idset_slot(t->v[i], nmask);
            while (nv[q] != NULL) q = (q + 1) & nmask;
            nv[q] = t->v[i];
        }
        PyMem_RawFree(t->v);
        t->v = nv;
        t->mask = nmask;
    }
    size_t q = idset_slot(id, t->mask);
    while (t->v[q] != NULL) {
        if (t->v[q] == id) return 0;
        q = (q + 1) & t->mask;
    }
    t->v[q] = id;
    t->n++;
    return 1;
}

/* The k smallest holds plus ties from the cache, appended to `out` as cap_candidates tuples.
 * Returns 1, or 0 when the cache could not answer (it is dropped), or -1 on error. */
static int cc_select(BlockMap *m, struct CandCache **pc, long long k, PyObject *out) {
    struct CandCache *c = *pc;
    size_t kk = (size_t)k;
    Cand *got = NULL;
    size_t ngot = 0, capgot = 0;
    IdSet seen = {NULL, 63, 0}; /* holds already taken (a hold may have several entries) */
    seen.v = (const void **)PyMem_RawCalloc(seen.mask + 1, sizeof(void *));
    if (seen.v == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Pair edge = {0, 0};
    int rc = 1;
    for (;;) {
        if (c->n == 0) break;
        if (ngot >= kk && pair_lt(edge, (Pair){c->v[0].a, c->v[0].b})) break;
        Cand e = cc_pop(c);
        Pair cur;
        const void *id;
        if (!cc_lookup(m, &e, c, &cur, &id)) {
            Py_XDECREF(e.lkey);
            continue;
        }
        if (cur.a != e.a || cur.b != e.b) {
            if (pair_lt(c->thr, cur)) {
                Py_XDECREF(e.lkey); /* above T now: no longer a candidate */
                continue;
            }
            e.a = cur.a;
            e.b = cur.b;
            if (cc_push(c, &e) < 0) {
                rc = -1;
                break;
            }
            continue;
        }
        int added = idset_add(&seen, id);
        if (added <= 0) {
            Py_XDECREF(e.lkey); /* a second entry for the same hold, or no memory */
            if (added < 0) {
                rc = -1;
                break;
            }
            continue;
        }
        if (ngot == capgot) {
            size_t ncap = capgot ? capgot * 2 : 256;
            Cand *ng = (Cand *)PyMem_RawRealloc(got, ncap * sizeof(Cand));
            if (ng == NULL) {
                Py_XDECREF(e.lkey);
                rc = -1;
                break;
            }
            got = ng;
            capgot = ncap;
        }
        got[ngot++] = e;
        if (ngot == kk) edge = cur;
    }
    if (rc == 1 && ngot < kk) rc = 0;
    /* Results first (references of `got` stay owned by it), then give the entries back. */
    for (size_t i = 0; rc == 1 && i < ngot; i++) {
        const Cand *e = &got[i];
        PyObject *key = e->lkey != NULL ? Py_NewRef(e->lkey)
                                        : PyBytes_FromStringAndSize((const char *)&e->key, 8);
        PyObject *tup = key == NULL ? NULL
                        : c->quota  ? Py_BuildValue("(LN)", (long long)e->a, key)
                                    : Py_BuildValue("(LLNk)", (long long)e->a, (long long)e->b,
                                                    key, (unsigned long)(e->rep1 - 1));
        if (tup == NULL || PyList_Append(out, tup) < 0) rc = -1;
        Py_XDECREF(tup);
    }
    for (size_t i = 0; i < ngot; i++) {
        if (*pc == NULL)
            Py_XDECREF(got[i].lkey);
        else if (cc_push(*pc, &got[i]) < 0)
            cache_drop(pc);
    }
    PyMem_RawFree(got);
    PyMem_RawFree(seen.v);
    if (rc == 0) cache_drop(pc);
    if (rc < 0 && !PyErr_Occurred()) PyErr_NoMemory();
    return rc;
}

/* Two scans, no cache: the k smallest values by a max-heap, then every hold at or below the
 * k-th (all holds when k >= holds). For large k, where a cache would hold most of the store. */
static int cap_direct(BlockMap *m, long long k, int lfu, PyObject *out) {
    size_t cap = m->mask + 1;
    Pair thr = {INT64_MAX, INT64_MAX};
    int all = (unsigned long long)k >= (unsigned long long)m->nholds;
    if (!all && kth_smallest(m, (size_t)k, lfu, 0, &thr) < 0) return -1;
    for (size_t i = 0; i < cap; i++) {
        const Slot *s = &m->slots[i];
        scan_prefetch(m, i);
        if (s->h.rep1 == 0) continue;
        PyObject *key = NULL;
        const Hold *x = &s->h;
        int64_t acc = m->sacc[i];
        for (;;) {
            Pair p = {lfu ? acc : 0, x->last_seen};
            if (all || !pair_lt(thr, p)) {
                if (key == NULL && (key = slot_key(m, s)) == NULL) return -1;
                PyObject *tup = Py_BuildValue("(LLOk)", (long long)p.a, (long long)p.b, key,
                                              (unsigned long)(x->rep1 - 1));
                if (tup == NULL || PyList_Append(out, tup) < 0) {
                    Py_XDECREF(tup);
                    Py_DECREF(key);
                    return -1;
                }
                Py_DECREF(tup);
            }
            uint32_t nx = x->next & IDX_MASK;
            if (!nx) break;
            x = OH(m, nx);
            acc = m->ovf[nx - 1].access;
        }
        Py_XDECREF(key);
    }
    return 0;
}

/* Two scans, no cache (see cap_direct). */
static int quota_direct(BlockMap *m, long long k, PyObject *out) {
    size_t cap = m->mask + 1;
    Pair thr = {INT64_MAX, 0};
    int all = (unsigned long long)k >= (unsigned long long)m->nkeys;
    if (!all && kth_smallest(m, (size_t)k, 0, 1, &thr) < 0) return -1;
    for (size_t i = 0; i < cap; i++) {
        const Slot *s = &m->slots[i];
        scan_prefetch(m, i);
        if (s->h.rep1 == 0) continue;
        int64_t newest = slot_newest(m, s);
        if (!all && newest > thr.a) continue;
        PyObject *key = slot_key(m, s);
        PyObject *tup = key ? Py_BuildValue("(LN)", (long long)newest, key) : NULL;
        if (tup == NULL || PyList_Append(out, tup) < 0) {
            Py_XDECREF(tup);
            return -1;
        }
        Py_DECREF(tup);
    }
    return 0;
}

/* Candidates kept by a cache for a call asking k: max(cc_factor * k, cc_min), saturating. */
static inline size_t cc_want(const BlockMap *m, long long k) {
    size_t want = (size_t)k > ((size_t)-1) / m->cc_factor ? (size_t)-1 : (size_t)k * m->cc_factor;
    return want < m->cc_min ? m->cc_min : want;
}

/* cap_candidates (quota 0) or quota_candidates (quota 1) into out, 0 or -1 with an exception:
 * from the kept cache where it stays a small part of the store (built when missing, rebuilt
 * once when it cannot answer), else by two direct scans. */
static int candidates(BlockMap *m, long long k, int lfu, int quota, PyObject *out) {
    size_t values = quota ? m->nkeys : m->nholds;
    if (k <= 0 || values == 0) return 0;
    size_t want = cc_want(m, k);
    if (want >= values) return quota ? quota_direct(m, k, out) : cap_direct(m, k, lfu, out);
    struct CandCache **pc = quota ? &m->qc : &m->cc;
    if (*pc != NULL && (*pc)->lfu != lfu) cache_drop(pc);
    for (int attempt = 0; attempt < 2; attempt++) {
        if (*pc == NULL && cache_build(m, want, lfu, quota) < 0) return -1;
        int rc = cc_select(m, pc, k, out);
        if (rc < 0) return -1;
        if (rc == 1) return 0;
        if (PyList_SetSlice(out, 0, PyList_GET_SIZE(out), NULL) < 0) return -1;
    }
    /* A freshly built cache always answers (it keeps at least k entries, all current). */
    PyErr_Format(PyExc_SystemError, "%s: candidate cache failed",
                 quota ? "quota_candidates" : "cap_candidates");
    return -1;
}

/* The list of candidates(), with the map busy meanwhile. */
static PyObject *candidates_list(BlockMap *m, long long k, int lfu, int quota) {
    if (bm_enter(m) < 0) return NULL;
    PyObject *out = PyList_New(0);
    if (out != NULL && candidates(m, k, lfu, quota, out) < 0) Py_CLEAR(out);
    m->busy = 0;
    return out;
}

static const char *const cap_names[] = {"k", "lfu"};

static PyObject *BM_cap_candidates(BlockMap *m, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames) {
    PyObject *a[2];
    if (parse_args("cap_candidates", cap_names, 2, args, nargs, kwnames, a) < 0) return NULL;
    long long k;
    if (as_clamped(a[0], &k) < 0) return NULL;
    int lfu = PyObject_IsTrue(a[1]);
    if (lfu < 0) return NULL;
    return candidates_list(m, k, lfu, 0);
}

static PyObject *BM_quota_candidates(BlockMap *m, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames) {
    static const char *const names[] = {"k"};
    PyObject *a[1];
    if (parse_args("quota_candidates", names, 1, args, nargs, kwnames, a) < 0) return NULL;
    long long k;
    if (as_clamped(a[0], &k) < 0) return NULL;
    return candidates_list(m, k, 0, 1);
}

static PyObject *BM_replica_summary(BlockMap *m, PyObject *Py_UNUSED(ignored)) {
    RMap per;
    if (rmap_init(&per) < 0) return NULL;
    PyObject *d = NULL;
    if (bm_enter(m) < 0) goto done;
    size_t cap = m->mask + 1;
    int failed = 0;
    for (size_t i = 0; i < cap && !failed; i++) {
        const Slot *s = &m->slots[i];
        scan_prefetch(m, i);
        if (s->h.rep1 == 0) continue;
        const Hold *x = &s->h;
        for (;;) {
            RMEntry *e = rmap_get(&per, x->rep1);
            if (e == NULL) {
                failed = 1;
                break;
            }
            e->a++;
            if (x->last_seen > e->b) e->b = x->last_seen;
            uint32_t nx = x->next & IDX_MASK;
            if (!nx) break;
            x = OH(m, nx);
        }
    }
    m->busy = 0;
    if (!failed) d = rmap_dict(&per, 1);
done:
    rmap_free(&per);
    return d;
}

/* Grow the table for `keys` keys at once (a snapshot load knows how many are coming): one
 * allocation instead of a doubling (and a rehash of everything so far) every time the load
 * passes 3/4. Never shrinks. */
static PyObject *BM_reserve(BlockMap *m, PyObject *arg) {
    Py_ssize_t keys = PyLong_AsSsize_t(arg);
    if (keys < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "keys must be >= 0");
        return NULL;
    }
    size_t want = (size_t)keys + m->nkeys;
    size_t ncap = m->mask + 1;
    while (want * 4 > ncap * 3) {
        if (ncap > ((size_t)1 << 40)) {
            PyErr_SetString(PyExc_OverflowError, "reserve: too many keys");
            return NULL;
        }
        ncap *= 2;
    }
    if (ncap > m->mask + 1) {
        if (bm_enter(m) < 0) return NULL;
        int r = bm_resize(m, ncap);
        m->busy = 0;
        if (r < 0) return NULL;
    }
    Py_RETURN_NONE;
}

/* Every hold as columns, for snapshots: (keys, replicas, tokens, last_seen, tiers, others).
 * Holds of 8-byte keys go to the columns, in native byte order: keys (8 bytes each, the key's
 * bytes), replicas (uint32), tokens (int32), last_seen (int64), tiers (int32); holds of any
 * other key length go to `others` as (key, replica, tokens, last_seen, tier) tuples. One pass
 * with plain memory copies: the index lock is held for it. */
static PyObject *BM_dump_columns(BlockMap *m, PyObject *Py_UNUSED(ignored)) {
    size_t n = m->nholds;
    PyObject *keys = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(8 * (n ? n : 1)));
    PyObject *reps = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 * (n ? n : 1)));
    PyObject *toks = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 * (n ? n : 1)));
    PyObject *tss = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(8 * (n ? n : 1)));
    PyObject *tiers = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 * (n ? n : 1)));
    PyObject *others = PyList_New(0);
    PyObject *result = NULL;
    if (!keys || !reps || !toks || !tss || !tiers || !others) goto done;
    if (bm_enter(m) < 0) goto done;
    {
        char *kp = PyBytes_AS_STRING(keys);
        char *rp = PyBytes_AS_STRING(reps);
        char *tp = PyBytes_AS_STRING(toks);
        char *sp = PyBytes_AS_STRING(tss);
        char *ip = PyBytes_AS_STRING(tiers);
        size_t j = 0;
        size_t cap = m->mask + 1;
        int failed = 0;
        for (size_t i = 0; i < cap && !failed; i++) {
            const Slot *s = &m->slots[i];
            scan_prefetch(m, i);
            if (s->h.rep1 == 0) continue;
            int is_long = (s->h.next & BM_LONG) != 0;
            const Hold *x = &s->h;
            for (;;) {
                uint32_t rep = x->rep1 - 1;
                if (BM_UNLIKELY(is_long)) {
                    PyObject *t = Py_BuildValue("(OIiLi)", m->lk[s->key].bytes, rep,
                                                x->tokens, (long long)x->last_seen, x->tier);
                    if (t == NULL || PyList_Append(others, t) < 0) {
                        Py_XDECREF(t);
                        failed = 1;
                        break;
                    }
                    Py_DECREF(t);
                } else if (j < n) {
                    memcpy(kp + 8 * j, &s->key, 8);
                    memcpy(rp + 4 * j, &rep, 4);
                    memcpy(tp + 4 * j, &x->tokens, 4);
                    memcpy(sp + 8 * j, &x->last_seen, 8);
                    memcpy(ip + 4 * j, &x->tier, 4);
                    j++;
                }
                uint32_t nx = x->next & IDX_MASK;
                if (!nx) break;
                x = OH(m, nx);
            }
        }
        m->busy = 0;
        if (failed) goto done;
        if (_PyBytes_Resize(&keys, (Py_ssize_t)(8 * j)) < 0 ||
            _PyBytes_Resize(&reps, (Py_ssize_t)(4 * j)) < 0 ||
            _PyBytes_Resize(&toks, (Py_ssize_t)(4 * j)) < 0 ||
            _PyBytes_Resize(&tss, (Py_ssize_t)(8 * j)) < 0 ||
            _PyBytes_Resize(&tiers, (Py_ssize_t)(4 * j)) < 0)
            goto done;
        result = PyTuple_Pack(6, keys, reps, toks, tss, tiers, others);
    }
done:
    Py_XDECREF(keys);
    Py_XDECREF(reps);
    Py_XDECREF(toks);
    Py_XDECREF(tss);
    Py_XDECREF(tiers);
    Py_XDECREF(others);
    return result;
}

/* Internal consistency, for tests: raises AssertionError naming the first broken rule. */
static PyObject *BM_check_invariants(BlockMap *m, PyObject *Py_UNUSED(ignored)) {
    if (bm_check_idle(m) < 0) return NULL;
    size_t cap = m->mask + 1;
    size_t keys = 0, holds = 0, ovf_used = 0, longs = 0;
    const char *err = NULL;
    uint8_t *seen = NULL;
    if (m->ovf_top) {
        seen = (uint8_t *)PyMem_RawCalloc(m->ovf_top, 1);
        if (seen == NULL) return PyErr_NoMemory();
    }
    if (m->nkeys * 4 > cap * 3) err = "load factor above 3/4";
    for (size_t i = 0; i < cap && err == NULL; i++) {
        const Slot *s = &m->slots[i];
        if (s->h.rep1 == 0) continue;
        keys++;
        size_t home = (size_t)slot_hash(m, s) & m->mask;
        for (size_t j = home; j != i; j = (j + 1) & m->mask) {
            if (m->slots[j].h.rep1 == 0) {
                err = "empty slot between a key's home and its slot";
                break;
            }
        }
        if (s->h.next & BM_LONG) {
            longs++;
            if (s->key >= m->lk_top || m->lk[s->key].bytes == NULL) {
                err = "long key points at a free side entry";
                break;
            }
            const LongKey *e = &m->lk[s->key];
            if (PyBytes_GET_SIZE(e->bytes) == 8) err = "8-byte key stored as long key";
            if (hash_long(PyBytes_AS_STRING(e->bytes), PyBytes_GET_SIZE(e->bytes)) != e->hash)
                err = "stale hash in side table";
        }
        const Hold *x = &s->h;
        uint32_t reps[64];
        size_t nr = 0;
        for (;;) {
            holds++;
            if (x->rep1 == 0) {
                err = "free arena entry in a chain";
                break;
            }
            for (size_t q = 0; q < nr && q < 64; q++)
                if (reps[q] == x->rep1) err = "replica twice in one key";
            if (nr < 64) reps[nr] = x->rep1;
            nr++;
            uint32_t nx = x->next & IDX_MASK;
            if (!nx) break;
            if (nx > m->ovf_top) {
                err = "link past the arena top";
                break;
            }
            if (seen[nx - 1]) {
                err = "arena entry linked twice";
                break;
            }
            seen[nx - 1] = 1;
            ovf_used++;
            x = OH(m, nx);
            if (x->next & BM_LONG) err = "LONG bit in an arena entry";
        }
    }
    if (err == NULL && keys != m->nkeys) err = "key count mismatch";
    if (err == NULL && holds != m->nholds) err = "hold count mismatch";
    if (err == NULL && ovf_used != m->ovf_live) err = "arena live count mismatch";
    if (err == NULL && longs != m->lk_live) err = "side table live count mismatch";
    if (err == NULL) {
        size_t nfree = 0;
        for (uint32_t f = m->ovf_free; f != 0 && err == NULL; f = OH(m, f)->next) {
            if (f > m->ovf_top || OH(m, f)->rep1 != 0) err = "bad arena free list";
            if (++nfree > m->ovf_top) err = "arena free list cycle";
        }
        if (err == NULL && nfree + m->ovf_live != m->ovf_top) err = "arena entries lost";
    }
    if (err == NULL) {
        size_t nfree = 0;
        for (size_t f = m->lk_free; f != 0 && err == NULL; f = (size_t)m->lk[f - 1].hash) {
            if (f > m->lk_top || m->lk[f - 1].bytes != NULL) err = "bad side free list";
            if (++nfree > m->lk_top) err = "side free list cycle";
        }
        if (err == NULL && nfree + m->lk_live != m->lk_top) err = "side entries lost";
    }
    PyMem_RawFree(seen);
    if (err != NULL) {
        PyErr_SetString(PyExc_AssertionError, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ======================================================================================= */
/* holds() iterator                                                                        */
/* ======================================================================================= */

typedef struct {
    PyObject_HEAD
    BlockMap *m;
    size_t pos;
    uint32_t cur; /* 0: the slot's inline hold is next; else arena index + 1 */
    uint64_t version;
} HoldsIter;

static PyObject *BM_holds(BlockMap *m, PyObject *Py_UNUSED(ignored)) {
    HoldsIter *it = PyObject_New(HoldsIter, &HoldsIterType);
    if (it == NULL) return NULL;
    it->m = (BlockMap *)Py_NewRef(m);
    it->pos = 0;
    it->cur = 0;
    it->version = m->version;
    return (PyObject *)it;
}

static void HI_dealloc(HoldsIter *it) {
    Py_XDECREF(it->m);
    PyObject_Free(it);
}

static PyObject *HI_next(HoldsIter *it) {
    BlockMap *m = it->m;
    if (m == NULL) return NULL;
    if (m->version != it->version) {
        PyErr_SetString(PyExc_RuntimeError, "BlockMap changed size during iteration");
        return NULL;
    }
    if (m->busy) {
        PyErr_SetString(PyExc_RuntimeError, "BlockMap iterated during another call");
        return NULL;
    }
    size_t cap = m->mask + 1;
    while (it->pos < cap) {
        const Slot *s = &m->slots[it->pos];
        if (s->h.rep1 == 0) {
            it->pos++;
            it->cur = 0;
            continue;
        }
        const Hold *x = it->cur == 0 ? &s->h : OH(m, it->cur);
        int64_t access = it->cur == 0 ? m->sacc[it->pos] : m->ovf[it->cur - 1].access;
        uint32_t nx = x->next & IDX_MASK;
        Hold copy = *x;
        if (nx) {
            it->cur = nx;
        } else {
            it->pos++;
            it->cur = 0;
        }
        return make_hold(m, s, &copy, access);
    }
    Py_CLEAR(it->m);
    return NULL;
}

static PyTypeObject HoldsIterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "inferencecache.index._blockmap.HoldsIterator",
    .tp_basicsize = sizeof(HoldsIter),
    .tp_dealloc = (destructor)HI_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)HI_next,
};

/* ======================================================================================= */
/* Type and module                                                                         */
/* ======================================================================================= */

#define FASTKW (METH_FASTCALL | METH_KEYWORDS)

static PyMethodDef BM_methods[] = {
    {"key_count", (PyCFunction)BM_key_count, METH_NOARGS, "Distinct keys."},
    {"hold_count", (PyCFunction)BM_hold_count, METH_NOARGS, "Holds (key, replica pairs)."},
    {"upsert", (PyCFunction)(void (*)(void))BM_upsert, FASTKW,
     "upsert(key, replica, tokens, last_seen, tier) -> NEW_KEY|NEW_HOLD bits"},
    {"upsert_many", (PyCFunction)(void (*)(void))BM_upsert_many, FASTKW,
     "upsert_many(keys, tokens, replica, last_seen, tier) -> (new keys, new holds)"},
    {"holders", (PyCFunction)(void (*)(void))BM_holders, FASTKW,
     "holders(key, fresh_after) -> [(replica, tokens, last_seen, tier)]"},
    {"walk", (PyCFunction)(void (*)(void))BM_walk, FASTKW,
     "walk(keys, counts, fresh_after) -> [Run]: leading runs of a request chain"},
    {"walk_ranked", (PyCFunction)(void (*)(void))BM_walk_ranked, FASTKW,
     "walk_ranked(keys, counts, fresh_after, ranker): "
     "ranker.rank(walk(keys, counts, fresh_after), True)"},
    {"credit", (PyCFunction)(void (*)(void))BM_credit, FASTKW,
     "credit(keys, blocks, replica): access += 1 on the replica's holds of keys[:blocks]"},
    {"remove_hold", (PyCFunction)(void (*)(void))BM_remove_hold, FASTKW,
     "remove_hold(key, replica) -> HOLD_REMOVED|KEY_REMOVED bits"},
    {"remove_holds", (PyCFunction)(void (*)(void))BM_remove_holds, FASTKW,
     "remove_holds(keys, replica) -> (holds removed, keys removed): remove_hold per key"},
    {"remove_replica", (PyCFunction)(void (*)(void))BM_remove_replica, FASTKW,
     "remove_replica(replica) -> (holds removed, keys removed)"},
    {"remove_key", (PyCFunction)(void (*)(void))BM_remove_key, FASTKW,
     "remove_key(key) -> replicas whose holds went with it"},
    {"sweep", (PyCFunction)(void (*)(void))BM_sweep, FASTKW,
     "sweep(stale_at_or_before) -> ({replica: holds removed}, keys removed)"},
    {"cap_candidates", (PyCFunction)(void (*)(void))BM_cap_candidates, FASTKW,
     "cap_candidates(k, lfu) -> [(effective_count, last_seen, key, replica)]"},
    {"quota_candidates", (PyCFunction)(void (*)(void))BM_quota_candidates, FASTKW,
     "quota_candidates(k) -> [(newest last_seen, key)]"},
    {"replica_summary", (PyCFunction)BM_replica_summary, METH_NOARGS,
     "replica_summary() -> {replica: (holds, newest last_seen)}"},
    {"holds", (PyCFunction)BM_holds, METH_NOARGS, "holds() -> iterator of Hold"},
    {"reserve", (PyCFunction)BM_reserve, METH_O,
     "reserve(keys): grow the table for that many more keys at once (snapshot loads)"},
    {"dump_columns", (PyCFunction)BM_dump_columns, METH_NOARGS,
     "dump_columns() -> (keys, replicas, tokens, last_seen, tiers, others): every hold"},
    {"memory_bytes", (PyCFunction)BM_memory_bytes, METH_NOARGS,
     "Bytes allocated by this map (table, overflow arena, side table and its bytes objects)."},
    {"capacity", (PyCFunction)BM_capacity, METH_NOARGS, "Slots in the table."},
    {"_tune_candidates", (PyCFunction)BM_tune_candidates, METH_VARARGS,
     "_tune_candidates(min, factor): candidates kept between cap_candidates calls (tests)."},
    {"check_invariants", (PyCFunction)BM_check_invariants, METH_NOARGS,
     "Verify internal consistency (tests); raises AssertionError."},
    {"__sizeof__", (PyCFunction)BM_sizeof, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BlockMapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "inferencecache.index._blockmap.BlockMap",
    .tp_doc = PyDoc_STR("Holds of one index partition (a compiled PartitionStore)."),
    .tp_basicsize = sizeof(BlockMap),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = BM_new,
    .tp_dealloc = (destructor)BM_dealloc,
    .tp_methods = BM_methods,
};

/* ======================================================================================= */
/* Applier: a batch of index updates (the binary form of index/batch.py) applied in one call.
 *
 * Why: an ingest message used to cost ~6-10 us of Python around ~1 us of store work (update
 * objects, the facade, one upsert_many). The server's wire parsers now write each update or
 * eviction event as one batch record, and this applies STORE and REMOVE records straight to the
 * partitions' BlockMaps: no Python object per block, none per record except the delta tuple
 * the index's views need. Partitions and replica ids come from a Python resolver, once per
 * distinct record route, cached until the index's generation changes (a partition or replica
 * id created or freed). Every other record kind, and every record this code does not apply
 * exactly as the reference (index/batch.py, apply.py) would, is handed back to Python.
 *
 * apply(batch, offset, now_us, generation, max_entries, max_hash_bytes, stop_after_store)
 *   -> (deltas, next_offset, defer)
 * deltas: [(partition, replica, keys delta, holds delta)] in record order (negative for
 * removals); defer: the record at next_offset is for Python. The call also stops after a STORE
 * when stop_after_store (the caller enforces quota and cap after each update), and after a
 * REMOVE that emptied a partition (the caller drops it before anything else writes). */

#define BATCH_MAGIC "ICB1"
#define BATCH_HEADER 12 /* magic, i64 appended_us */
#define REC_HEADER 8    /* u8 kind, 3 reserved bytes, u32 body length */
#define REC_STORE 1
#define REC_REMOVE 2
#define TIER_INVALID_C INT32_MAX

typedef struct {
    PyObject_HEAD
    PyObject *resolve; /* resolve(kind, route bytes) -> (value, generation) */
    PyObject *cache;   /* dict: kind byte + route bytes -> value */
    long long generation;
} Applier;

static PyTypeObject ApplierType;

static inline uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline int64_t le64(const uint8_t *p) {
    return (int64_t)((uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32);
}

/* The route section [pos, *end) of five length-prefixed strings; -1 if malformed. */
static int route_span(const uint8_t *b, Py_ssize_t pos, Py_ssize_t stop, Py_ssize_t *end) {
    for (int i = 0; i < 5; i++) {
        if (stop - pos < 4) return -1;
        uint32_t n = le32(b + pos);
        pos += 4;
        if ((uint64_t)(stop - pos) < n) return -1;
        pos += n;
    }
    *end = pos;
    return 0;
}

static PyObject *AP_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *resolve;
    static char *kw[] = {"resolve", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Applier", kw, &resolve)) return NULL;
    Applier *a = (Applier *)type->tp_alloc(type, 0);
    if (a == NULL) return NULL;
    a->resolve = Py_NewRef(resolve);
    a->cache = PyDict_New();
    a->generation = -1;
    if (a->cache == NULL) {
        Py_DECREF(a);
        return NULL;
    }
    return (PyObject *)a;
}

static int AP_traverse(Applier *a, visitproc visit, void *arg) {
    Py_VISIT(a->resolve);
    Py_VISIT(a->cache);
    return 0;
}

static int AP_clear(Applier *a) {
    Py_CLEAR(a->resolve);
    Py_CLEAR(a->cache);
    return 0;
}

static void AP_dealloc(Applier *a) {
    PyObject_GC_UnTrack(a);
    AP_clear(a);
    Py_TYPE(a)->tp_free((PyObject *)a);
}

/* The cached resolution of a route (borrowed, kept alive by the cache), resolving on a miss;
 * NULL with an exception. */
static PyObject *ap_route(Applier *a, int kind, const uint8_t *b, Py_ssize_t r0, Py_ssize_t r1) {
    PyObject *key = PyBytes_FromStringAndSize(NULL, 1 + (r1 - r0));
    if (key == NULL) return NULL;
    char *kp = PyBytes_AS_STRING(key);
    kp[0] = (char)kind;
    memcpy(kp + 1, b + r0, (size_t)(r1 - r0));
    PyObject *val = PyDict_GetItemWithError(a->cache, key);
    if (val != NULL || PyErr_Occurred()) {
        Py_DECREF(key);
        return val;
    }
    PyObject *res = PyObject_CallFunction(a->resolve, "iy#", kind, (const char *)b + r0,
                                          (Py_ssize_t)(r1 - r0));
    if (res == NULL) {
        Py_DECREF(key);
        return NULL;
    }
    val = NULL;
    if (!PyTuple_Check(res) || PyTuple_GET_SIZE(res) != 2) {
        PyErr_SetString(PyExc_TypeError, "resolve must return (value, generation)");
    } else {
        long long gen = PyLong_AsLongLong(PyTuple_GET_ITEM(res, 1));
        if (!(gen == -1 && PyErr_Occurred())) {
            if (gen != a->generation) { /* the resolver changed the index's shape */
                PyDict_Clear(a->cache);
                a->generation = gen;
            }
            if (PyDict_SetItem(a->cache, key, PyTuple_GET_ITEM(res, 0)) == 0)
                val = PyTuple_GET_ITEM(res, 0); /* the cache holds a reference */
        }
    }
    Py_DECREF(key);
    Py_DECREF(res);
    return val;
}

static int delta_append(PyObject *deltas, PyObject *part, PyObject *rid, Py_ssize_t dk,
                        Py_ssize_t dh) {
    PyObject *t = Py_BuildValue("(OOnn)", part, rid, dk, dh);
    if (t == NULL) return -1;
    int rc = PyList_Append(deltas, t);
    Py_DECREF(t);
    return rc;
}

/* Replica id (int >= 0) -> rep1; -1 with an exception. */
static int ap_rep1(PyObject *rid, uint32_t *rep1) {
    long long v = PyLong_AsLongLong(rid);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0 || v >= (long long)REP_MAX) {
        PyErr_SetString(PyExc_ValueError, "replica id out of range");
        return -1;
    }
    *rep1 = (uint32_t)v + 1;
    return 0;
}

/* One STORE record body after its route: 1 applied, 0 defer, -1 error. value is
 * (BlockMap, replica id, partition) or None (a record the index skips: probe tenant). */
static int ap_store(PyObject *value, const uint8_t *b, Py_ssize_t pos, Py_ssize_t stop,
                    int64_t default_ts, long long max_entries, long long max_hash,
                    PyObject *deltas) {
    if (stop - pos < 16) return 0;
    int64_t ts = le64(b + pos);
    int32_t tier = (int32_t)le32(b + pos + 8);
    uint32_t n = le32(b + pos + 12);
    pos += 16;
    if ((uint64_t)(stop - pos) != (uint64_t)n * 12) return 0; /* malformed: Python decides */
    if (value == Py_None) return 1;
    if (!PyTuple_Check(value) || PyTuple_GET_SIZE(value) != 3 ||
        Py_TYPE(PyTuple_GET_ITEM(value, 0)) != &BlockMapType)
        return 0;
    if (n == 0) return 1;
    if ((long long)n > max_entries || max_hash < 8) return 0; /* drops: counted by Python */
    BlockMap *m = (BlockMap *)PyTuple_GET_ITEM(value, 0);
    PyObject *rid = PyTuple_GET_ITEM(value, 1);
    uint32_t rep1;
    if (ap_rep1(rid, &rep1) < 0) return -1;
    if (ts == 0) ts = default_ts;
    if (tier == 0) tier = 1;
    else if (tier < 0) tier = TIER_INVALID_C;
    const uint8_t *hashes = b + pos;
    const uint8_t *counts = b + pos + 8 * (Py_ssize_t)n;
    if (bm_enter(m) < 0) return -1;
    Py_ssize_t new_keys = 0, new_holds = 0;
    uint64_t hring[RING];
    Py_ssize_t a_next = 0, nn = (Py_ssize_t)n;
    int failed = 0;
    for (Py_ssize_t i = 0; i < nn; i++) {
        Py_ssize_t alim = i + PF_A < nn ? i + PF_A : nn - 1;
        for (; a_next <= alim; a_next++) {
            uint64_t h = key_hash((const char *)hashes + 8 * a_next, 8);
            hring[a_next & (RING - 1)] = h;
            BM_PREFETCH(&m->slots[(size_t)h & m->mask]);
        }
        int r = bm_upsert(m, (const char *)hashes + 8 * i, 8, hring[i & (RING - 1)], NULL, rep1,
                          (int32_t)le32(counts + 4 * i), ts, tier);
        if (BM_UNLIKELY(r < 0)) {
            failed = 1;
            break;
        }
        new_keys += (r & NEW_KEY) != 0;
        new_holds += (r & NEW_HOLD) != 0;
    }
    m->busy = 0;
    if (failed) return -1;
    if ((new_keys || new_holds) &&
        delta_append(deltas, PyTuple_GET_ITEM(value, 2), rid, new_keys, new_holds) < 0)
        return -1;
    return 1;
}

/* One REMOVE record body after its route: 1 applied, 2 applied and a partition emptied,
 * 0 defer, -1 error. value is None (replica or (tenant, model) unknown: nothing held) or
 * (replica id, partition, BlockMap, partition, BlockMap, ...) for the partitions the event
 * reaches (contract-and-index.md §4.4: every scheme, the event's adapter or all). */
static int ap_remove(PyObject *value, const uint8_t *b, Py_ssize_t pos, Py_ssize_t stop,
                     PyObject *deltas) {
    if (stop - pos < 12) return 0;
    uint32_t n = le32(b + pos + 8);
    pos += 12;
    if ((uint64_t)(stop - pos) != (uint64_t)n * 8) return 0;
    if (value == Py_None) return 1;
    if (!PyTuple_Check(value) || PyTuple_GET_SIZE(value) % 2 != 1) return 0;
    Py_ssize_t np = PyTuple_GET_SIZE(value) / 2;
    for (Py_ssize_t j = 0; j < np; j++)
        if (Py_TYPE(PyTuple_GET_ITEM(value, 2 + 2 * j)) != &BlockMapType) return 0;
    PyObject *rid = PyTuple_GET_ITEM(value, 0);
    uint32_t rep1;
    if (ap_rep1(rid, &rep1) < 0) return -1;
    int emptied = 0;
    for (Py_ssize_t j = 0; j < np; j++) {
        BlockMap *m = (BlockMap *)PyTuple_GET_ITEM(value, 2 + 2 * j);
        if (bm_enter(m) < 0) return -1;
        Py_ssize_t holds = 0, keys = 0;
        for (uint32_t i = 0; i < n; i++) {
            PyObject *dropped = NULL;
            int bits = bm_remove_one(m, (const char *)b + pos + 8 * (Py_ssize_t)i, 8, rep1,
                                     &dropped);
            Py_XDECREF(dropped); /* 8-byte keys are inline: never a side-table bytes */
            holds += (bits & HOLD_REMOVED) != 0;
            keys += (bits & KEY_REMOVED) != 0;
        }
        if (holds) bm_maybe_shrink(m);
        m->busy = 0;
        if (holds) {
            if (delta_append(deltas, PyTuple_GET_ITEM(value, 1 + 2 * j), rid, -keys, -holds) < 0)
                return -1;
            if (m->nkeys == 0) emptied = 1;
        }
    }
    return emptied ? 2 : 1;
}

static PyObject *AP_apply(Applier *a, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "apply(batch, offset, now_us, generation, "
                                         "max_entries, max_hash_bytes, stop_after_store)");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *deltas = NULL, *result = NULL;
    long long offset = PyLong_AsLongLong(args[1]);
    long long now = PyLong_AsLongLong(args[2]);
    long long gen = PyLong_AsLongLong(args[3]);
    long long max_entries = PyLong_AsLongLong(args[4]);
    long long max_hash = PyLong_AsLongLong(args[5]);
    int stop_after_store = PyObject_IsTrue(args[6]);
    if (PyErr_Occurred() || stop_after_store < 0) goto done;
    const uint8_t *b = (const uint8_t *)view.buf;
    Py_ssize_t n = view.len;
    if (n < BATCH_HEADER || memcmp(b, BATCH_MAGIC, 4) != 0) {
        PyErr_SetString(PyExc_ValueError, "not an ICB1 batch");
        goto done;
    }
    if (offset < BATCH_HEADER || offset > n) {
        PyErr_SetString(PyExc_ValueError, "offset outside the batch");
        goto done;
    }
    if (gen != a->generation) {
        PyDict_Clear(a->cache);
        a->generation = gen;
    }
    int64_t appended = le64(b + 4);
    int64_t default_ts = appended ? appended : (int64_t)now;
    deltas = PyList_New(0);
    if (deltas == NULL) goto done;
    Py_ssize_t pos = (Py_ssize_t)offset;
    int defer = 0;
    while (pos < n) {
        if (n - pos < REC_HEADER) {
            defer = 1; /* malformed tail: the reference reader reports it */
            break;
        }
        int kind = b[pos];
        Py_ssize_t body = (Py_ssize_t)le32(b + pos + 4);
        Py_ssize_t start = pos + REC_HEADER, stop = start + body;
        Py_ssize_t r1;
        if (body > n - start || (kind != REC_STORE && kind != REC_REMOVE) ||
            route_span(b, start, stop, &r1) < 0) {
            defer = 1;
            break;
        }
        /* the whole body is checked before the route is resolved: resolving may create a
         * partition, which only a record that will be applied may do */
        Py_ssize_t fixed = kind == REC_STORE ? 16 : 12, per = kind == REC_STORE ? 12 : 8;
        if (stop - r1 < fixed ||
            (uint64_t)(stop - r1 - fixed) != (uint64_t)le32(b + r1 + fixed - 4) * per) {
            defer = 1; /* malformed: the reference reader reports it */
            break;
        }
        if (kind == REC_STORE && stop - r1 == fixed) { /* no entries: no partition to make */
            pos = stop;
            if (stop_after_store) break;
            continue;
        }
        PyObject *value = ap_route(a, kind, b, start, r1);
        if (value == NULL) {
            /* a route the resolver refuses (not UTF-8, ...): hand the record to the reference,
             * which raises the same error after the deltas of the records before it are in */
            PyErr_Clear();
            defer = 1;
            break;
        }
        int r = kind == REC_STORE
                    ? ap_store(value, b, r1, stop, default_ts, max_entries, max_hash, deltas)
                    : ap_remove(value, b, r1, stop, deltas);
        if (r < 0) goto done;
        if (r == 0) {
            defer = 1;
            break;
        }
        pos = stop;
        if (r == 2 || (kind == REC_STORE && stop_after_store)) break;
    }
    result = Py_BuildValue("(OnO)", deltas, pos, defer ? Py_True : Py_False);
done:
    Py_XDECREF(deltas);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef AP_methods[] = {
    {"apply", (PyCFunction)(void (*)(void))AP_apply, METH_FASTCALL,
     "apply(batch, offset, now_us, generation, max_entries, max_hash_bytes, stop_after_store)"
     " -> (deltas, next_offset, defer)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ApplierType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "inferencecache.index._blockmap.Applier",
    .tp_doc = PyDoc_STR("Applies ICB1 batches (index/batch.py) to BlockMap partitions."),
    .tp_basicsize = sizeof(Applier),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = AP_new,
    .tp_dealloc = (destructor)AP_dealloc,
    .tp_traverse = (traverseproc)AP_traverse,
    .tp_clear = (inquiry)AP_clear,
    .tp_methods = AP_methods,
};

static struct PyModuleDef bm_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "inferencecache.index._blockmap",
    .m_doc = "Compiled PartitionStore of the routing index (see docs/index-store.md).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__blockmap(void) {
    if (PyType_Ready(&BlockMapType) < 0 || PyType_Ready(&HoldsIterType) < 0 ||
        PyType_Ready(&ApplierType) < 0)
        return NULL;
    if (RunType == NULL) {
        PyObject *store = PyImport_ImportModule("inferencecache.index.store");
        if (store == NULL) return NULL;
        RunType = PyObject_GetAttrString(store, "Run");
        HoldType = RunType ? PyObject_GetAttrString(store, "Hold") : NULL;
        Py_DECREF(store);
        if (HoldType == NULL) {
            Py_CLEAR(RunType);
            return NULL;
        }
        run_fast = ic_named_fast(RunType, 5);
        hold_fast = ic_named_fast(HoldType, 6);
    }
    PyObject *mod = PyModule_Create(&bm_module);
    if (mod == NULL) return NULL;
    if (PyModule_AddObjectRef(mod, "BlockMap", (PyObject *)&BlockMapType) < 0 ||
        PyModule_AddObjectRef(mod, "Applier", (PyObject *)&ApplierType) < 0 ||
        PyModule_AddIntConstant(mod, "NEW_KEY", NEW_KEY) < 0 ||
        PyModule_AddIntConstant(mod, "NEW_HOLD", NEW_HOLD) < 0 ||
        PyModule_AddIntConstant(mod, "HOLD_REMOVED", HOLD_REMOVED) < 0 ||
        PyModule_AddIntConstant(mod, "KEY_REMOVED", KEY_REMOVED) < 0 ||
        PyModule_AddIntConstant(mod, "FAST_NAMEDTUPLES", run_fast && hold_fast) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
