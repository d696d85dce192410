"""GGUF block dequantizers (plain MLX ops) against gguf-py's own `gguf.quants.dequantize`.

Random block bytes exercise every bit of every quant/scale/sign field; the fp16 scale fields
are overwritten with random *finite* fp16 bit patterns (normals, subnormals, zeros, both
signs), so the comparison covers the whole fp16 range. Equality is checked on the float32
bit patterns (so -0.0 vs +0.0 would also fail): both sides do the same float32 ops in the same
order from the same fp16 inputs.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from strata_mlx.format.gguf_quants import (
    FORMATS,
    dequantize,
    iq2xs_grid,
    iq3s_grid,
    kmask_iq2xs,
    ksigns_iq2xs,
    quantize_reference,
    row_bytes,
)

NAMES = sorted(FORMATS)


def _finite_f16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    bad = (bits & 0x7C00) == 0x7C00  # exponent all ones: inf / NaN
    bits[bad] &= np.uint16(0xBFFF)  # clear the exponent's top bit -> finite
    return bits


def _random_rows(name: str, n_rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    f = FORMATS[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n_rows, blocks_per_row, f.type_size), dtype=np.uint8)
    for off in f.f16_offsets:
        bits = _finite_f16_bits(rng, n_rows * blocks_per_row).reshape(n_rows, blocks_per_row)
        raw[:, :, off : off + 2] = bits.view(np.uint8).reshape(n_rows, blocks_per_row, 2)
    return raw.reshape(n_rows, blocks_per_row * f.type_size)


def _assert_bits_equal(ours: mx.array, ref: np.ndarray) -> None:
    ours_np = np.array(ours)
    assert ours_np.dtype == np.float32 and ref.dtype == np.float32
    assert ours_np.shape == ref.shape
    assert np.isfinite(ref).all()
    np.testing.assert_array_equal(ours_np.view(np.uint32), ref.view(np.uint32))


def test_formats_match_gguf_sizes():
    for name, f in FORMATS.items():
        qtype = GGMLQuantizationType[name]
        assert f.ggml_type == int(qtype)
        assert (f.block_size, f.type_size) == GGML_QUANT_SIZES[qtype]
        assert sum(size for _, _, size in f.fields) == f.type_size
        assert f.f16_offsets  # every format has an fp16 `d`
        assert row_bytes(name, 2 * f.block_size) == 2 * f.type_size
    with pytest.raises(ValueError):
        row_bytes("Q4_K", 100)
    assert FORMATS["Q2_K"].field("d") == slice(80, 82)  # K-quant `d` at the end
    assert FORMATS["Q6_K"].field("d") == slice(208, 210)


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_bit_exact(name):
    f = FORMATS[name]
    n_rows, blocks_per_row = 5, max(2, 512 // f.block_size)
    raw = _random_rows(name, n_rows, blocks_per_row, seed=f.ggml_type)
    ref = gguf_dequantize(raw, GGMLQuantizationType[name])
    n_cols = blocks_per_row * f.block_size
    assert ref.shape == (n_rows, n_cols)
    _assert_bits_equal(dequantize(name, mx.array(raw), (n_rows, n_cols)), ref)


@pytest.mark.parametrize("name", ["Q4_K", "IQ2_XS"])
def test_dequantize_shapes_and_dtype(name):
    f = FORMATS[name]
    n_exp, out_dim, n_cols = 2, 3, 2 * f.block_size
    raw = _random_rows(name, n_exp * out_dim, 2, seed=7)
    ref = gguf_dequantize(raw, GGMLQuantizationType[name]).reshape(n_exp, out_dim, n_cols)
    blocks3 = mx.array(raw.reshape(n_exp, out_dim, -1))
    _assert_bits_equal(dequantize(name, blocks3, (n_exp, out_dim, n_cols)), ref)
    _assert_bits_equal(dequantize(name, mx.array(raw.ravel()), ref.shape), ref)  # flat bytes
    half = dequantize(name, blocks3, ref.shape, dtype=mx.float16)
    assert half.dtype == mx.float16
    with np.errstate(over="ignore"):  # huge random fp16 scales overflow fp16 -> inf
        np.testing.assert_array_equal(np.array(half), ref.astype(np.float16))
    with pytest.raises(ValueError):
        dequantize(name, blocks3, (n_exp, out_dim, n_cols + f.block_size))
    with pytest.raises(TypeError):
        dequantize(name, blocks3.astype(mx.int8), ref.shape)


def test_codebooks_and_sign_tables():
    g2, g3 = iq2xs_grid(), iq3s_grid()
    assert g2.dtype == mx.uint8 and g2.shape == (512, 8)
    assert g3.dtype == mx.uint8 and g3.shape == (512, 4)
    assert set(np.unique(np.array(g2))) == {0x08, 0x19, 0x2B}
    assert set(np.unique(np.array(g3))) <= set(range(1, 16, 2))
    # first entries of llama.cpp's packed tables (ggml-common.h), little-endian bytes
    assert int(np.array(g2.view(mx.uint64))[1, 0]) == 0x080808080808082B
    assert int(np.array(g3.view(mx.uint32))[1, 0]) == 0x01010103
    assert iq2xs_grid() is g2  # built once
    ks = np.array(ksigns_iq2xs())
    assert ks.shape == (128,)
    np.testing.assert_array_equal(ks & 0x7F, np.arange(128))
    parity = np.array([bin(int(v)).count("1") % 2 for v in ks])
    assert not parity.any()  # bit 7 makes every sign byte even
    np.testing.assert_array_equal(np.array(kmask_iq2xs()), 1 << np.arange(8))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantize_reference_roundtrip(name):
    f = FORMATS[name]
    w = np.random.default_rng(1).standard_normal((4, 4 * f.block_size)).astype(np.float32)
    raw = quantize_reference(name, w)
    assert raw.dtype == np.uint8 and raw.shape == (4, row_bytes(name, w.shape[1]))
    ref = gguf_dequantize(raw, GGMLQuantizationType[name])
    _assert_bits_equal(dequantize(name, mx.array(raw), w.shape), ref)
    assert np.abs(ref - w).max() < 0.5  # it really is a quantization of w


def test_quantize_reference_unsupported():
    with pytest.raises(NotImplementedError):
        quantize_reference("Q4_K", np.zeros((1, 256), np.float32))
    with pytest.raises(ValueError):
        quantize_reference("F99", np.zeros((1, 256), np.float32))
