// The weight formats of the expert kernels: one decoder per format, written once for every
// dialect (Metal, CUDA, host C++), as llama.cpp's dequantize_row_* are.
//
// A *chunk* is 16 consecutive weights of one row, chunk c = weights [16c, 16c + 16). Every
// supported format keeps one (scale, offset) per chunk, so a decoder returns the chunk as
//   w[j] = scale * q[j] + offset,   j = 0..15,
// with q[j] small integers (signed for the i-quants; signed multiples of 0.5 for MXFP4) held
// exactly in float32. The kernels (algorithm.py) dot q with the activations first and scale
// once per chunk.
//
// Each decoder is checked bit for bit against the reference dequantizers
// (strata_mlx.format.gguf_quants, mx.dequantize, strata_mlx.format.quant.dequantize_mxfp4) by
// tests/runtime/test_kernels.py, compiled as host C++: on random blocks whose fp16 fields take any
// finite value (subnormal and huge ones too), MXFP4 on every E8M0 scale, and sk_f16 on all
// 65536 bit patterns; loads are checked aligned and inside the row under AddressSanitizer and
// UBSan.
//
// This file names only what each dialect's PRELUDE defines (custom_kernels/cuda.py, host.py
// and the Apple-silicon one): SK_FN, SK_GLOBAL, SK_UNROLL, sk_as_float, sk_tof. No
// preprocessor lines: every dialect compiles this text unchanged.

// ---- little-endian loads at byte offset o of a row, and scale fields --------------------------

SK_FN uint32_t sk_ld8(const SK_GLOBAL uint8_t* p, uint32_t o) {
  return (uint32_t)p[o];
}
SK_FN uint32_t sk_ld16(const SK_GLOBAL uint8_t* p, uint32_t o) {
  return (uint32_t)(*(const SK_GLOBAL uint16_t*)(p + o));
}
SK_FN uint32_t sk_ld32(const SK_GLOBAL uint8_t* p, uint32_t o) {
  return *(const SK_GLOBAL uint32_t*)(p + o);
}
// An IEEE fp16 from its bits, subnormals, infinities and NaN included (no fp16 type needed).
SK_FN float sk_f16(uint32_t h) {
  const uint32_t e = (h >> 10u) & 31u;
  const uint32_t m = h & 1023u;
  float v;
  if (e == 0u) {
    v = (float)m * sk_as_float(0x33800000u);
  } else if (e == 31u) {
    v = sk_as_float(0x7f800000u | (m << 13u));
  } else {
    v = sk_as_float(((e + 112u) << 23u) | (m << 13u));
  }
  return (h & 0x8000u) != 0u ? -v : v;
}
SK_FN float sk_bf16(uint32_t b) {
  return sk_as_float(b << 16u);
}
SK_FN float sk_f32(uint32_t b) {
  return sk_as_float(b);
}

// One decoded chunk. Formats without an offset leave it 0 and the kernels never read it.
struct sk_chunk {
  float scale;
  float offset;
  float q[16];
};

// ---- MLX affine (mx.quantize): BITS-bit weights, one scale and bias per GROUP_SIZE ------------
// The row is a little-endian bit stream, weight i at bits [i * BITS, i * BITS + BITS);
// w = scale[g] * q + bias[g], g = i / GROUP_SIZE. Scales and biases are in one dtype:

enum sk_scales { SK_SCALES_F16, SK_SCALES_BF16, SK_SCALES_F32 };

template <sk_scales SCALES>
SK_FN float sk_scale_at(const SK_GLOBAL uint8_t* p, uint32_t g) {
  if (SCALES == SK_SCALES_F32) {
    return sk_f32(sk_ld32(p, g * 4u));
  }
  const uint32_t bits = sk_ld16(p, g * 2u);
  return SCALES == SK_SCALES_BF16 ? sk_bf16(bits) : sk_f16(bits);
}

template <uint32_t BITS, uint32_t GROUP_SIZE, sk_scales SCALES>
SK_FN sk_chunk sk_decode_affine(const SK_GLOBAL uint8_t* w, const SK_GLOBAL uint8_t* scales,
                                const SK_GLOBAL uint8_t* biases, uint32_t c) {
  // The chunk's 16 * BITS bits are 2 * BITS bytes: read as 32-bit words when that is a
  // multiple of 4 (even BITS), else as 16-bit words (the row is only 2-byte aligned then).
  const uint32_t WORD = (2u * BITS) % 4u == 0u ? 32u : 16u;
  const uint32_t N_WORDS = 16u * BITS / WORD;
  uint32_t words[BITS];
  SK_UNROLL
  for (uint32_t k = 0u; k < N_WORDS; ++k) {
    const uint32_t o = c * 2u * BITS + k * (WORD / 8u);
    words[k] = WORD == 32u ? sk_ld32(w, o) : sk_ld16(w, o);
  }
  sk_chunk r;
  const uint32_t g = c / (GROUP_SIZE / 16u);
  r.scale = sk_scale_at<SCALES>(scales, g);
  r.offset = sk_scale_at<SCALES>(biases, g);
  SK_UNROLL
  for (uint32_t j = 0u; j < 16u; ++j) {
    const uint32_t k = j * BITS / WORD;
    const uint32_t shift = j * BITS % WORD;
    uint32_t v = words[k] >> shift;
    if (shift + BITS > WORD) {  // the weight straddles two words
      v = v | (words[k + 1u] << (WORD - shift));
    }
    r.q[j] = (float)(v & ((1u << BITS) - 1u));
  }
  return r;
}

