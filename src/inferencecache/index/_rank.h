/*
 * C API of inferencecache.index._rank for the compiled store (_blockmap.c): lets
 * BlockMap.walk_ranked hand its runs to a compiled BoundRanker as plain C structs, so a chain
 * lookup creates no Run objects. Obtained with PyCapsule_Import(RANK_CAPI_NAME, 0).
 */
#ifndef INFERENCECACHE_RANK_H
#define INFERENCECACHE_RANK_H

#include <Python.h>
#include <stdint.h>

#define RANK_CAPI_NAME "inferencecache.index._rank._C_API"
#define RANK_CAPI_ABI 2

/* One leading run of a chain walk: the fields of store.Run. */
typedef struct {
    int64_t replica;
    int64_t tokens; /* int32-wrapped sum */
    int64_t oldest;
    int64_t tier;
    int64_t blocks;
} RankRun;

typedef struct {
    int abi; /* RANK_CAPI_ABI */
    PyTypeObject *bound_type;
    /* bound.rank(runs, True) over `n` runs. Returns (scored, scores, credit), None (the caller
     * runs the Python reference), or NULL with an exception set. */
    PyObject *(*rank_runs)(PyObject *bound, const RankRun *runs, Py_ssize_t n);
} RankCAPI;

#endif
