/* CRC-32C (Castagnoli) and CRC-32 (zlib's) for verifying expert records as they are read.
 *
 * crc32c is what new stores record: x86-64 has it as an instruction since SSE4.2 (2008) and
 * ARMv8 as __crc32cd (every Apple silicon chip), so the reader threads can check a record
 * at several GB/s a core with no vendored hash library. The instruction has a latency of
 * ~3 cycles and a throughput of 1 a cycle, so one dependency chain runs at a third of its
 * speed: buffers are cut into three interleaved streams whose CRCs are merged with a table
 * that multiplies by x^(8 * stream length) mod P. Where the CPU has no such instruction a
 * slicing-by-8 table (~1 byte a cycle) does the same work.
 *
 * crc32 (zlib.crc32's polynomial) is what stores converted before crc32c record; they keep
 * loading and are verified natively too: with ARMv8's __crc32d where there is one; on x86 by
 * folding 64 bytes at a time with carry-less multiplies (PCLMULQDQ; Intel's "Fast CRC
 * Computation for Generic Polynomials Using PCLMULQDQ", the constants Linux and Chromium's
 * zlib use); else by the same slicing-by-8 tables.
 *
 * Both return what zlib.crc32 does: pre- and post-inverted, crc(a + b) = update(crc(a), b).
 */
#include "checksum.h"

#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#define HAVE_X86 1
#include <nmmintrin.h>
#include <smmintrin.h>
#include <wmmintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#define HAVE_ARM_CRC 1
#include <arm_acle.h>
#endif

#define POLY_CRC32 0xedb88320u  /* reflected */
#define POLY_CRC32C 0x82f63b78u /* reflected */
#define LONG_STREAM 8192        /* bytes per stream, three streams a block */
#define SHORT_STREAM 256

typedef uint32_t Shift[4][256]; /* multiply a CRC register by x^(8n) mod P, a byte at a time */

static uint32_t slice[2][8][256]; /* [kind - 1]: slicing-by-8 tables */
/* [kind - 1]: x^(2^n) mod P for checksum_combine, n from 0 to 3 + 63 (a length of up to 64 bits,
 * in bytes of 2^3 bits). Not read modulo 32 as zlib's: x^(2^32) = x mod crc32's P, but
 * x^(2^31) = x mod crc32c's, so from 2^29 bytes on that table gave crc32c a wrong power. */
static uint32_t x2n[2][67];
static Shift shift_long[2], shift_short[2];
static uint32_t (*impl[3])(uint32_t, const unsigned char *, size_t);
static const char *impl_name[3];

/* a * b mod P, polynomials over GF(2) in reflected order (bit 31 is x^0), as zlib does. */
static uint32_t multmodp(uint32_t a, uint32_t b, uint32_t poly) {
    uint32_t m = (uint32_t)1 << 31, p = 0;
    if (!a) return 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ poly : b >> 1;
    }
    return p;
}

static inline uint32_t shift(Shift t, uint32_t c) {
    return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
}

static inline uint64_t load64(const unsigned char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

/* ---------------------------------------------------------------- tables (any CPU) */

static uint32_t crc_table(uint32_t t[8][256], uint32_t crc, const unsigned char *p,
                          size_t n) {
    crc = ~crc;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    while (n && ((uintptr_t)p & 7)) {
        crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xff];
        n--;
    }
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t w = load64(p) ^ crc;
        crc = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^
              t[4][(w >> 24) & 0xff] ^ t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^
              t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
    }
#endif
    while (n--) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xff];
    return ~crc;
}

static uint32_t crc32_table(uint32_t crc, const unsigned char *p, size_t n) {
    return crc_table(slice[0], crc, p, n);
}

static uint32_t crc32c_table(uint32_t crc, const unsigned char *p, size_t n) {
    return crc_table(slice[1], crc, p, n);
}

/* ---------------------------------------------------------------- instructions */

/* Three interleaved streams of `len` bytes: c covers the first, c1 and c2 start from zero on
 * the next two; then crc(all) = shift(shift(c) ^ c1) ^ c2 (the register is linear). */
