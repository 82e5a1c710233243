/*
 * Plain __slots__ records filled from C without running __init__ (shared by
 * inferencecache.index._rank and inferencecache.server._lookupwire).
 *
 * A class qualifies when it derives from object, has no __dict__/__weakref__ and exactly the
 * given slots, each a plain object slot (what @dataclass(slots=True) makes of a class whose
 * __init__ only assigns its fields): then allocating it and setting every slot equals calling
 * it with those values. Reading such slots by offset is equally valid.
 */
#ifndef INFERENCECACHE_SLOTS_H
#define INFERENCECACHE_SLOTS_H

#include <Python.h>
#include <structmember.h>

#define SLOTS_MAX 16

/* Offsets of the slots `names` (a tuple of str) of `cls` into off[]; -1 with TypeError when
 * cls does not qualify. */
static int slots_layout(PyObject *cls, PyObject *names, Py_ssize_t *off) {
    if (!PyType_Check(cls) || !PyTuple_Check(names)) {
        PyErr_SetString(PyExc_TypeError, "expected a class and a tuple of slot names");
        return -1;
    }
    PyTypeObject *t = (PyTypeObject *)cls;
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    if (n < 1 || n > SLOTS_MAX || t->tp_base != &PyBaseObject_Type || t->tp_dictoffset != 0 ||
        t->tp_weaklistoffset != 0 || t->tp_itemsize != 0 ||
        t->tp_basicsize != (Py_ssize_t)(sizeof(PyObject) + (size_t)n * sizeof(PyObject *)) ||
        t->tp_alloc == NULL) {
        PyErr_Format(PyExc_TypeError,
                     "%.100s must be a __slots__ record of exactly %zd slots deriving from object",
                     t->tp_name, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        PyObject *d = PyUnicode_Check(name) ? PyObject_GetAttr(cls, name) : NULL;
        if (d == NULL) {
            if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_AttributeError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError, "%.100s has no slot %R", t->tp_name, name);
            }
            return -1;
        }
        int ok = Py_IS_TYPE(d, &PyMemberDescr_Type);
        PyMemberDef *md = ok ? ((PyMemberDescrObject *)d)->d_member : NULL;
        ok = ok && md->type == T_OBJECT_EX && !(md->flags & READONLY) &&
             md->offset >= (Py_ssize_t)sizeof(PyObject) && md->offset < t->tp_basicsize;
        for (Py_ssize_t j = 0; ok && j < i; j++) ok = off[j] != md->offset;
        if (ok) off[i] = md->offset;
        Py_DECREF(d);
        if (!ok) {
            PyErr_Format(PyExc_TypeError, "%.100s.%U must be a plain slot", t->tp_name, name);
            return -1;
        }
    }
    return 0;
}

/* The slot at byte offset `off` of obj (borrowed; NULL when unset). */
static inline PyObject *slot_get(PyObject *obj, Py_ssize_t off) {
    return *(PyObject **)((char *)obj + off);
}

/* Set an unset slot (steals the reference). */
static inline void slot_init(PyObject *obj, Py_ssize_t off, PyObject *value) {
    *(PyObject **)((char *)obj + off) = value;
}

#endif
