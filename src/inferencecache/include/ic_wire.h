/*
 * The protobuf wire format as the reference runtime (upb, what the `protobuf` package runs)
 * reads it, shared by every hand-written C parser and writer of contract messages
 * (server/_lookupwire.c, updatewire/_native.c) and by the fingerprint's packed-varint decoder.
 * Header-only: each extension module gets its own static copy.
 *
 * What upb accepts, and so what these readers accept (tests/server/test_wire_differential.py
 * checks every parser against protobuf itself):
 * - a varint of 1 to 10 bytes, canonical or not; its value is the low 64 bits (a 10th byte
 *   above 1 loses its high bits); 11 bytes or more is corrupt;
 * - a tag of 1 to 5 bytes whose value fits 32 bits, with a field number >= 1 and wire type
 *   0 (varint), 1 (fixed64), 2 (length-delimited) or 5 (fixed32); groups (3, 4) are left to
 *   protobuf (IC_DECLINE), 6 and 7 are corrupt;
 * - a length of 1 to 5 bytes that fits in what is left of the enclosing message.
 * A field whose wire type is not its declared one is kept by upb as an unknown field, so a
 * parser skips it like any field it does not know.
 *
 * Every reader returns IC_OK or IC_DECLINE: the caller then lets protobuf decide, which also
 * rejects everything that is corrupt. A parser built on these never accepts a message protobuf
 * rejects, and never reads one differently.
 */
#ifndef INFERENCECACHE_IC_WIRE_H
#define INFERENCECACHE_IC_WIRE_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

#define IC_OK 0
#define IC_DECLINE 1

#define IC_WIRE_VARINT 0
#define IC_WIRE_FIXED64 1
#define IC_WIRE_LEN 2
#define IC_WIRE_FIXED32 5

/* ---- reading ------------------------------------------------------------------------------ */

/* A varint of at most `max_bytes` bytes at *pos (< end); its low 64 bits into *out. */
static inline int ic_varint_max(const uint8_t *b, Py_ssize_t end, Py_ssize_t *pos, uint64_t *out,
                                int max_bytes) {
    Py_ssize_t p = *pos;
    uint64_t v = 0;
    for (int i = 0; i < max_bytes; i++) {
        if (p >= end) return IC_DECLINE;
        uint8_t c = b[p++];
        if (i < 10) v |= (uint64_t)(c & 0x7F) << (7 * i);
        if (c < 0x80) {
            *pos = p;
            *out = v;
            return IC_OK;
        }
    }
    return IC_DECLINE;
}

/* A value varint (1 to 10 bytes). */
static inline int ic_varint(const uint8_t *b, Py_ssize_t end, Py_ssize_t *pos, uint64_t *out) {
    return ic_varint_max(b, end, pos, out, 10);
}

/* A tag: *field >= 1 and *wire in {0, 1, 2, 5}; anything else declines. */
static inline int ic_tag(const uint8_t *b, Py_ssize_t end, Py_ssize_t *pos, uint32_t *field,
                         int *wire) {
    uint64_t key;
    if (b[*pos] < 0x80) { /* the one-byte tags of fields 1..15 */
        key = b[(*pos)++];
    } else if (ic_varint_max(b, end, pos, &key, 5) != IC_OK || key > UINT32_MAX) {
        return IC_DECLINE;
    }
    int w = (int)(key & 7);
    *field = (uint32_t)(key >> 3);
    *wire = w;
    if (*field == 0 || (w != 0 && w != 1 && w != 2 && w != 5)) return IC_DECLINE;
    return IC_OK;
}

/* A length-delimited payload at *pos: its bytes are [*start, *stop), *pos moves past them. */
static inline int ic_payload(const uint8_t *b, Py_ssize_t end, Py_ssize_t *pos, Py_ssize_t *start,
                             Py_ssize_t *stop) {
    uint64_t len;
    if (ic_varint_max(b, end, pos, &len, 5) != IC_OK || len > (uint64_t)(end - *pos))
        return IC_DECLINE;
    *start = *pos;
    *stop = *pos + (Py_ssize_t)len;
    *pos = *stop;
    return IC_OK;
}

/* Skip the value of a field this parser does not read (unknown, or of another wire type). */
static inline int ic_skip(const uint8_t *b, Py_ssize_t end, Py_ssize_t *pos, int wire) {
    uint64_t v;
    Py_ssize_t s0, s1;
    switch (wire) {
    case IC_WIRE_VARINT:
        return ic_varint(b, end, pos, &v);
    case IC_WIRE_LEN:
        return ic_payload(b, end, pos, &s0, &s1);
    case IC_WIRE_FIXED64:
    case IC_WIRE_FIXED32: {
        Py_ssize_t w = wire == IC_WIRE_FIXED64 ? 8 : 4;
        if (end - *pos < w) return IC_DECLINE;
        *pos += w;
        return IC_OK;
    }
    default:
        return IC_DECLINE;
    }
}

/* int32 and enum fields: protobuf keeps the low 32 bits, two's complement. */
static inline int32_t ic_as_int32(uint64_t v) { return (int32_t)(uint32_t)v; }

/* ---- packed repeated varints -------------------------------------------------------------- */

/* Offset of the varint around the continuation run touching p[i] if it is longer than 10
 * bytes, else -1; *next gets the run's end so a scan resumes after it. */
static Py_ssize_t ic_varint_run_overlong(const uint8_t *p, Py_ssize_t len, Py_ssize_t i,
                                         Py_ssize_t *next) {
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

/* Whether a packed payload holds whole varints of at most 10 bytes (what protobuf accepts). */
static inline int ic_packed_ok(const uint8_t *p, Py_ssize_t len) {
    return len == 0 || (p[len - 1] < 0x80 && ic_varint_overlong(p, len) < 0);
}

/* ---- writing ------------------------------------------------------------------------------ */

static inline Py_ssize_t ic_varint_size(uint64_t v) {
    Py_ssize_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

/* Write the varint of v at p (room for 10 bytes); returns the byte after it. */
static inline uint8_t *ic_put_varint(uint8_t *p, uint64_t v) {
    while (v >= 0x80) {
        *p++ = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    *p++ = (uint8_t)v;
    return p;
}

#endif