#define HW_CRC(NAME, ATTR, STEP64, STEP8, KIND)                                               \
    ATTR static uint32_t NAME(uint32_t crc, const unsigned char *p, size_t n) {              \
        uint32_t c = ~crc;                                                                   \
        while (n && ((uintptr_t)p & 7)) {                                                    \
            c = STEP8(c, *p++);                                                              \
            n--;                                                                             \
        }                                                                                    \
        static const size_t lens[2] = {LONG_STREAM, SHORT_STREAM};                           \
        for (int s = 0; s < 2; s++) {                                                        \
            const size_t len = lens[s];                                                      \
            uint32_t(*t)[256] = s ? shift_short[KIND - 1] : shift_long[KIND - 1];      \
            for (; n >= 3 * len; n -= 3 * len, p += 2 * len) {                               \
                uint32_t c1 = 0, c2 = 0;                                                     \
                const unsigned char *end = p + len;                                          \
                do {                                                                         \
                    c = (uint32_t)STEP64(c, load64(p));                                      \
                    c1 = (uint32_t)STEP64(c1, load64(p + len));                              \
                    c2 = (uint32_t)STEP64(c2, load64(p + 2 * len));                          \
                    p += 8;                                                                  \
                } while (p < end);                                                           \
                c = shift(t, c) ^ c1;                                                        \
                c = shift(t, c) ^ c2;                                                        \
            }                                                                                \
        }                                                                                    \
        for (; n >= 8; n -= 8, p += 8) c = (uint32_t)STEP64(c, load64(p));                   \
        while (n--) c = STEP8(c, *p++);                                                      \
        return ~c;                                                                           \
    }

#ifdef HAVE_X86
HW_CRC(crc32c_sse42, __attribute__((target("sse4.2"))), _mm_crc32_u64, _mm_crc32_u8,
       CHECKSUM_CRC32C)
#endif
#ifdef HAVE_ARM_CRC
HW_CRC(crc32c_arm, , __crc32cd, __crc32cb, CHECKSUM_CRC32C)
HW_CRC(crc32_arm, , __crc32d, __crc32b, CHECKSUM_CRC32)
#endif

#ifdef HAVE_X86
/* crc32 of n bytes (n >= 64, a multiple of 16) from the register `crc` (pre-inverted):
 * four 128-bit lanes folded forward by x^512, then into one, then Barrett-reduced. */
__attribute__((target("pclmul,sse4.1"))) static uint32_t crc32_fold(uint32_t crc,
                                                                     const unsigned char *p,
                                                                     size_t n) {
    const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596, 0x0154442bd4);
    const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009e, 0x01751997d0);
    const __m128i k5 = _mm_set_epi64x(0, 0x0163cd6124);
    const __m128i poly = _mm_set_epi64x(0x01f7011641, 0x01db710641); /* mu, P' */
    const __m128i low32 = _mm_setr_epi32(~0, 0, ~0, 0);
    __m128i x1 = _mm_loadu_si128((const __m128i *)p), x2 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(p + 32)), x4 = _mm_loadu_si128((const __m128i *)(p + 48));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
    for (p += 64, n -= 64; n >= 64; p += 64, n -= 64) {
#define FOLD(x, k, next)                                                                   \
    x = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00),                      \
                                    _mm_clmulepi64_si128(x, k, 0x11)),                     \
                      next)
        FOLD(x1, k1k2, _mm_loadu_si128((const __m128i *)p));
        FOLD(x2, k1k2, _mm_loadu_si128((const __m128i *)(p + 16)));
        FOLD(x3, k1k2, _mm_loadu_si128((const __m128i *)(p + 32)));
        FOLD(x4, k1k2, _mm_loadu_si128((const __m128i *)(p + 48)));
    }
    FOLD(x1, k3k4, x2);
    FOLD(x1, k3k4, x3);
    FOLD(x1, k3k4, x4);
    for (; n >= 16; p += 16, n -= 16) FOLD(x1, k3k4, _mm_loadu_si128((const __m128i *)p));
#undef FOLD
    /* 128 -> 64 bits */
    x2 = _mm_clmulepi64_si128(x1, k3k4, 0x10);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2);
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, low32), k5, 0x00), x2);
    /* Barrett reduction to 32 bits */
    x2 = _mm_clmulepi64_si128(_mm_and_si128(x1, low32), poly, 0x10);
    x2 = _mm_clmulepi64_si128(_mm_and_si128(x2, low32), poly, 0x00);
    return (uint32_t)_mm_extract_epi32(_mm_xor_si128(x1, x2), 1);
}

