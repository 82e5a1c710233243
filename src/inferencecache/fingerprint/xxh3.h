/*
 * XXH3-64 (seeded), written for inferencecache from the public xxHash specification
 * (doc/xxhash_spec.md, "XXH3 Algorithm Description"). Portable C11, scalar, no intrinsics.
 *
 * Every multi-byte read is an explicit little-endian load, so the results are the same on
 * little- and big-endian machines. Nothing here keeps global mutable state: a hash key
 * (seed plus the seed-derived secret used above 240 bytes) lives in a caller-owned struct.
 *
 *   ic_xxh3_key k;  ic_xxh3_key_init(&k, 1337);
 *   uint64_t h  = ic_xxh3_64(&k, data, len);           == xxhash.xxh3_64_intdigest(data, 1337)
 *   uint64_t h2 = ic_xxh3_64_pair(&k, a, b);           == the same over le64(a) || le64(b)
 */
#ifndef INFERENCECACHE_XXH3_H
#define INFERENCECACHE_XXH3_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) || defined(__clang__)
#define IC_INLINE static inline __attribute__((always_inline))
#define IC_LIKELY(x) __builtin_expect(!!(x), 1)
#define IC_UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define IC_INLINE static inline
#define IC_LIKELY(x) (x)
#define IC_UNLIKELY(x) (x)
#endif

/* ---- constants (from the specification) ------------------------------------------------- */

#define IC_P32_1 UINT64_C(0x9E3779B1)
#define IC_P32_2 UINT64_C(0x85EBCA77)
#define IC_P32_3 UINT64_C(0xC2B2AE3D)
#define IC_P64_1 UINT64_C(0x9E3779B185EBCA87)
#define IC_P64_2 UINT64_C(0xC2B2AE3D27D4EB4F)
#define IC_P64_3 UINT64_C(0x165667B19E3779F9)
#define IC_P64_4 UINT64_C(0x85EBCA77C2B2AE63)
#define IC_P64_5 UINT64_C(0x27D4EB2F165667C5)
#define IC_PMX_1 UINT64_C(0x165667919E3779F9)
#define IC_PMX_2 UINT64_C(0x9FB21C651E98DF25)

#define IC_SECRET_LEN 192
#define IC_STRIPE_LEN 64
#define IC_STRIPES_PER_BLOCK ((IC_SECRET_LEN - IC_STRIPE_LEN) / 8) /* 16 */
#define IC_BLOCK_LEN (IC_STRIPE_LEN * IC_STRIPES_PER_BLOCK)         /* 1024 */

static const uint8_t ic_default_secret[IC_SECRET_LEN] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

/* ---- portable primitives ---------------------------------------------------------------- */

/* IC_PORTABLE_LOADS forces the byte-by-byte forms (used to test them on little-endian hosts). */
#if !defined(IC_PORTABLE_LOADS) && defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__) && \
    __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define IC_HOST_LE 1
#else
#define IC_HOST_LE 0
#endif

IC_INLINE uint32_t ic_bswap32(uint32_t x) {
    return (x >> 24) | ((x >> 8) & 0x0000FF00u) | ((x << 8) & 0x00FF0000u) | (x << 24);
}

IC_INLINE uint64_t ic_bswap64(uint64_t x) {
    return ((uint64_t)ic_bswap32((uint32_t)x) << 32) | ic_bswap32((uint32_t)(x >> 32));
}

/* Little-endian loads/stores. On a known little-endian host a memcpy is one load; everywhere
 * else the byte-by-byte form is correct by construction (and compilers merge it). */
IC_INLINE uint32_t ic_read32(const uint8_t *p) {
#if IC_HOST_LE
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
#else
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
#endif
}

IC_INLINE uint64_t ic_read64(const uint8_t *p) {
#if IC_HOST_LE
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
#else
    return (uint64_t)ic_read32(p) | ((uint64_t)ic_read32(p + 4) << 32);
#endif
}

IC_INLINE void ic_write32(uint8_t *p, uint32_t v) {
#if IC_HOST_LE
    memcpy(p, &v, 4);
#else
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
#endif
}

IC_INLINE void ic_write64(uint8_t *p, uint64_t v) {
    ic_write32(p, (uint32_t)v);
    ic_write32(p + 4, (uint32_t)(v >> 32));
}

/* Big-endian store: the wire form of a prefix hash. */
IC_INLINE void ic_write64_be(uint8_t *p, uint64_t v) {
    for (int i = 7; i >= 0; i--) {
        p[i] = (uint8_t)v;
        v >>= 8;
    }
}

IC_INLINE uint64_t ic_rotl64(uint64_t x, unsigned r) { return (x << r) | (x >> (64u - r)); }

