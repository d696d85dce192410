/* Affine-quantized expert matmuls on the CPU, arithmetic for arithmetic MLX's own.

   Owns one function, qmm_pairs: the product x @ W^T of (token, expert) pairs whose weights
   sit in arena slots as MLX affine codes (weight uint32 [N, K * bits / 32], scales and
   biases [N, K / group_size]). Each output is the sum, in order over k, of
   x[k] * (scale * q + bias) in float32 with every product and sum rounded on its own, which
   is what MLX's CPU quantized matmul computes for these widths (its scalar path; the
   Python side checks the two agree bit for bit before it uses this). The sums of several
   outputs run side by side in vector lanes (each lane its own output, the order within a
   lane unchanged): that is where the speed comes from. A pair reads its slot's codes
   straight from the record; a slot with SHARED_PAIRS pairs or more has its weights formed
   once (scale * q + bias, the same two roundings) for all of them. Built with
   -ffp-contract=off: a fused multiply-add would round once where MLX rounds twice.

   Never: reads files, allocates Python objects per pair, or holds the GIL while it
   computes. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { SCALE_F32 = 0, SCALE_F16 = 1, SCALE_BF16 = 2 };

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 113;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float load_scale(const uint8_t *p, int kind) {
    if (kind == SCALE_F32) {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p, 2);
    if (kind == SCALE_F16) return half_to_float(h);
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* x86-64: an AVX2 build of the loop beside the baseline one, picked at load time. Lanes never
   mix: the vector width changes how many outputs run side by side, not any sum. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

#define LANES 8
#define BLOCK 4 /* vectors of outputs in flight: their sums' additions overlap */
/* Pairs of one slot from which its weights are formed once (scale * q + bias, in float) and
   shared; fewer read the codes straight from the record. */
#define SHARED_PAIRS 3

static uint32_t load_word(const uint8_t *p) {
    uint32_t w;
    memcpy(&w, p, 4);
    return w;
}

/* One output's sum, the scalar way (outputs past the last whole block). */
static float one_output(const float *x, const uint8_t *row, const uint8_t *scales,
                        const uint8_t *biases, int K, int bits, int group_size, int kind) {
    const int per_word = 32 / bits;
    const uint32_t mask = (1u << bits) - 1;
    const int ssize = kind == SCALE_F32 ? 4 : 2;
    float acc = 0.0f;
    for (int w = 0; w < K / per_word; w++) {
        uint32_t word = load_word(row + 4 * w);
        for (int p = 0; p < per_word; p++) {
            const int k = w * per_word + p;
            const int g = k / group_size;
            float t = load_scale(scales + g * ssize, kind) * (float)((word >> (bits * p)) & mask);
            t = t + load_scale(biases + g * ssize, kind);
            acc = acc + x[k] * t;
        }
    }
    return acc;
}

/* out[n] = sum over k, in order, of x[k] * (scale * q + bias), every product and sum rounded
   on its own: MLX's _qmm_t, whose codes come low bits first out of each little-endian word.
   LANES x BLOCK outputs at a time, each lane one output's sum, straight from the record. */
VECTOR_CLONES
static void one_pair(const float *restrict x, const uint8_t *rec, Py_ssize_t w_off,
                     Py_ssize_t s_off, Py_ssize_t b_off, int N, int K, int bits,
                     int group_size, int kind, float *restrict out) {
    const int per_word = 32 / bits;
    const int row_bytes = K / 8 * bits;
    const int G = K / group_size;
    const int ssize = kind == SCALE_F32 ? 4 : 2;
    const v8u mask = (v8u){0} + ((1u << bits) - 1);
    int n0 = 0;
    for (; n0 + LANES * BLOCK <= N; n0 += LANES * BLOCK) {
        v8f acc[BLOCK], sc[BLOCK], bi[BLOCK];
        for (int b = 0; b < BLOCK; b++) acc[b] = (v8f){0};
        int g_loaded = -1;
        for (int w = 0; w < K / per_word; w++) {
            uint32_t loaded[BLOCK][LANES];
            for (int b = 0; b < BLOCK; b++)
                for (int i = 0; i < LANES; i++) {
                    const int n = n0 + b * LANES + i;
                    loaded[b][i] = load_word(rec + w_off + (Py_ssize_t)n * row_bytes + 4 * w);
                }
            v8u words[BLOCK];
            memcpy(words, loaded, sizeof words);
            for (int p = 0; p < per_word; p++) {
                const int k = w * per_word + p;
                const int g = k / group_size;
                if (g != g_loaded) {
                    for (int b = 0; b < BLOCK; b++)
                        for (int i = 0; i < LANES; i++) {
                            const Py_ssize_t at = ((Py_ssize_t)(n0 + b * LANES + i) * G + g) * ssize;
                            sc[b][i] = load_scale(rec + s_off + at, kind);
                            bi[b][i] = load_scale(rec + b_off + at, kind);
                        }
                    g_loaded = g;
                }
                const v8f xk = (v8f){0} + x[k];
                for (int b = 0; b < BLOCK; b++) {
                    v8f q = __builtin_convertvector((words[b] >> (uint32_t)(bits * p)) & mask, v8f);
                    v8f t = sc[b] * q;
                    t = t + bi[b];
                    acc[b] = acc[b] + xk * t;
                }
            }
        }
        for (int b = 0; b < BLOCK; b++)
            for (int i = 0; i < LANES; i++) out[n0 + b * LANES + i] = acc[b][i];
    }
    for (int n = n0; n < N; n++) {
        const Py_ssize_t at = (Py_ssize_t)n * G * ssize;
        out[n] = one_output(x, rec + w_off + (Py_ssize_t)n * row_bytes, rec + s_off + at,
                            rec + b_off + at, K, bits, group_size, kind);
    }
}

