/*
 * Varint checks shared by the C parsers of packed repeated uint32 payloads (token ids).
 * Header-only: each extension module gets its own static copy.
 */
#ifndef INFERENCECACHE_VARINT_H
#define INFERENCECACHE_VARINT_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Offset of the varint around the continuation run touching p[i] if it is longer than 10
 * bytes, else -1; *next gets the run's end so a scan resumes after it. */
static Py_ssize_t ic_varint_run_overlong(const uint8_t *p, Py_ssize_t len, Py_ssize_t i, Py_ssize_t *next) {
    Py_ssize_t start = i, end = i;
    while (start > 0 && p[start - 1] >= 0x80) start--;
    while (end < len && p[end] >= 0x80) end++;
    *next = end;
    return end - start >= 10 ? start : -1; /* 10 continuation bytes: the varint has 11+ */
}

/* Offset of the first varint longer than 10 bytes (protobuf rejects the whole message), or -1.
 * Such a varint holds 10 continuation bytes in a row, so one of the 4-byte windows at multiples
 * of 4 is all continuation bytes; u32 traffic (at most 5 bytes per varint) rarely has one, and
 * then only the run around it is walked. */
static Py_ssize_t ic_varint_overlong(const uint8_t *p, Py_ssize_t len) {
    const uint32_t all = UINT32_C(0x80808080);
    Py_ssize_t i = 0, next, at;
    while (i + 4 <= len) {
        uint32_t w;
        memcpy(&w, p + i, 4);
        if ((w & all) != all) {
            i += 4;
            continue;
        }
        if ((at = ic_varint_run_overlong(p, len, i, &next)) >= 0) return at;
        i = (next + 4) & ~(Py_ssize_t)3; /* the next window wholly after this run */
    }
    return -1;
}

#endif