/* 64x64 -> 128-bit multiply, folded by xor of the two halves. */
IC_INLINE uint64_t ic_mul_fold(uint64_t a, uint64_t b) {
#if defined(__SIZEOF_INT128__)
    __extension__ typedef unsigned __int128 ic_u128;
    ic_u128 r = (ic_u128)a * b;
    return (uint64_t)r ^ (uint64_t)(r >> 64);
#else
    uint64_t a_lo = a & 0xFFFFFFFFu, a_hi = a >> 32, b_lo = b & 0xFFFFFFFFu, b_hi = b >> 32;
    uint64_t ll = a_lo * b_lo, lh = a_lo * b_hi, hl = a_hi * b_lo, hh = a_hi * b_hi;
    uint64_t mid = (ll >> 32) + (lh & 0xFFFFFFFFu) + (hl & 0xFFFFFFFFu);
    uint64_t lo = (mid << 32) | (ll & 0xFFFFFFFFu);
    uint64_t hi = hh + (lh >> 32) + (hl >> 32) + (mid >> 32);
    return lo ^ hi;
#endif
}

/* Final mixes: XXH64's avalanche, and XXH3's shorter one. */
IC_INLINE uint64_t ic_avalanche64(uint64_t x) {
    x ^= x >> 33;
    x *= IC_P64_2;
    x ^= x >> 29;
    x *= IC_P64_3;
    x ^= x >> 32;
    return x;
}

IC_INLINE uint64_t ic_avalanche3(uint64_t x) {
    x ^= x >> 37;
    x *= IC_PMX_1;
    x ^= x >> 32;
    return x;
}

/* ---- key: seed and the long-input secret ------------------------------------------------ */

typedef struct {
    uint64_t seed;
    /* ((secret[24..32) ^ secret[32..40)) + seed, and ((secret[40..48) ^ secret[48..56)) - seed:
     * the two words the 9..16-byte class mixes in, precomputed for the 16-byte chain step. */
    uint64_t flip16_lo;
    uint64_t flip16_hi;
    /* Above 240 bytes a seeded hash uses a secret derived from the seed (default when 0). */
    uint8_t secret[IC_SECRET_LEN];
} ic_xxh3_key;

static void ic_xxh3_key_init(ic_xxh3_key *k, uint64_t seed) {
    k->seed = seed;
    k->flip16_lo = (ic_read64(ic_default_secret + 24) ^ ic_read64(ic_default_secret + 32)) + seed;
    k->flip16_hi = (ic_read64(ic_default_secret + 40) ^ ic_read64(ic_default_secret + 48)) - seed;
    for (int i = 0; i < IC_SECRET_LEN / 16; i++) {
        const uint8_t *s = ic_default_secret + 16 * i;
        ic_write64(k->secret + 16 * i, ic_read64(s) + seed);
        ic_write64(k->secret + 16 * i + 8, ic_read64(s + 8) - seed);
    }
}

/* ---- 0..16 bytes ------------------------------------------------------------------------ */

IC_INLINE uint64_t ic_xxh3_0to16(const uint8_t *p, size_t len, uint64_t seed) {
    const uint8_t *s = ic_default_secret;
    if (len > 8) {
        uint64_t lo = ((ic_read64(s + 24) ^ ic_read64(s + 32)) + seed) ^ ic_read64(p);
        uint64_t hi = ((ic_read64(s + 40) ^ ic_read64(s + 48)) - seed) ^ ic_read64(p + len - 8);
        return ic_avalanche3((uint64_t)len + ic_bswap64(lo) + hi + ic_mul_fold(lo, hi));
    }
    if (len >= 4) {
        uint64_t mseed = seed ^ ((uint64_t)ic_bswap32((uint32_t)seed) << 32);
        uint64_t both = (uint64_t)ic_read32(p + len - 4) | ((uint64_t)ic_read32(p) << 32);
        uint64_t v = ((ic_read64(s + 8) ^ ic_read64(s + 16)) - mseed) ^ both;
        v ^= ic_rotl64(v, 49) ^ ic_rotl64(v, 24);
        v *= IC_PMX_2;
        v ^= (v >> 35) + (uint64_t)len;
        v *= IC_PMX_2;
        return v ^ (v >> 28);
    }
    if (len > 0) {
        uint32_t packed = (uint32_t)p[len - 1] | ((uint32_t)len << 8) | ((uint32_t)p[0] << 16) |
                          ((uint32_t)p[len >> 1] << 24);
        uint64_t v = ((uint64_t)(ic_read32(s) ^ ic_read32(s + 4)) + seed) ^ (uint64_t)packed;
        return ic_avalanche64(v);
    }
    return ic_avalanche64(seed ^ ic_read64(s + 56) ^ ic_read64(s + 64));
}

/* ---- 17..240 bytes ---------------------------------------------------------------------- */

/* One 16-byte chunk of data against 16 bytes of (default) secret at offset so. */
IC_INLINE uint64_t ic_mix16(const uint8_t *p, size_t so, uint64_t seed) {
    const uint8_t *s = ic_default_secret + so;
    return ic_mul_fold(ic_read64(p) ^ (ic_read64(s) + seed), ic_read64(p + 8) ^ (ic_read64(s + 8) - seed));
}