// ---- GGUF k-quants and i-quants: 256 weights a block, 16 chunks a block -----------------------

// IQ2_XS, 74 bytes: d f16 | qs u16[32] (9-bit grid index | 7-bit sign index) | scales u8[8]
// (a nibble per 16 weights). A chunk is 2 grid entries of 8 weights (grid: 2 uint32 an entry).
SK_FN sk_chunk sk_decode_iq2_xs(const SK_GLOBAL uint8_t* w, uint32_t c,
                                const SK_GLOBAL uint32_t* iq2xs_grid,
                                const SK_GLOBAL uint32_t* iq2xs_signs) {
  const uint32_t bo = (c >> 4u) * 74u;
  const uint32_t e = c & 15u;
  const uint32_t sc = (sk_ld8(w, bo + 66u + (e >> 1u)) >> ((e & 1u) * 4u)) & 15u;
  sk_chunk r;
  r.scale = sk_f16(sk_ld16(w, bo)) * (0.5f + (float)sc) * 0.25f;
  r.offset = 0.0f;
  SK_UNROLL
  for (uint32_t h = 0u; h < 2u; ++h) {
    const uint32_t qs = sk_ld16(w, bo + 2u + e * 4u + h * 2u);
    const uint32_t signs = iq2xs_signs[qs >> 9u];
    const uint32_t grid[2] = {iq2xs_grid[(qs & 511u) * 2u], iq2xs_grid[(qs & 511u) * 2u + 1u]};
    SK_UNROLL
    for (uint32_t j = 0u; j < 8u; ++j) {
      const float g = (float)((grid[j >> 2u] >> (8u * (j & 3u))) & 255u);
      r.q[h * 8u + j] = ((signs >> j) & 1u) != 0u ? -g : g;
    }
  }
  return r;
}

// IQ3_S, 110 bytes: d f16 | qs u8[64] (low 8 bits of grid index) | qh u8[8] (9th bits)
// | signs u8[32] (a bit per weight) | scales u8[4] (a nibble per 32 weights).
// A chunk is 4 grid entries of 4 weights.
SK_FN sk_chunk sk_decode_iq3_s(const SK_GLOBAL uint8_t* w, uint32_t c,
                               const SK_GLOBAL uint32_t* iq3s_grid) {
  const uint32_t bo = (c >> 4u) * 110u;
  const uint32_t e = c & 15u;
  const uint32_t sc = (sk_ld8(w, bo + 106u + (e >> 2u)) >> (((e >> 1u) & 1u) * 4u)) & 15u;
  const uint32_t qh = sk_ld8(w, bo + 66u + (e >> 1u)) >> ((e & 1u) * 4u);
  const uint32_t signs = sk_ld16(w, bo + 74u + e * 2u);
  sk_chunk r;
  r.scale = sk_f16(sk_ld16(w, bo)) * (float)(1u + 2u * sc);
  r.offset = 0.0f;
  SK_UNROLL
  for (uint32_t k = 0u; k < 4u; ++k) {
    const uint32_t grid = iq3s_grid[sk_ld8(w, bo + 2u + e * 4u + k) | (((qh >> k) & 1u) << 8u)];
    SK_UNROLL
    for (uint32_t i = 0u; i < 4u; ++i) {
      const uint32_t j = k * 4u + i;
      const float g = (float)((grid >> (8u * i)) & 255u);
      r.q[j] = ((signs >> j) & 1u) != 0u ? -g : g;
    }
  }
  return r;
}

// Q4_K, 144 bytes: d f16 | dmin f16 | scales u8[12] (8 6-bit scales and mins) | qs u8[128]
// (32-byte run r holds sub-blocks 2r (low nibbles) and 2r+1 (high)). w = d*sc*q - dmin*m.
SK_FN sk_chunk sk_decode_q4_k(const SK_GLOBAL uint8_t* w, uint32_t c) {
  const uint32_t bo = (c >> 4u) * 144u;
  const uint32_t e = c & 15u;
  const uint32_t s = e >> 1u;  // the sub-block of 32 weights
  const uint32_t sd = sk_ld8(w, bo + 4u + (s & 3u));
  const uint32_t sm = sk_ld8(w, bo + 8u + (s & 3u));
  const uint32_t smd = sk_ld8(w, bo + 12u + (s & 3u));
  const uint32_t sc = (s >> 2u) != 0u ? (smd & 15u) | ((sd >> 2u) & 48u) : sd & 63u;
  const uint32_t mn = (s >> 2u) != 0u ? (smd >> 4u) | ((sm >> 2u) & 48u) : sm & 63u;
  const uint32_t shift = (s & 1u) * 4u;
  const uint32_t qs = bo + 16u + (s >> 1u) * 32u + (e & 1u) * 16u;
  sk_chunk r;
  r.scale = sk_f16(sk_ld16(w, bo)) * (float)sc;
  r.offset = -(sk_f16(sk_ld16(w, bo + 2u)) * (float)mn);
  SK_UNROLL
  for (uint32_t k = 0u; k < 4u; ++k) {
    const uint32_t v = sk_ld32(w, qs + 4u * k);
    SK_UNROLL
    for (uint32_t i = 0u; i < 4u; ++i) {
      r.q[k * 4u + i] = (float)((v >> (shift + 8u * i)) & 15u);
    }
  }
  return r;
}

