/*
 * Named tuples (typing.NamedTuple classes without extra fields) built from C, shared by the
 * compiled store (store.Run, store.Hold) and the compiled ranker (model.ReplicaScore).
 * Header-only: each extension module gets its own static copy.
 *
 * Such a class is a tuple subtype with the tuple's own layout, so an instance is allocated and
 * filled through the tuple API, without running the class's Python __new__ (~0.05 us instead
 * of ~0.3 us). ic_named_fast checks that once per class; otherwise the class is called.
 */
#ifndef INFERENCECACHE_IC_NAMED_H
#define INFERENCECACHE_IC_NAMED_H

#include <Python.h>

/* Whether `type` is a NamedTuple of exactly `fields` fields with the tuple's layout. */
static int ic_named_fast(PyObject *type, Py_ssize_t fields) {
    if (!PyType_Check(type)) return 0;
    PyTypeObject *t = (PyTypeObject *)type;
    PyObject *f = PyObject_GetAttrString(type, "_fields");
    int ok = f != NULL && PyTuple_Check(f) && PyTuple_GET_SIZE(f) == fields;
    Py_XDECREF(f);
    PyErr_Clear();
    return ok && PyType_IsSubtype(t, &PyTuple_Type) &&
           t->tp_basicsize == PyTuple_Type.tp_basicsize &&
           t->tp_itemsize == PyTuple_Type.tp_itemsize && t->tp_dictoffset == 0 &&
           t->tp_alloc != NULL;
}

/* type(*items), stealing the n item references (NULL items: a failed conversion; then NULL
 * is returned with the exception set). `fast` is ic_named_fast(type, n). */
static PyObject *ic_make_named(PyObject *type, int fast, PyObject **items, Py_ssize_t n) {
    PyObject *r = NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (items[i] == NULL) goto fail;
    if (fast) {
        r = ((PyTypeObject *)type)->tp_alloc((PyTypeObject *)type, n);
        if (r == NULL) goto fail;
        for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(r, i, items[i]);
        return r;
    }
    r = PyObject_Vectorcall(type, items, (size_t)n, NULL);
fail:
    for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(items[i]);
    return r;
}

#endif