IC_INLINE uint64_t ic_xxh3_17to128(const uint8_t *p, size_t len, uint64_t seed) {
    uint64_t acc = (uint64_t)len * IC_P64_1;
    /* Chunks taken pairwise from both ends; enough pairs to cover the input. */
    size_t rounds = ((len - 1) >> 5) + 1;
    for (size_t i = 0; i < rounds; i++) {
        acc += ic_mix16(p + 16 * i, 32 * i, seed);
        acc += ic_mix16(p + len - 16 * (i + 1), 32 * i + 16, seed);
    }
    return ic_avalanche3(acc);
}

static uint64_t ic_xxh3_129to240(const uint8_t *p, size_t len, uint64_t seed) {
    uint64_t acc = (uint64_t)len * IC_P64_1;
    size_t chunks = len >> 4;
    for (size_t i = 0; i < 8; i++) acc += ic_mix16(p + 16 * i, 16 * i, seed);
    acc = ic_avalanche3(acc);
    for (size_t i = 8; i < chunks; i++) acc += ic_mix16(p + 16 * i, 16 * (i - 8) + 3, seed);
    acc += ic_mix16(p + len - 16, 119, seed); /* the spec's fixed "last chunk" secret offset */
    return ic_avalanche3(acc);
}

/* ---- > 240 bytes ------------------------------------------------------------------------ */

IC_INLINE void ic_accumulate(uint64_t acc[8], const uint8_t *stripe, const uint8_t *s) {
    for (int i = 0; i < 8; i++) {
        uint64_t d = ic_read64(stripe + 8 * i);
        uint64_t v = d ^ ic_read64(s + 8 * i);
        acc[i ^ 1] += d;
        acc[i] += (v & 0xFFFFFFFFu) * (v >> 32);
    }
}

IC_INLINE void ic_scramble(uint64_t acc[8], const uint8_t *s) {
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= ic_read64(s + 8 * i);
        acc[i] = a * IC_P32_1;
    }
}

static uint64_t ic_xxh3_long(const uint8_t *p, size_t len, const uint8_t *secret) {
    uint64_t acc[8] = {IC_P32_3, IC_P64_1, IC_P64_2, IC_P64_3, IC_P64_4, IC_P32_2, IC_P64_5, IC_P32_1};
    /* Full blocks, except that the last block (even a full one) is left for the tail step. */
    size_t blocks = (len - 1) / IC_BLOCK_LEN;
    for (size_t b = 0; b < blocks; b++) {
        const uint8_t *blk = p + b * IC_BLOCK_LEN;
        for (size_t n = 0; n < IC_STRIPES_PER_BLOCK; n++) ic_accumulate(acc, blk + n * IC_STRIPE_LEN, secret + 8 * n);
        ic_scramble(acc, secret + IC_SECRET_LEN - IC_STRIPE_LEN);
    }
    const uint8_t *last = p + blocks * IC_BLOCK_LEN;
    size_t stripes = (len - blocks * IC_BLOCK_LEN - 1) / IC_STRIPE_LEN;
    for (size_t n = 0; n < stripes; n++) ic_accumulate(acc, last + n * IC_STRIPE_LEN, secret + 8 * n);
    /* The final 64 bytes (possibly overlapping what came before) as one more stripe. */
    ic_accumulate(acc, p + len - IC_STRIPE_LEN, secret + IC_SECRET_LEN - IC_STRIPE_LEN - 7);
    uint64_t r = (uint64_t)len * IC_P64_1;
    for (int i = 0; i < 4; i++) {
        const uint8_t *s = secret + 11 + 16 * i;
        r += ic_mul_fold(acc[2 * i] ^ ic_read64(s), acc[2 * i + 1] ^ ic_read64(s + 8));
    }
    return ic_avalanche3(r);
}

/* ---- entry points ----------------------------------------------------------------------- */

IC_INLINE uint64_t ic_xxh3_64(const ic_xxh3_key *k, const uint8_t *p, size_t len) {
    if (len <= 16) return ic_xxh3_0to16(p, len, k->seed);
    if (len <= 128) return ic_xxh3_17to128(p, len, k->seed);
    if (len <= 240) return ic_xxh3_129to240(p, len, k->seed);
    return ic_xxh3_long(p, len, k->secret);
}

/* XXH3-64 of the 16 bytes le64(a) || le64(b): the prefix-chain step, without a byte buffer. */
IC_INLINE uint64_t ic_xxh3_64_pair(const ic_xxh3_key *k, uint64_t a, uint64_t b) {
    uint64_t lo = k->flip16_lo ^ a;
    uint64_t hi = k->flip16_hi ^ b;
    return ic_avalanche3(UINT64_C(16) + ic_bswap64(lo) + hi + ic_mul_fold(lo, hi));
}

#endif /* INFERENCECACHE_XXH3_H */
