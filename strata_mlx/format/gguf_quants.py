"""GGUF (ggml) block quant formats: one reference dequantizer per format.

The formats as data (`FORMATS`: the byte layout of each supported ggml block, from llama.cpp's
ggml-common.h as mirrored by gguf-py; `row_bytes`; the i-quant codebooks and sign tables) are
custom_kernels.ggml's, one source for the kernels and this reference, imported here. Owns: the
tables as MLX arrays (so a GPU kernel can take them as inputs) and `dequantize`, which decodes raw block bytes with plain `mlx.core` ops (view, shifts,
masks, take, reshape; no Python loop over blocks) so it runs on any MLX backend and is the
oracle that custom kernels are tested against. Every decoder follows gguf-py's float32
operation order, so its output is bit-identical to `gguf.quants.dequantize`.

Exactness note for kernels: in every format here the products (fp16 d, 11 significant bits)
x (integer sub-scale) x (integer quant / grid value) need at most 23 significant bits, so
they are exact in float32 whatever the order, and the only rounding is the final `- dmin*m`
(Q2_K/Q4_K/Q5_K) or `+ m` (Q4_1). Any float32 evaluation, with or without FMA, therefore
reproduces these values bit-for-bit; computing in fp16/bf16 does not.

Never: reads or writes files, parses GGUF headers/metadata, or quantizes on its own
(`quantize_reference` only delegates to gguf-py for the types gguf-py can quantize).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import cache

import gguf
import mlx.core as mx
import numpy as np

from custom_kernels import ggml
from custom_kernels.ggml import FORMATS as FORMATS
from custom_kernels.ggml import BlockFormat, get_format
from custom_kernels.ggml import row_bytes as row_bytes

# ---------------------------------------------------------------------------------------------
# Codebooks and sign tables as MLX arrays (custom_kernels.ggml builds them from gguf-py's).
# Byte j of grid row i is weight j of that codebook entry, so `grid.view(mx.uint64)` (IQ2_XS)
# or `grid.view(mx.uint32)` (IQ3_S) gives llama.cpp's packed little-endian tables exactly.


@cache
def iq2xs_grid() -> mx.array:
    """IQ2_XS codebook: uint8 [512, 8], entries in {0x08, 0x19, 0x2b}."""
    return mx.array(ggml.grid("IQ2_XS"))


@cache
def iq3s_grid() -> mx.array:
    """IQ3_S codebook: uint8 [512, 4], entries in {1, 3, ..., 15}."""
    return mx.array(ggml.grid("IQ3_S"))


@cache
def ksigns_iq2xs() -> mx.array:
    """uint8 [128]: 7 stored sign bits -> 8 sign bits (bit 7 = parity of the low 7)."""
    return mx.array(ggml.ksigns_iq2xs())


@cache
def kmask_iq2xs() -> mx.array:
    """uint8 [8]: 1 << j, the per-weight bit mask for sign bytes."""
    return mx.array(np.array([1 << j for j in range(8)], dtype=np.uint8))


# ---------------------------------------------------------------------------------------------
# Decoders: b is uint8 [n_blocks, type_size] -> float32 [n_blocks, block_size].
# Each mirrors gguf-py's (= ggml's) float32 op order: scale products first, then d * q (- m).


def _u8(values: Sequence[int], shape: Sequence[int]) -> mx.array:
    return mx.array(np.asarray(values, dtype=np.uint8).reshape(shape))


def _f16(b: mx.array, f: BlockFormat, name: str) -> mx.array:
    """fp16 field -> float32 [n_blocks, 1]."""
    return b[:, f.field(name)].view(mx.float16).astype(mx.float32)


def _get(b: mx.array, f: BlockFormat, name: str) -> mx.array:
    return b[:, f.field(name)]


def _nibbles(x: mx.array) -> mx.array:
    """[n, k] bytes -> [n, 2k]: low nibbles of each byte pair interleaved (lo, hi, lo, hi...)."""
    n = x.shape[0]
    return ((x[:, :, None] >> _u8([0, 4], (1, 1, 2))) & 0x0F).reshape(n, -1)


def _dq_q4_0(b: mx.array, f: BlockFormat) -> mx.array:
    n = b.shape[0]
    d = _f16(b, f, "d")
    # byte i holds weight i (low nibble) and weight i + 16 (high nibble)
    q = (_get(b, f, "qs").reshape(n, 1, 16) >> _u8([0, 4], (1, 2, 1))) & 0x0F
    q = (q.reshape(n, 32).astype(mx.int8) - 8).astype(mx.float32)
    return d * q


def _dq_q4_1(b: mx.array, f: BlockFormat) -> mx.array:
    n = b.shape[0]
    d, m = _f16(b, f, "d"), _f16(b, f, "m")
    q = (_get(b, f, "qs").reshape(n, 1, 16) >> _u8([0, 4], (1, 2, 1))) & 0x0F
    return d * q.reshape(n, 32).astype(mx.float32) + m


def _dq_q8_0(b: mx.array, f: BlockFormat) -> mx.array:
    d = _f16(b, f, "d")
    return _get(b, f, "qs").view(mx.int8).astype(mx.float32) * d


def _dq_q2_k(b: mx.array, f: BlockFormat) -> mx.array:
    n = b.shape[0]
    scales = _get(b, f, "scales")
    d, dmin = _f16(b, f, "d"), _f16(b, f, "dmin")
    dl = (d * (scales & 0x0F).astype(mx.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).astype(mx.float32)).reshape(n, 16, 1)
    # each 32-byte half of qs feeds 128 weights; 2-bit plane j -> weights 32j .. 32j+31
    q = (_get(b, f, "qs").reshape(n, 2, 1, 32) >> _u8([0, 2, 4, 6], (1, 1, 4, 1))) & 3
    q = q.reshape(n, 16, 16).astype(mx.float32)
    return (dl * q - ml).reshape(n, 256)


def _dq_q3_k(b: mx.array, f: BlockFormat) -> mx.array:
    n = b.shape[0]
    d = _f16(b, f, "d")
    sc = _get(b, f, "scales")
    # 16 6-bit scales: low 4 bits from nibbles of bytes 0..7, high 2 bits from bytes 8..11
    lo = (sc[:, :8].reshape(n, 1, 8) >> _u8([0, 4], (1, 2, 1))).reshape(n, 16)
    hi = (sc[:, 8:].reshape(n, 1, 4) >> _u8([0, 2, 4, 6], (1, 4, 1))).reshape(n, 16)
    s = ((lo & 0x0F) | ((hi & 3) << 4)).astype(mx.int8) - 32
    dl = (d * s.astype(mx.float32)).reshape(n, 16, 1)
    ql = (_get(b, f, "qs").reshape(n, 2, 1, 32) >> _u8([0, 2, 4, 6], (1, 1, 4, 1))) & 3
    qh = (_get(b, f, "hmask").reshape(n, 1, 1, 32) >> _u8(range(8), (1, 1, 8, 1))) & 1
    # the high bit *clear* means "subtract 4"
    qh = qh.reshape(n, 16, 16) ^ 1
    q = (ql.reshape(n, 16, 16).astype(mx.int8) - (qh << 2).astype(mx.int8)).astype(mx.float32)
    return (dl * q).reshape(n, 256)


def _k_scale_min(scales: mx.array) -> tuple[mx.array, mx.array]:
    """Q4_K/Q5_K: 12 bytes -> 8 6-bit scales and 8 6-bit mins (uint8 [n, 8] each)."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    sd, sm, smd = s[:, 0], s[:, 1], s[:, 2]
    sc = mx.concatenate([sd & 0x3F, (smd & 0x0F) | ((sd >> 2) & 0x30)], axis=-1)
    mn = mx.concatenate([sm & 0x3F, (smd >> 4) | ((sm >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_scales(b: mx.array, f: BlockFormat) -> tuple[mx.array, mx.array]:
    n = b.shape[0]
    d, dmin = _f16(b, f, "d"), _f16(b, f, "dmin")
    sc, mn = _k_scale_min(_get(b, f, "scales"))
    dl = (d * sc.astype(mx.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.astype(mx.float32)).reshape(n, 8, 1)
    return dl, ml


def _k_low_nibbles(qs: mx.array) -> mx.array:
    """128 bytes -> [n, 8, 32]: 32-byte chunk c gives sub-blocks 2c (low) and 2c+1 (high)."""
    n = qs.shape[0]
    return ((qs.reshape(n, 4, 1, 32) >> _u8([0, 4], (1, 1, 2, 1))) & 0x0F).reshape(n, 8, 32)


def _dq_q4_k(b: mx.array, f: BlockFormat) -> mx.array:
    n = b.shape[0]
    dl, ml = _k_scales(b, f)
    q = _k_low_nibbles(_get(b, f, "qs")).astype(mx.float32)
    return (dl * q - ml).reshape(n, 256)


def _dq_q5_k(b: mx.array, f: BlockFormat) -> mx.array:
    n = b.shape[0]
    dl, ml = _k_scales(b, f)
    ql = _k_low_nibbles(_get(b, f, "qs"))
    # bit j of qh[l] is the 5th bit of weight 32j + l
    qh = (_get(b, f, "qh").reshape(n, 1, 1, 32) >> _u8(range(8), (1, 1, 8, 1))) & 1
    q = (ql | (qh.reshape(n, 8, 32) << 4)).astype(mx.float32)
    return (dl * q - ml).reshape(n, 256)


def _dq_q6_k(b: mx.array, f: BlockFormat) -> mx.array:
    n = b.shape[0]
    d = _f16(b, f, "d")
    dl = (d * _get(b, f, "scales").view(mx.int8).astype(mx.float32)).reshape(n, 16, 1)
    ql = (_get(b, f, "ql").reshape(n, 2, 1, 64) >> _u8([0, 4], (1, 1, 2, 1))) & 0x0F
    qh = (_get(b, f, "qh").reshape(n, 2, 1, 32) >> _u8([0, 2, 4, 6], (1, 1, 4, 1))) & 3
    q = (ql.reshape(n, 8, 32) | (qh.reshape(n, 8, 32) << 4)).astype(mx.int8) - 32
    return (dl * q.reshape(n, 16, 16).astype(mx.float32)).reshape(n, 256)


def _sign_from_bits(bits: mx.array) -> mx.array:
    """uint8 bit (0/1) -> float32 +1/-1."""
    return mx.where(bits == 0, mx.array(1.0, mx.float32), mx.array(-1.0, mx.float32))


def _dq_iq2_xs(b: mx.array, f: BlockFormat) -> mx.array:
    n = b.shape[0]
    d = _f16(b, f, "d")
    qs = _get(b, f, "qs").view(mx.uint16)  # [n, 32]: 9-bit grid index | 7-bit sign index << 9
    sc = _nibbles(_get(b, f, "scales")).astype(mx.float32)  # [n, 16], one per 16 weights
    db = (d * (0.5 + sc) * 0.25).reshape(n, 16, 1, 1)
    signs = mx.take(ksigns_iq2xs(), (qs >> 9).astype(mx.int32), axis=0)  # [n, 32]
    bits = (signs[:, :, None] >> _u8(range(8), (1, 1, 8))) & 1
    sign = _sign_from_bits(bits).reshape(n, 16, 2, 8)
    grid = (
        mx.take(iq2xs_grid(), (qs & 511).astype(mx.int32), axis=0)
        .astype(mx.float32)
        .reshape(n, 16, 2, 8)
    )
    return (db * grid * sign).reshape(n, 256)


def _dq_iq3_s(b: mx.array, f: BlockFormat) -> mx.array:
    n = b.shape[0]
    d = _f16(b, f, "d")
    sc = _nibbles(_get(b, f, "scales"))  # [n, 8], one per 32 weights
    db = (d * (1 + 2 * sc).astype(mx.float32)).reshape(n, 8, 1, 1)
    bits = (_get(b, f, "signs")[:, :, None] >> _u8(range(8), (1, 1, 8))) & 1
    sign = _sign_from_bits(bits).reshape(n, 8, 4, 8)
    # bit i of the qh bytes (little-endian bit order) is the 9th bit of grid index i
    qh = (_get(b, f, "qh")[:, :, None] >> _u8(range(8), (1, 1, 8))) & 1
    idx = _get(b, f, "qs").astype(mx.uint16) | (qh.reshape(n, 64).astype(mx.uint16) << 8)
    grid = mx.take(iq3s_grid(), idx.astype(mx.int32), axis=0).astype(mx.float32).reshape(n, 8, 4, 8)
    return (db * grid * sign).reshape(n, 256)


_DECODERS: dict[str, Callable[[mx.array, BlockFormat], mx.array]] = {
    "Q4_0": _dq_q4_0,
    "Q4_1": _dq_q4_1,
    "Q8_0": _dq_q8_0,
    "Q2_K": _dq_q2_k,
    "Q3_K": _dq_q3_k,
    "Q4_K": _dq_q4_k,
    "Q5_K": _dq_q5_k,
    "Q6_K": _dq_q6_k,
    "IQ2_XS": _dq_iq2_xs,
    "IQ3_S": _dq_iq3_s,
}
assert set(_DECODERS) == set(FORMATS)


def dequantize(
    fmt: str | BlockFormat,
    blocks: mx.array,
    shape: tuple[int, ...],
    dtype: mx.Dtype = mx.float32,
) -> mx.array:
    """Raw ggml blocks -> float weights of `shape`.

    `blocks` is uint8, rows of blocks ([..., row_bytes]) or flat; `shape[-1]` is weights per
    row (a multiple of the block size). Computed in float32 (bit-identical to gguf-py's
    `gguf.quants.dequantize`), then cast to `dtype`.
    """
    f = get_format(fmt)
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("shape must have at least one dimension")
    row_bytes(f, shape[-1])  # validates the row length
    if not isinstance(blocks, mx.array):
        blocks = mx.array(np.asarray(blocks))
    if blocks.dtype != mx.uint8:
        raise TypeError(f"blocks must be uint8 raw bytes, got {blocks.dtype}")
    n_blocks = math.prod(shape) // f.block_size
    if blocks.size != n_blocks * f.type_size:
        raise ValueError(
            f"{f.name}: {blocks.size} bytes given, shape {shape} needs {n_blocks * f.type_size}"
        )
    out = _DECODERS[f.name](blocks.reshape(n_blocks, f.type_size), f).reshape(shape)
    return out if dtype == mx.float32 else out.astype(dtype)


def quantize_reference(fmt: str | BlockFormat, weights: np.ndarray) -> np.ndarray:
    """float weights [..., n_cols] -> uint8 [..., row_bytes], via gguf-py's quantizer only.

    gguf-py quantizes Q4_0 / Q4_1 / Q8_0 (among ours); other types raise NotImplementedError.
    """
    f = get_format(fmt)
    w = np.asarray(weights, dtype=np.float32)
    try:
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType(f.ggml_type))
    except NotImplementedError:
        raise NotImplementedError(f"gguf-py cannot quantize {f.name}") from None