static uint32_t crc32_pclmul(uint32_t crc, const unsigned char *p, size_t n) {
    if (n < 64) return crc32_table(crc, p, n);
    size_t body = n & ~(size_t)15;
    crc = ~crc32_fold(~crc, p, body);
    return body == n ? crc : crc32_table(crc, p + body, n - body);
}
#endif

/* ---------------------------------------------------------------- setup */

static void build_shift(Shift t, size_t len, const uint32_t byte_table[256], uint32_t poly) {
    uint32_t op = (uint32_t)1 << 31; /* x^0, times x^8 per zero byte fed */
    for (size_t i = 0; i < len; i++) op = (op >> 8) ^ byte_table[op & 0xff];
    for (int k = 0; k < 4; k++)
        for (uint32_t i = 0; i < 256; i++) t[k][i] = multmodp(op, i << (8 * k), poly);
}

void checksum_init(void) {
    static int done = 0;
    if (done) return;
    const uint32_t polys[2] = {POLY_CRC32, POLY_CRC32C};
    for (int k = 0; k < 2; k++) {
        uint32_t(*t)[256] = slice[k];
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int j = 0; j < 8; j++) c = c & 1 ? (c >> 1) ^ polys[k] : c >> 1;
            t[0][i] = c;
        }
        for (int s = 1; s < 8; s++)
            for (int i = 0; i < 256; i++) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
        build_shift(shift_long[k], LONG_STREAM, t[0], polys[k]);
        build_shift(shift_short[k], SHORT_STREAM, t[0], polys[k]);
        uint32_t p = (uint32_t)1 << 30; /* x^1 (bit 31 is x^0) */
        x2n[k][0] = p;
        for (int n = 1; n < 67; n++) x2n[k][n] = p = multmodp(p, p, polys[k]);
    }
    impl[CHECKSUM_CRC32] = crc32_table;
    impl_name[CHECKSUM_CRC32] = "table";
    impl[CHECKSUM_CRC32C] = crc32c_table;
    impl_name[CHECKSUM_CRC32C] = "table";
#ifdef HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) {
        impl[CHECKSUM_CRC32C] = crc32c_sse42;
        impl_name[CHECKSUM_CRC32C] = "sse4.2";
    }
    if (__builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1")) {
        impl[CHECKSUM_CRC32] = crc32_pclmul;
        impl_name[CHECKSUM_CRC32] = "pclmul";
    }
#endif
#ifdef HAVE_ARM_CRC
    impl[CHECKSUM_CRC32C] = crc32c_arm;
    impl_name[CHECKSUM_CRC32C] = "armv8-crc";
    impl[CHECKSUM_CRC32] = crc32_arm;
    impl_name[CHECKSUM_CRC32] = "armv8-crc";
#endif
    done = 1;
}

uint32_t checksum_update(int kind, uint32_t crc, const void *p, size_t n) {
    return impl[kind](crc, (const unsigned char *)p, n);
}

const char *checksum_impl(int kind) { return impl_name[kind]; }

/* For tests: the portable tables, whatever the CPU has. */
uint32_t checksum_update_table(int kind, uint32_t crc, const void *p, size_t n) {
    return (kind == CHECKSUM_CRC32 ? crc32_table : crc32c_table)(crc, (const unsigned char *)p,
                                                                   n);
}

uint32_t checksum_combine(int kind, uint32_t crc1, uint32_t crc2, uint64_t len2) {
    /* crc(a + b) from crc(a), crc(b) and len(b): crc1 times x^(8 len2) mod P, plus crc2 (the
     * register is linear; the pre- and post-inversions cancel as in zlib's crc32_combine). */
    const uint32_t poly = kind == CHECKSUM_CRC32 ? POLY_CRC32 : POLY_CRC32C;
    uint32_t p = (uint32_t)1 << 31; /* x^0 */
    unsigned k = 3;                  /* 8 len2 = len2 * 2^3 */
    for (; len2; len2 >>= 1, k++)
        if (len2 & 1) p = multmodp(x2n[kind - 1][k], p, poly);
    return multmodp(p, crc1, poly) ^ crc2;
}