// Q2_K, 84 bytes: scales u8[16] (low nibble scale, high nibble min, per 16 weights)
// | qs u8[64] (two 32-byte parts; 2-bit plane p of part h = weights 128h + 32p + l)
// | d f16 | dmin f16.
SK_FN sk_chunk sk_decode_q2_k(const SK_GLOBAL uint8_t* w, uint32_t c) {
  const uint32_t bo = (c >> 4u) * 84u;
  const uint32_t e = c & 15u;
  const uint32_t sb = sk_ld8(w, bo + e);
  const uint32_t shift = ((e >> 1u) & 3u) * 2u;
  const uint32_t qs = bo + 16u + (e >> 3u) * 32u + (e & 1u) * 16u;
  sk_chunk r;
  r.scale = sk_f16(sk_ld16(w, bo + 80u)) * (float)(sb & 15u);
  r.offset = -(sk_f16(sk_ld16(w, bo + 82u)) * (float)(sb >> 4u));
  SK_UNROLL
  for (uint32_t k = 0u; k < 4u; ++k) {
    const uint32_t v = sk_ld32(w, qs + 4u * k);
    SK_UNROLL
    for (uint32_t i = 0u; i < 4u; ++i) {
      r.q[k * 4u + i] = (float)((v >> (shift + 8u * i)) & 3u);
    }
  }
  return r;
}

// ---- OCP MXFP4 (GPT-OSS's experts; mx.quantize mode "mxfp4"): 32 weights a block --------------
// Row W: 4-bit E2M1 codes, two a byte, low nibble first (16 bytes a block); row S: one E8M0
// byte s a block, 2^(s - 127). w = E2M1[code] * 2^(s - 127). A chunk is 16 of a block's 32
// weights, 8 bytes of codes (two 32-bit words); both chunks of a block read one scale byte.

// 2^(s - 127) as float32 bits: s is the exponent field; s = 0 is the subnormal 2^-127;
// s = 255 gives inf (as mx.dequantize; OCP reserves it for NaN).
SK_FN float sk_e8m0(uint32_t s) {
  return s == 0u ? sk_as_float(0x00400000u) : sk_as_float(s << 23u);
}

SK_FN sk_chunk sk_decode_mxfp4(const SK_GLOBAL uint8_t* w, const SK_GLOBAL uint8_t* scales,
                               uint32_t c) {
  sk_chunk r;
  r.scale = sk_e8m0(sk_ld8(scales, c >> 1u));
  r.offset = 0.0f;
  SK_UNROLL
  for (uint32_t k = 0u; k < 2u; ++k) {
    const uint32_t v = sk_ld32(w, c * 8u + k * 4u);
    SK_UNROLL
    for (uint32_t i = 0u; i < 8u; ++i) {
      // E2M1: sign | 2-bit exponent e | 1 mantissa bit m; twice its magnitude is
      // m (e = 0, subnormal) or (2 + m) << (e - 1): 0, 1, 2, 3, 4, 6, 8, 12
      const uint32_t code = (v >> (4u * i)) & 15u;
      const uint32_t e = (code >> 1u) & 3u;
      const uint32_t m = code & 1u;
      const float g = (float)(e == 0u ? m : (2u + m) << (e - 1u)) * 0.5f;
      r.q[k * 8u + i] = (code & 8u) != 0u ? -g : g;
    }
  }
  return r;
}

// ---- a chunk against 16 activations ----------------------------------------------------------

struct sk_x16 {
  float v[16];
};

template <typename X>
SK_FN sk_x16 sk_load_x16(const SK_GLOBAL X* x) {
  sk_x16 r;
  SK_UNROLL
  for (uint32_t j = 0u; j < 16u; ++j) {
    r.v[j] = sk_tof(x[j]);
  }
  return r;
}

// q . x, summed left to right (q[0] * x[0] + q[1] * x[1] + ...): one order for every dialect.
SK_FN float sk_dot16(sk_chunk w, sk_x16 x) {
  float s = w.q[0] * x.v[0];
  SK_UNROLL
  for (uint32_t j = 1u; j < 16u; ++j) {
    s = s + w.q[j] * x.v[j];
  }
  return s;
}

SK_FN float sk_sum16(sk_x16 x) {
  float s = x.v[0];
  SK_UNROLL
  for (uint32_t j = 1u; j < 16u; ++j) {
    s = s + x.v[j];
  }
  return s;
}