#define TILE 32 /* outputs whose sums stay in registers across k */

/* One record's weights as MLX's scalar loop forms them, scale * q + bias (two roundings),
   in float [K][N]: k-major, so that consecutive outputs are consecutive floats. */
VECTOR_CLONES
static void dequantize(const uint8_t *rec, Py_ssize_t w_off, Py_ssize_t s_off,
                       Py_ssize_t b_off, int N, int K, int bits, int group_size,
                       int scale_kind, uint8_t *restrict codes, float *restrict scales,
                       float *restrict biases, float *restrict weights) {
    const int per_byte = 8 / bits;
    const unsigned mask = (1u << bits) - 1;
    const int row_bytes = K / per_byte;
    const int G = K / group_size;
    const int ssize = scale_kind == SCALE_F32 ? 4 : 2;
    for (int n = 0; n < N; n++) {
        const uint8_t *w = rec + w_off + (Py_ssize_t)n * row_bytes;
        for (int j = 0; j < row_bytes; j++) codes[(Py_ssize_t)j * N + n] = w[j];
        for (int g = 0; g < G; g++) {
            Py_ssize_t at = ((Py_ssize_t)n * G + g) * ssize;
            scales[g * N + n] = load_scale(rec + s_off + at, scale_kind);
            biases[g * N + n] = load_scale(rec + b_off + at, scale_kind);
        }
    }
    /* codes come low bits first out of each byte (MLX's packing) */
    for (int j = 0; j < row_bytes; j++) {
        const uint8_t *restrict q = codes + (Py_ssize_t)j * N;
        for (int p = 0; p < per_byte; p++) {
            const int k = j * per_byte + p;
            const float *restrict s = scales + (Py_ssize_t)(k / group_size) * N;
            const float *restrict b = biases + (Py_ssize_t)(k / group_size) * N;
            float *restrict wk = weights + (Py_ssize_t)k * N;
            const unsigned shift = (unsigned)(bits * p);
            for (int n = 0; n < N; n++) {
                float t = s[n] * (float)((q[n] >> shift) & mask);
                wk[n] = t + b[n];
            }
        }
    }
}

/* out[n] = sum over k, in order, of x[k] * weights[k][n], each product and sum rounded: the
   same sums, once a slot's weights are formed for several pairs. */
VECTOR_CLONES
static void shared_pair(const float *restrict x, const float *restrict weights, int N, int K,
                     float *restrict out) {
    int n0 = 0;
    for (; n0 + TILE <= N; n0 += TILE) {
        float acc[TILE];
        for (int j = 0; j < TILE; j++) acc[j] = 0.0f;
        for (int k = 0; k < K; k++) {
            const float xk = x[k];
            const float *restrict w = weights + (Py_ssize_t)k * N + n0;
            for (int j = 0; j < TILE; j++) acc[j] = acc[j] + xk * w[j];
        }
        for (int j = 0; j < TILE; j++) out[n0 + j] = acc[j];
    }
    for (int n = n0; n < N; n++) {
        float acc = 0.0f;
        for (int k = 0; k < K; k++) acc = acc + x[k] * weights[(Py_ssize_t)k * N + n];
        out[n] = acc;
    }
}

