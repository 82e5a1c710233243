/*
 * Argument helpers shared by the C extension modules (inferencecache.fingerprint._native and
 * inferencecache.index._blockmap): METH_FASTCALL | METH_KEYWORDS parsing, and what an opened
 * sequence-or-buffer argument holds on to.
 * Header-only: each extension module gets its own static copy.
 */
#ifndef INFERENCECACHE_PYARGS_H
#define INFERENCECACHE_PYARGS_H

#include <Python.h>

/* Fill out[0..n) from positional args then keywords; out[i] stays NULL when not given.
 * The first `required` parameters must be present (all of them: "takes N arguments", else
 * "takes at most N arguments"). */
static int ic_parse_args(const char *fname, const char *const *names, int n, int required,
                         PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                         PyObject **out) {
    for (int i = 0; i < n; i++) out[i] = NULL;
    if (nargs > n) {
        PyErr_Format(PyExc_TypeError, "%s() takes %s%d arguments (%zd given)", fname,
                     required < n ? "at most " : "", n, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) out[i] = args[i];
    if (kwnames != NULL) {
        Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t k = 0; k < nkw; k++) {
            PyObject *key = PyTuple_GET_ITEM(kwnames, k);
            int found = 0;
            for (int i = 0; i < n; i++) {
                if (PyUnicode_CompareWithASCIIString(key, names[i]) == 0) {
                    if (out[i] != NULL) {
                        PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'",
                                     fname, names[i]);
                        return -1;
                    }
                    out[i] = args[nargs + k];
                    found = 1;
                    break;
                }
            }
            if (!found) {
                PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'",
                             fname, key);
                return -1;
            }
        }
    }
    for (int i = 0; i < required; i++) {
        if (out[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fname, names[i]);
            return -1;
        }
    }
    return 0;
}

/* What an opened sequence-or-buffer argument holds on to until released: the sequence's list
 * or tuple (owned), or the buffer's view. Starts zeroed; release with ic_input_release. */
typedef struct {
    PyObject *seq;
    Py_buffer view;
    int has_view;
} ic_input;

static inline int ic_input_view(ic_input *in, PyObject *obj, int flags) {
    if (PyObject_GetBuffer(obj, &in->view, flags) < 0) return -1;
    in->has_view = 1;
    return 0;
}

static inline void ic_input_release(ic_input *in) {
    Py_CLEAR(in->seq);
    if (in->has_view) {
        PyBuffer_Release(&in->view);
        in->has_view = 0;
    }
}

#endif