static PyObject *qmm_pairs(PyObject *self, PyObject *args) {
    Py_buffer out, x, arena, pair_x, pair_slot, order;
    Py_ssize_t record_bytes, w_off, s_off, b_off;
    int N, K, bits, group_size, scale_kind;
    if (!PyArg_ParseTuple(args, "w*y*y*y*y*y*nnnniiiii", &out, &x, &arena, &pair_x, &pair_slot,
                          &order, &record_bytes, &w_off, &s_off, &b_off, &N, &K, &bits,
                          &group_size, &scale_kind))
        return NULL;
    PyObject *result = NULL;
    const char *bad = NULL;
    Py_ssize_t n_pairs = pair_slot.len / 4, n_rows = x.len / 4 / (K > 0 ? K : 1);
    Py_ssize_t n_slots = record_bytes > 0 ? arena.len / record_bytes : 0;
    int G = group_size > 0 ? K / group_size : 0;
    int ssize = scale_kind == SCALE_F32 ? 4 : 2;
    if (!(bits == 2 || bits == 4 || bits == 8) || N <= 0 || K <= 0 || group_size <= 0 ||
        K % group_size || K % (32 / bits) || scale_kind < 0 || scale_kind > 2)
        bad = "unsupported shape or format";
    else if (out.len != n_pairs * N * 4 || pair_x.len != pair_slot.len || order.len != pair_slot.len ||
             x.len != n_rows * K * 4 || arena.len != n_slots * record_bytes)
        bad = "buffer sizes do not match";
    else if (w_off < 0 || w_off + (Py_ssize_t)N * K / (8 / bits) > record_bytes || s_off < 0 ||
             s_off + (Py_ssize_t)N * G * ssize > record_bytes || b_off < 0 ||
             b_off + (Py_ssize_t)N * G * ssize > record_bytes)
        bad = "components outside the record";
    const int32_t *px = pair_x.buf, *ps = pair_slot.buf, *po = order.buf;
    for (Py_ssize_t i = 0; !bad && i < n_pairs; i++) {
        if (po[i] < 0 || po[i] >= n_pairs || px[i] < 0 || px[i] >= n_rows || ps[i] < 0 ||
            ps[i] >= n_slots)
            bad = "index out of range";
    }
    if (bad) {
        PyErr_SetString(PyExc_ValueError, bad);
        goto done;
    }
    uint8_t *codes = NULL;
    float *sc = NULL, *bi = NULL, *wt = NULL;
    codes = malloc((size_t)K * N / (8 / bits));
    sc = malloc(sizeof(float) * (size_t)G * N);
    bi = malloc(sizeof(float) * (size_t)G * N);
    wt = malloc(sizeof(float) * (size_t)K * N);
    if (!codes || !sc || !bi || !wt) {
        free(codes);
        free(sc);
        free(bi);
        free(wt);
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < n_pairs;) {
        const int32_t slot = ps[po[i]];
        Py_ssize_t run = 1;
        while (i + run < n_pairs && ps[po[i + run]] == slot) run++;
        const uint8_t *rec = (const uint8_t *)arena.buf + (Py_ssize_t)slot * record_bytes;
        if (run >= SHARED_PAIRS)
            dequantize(rec, w_off, s_off, b_off, N, K, bits, group_size, scale_kind, codes, sc, bi,
                       wt);
        for (Py_ssize_t j = i; j < i + run; j++) {
            const int32_t p = po[j];
            const float *xp = (const float *)x.buf + (Py_ssize_t)px[p] * K;
            float *op = (float *)out.buf + (Py_ssize_t)p * N;
            if (run >= SHARED_PAIRS)
                shared_pair(xp, wt, N, K, op);
            else
                one_pair(xp, rec, w_off, s_off, b_off, N, K, bits, group_size, scale_kind, op);
        }
        i += run;
    }
    Py_END_ALLOW_THREADS;
    free(codes);
    free(sc);
    free(bi);
    free(wt);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&x);
    PyBuffer_Release(&arena);
    PyBuffer_Release(&pair_x);
    PyBuffer_Release(&pair_slot);
    PyBuffer_Release(&order);
    return result;
}

static PyMethodDef methods[] = {
    {"qmm_pairs", qmm_pairs, METH_VARARGS,
     "qmm_pairs(out, x, arena, pair_x, pair_slot, order, record_bytes, w_off, s_off, b_off, "
     "N, K, bits, group_size, scale_kind) -> None: out[p] = x[pair_x[p]] @ W(slot "
     "pair_slot[p])^T for p in `order` (a slot's pairs adjacent in it)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_experts",
                                    "Affine expert matmuls on the CPU (see cpu_experts.c).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__cpu_experts(void) { return PyModule_Create(&module); }
