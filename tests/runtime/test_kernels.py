"""Expert kernels (custom_kernels/): one algorithm, three dialects, checked against the reference.

CPU (CI):
  - the decoders of formats.h, compiled as host C++, equal the reference dequantizers bit for
    bit (gguf_quants.dequantize; mx.dequantize for affine), and load only aligned bytes of
    their row (AddressSanitizer, UBSan);
  - Metal, CUDA and host sources are the same shared body and header plus a dialect layer,
    and the Metal and CUDA ones type-check as C++ against stand-ins for their builtins;
  - the shared body, compiled as host C++ with 32-lane warps emulated, computes
    switch_glu_reference's result (float32, decode and prefill tiles);
  - kernel_for's semantics, the prefill tiling.
GPU (`-m gpu`, MLX's CUDA backend): the CUDA dialect vs switch_glu_reference for every format,
decode (T=1, k=10, D=2048, inter=512) and prefill (T=1024) shapes.

The CPU tests compare float32 kernels with references computed on the CPU stream, whatever the
default device: there MLX rounds each float32 product and sum once, so 1e-5 x RMS bounds the
summation-order difference. On MLX's CUDA backend float32 matmuls may run as TF32 (2^-10) and
dequantize may fuse a multiply-add, which those bounds do not allow for.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import tempfile

import mlx.core as mx
import numpy as np
import pytest

from custom_kernels import algorithm, cuda, dispatch, host, metal
from strata_mlx.format.gguf_quants import FORMATS, dequantize, row_bytes
from strata_mlx.format.quant import (
    component_views,
    dequantize_mxfp4,
    dtype_name,
    expert_tensors,
    layout_for,
    switch_glu_reference,
    to_numpy,
)
from strata_mlx.format.store import PROJECTIONS, RecordLayout

HAVE_CXX = host.compiler() is not None
needs_cxx = pytest.mark.skipif(not HAVE_CXX, reason="no C++ compiler for the host dialect")

# ---------------------------------------------------------------------------------------------
# Random experts in every format


def _finite_f16_bits(rng, n):
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    bad = (bits & 0x7C00) == 0x7C00
    bits[bad] &= np.uint16(0xBFFF)
    return bits


# fp16 scale fields are set to +-U(0.5, 1.5) * this / sqrt(in) so weights are ~ 1/sqrt(in)
_GGUF_D = {"IQ2_XS": 1 / 50, "IQ3_S": 1 / 128, "Q4_K": 1 / 240, "Q2_K": 1 / 12}


def gguf_rows(qtype: str, rows: int, n_in: int, rng, full_range: bool = False) -> np.ndarray:
    """uint8 [rows, row_bytes]: random blocks; fp16 fields random finite bit patterns
    (full_range) or moderate values."""
    f = FORMATS[qtype]
    nb = n_in // f.block_size
    raw = rng.integers(0, 256, size=(rows, nb, f.type_size), dtype=np.uint8)
    for off in f.f16_offsets:
        if full_range:
            bits = _finite_f16_bits(rng, rows * nb)
        else:
            mag = rng.uniform(0.5, 1.5, rows * nb) * _GGUF_D[qtype] / np.sqrt(n_in)
            sign = rng.choice([-1.0, 1.0], rows * nb)
            bits = (mag * sign).astype(np.float16).view(np.uint16)
        raw[:, :, off : off + 2] = bits.reshape(rows, nb, 1).view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, nb * f.type_size)


def _shapes(d: int, inter: int) -> dict[str, tuple[int, int]]:
    return {"gate_proj": (inter, d), "up_proj": (inter, d), "down_proj": (d, inter)}


def affine_experts(n, d, inter, bits, gs, dtype, seed=0, quant=None, activation=None):
    # all n experts quantized in one call per projection, exactly as expert_tensors does each;
    # on the CPU stream (on the GPU, each new configuration would JIT-compile quantize).
    # With `activation` (GPT-OSS's swiglu_oai) each projection has a bias too, O(0.3).
    with mx.stream(mx.cpu):
        keys = mx.random.split(mx.random.key(seed), 6)
        w = {
            p: mx.random.normal((n, o, i), key=keys[j]) / np.sqrt(i)
            for j, (p, (o, i)) in enumerate(_shapes(d, inter).items())
        }
        if activation is not None:
            for j, (p, (o, _)) in enumerate(_shapes(d, inter).items()):
                w[f"{p}.bias"] = mx.random.normal((n, o), key=keys[3 + j]) * 0.3
        t, table = expert_tensors(w, quant or {"bits": bits, "group_size": gs}, dtype)
        layout = layout_for({name: v[0] for name, v in t.items()}, table, activation)
        t = {name: to_numpy(v) for name, v in t.items()}
    recs = [np.frombuffer(layout.pack({k: v[e] for k, v in t.items()}), np.uint8) for e in range(n)]
    return layout, recs


def gguf_experts(n, d, inter, types: dict[str, str], seed=0):
    rng = np.random.default_rng(seed)
    comps, table = {}, {}
    for p, (o, i) in _shapes(d, inter).items():
        comps[f"{p}.weight"] = ("uint8", (o, row_bytes(types[p], i)))
        table[p] = {"format": "gguf", "type": types[p], "in_features": i}
    layout = RecordLayout.build(comps, table)
    recs = []
    for _ in range(n):
        arrays = {
            f"{p}.weight": gguf_rows(types[p], o, i, rng) for p, (o, i) in _shapes(d, inter).items()
        }
        recs.append(np.frombuffer(layout.pack(arrays), np.uint8))
    return layout, recs


def _gguf(gate_up: str, down: str | None = None):
    return lambda n, d, i, seed: gguf_experts(
        n, d, i, {"gate_proj": gate_up, "up_proj": gate_up, "down_proj": down or gate_up}, seed
    )


def _affine(bits, gs, dtype=mx.float16):
    return lambda n, d, i, seed: affine_experts(n, d, i, bits, gs, dtype, seed)


def _mxfp4(n, d, inter, seed):
    # mx.quantize's mxfp4 of normal weights (scales of each block's max), the layout GPT-OSS
    # ships; fp16 is what the scales meet in a model (they are uint8 whatever it is)
    return affine_experts(n, d, inter, 4, 32, mx.float16, seed, quant={"mode": "mxfp4"})


# GPT-OSS's experts: biased projections and the clamped SwiGLU, with a limit (1.0) that the
# O(1) gate and up outputs cross often, so that both clamps bite.
GPT_OSS_ACTIVATION = {"name": "swiglu_oai", "alpha": 1.702, "limit": 1.0}


def _gpt_oss(quant, dtype=mx.float16):
    return lambda n, d, i, seed: affine_experts(
        n, d, i, 4, 32, dtype, seed, quant=quant, activation=GPT_OSS_ACTIVATION
    )


# name -> builder(n_experts, D, inter, seed) -> (layout, records)
CASES = {
    "affine4-g64": _affine(4, 64),
    "affine4-g32-bf16scales": _affine(4, 32, mx.bfloat16),
    "affine4-g128-f32scales": _affine(4, 128, mx.float32),
    "affine2-g64": _affine(2, 64),
    "affine3-g64": _affine(3, 64),
    "affine8-g32": _affine(8, 32),
    "IQ2_XS": _gguf("IQ2_XS"),
    "Q4_K": _gguf("Q4_K"),
    "IQ3_S": _gguf("IQ3_S"),
    "Q2_K": _gguf("Q2_K"),
    "IQ2_XS+Q2_K-down": _gguf("IQ2_XS", "Q2_K"),
    "IQ3_S+Q4_K-down": _gguf("IQ3_S", "Q4_K"),
    "mxfp4": _mxfp4,
    "mxfp4-gpt-oss": _gpt_oss({"mode": "mxfp4"}),
    "mxfp4-gpt-oss-bf16bias": _gpt_oss({"mode": "mxfp4"}, mx.bfloat16),
    "affine4-g32-gpt-oss": _gpt_oss({"bits": 4, "group_size": 32}),
}


def make_problem(layout, recs, n_tokens, k, dtype, seed=0, n_slots=None):
    """Records placed at random arena slots; routing as strata_mlx.runtime.experts builds it:
    slots [n] of the needed experts, idx [T, k] into slots."""
    rng = np.random.default_rng(seed + 1)
    n = len(recs)
    n_slots = n_slots or n + 3
    where = rng.permutation(n_slots)[:n]
    arena = np.zeros((n_slots, layout.record_bytes), np.uint8)
    for e, s in enumerate(where):
        arena[s] = recs[e]
    ids = np.stack([rng.choice(n, k, replace=False) for _ in range(n_tokens)])
    needed = np.unique(ids)
    slots = mx.array(where[needed].astype(np.uint32))
    idx = mx.array(np.searchsorted(needed, ids).astype(np.uint32))
    d = algorithm.projection(layout, "gate_proj").in_features
    x = mx.array(rng.standard_normal((n_tokens, d)).astype(np.float32)).astype(dtype)
    return x, mx.array(arena), slots, idx


def cpu_reference(x, rows, layout, idx):
    """switch_glu_reference on the CPU stream (see the module docstring for why)."""
    with mx.stream(mx.cpu):
        return switch_glu_reference(x, rows, layout, idx)


def host_decode(dec: algorithm.Decoder, bases: dict[str, np.ndarray], n_in: int) -> np.ndarray:
    """float32 [rows, n_in]: rows decoded by formats.h's decoder for `dec`, through the dequant
    kernel compiled as host C++; `bases` holds each base's uint8 [rows, row_bytes]."""
    offsets, off = [], 0
    for b in dec.bases:
        offsets.append((b, off, bases[b].shape[1]))
        off += -(-bases[b].nbytes // 16) * 16
    record = np.zeros(-(-off // 4096) * 4096, np.uint8)
    for b, o, _ in offsets:
        record[o : o + bases[b].nbytes] = bases[b].reshape(-1)
    rows = bases[dec.bases[0]].shape[0]
    proj = algorithm.Projection(dec, rows, n_in, tuple(offsets))
    src = algorithm.dequant_source(proj, record.size, "rows")
    tables = [mx.array(algorithm.tables()[t]) for t in dec.tables]
    (w,) = host.build(src)(
        [mx.array(record[None]), mx.array([0], dtype=mx.uint32), *tables],
        (rows * n_in // algorithm.CHUNK, 1, 1),
        (algorithm.THREADGROUP, 1, 1),
        [(1, rows, n_in)],
        [mx.float32],
        [("T", mx.float32)],
    )
    return np.array(w[0])


# ---------------------------------------------------------------------------------------------
# CPU: the decoders of formats.h vs the reference dequantizers


@needs_cxx
@pytest.mark.parametrize("qtype", sorted(algorithm.GGUF_DECODERS))
def test_gguf_decode_bit_exact(qtype):
    rng = np.random.default_rng(FORMATS[qtype].ggml_type)
    rows, n_in = 7, 4 * 256
    raw = gguf_rows(qtype, rows, n_in, rng, full_range=True)  # subnormal and huge scales too
    ours = host_decode(algorithm.gguf_decoder(qtype), {"W": raw}, n_in)
    with mx.stream(mx.cpu):
        ref = np.array(dequantize(qtype, mx.array(raw), (rows, n_in)))
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


@needs_cxx
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_affine_decode_bit_exact(bits, group_size, dtype):
    with mx.stream(mx.cpu):  # the reference on the CPU (see the module docstring)
        w = mx.random.normal((6, 512), key=mx.random.key(bits * 1000 + group_size)).astype(dtype)
        q, s, b = mx.quantize(w, group_size, bits)
        # float32 scale * q + bias: what the kernels compute (fp16/bf16 scale * q is exact)
        ref = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size, bits)
        ref = np.array(ref)
    bases = {
        "W": np.array(q).view(np.uint8).reshape(6, -1),
        "S": to_numpy(s).view(np.uint8).reshape(6, -1),
        "B": to_numpy(b).view(np.uint8).reshape(6, -1),
    }
    dec = algorithm.affine_decoder(bits, group_size, dtype_name(s.dtype))
    ours = host_decode(dec, bases, 512)
    if dtype == mx.float32:  # fp32 scale * q rounds; fused or not may differ by an ulp
        np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7)
    else:
        np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


def mxfp4_rows(rows: int, n_in: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """uint8 codes [rows, n_in / 2] (every byte) and scales [rows, n_in / 32] cycling through
    every E8M0 value, 0 (2^-127) and 255 (inf) included."""
    codes = rng.integers(0, 256, size=(rows, n_in // 2), dtype=np.uint8)
    scales = (np.arange(rows * n_in // 32) % 256).astype(np.uint8).reshape(rows, n_in // 32)
    return codes, scales


def _same_bits(a: np.ndarray, b: np.ndarray, what: str) -> None:
    """Bit for bit, NaNs aside (0 * 2^128: equal as NaNs, whatever their sign)."""
    nan = np.isnan(a)
    assert np.array_equal(nan, np.isnan(b)), what
    np.testing.assert_array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32), what)


@needs_cxx
def test_mxfp4_decode_bit_exact():
    rows, n_in = 16, 32 * 48  # 768 blocks: every scale three times
    codes, scales = mxfp4_rows(rows, n_in, np.random.default_rng(4))
    ours = host_decode(algorithm.MXFP4_DECODER, {"W": codes, "S": scales}, n_in)
    with mx.stream(mx.cpu):
        ref = np.array(dequantize_mxfp4(mx.array(codes), mx.array(scales)))
        mlx = mx.dequantize(
            mx.array(codes).view(mx.uint32), mx.array(scales), mode="mxfp4", dtype=mx.float32
        )
    _same_bits(ours, ref, "formats.h vs dequantize_mxfp4")
    _same_bits(ours, np.array(mlx), "formats.h vs mx.dequantize mxfp4")


def _minimal_rows() -> list[tuple[algorithm.Decoder, dict[str, int], int]]:
    """(decoder, bytes of each base's row, in_features) for the smallest row of each format:
    one block, or one group, so that every load sits at the row's edge."""
    rows = [(d, {"W": FORMATS[t].type_size}, 256) for t, d in algorithm.GGUF_DECODERS.items()]
    rows.append((algorithm.MXFP4_DECODER, {"W": 16, "S": 1}, 32))
    for bits in (2, 3, 4, 5, 6, 8):
        for gs in (32, 64, 128):
            for dtype, esz in (("float16", 2), ("bfloat16", 2), ("float32", 4)):
                dec = algorithm.affine_decoder(bits, gs, dtype)
                rows.append((dec, {"W": gs * bits // 8, "S": esz, "B": esz}, gs))
    return rows


@needs_cxx
def test_decoders_load_only_aligned_in_bounds(tmp_path):
    # Each base row is its own heap block of exactly its size: AddressSanitizer reports a load
    # outside it (or outside a table), UBSan a misaligned one; the calls are those the kernels
    # make (Decoder.call).
    lines = [
        host.PRELUDE + algorithm.SHARED_HEADER,
        "static float sk_warp_sum(float v) { return v; }",
    ]
    lines += ["#include <cstdio>", "#include <cstdlib>"]
    lines += [f"static uint32_t* {t};" for t in algorithm.tables()]
    lines += [
        "static const uint8_t* row(size_t n) {",
        "  uint8_t* p = (uint8_t*)malloc(n);",
        "  for (size_t i = 0; i < n; ++i) p[i] = (uint8_t)rand();",
        "  return p;",
        "}",
        "int main() {",
        "  float sink = 0.0f;",
    ]
    for t, table in algorithm.tables().items():
        lines.append(f"  {t} = (uint32_t*)row({table.nbytes}u);")
    for dec, sizes, n_in in _minimal_rows():
        lines.append(f"  {{  // {dec.name}")
        lines += [f"    const uint8_t* l_{b} = row({n}u);" for b, n in sizes.items()]
        call = dec.call(tuple(f"l_{b}" for b in dec.bases), "c")
        lines += [
            f"    for (uint32_t c = 0u; c < {n_in // algorithm.CHUNK}u; ++c) {{",
            f"      const sk_chunk r = {call};",
            "      sink += r.scale + r.offset;",
            "      for (int j = 0; j < 16; ++j) sink += r.q[j];",
            "    }",
            "  }",
        ]
    lines += ['  printf("%g\\n", sink);', "  return 0;", "}"]
    src, exe = tmp_path / "decoders.cpp", tmp_path / "decoders"
    src.write_text("\n".join(lines) + "\n")
    flags = ["-std=c++17", "-O0", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
    r = subprocess.run([host.compiler(), *flags, "-o", str(exe), str(src)], capture_output=True)
    if r.returncode and b"san" in r.stderr:
        pytest.skip(f"no sanitizer runtime: {r.stderr.decode()[-200:]}")
    assert r.returncode == 0, r.stderr.decode()[-4000:]
    env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=0"}
    r = subprocess.run([str(exe)], capture_output=True, env=env)
    assert r.returncode == 0 and b"runtime error" not in r.stderr, r.stderr.decode()[-4000:]


# ---------------------------------------------------------------------------------------------
# CPU: one algorithm, dialect layers only


def _sources_of(case: str, tm: int):
    layout, _ = CASES[case](1, 256, 256, 0)
    kern = dispatch.ExpertKernels(host, layout, dispatch.plan(layout))
    return kern.sources(k=3, tm=tm)


DIALECTS = {"metal": metal, "cuda": cuda, "host": host}
DIALECT_TOKENS = re.compile(
    r"device|__|thread_position|blockIdx|threadIdx|blockDim|simd|metal|expf|half|bfloat|#|ulong"
)


@pytest.mark.parametrize("case", sorted(CASES))
def test_dialects_share_the_algorithm(case):
    for src in _sources_of(case, tm=1) + _sources_of(case, tm=4):
        stripped = {}
        for name, mod in DIALECTS.items():
            header, body = mod.sources(src)
            assert header.startswith(mod.PRELUDE) and body.startswith(mod.PROLOGUE), name
            stripped[name] = (header[len(mod.PRELUDE) :], body[len(mod.PROLOGUE) :])
        # With the dialect layer removed, every dialect compiles the identical text ...
        assert stripped["metal"] == stripped["cuda"] == stripped["host"] == (src.header, src.body)
        # ... which names nothing dialect-specific.
        for text in (src.header, src.body):
            assert not DIALECT_TOKENS.search(text), DIALECT_TOKENS.search(text)


def test_dialect_layers_define_the_same_names():
    for name, mod in DIALECTS.items():
        layer = mod.PRELUDE + mod.PROLOGUE
        for n in algorithm.DIALECT_NAMES:
            assert re.search(rf"(#define {n}\b|\b{n}\s*\(|\b{n}\s*=)", layer), (name, n)
    # The dialect layers stay thin: no decode logic lives in them.
    for mod in (metal, cuda):
        assert len(mod.PRELUDE.splitlines()) + len(mod.PROLOGUE.splitlines()) < 30


def _all_sources(kern) -> list[algorithm.KernelSource]:
    return [*kern.sources(k=3, tm=1), *kern.sources(k=3, tm=4), *kern.dequant_sources().values()]


DECODERS = {
    d.function.split("<")[0] for d in (*algorithm.GGUF_DECODERS.values(), algorithm.MXFP4_DECODER)
} | {"sk_decode_affine"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_header_is_the_parts_of_formats_h_its_body_calls(case):
    assert "".join(p.text for p in algorithm._PIECES) == algorithm.SHARED_HEADER
    layout, _ = CASES[case](1, 256, 256, 0)
    own = dispatch.ExpertKernels(host, layout, dispatch.plan(layout), header="own")
    full = dispatch.ExpertKernels(host, layout, dispatch.plan(layout), header="full")
    for src, whole in zip(_all_sources(own), _all_sources(full)):
        assert whole.header == algorithm.SHARED_HEADER
        assert src.body == whole.body and src.name != whole.name  # told apart by MLX's cache
        assert len(src.header) < len(whole.header) / 2
        # its own decoders, no other format's
        called = {d for d in DECODERS if d + "<" in src.body or d + "(" in src.body}
        defined = {d for d in DECODERS if f"sk_chunk {d}(" in src.header}
        assert called and defined == called, (src.name, called, defined)
        # formats.h's pieces as they are in the file, in its order
        pos = 0
        for piece in algorithm._PIECES:
            if src.header.startswith(piece.text, pos):
                pos += len(piece.text)
        assert pos == len(src.header), src.header[pos : pos + 200]


def test_kernel_headers_are_own_unless_asked_for_full(monkeypatch):
    from strata_mlx.config import OptionError
    from strata_mlx.runtime import kernels

    layout, _ = CASES["IQ2_XS+Q2_K-down"](1, 256, 256, 0)
    monkeypatch.delenv("STRATA_MLX_KERNEL_HEADER", raising=False)
    assert dispatch.kernel_header() == "own"
    kern = dispatch.ExpertKernels(host, layout, dispatch.plan(layout))  # reads it when built
    assert kern.sources(3, 1)[0].header != algorithm.SHARED_HEADER
    monkeypatch.setenv("STRATA_MLX_KERNEL_HEADER", "full")
    assert kern.sources(3, 1)[0].header == algorithm.SHARED_HEADER
    monkeypatch.setenv("STRATA_MLX_KERNEL_HEADER", "all")
    with pytest.raises(ValueError, match="STRATA_MLX_KERNEL_HEADER='all': one of own, full"):
        dispatch.kernel_header()
    monkeypatch.setattr(kernels, "_CHECKED", {})
    with pytest.raises(OptionError, match="STRATA_MLX_KERNEL_HEADER='all'"):
        kernels.expert_kernel(layout, "host")


def test_generated_sources_are_short_lines():
    # a person reads these (`strata-mlx kernels show`): no 400-character expression lines
    for case in sorted(CASES):
        layout, _ = CASES[case](1, 256, 256, 0)
        kern = dispatch.ExpertKernels(host, layout, dispatch.plan(layout))
        srcs = [
            *kern.sources(k=3, tm=1),
            *kern.sources(k=3, tm=8),
            *kern.dequant_sources().values(),
        ]
        for src in srcs:
            for mod in DIALECTS.values():
                for line in "\n".join(mod.sources(src)).splitlines():
                    assert len(line) <= 100, (case, src.name, line)


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_kernels_show_prints_the_compiled_source(dialect):
    from typer.testing import CliRunner

    from strata_mlx.apps.cli import app

    args = ["kernels", "show", "IQ3_S", "--down", "Q4_K", "--dialect", dialect]
    r = CliRunner().invoke(app, [*args, "--hidden", "256", "--inter", "512", "--top-k", "4"])
    assert r.exit_code == 0, r.output
    mod = DIALECTS[dialect]
    layout, _ = CASES["IQ3_S+Q4_K-down"](1, 256, 512, 0)
    kern = dispatch.ExpertKernels(mod, layout, dispatch.plan(layout))
    srcs = [*kern.sources(k=4, tm=1), *kern.dequant_sources().values()]
    for src in srcs:
        header, body = mod.sources(src)
        assert src.name in r.output and header in r.output and body in r.output, src.name
    # each header printed once: gate/up's (IQ3_S), down's (Q4_K), and the dequantize
    # kernels' of each format (no dot product), the gate and up ones sharing theirs
    headers = {mod.sources(src)[0] for src in srcs}
    assert len(headers) == 4
    assert r.output.count(f"header (the {dialect} prelude") == 4
    r = CliRunner().invoke(app, ["kernels", "show", "Q6_K", "--dialect", dialect])
    assert r.exit_code == 2 and "Q6_K has no kernel" in r.output


# Stand-ins for the builtins each GPU dialect's prelude and prologue use: enough for the host
# compiler to type-check the exact text MLX compiles (the kernel signature as MLX writes it,
# T as each activation dtype). Neither GPU compiler runs on this project's CPU machines.
GPU_STANDINS = {
    "cuda": """\
#include <cmath>
#include <cstdint>
#include <cstring>
#define __device__
#define __forceinline__ inline
struct __half { float f; };
struct __nv_bfloat16 { float f; };
inline float __half2float(__half v) { return v.f; }
inline float __bfloat162float(__nv_bfloat16 v) { return v.f; }
inline __half __float2half(float v) { return {v}; }
inline __nv_bfloat16 __float2bfloat16(float v) { return {v}; }
struct uint4 { uint32_t x, y, z, w; };
inline float __uint_as_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline float __shfl_xor_sync(unsigned, float v, int) { return v; }
struct sk_dim3 { uint32_t x, y, z; };
static sk_dim3 blockIdx, blockDim, threadIdx;
""",
    "metal": """\
#include <cstdint>
#include <cstring>
#define device
#define thread
typedef unsigned long ulong;
struct half { float f; half(float v) : f(v) {} operator float() const { return f; } };
struct bfloat16_t { float f; bfloat16_t(float v) : f(v) {} operator float() const { return f; } };
template <typename To, typename From> To as_type(From v) { To t; std::memcpy(&t, &v, 4); return t; }
namespace metal { inline float exp(float v) { return v; } inline float simd_sum(float v) { return v; } }
struct uint3 { uint32_t x, y, z; };
""",
}
GPU_DTYPES = {
    "cuda": ("float", "__half", "__nv_bfloat16"),
    "metal": ("float", "half", "bfloat16_t"),
}
_INPUT_TYPES = {"arena": "uint8_t", "pair_slot": "uint32_t", "slots": "uint32_t"}


@needs_cxx
@pytest.mark.parametrize("dialect", sorted(GPU_STANDINS))
def test_gpu_dialect_sources_type_check_as_cxx(dialect, tmp_path):
    mod = DIALECTS[dialect]
    kernels = {}
    for case in sorted(CASES):
        layout, _ = CASES[case](1, 256, 256, 0)
        kern = dispatch.ExpertKernels(mod, layout, dispatch.plan(layout))
        projs = (kern.gate, kern.up, kern.down)
        srcs = [
            *kern.sources(k=3, tm=1),
            *kern.sources(k=3, tm=4),
            *kern.dequant_sources().values(),
            *(algorithm.dequant_source(p, layout.record_bytes, "w", True) for p in projs),
        ]
        kernels.update((src.name, src) for src in srcs)
    # each kernel with its own header (the parts of formats.h it calls), in a namespace of its
    # own: the kernel type-checks with nothing more, and the headers cannot clash
    lines = [GPU_STANDINS[dialect]]
    for i, src in enumerate(kernels.values()):
        params = []
        for n in src.input_names:
            ctype = _INPUT_TYPES.get(n, "int32_t" if n == "tile_pairs" else "T")
            params.append(
                f"const {ctype}* {n}" if n not in algorithm.tables() else f"const uint32_t* {n}"
            )
        params += [f"T* {n}" for n in src.output_names]
        if dialect == "metal":
            params = [f"device {p}" for p in params] + ["uint3 thread_position_in_grid"]
        lines += [
            f"namespace n{i} {{",
            mod.sources(src)[0],
            f"template <typename T>\nvoid k{i}({', '.join(params)}) {{",
            mod.sources(src)[1],
            "}",
        ]
        lines += [
            f"template void k{i}<{t}>({', '.join(params).replace('T*', t + '*')});"
            for t in GPU_DTYPES[dialect]
        ]
        lines.append(f"}}  // namespace n{i}")
    path = tmp_path / f"{dialect}.cpp"
    path.write_text("\n".join(lines) + "\n")
    cmd = [host.compiler(), "-std=c++17", "-fsyntax-only", "-Wno-unknown-pragmas", str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]


# ---------------------------------------------------------------------------------------------
# CPU: the shared body executed as host C++


def _compare(y, ref, what, max_tol, frob_tol):
    """Max error relative to the output's RMS, and relative Frobenius error."""
    y32 = np.array(y.astype(mx.float32))
    r32 = np.array(ref.astype(mx.float32))
    assert y32.shape == r32.shape, (what, y32.shape, r32.shape)
    assert np.isfinite(y32).all(), f"{what}: non-finite kernel output"
    rms = float(np.sqrt(np.mean(r32.astype(np.float64) ** 2)))
    assert rms > 0, f"{what}: reference is all zero"
    err = np.abs(y32.astype(np.float64) - r32)
    max_rel = float(err.max()) / rms
    frob_rel = float(np.sqrt(np.mean(err**2))) / rms
    assert max_rel <= max_tol and frob_rel <= frob_tol, (
        f"{what}: max |kernel - reference| = {max_rel:.3g} x RMS (allowed {max_tol:.3g}), "
        f"RMS error = {frob_rel:.3g} x RMS (allowed {frob_tol:.3g}); "
        f"worst at {np.unravel_index(err.argmax(), err.shape)}"
    )
    return max_rel, frob_rel


HOST_CASES = [(c, 1) for c in sorted(CASES)] + [
    ("affine4-g64", 4),
    ("mxfp4", 4),
    ("mxfp4-gpt-oss", 4),
    ("IQ2_XS+Q2_K-down", 4),
    ("IQ3_S+Q4_K-down", 4),
    ("affine3-g64", 8),
]


@needs_cxx
@pytest.mark.parametrize("case,tile", HOST_CASES)
def test_host_kernel_matches_reference(case, tile):
    layout, recs = CASES[case](6, 256, 256, 3)
    x, arena, slots, idx = make_problem(layout, recs, n_tokens=5, k=3, dtype=mx.float32, seed=4)
    fn = dispatch.kernel_for("host", layout)
    y = fn(x, arena, slots, idx, layout, tile=tile)
    ref = cpu_reference(x, arena[slots], layout, idx)
    # float32 throughout; only the summation order differs (dots of 256 terms).
    _compare(y, ref, f"host {case} tile={tile}", max_tol=1e-5, frob_tol=1e-6)


@needs_cxx
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("stores", ["scalar", "wide"])
def test_host_dequant_kernel_bit_exact(case, stores, monkeypatch):
    """Either store of the dequantize kernel (STRATA_MLX_DEQUANT_STORES) writes the decoder's
    values bit for bit."""
    monkeypatch.setenv("STRATA_MLX_DEQUANT_STORES", stores)
    monkeypatch.setattr(dispatch, "_CACHE", {})  # kernels built afresh with this store
    layout, recs = CASES[case](3, 256, 256, 5)
    x, arena, slots, idx = make_problem(layout, recs, n_tokens=2, k=2, dtype=mx.float32)
    fn = dispatch.kernel_for("host", layout)
    assert ("sk_store16" in fn.dequant_sources()["up_proj"].body) == (stores == "wide")
    got = fn.dequantize(arena, slots)
    records = np.array(arena)[np.array(slots)]
    for p, pr in dispatch.plan(layout).items():
        # the same decoder on the same rows copied out of the records (all slots stacked)
        bases = {
            b: records[:, off : off + stride * pr.out_features].reshape(-1, stride)
            for b, off, stride in pr.offsets
        }
        want = host_decode(pr.decoder, bases, pr.in_features)
        if layout.quant[p]["format"] == "gguf":  # and the reference itself, bit for bit
            with mx.stream(mx.cpu):
                ref = dequantize(layout.quant[p]["type"], mx.array(bases["W"]), want.shape)
            np.testing.assert_array_equal(np.array(ref).view(np.uint32), want.view(np.uint32))
        if layout.quant[p]["format"] == "mxfp4":
            with mx.stream(mx.cpu):
                ref = dequantize_mxfp4(mx.array(bases["W"]), mx.array(bases["S"]))
            np.testing.assert_array_equal(np.array(ref).view(np.uint32), want.view(np.uint32))
        np.testing.assert_array_equal(
            np.array(got[p]).reshape(want.shape).view(np.uint32),
            want.view(np.uint32),
            err_msg=f"{case} {p}",
        )


@needs_cxx
@pytest.mark.parametrize(
    "case", ["affine4-g64", "IQ2_XS+Q2_K-down", "IQ3_S+Q4_K-down", "mxfp4", "mxfp4-gpt-oss"]
)
def test_host_prefill_dequant_strategy(case):
    layout, recs = CASES[case](4, 256, 256, 6)
    x, arena, slots, idx = make_problem(layout, recs, n_tokens=9, k=2, dtype=mx.float32, seed=8)
    fn = dispatch.kernel_for("host", layout)
    # The host dialect's matmuls on the CPU stream, as the reference's: on a GPU's default
    # stream they would run as TF32 (2^-10), which these bounds do not allow for.
    with mx.stream(mx.cpu):
        y = fn(x, arena, slots, idx, layout, strategy="dequant")
        # 18 pairs over <= 4 experts is prefill: the automatic strategy is PREFILL_STRATEGY's
        auto = fn(x, arena, slots, idx, layout)
        explicit = fn(x, arena, slots, idx, layout, strategy=dispatch.PREFILL_STRATEGY)
    ref = cpu_reference(x, arena[slots], layout, idx)
    _compare(y, ref, f"host dequant {case}", max_tol=1e-5, frob_tol=1e-6)
    np.testing.assert_array_equal(np.array(auto), np.array(explicit))
    decode = fn(x, arena, slots, idx, layout, strategy="fused", tile=1)
    assert not np.array_equal(np.array(y), np.array(decode))  # the strategies are told apart


def test_the_dequantize_writes_wide_stores_unless_asked_for_scalar(monkeypatch):
    monkeypatch.delenv("STRATA_MLX_DEQUANT_STORES", raising=False)
    assert dispatch.dequant_stores() == "wide"
    monkeypatch.setenv("STRATA_MLX_DEQUANT_STORES", "scalar")
    assert dispatch.dequant_stores() == "scalar"


@needs_cxx
def test_a_bad_dequant_store_setting_is_refused_not_taken_for_a_kernel_failure(monkeypatch):
    from strata_mlx.config import OptionError
    from strata_mlx.runtime import kernels

    monkeypatch.setenv("STRATA_MLX_DEQUANT_STORES", "vector")
    monkeypatch.setattr(kernels, "_CHECKED", {})
    layout, _ = CASES["affine4-g64"](2, 256, 256, 0)
    with pytest.raises(OptionError, match="STRATA_MLX_DEQUANT_STORES='vector': one of scalar"):
        kernels.expert_kernel(layout, "host")


@needs_cxx
def test_host_leading_dims_and_auto_tile():
    layout, recs = CASES["affine4-g64"](4, 256, 256, 0)
    x, arena, slots, idx = make_problem(layout, recs, n_tokens=6, k=2, dtype=mx.float32)
    fn = dispatch.kernel_for("host", layout)
    # 12 pairs over 4 experts: prefill, fused tiles
    y = fn(x.reshape(2, 3, -1), arena, slots, idx.reshape(2, 3, 2), layout, strategy="fused")
    ref = cpu_reference(x, arena[slots], layout, idx)
    assert y.shape == (2, 3, 2, 256)
    _compare(y.reshape(6, 2, 256), ref, "host leading dims", 1e-5, 1e-6)


@needs_cxx
@pytest.mark.parametrize("case", ["affine4-g64", "IQ2_XS+Q2_K-down", "mxfp4"])
def test_host_one_token_pairs_equal_the_general_call(case):
    """`pairs` (decode's handshake: one token's pairs by their slots) runs the same kernels on
    the same inputs as the general call: equal outputs, bit for bit, also through the kernel
    the runtime resolves."""
    from strata_mlx.runtime import kernels

    layout, recs = CASES[case](6, 256, 256, 2)
    x, arena, slots, idx = make_problem(layout, recs, n_tokens=1, k=4, dtype=mx.float32, seed=3)
    fn = dispatch.kernel_for("host", layout)
    want = np.array(fn(x.reshape(1, 1, -1), arena, slots, idx.reshape(1, 1, -1), layout))
    pair_slot = mx.array(np.array(slots)[np.array(idx)[0]])
    got = np.array(fn.pairs(x.reshape(1, 1, -1), arena, pair_slot))
    assert got.shape == want.shape == (1, 1, 4, 256)
    np.testing.assert_array_equal(got, want)
    run = kernels.expert_kernel(layout, "host")
    np.testing.assert_array_equal(np.array(run.pairs(x, arena, pair_slot)), want[0])
    flat = np.array(fn.pairs(x.reshape(-1), arena, pair_slot))  # [D] -> [k, D]
    np.testing.assert_array_equal(flat, want[0, 0])
    with pytest.raises(ValueError, match="one token of 256 features"):
        fn.pairs(mx.concatenate([x, x]), arena, pair_slot)


@needs_cxx
@pytest.mark.parametrize("case", ["affine4-g64", "IQ3_S+Q4_K-down", "mxfp4-gpt-oss"])
def test_host_kernels_compute_the_same_bits_with_either_header(case):
    """The kernels compiled with their own parts of formats.h and with all of it: the same
    outputs bit for bit (decode's pairs; the dequantize kernels of a two-format layout)."""
    layout, recs = CASES[case](6, 256, 256, 2)
    x, arena, slots, idx = make_problem(layout, recs, n_tokens=1, k=4, dtype=mx.float32, seed=3)
    pair_slot = mx.array(np.array(slots)[np.array(idx)[0]])
    out = {}
    for header in algorithm.KERNEL_HEADERS:
        kern = dispatch.ExpertKernels(host, layout, dispatch.plan(layout), header=header)
        out[header] = [np.array(kern.pairs(x, arena, pair_slot))]
        if case == "IQ3_S+Q4_K-down":
            out[header] += [np.array(w) for w in kern.dequantize(arena, slots).values()]
    for own, full in zip(out["own"], out["full"]):
        np.testing.assert_array_equal(own.view(np.uint32), full.view(np.uint32))


def test_the_kernel_call_benchmark_says_what_it_cannot_time_here(tmp_path):
    """benchmarks/kernel_call.py on a machine without a GPU device: the source sizes of a
    synthetic store's kernels with either header, then "nothing timed", and exit status 0;
    with --stub, the glue's table."""
    from test_synthetic import tiny_synthetic

    if (hasattr(mx, "cuda") and mx.cuda.is_available()) or mx.metal.is_available():
        pytest.skip("a GPU device: the benchmark times its calls (a GPU tool)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = tiny_synthetic(tmp_path / "synth")
    script = os.path.join(root, "benchmarks", "kernel_call.py")
    r = subprocess.run([sys.executable, script, str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    sizes = dict(re.findall(r"(own|full) *: decode gate_up (\d+)", r.stdout))
    assert int(sizes["own"]) < int(sizes["full"]), r.stdout
    assert "nothing timed" in r.stdout
    # --stub: `pairs` against the general call with one-op kernels, timed on this machine
    r = subprocess.run(
        [sys.executable, script, str(path), "--stub", "--calls", "96", "--rounds", "1"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = dict(re.findall(r"^(pairs|general) +([0-9.]+)", r.stdout, re.M))
    assert set(rows) == {"pairs", "general"} and "difference" in r.stdout, r.stdout


@needs_cxx
def test_host_f16_helper_all_bit_patterns():
    code = (
        host.PRELUDE
        + algorithm.SHARED_HEADER
        + 'static float sk_warp_sum(float v) { return v; }\nextern "C" void f16_all(float* o)'
        " { for (uint32_t h = 0; h < 65536u; ++h) o[h] = sk_f16(h); }\n"
    )
    with tempfile.TemporaryDirectory() as d:
        src, lib = os.path.join(d, "f16.cpp"), os.path.join(d, "f16.so")
        open(src, "w").write(code)
        subprocess.run([host.compiler(), "-O1", "-shared", "-fPIC", "-o", lib, src], check=True)
        out = np.zeros(65536, np.float32)
        ctypes.CDLL(lib).f16_all(out.ctypes.data_as(ctypes.c_void_p))
    ref = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(out[~nan].view(np.uint32), ref[~nan].view(np.uint32))


@needs_cxx
def test_host_harness_catches_divergent_warps():
    src = algorithm.KernelSource(
        "divergent",
        ("a",),
        ("o",),
        "",
        "  if (sk_gx & 1u) return;\n  o[0] = sk_warp_sum(1.0f);\n",
        1,
    )
    run = host.build(src)
    with pytest.raises(RuntimeError, match="diverged"):
        run([mx.zeros((1,))], (32, 1, 1), (32, 1, 1), [(1,)], [mx.float32], [("T", mx.float32)])


@needs_cxx
def test_affine_kernels_do_not_import_gguf():
    # gguf-py is needed by GGUF formats only: an affine model's kernels resolve, self-check and
    # run without importing it.
    code = """
import sys
import mlx.core as mx
from strata_mlx.runtime import kernels
from strata_mlx.format.quant import expert_tensors, layout_for
shapes = {"gate_proj": (256, 256), "up_proj": (256, 256), "down_proj": (256, 256)}
w = {p: mx.random.normal((1, *s)) / 16 for p, s in shapes.items()}
t, table = expert_tensors(w, {"bits": 4, "group_size": 64}, mx.float16)
layout = layout_for({n: v[0] for n, v in t.items()}, table)
fn = kernels.expert_kernel(layout, "host")
assert fn.__name__ != "reference", "the host kernel failed its self-check"
loaded = sorted(m for m in sys.modules if m == "gguf" or m.endswith("gguf_quants"))
assert not loaded, loaded
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# CPU: dispatch semantics and tiling


def test_kernel_for_semantics():
    layout, _ = CASES["affine4-g64"](1, 256, 256, 0)
    assert dispatch.kernel_for("reference", layout) is None
    with pytest.raises(ValueError):
        dispatch.kernel_for("vulkan", layout)
    fn = dispatch.kernel_for("cuda", layout)  # built lazily: nothing compiles on the CPU
    assert fn is not None and dispatch.kernel_for("cuda", layout) is fn
    assert dispatch.kernel_for("metal", layout) is not fn
    # formats without a kernel -> None (the caller falls back to the reference)
    t, table = expert_tensors(
        {p: mx.zeros(s) for p, s in _shapes(256, 256).items()}, None, mx.float16
    )
    assert dispatch.kernel_for("cuda", layout_for(t, table)) is None
    q6 = gguf_experts(1, 256, 256, dict.fromkeys(PROJECTIONS, "Q4_K"))[0]
    q6.quant["down_proj"] = {**q6.quant["down_proj"], "type": "Q6_K"}
    assert dispatch.kernel_for("cuda", q6) is None
    for case in CASES:
        assert dispatch.supported(CASES[case](1, 256, 256, 0)[0]), case


@pytest.mark.parametrize("tile", [1, 3, 8])
def test_tile_pairs_cover_each_pair_once(tile):
    rng = np.random.default_rng(tile)
    n_slots = 7
    ps = rng.integers(0, n_slots, 50).astype(np.uint32)
    tiles, n_tiles = dispatch.tile_pairs(mx.array(ps), tile, n_slots)
    t = np.array(tiles).reshape(n_tiles, tile)
    used = t[t >= 0]
    assert sorted(used.tolist()) == list(range(50))
    for row in t:
        members = row[row >= 0]
        assert (row[: len(members)] >= 0).all()  # filled from the front
        assert len(set(ps[members].tolist())) <= 1  # one slot per tile


# ---------------------------------------------------------------------------------------------
# GPU: the CUDA dialect on MLX's CUDA backend

D, INTER, K, N_EXPERTS = 2048, 512, 10, 32
SHAPES = {"decode": 1, "prefill": 1024}
EPS = {mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7, mx.float32: 2.0**-10}  # f32: TF32 matmuls

# (case, shape, dtype, strategy). Each distinct kernel is a ~1.5 s JIT compile, and each affine
# (bits, group, dtype) configuration costs MLX ~15 s of JIT for the reference's quantize and
# gather_qmm, so the GPU matrix covers every decoder and every dialect-specific type once;
# the remaining configurations (8-bit, bf16/f32 scales) run the same shared body on the CPU
# (test_host_kernel_matches_reference). A larger matrix took 242 s on the H200 (most of it
# MLX's JIT for the affine references); this one drops ~110 s of that.
GPU_DECODE = (
    "affine4-g64",
    "affine2-g64",
    "affine3-g64",
    "IQ2_XS",
    "Q4_K",
    "IQ3_S",
    "Q2_K",
    "IQ2_XS+Q2_K-down",
    "IQ3_S+Q4_K-down",
    "mxfp4",
    "mxfp4-gpt-oss",
)
PREFILL_CASES = (  # automatic strategy: dequant kernels + gather_mm
    "affine4-g64",
    "affine2-g64",
    "IQ2_XS",
    "Q4_K",
    "IQ2_XS+Q2_K-down",
    "IQ3_S+Q4_K-down",
    "mxfp4",
    "mxfp4-gpt-oss",
)
GPU_CASES = (
    [(c, "decode", mx.float16, None) for c in GPU_DECODE]
    + [(c, "prefill", mx.float16, None) for c in PREFILL_CASES]
    + [(c, "prefill", mx.float16, "fused") for c in ("affine4-g64", "IQ3_S+Q4_K-down")]
    + [("affine4-g64", "decode", mx.bfloat16, None), ("IQ2_XS", "decode", mx.float32, None)]
)


def _cuda_available() -> bool:
    return hasattr(mx, "cuda") and mx.cuda.is_available()


@pytest.fixture(scope="module")
def gpu():
    if not _cuda_available():
        pytest.skip("needs MLX's CUDA backend")
    mx.set_default_device(mx.gpu)
    yield
    mx.set_default_device(mx.cpu)


_EXPERTS: dict[str, tuple] = {}


def _experts(case):
    if case not in _EXPERTS:
        _EXPERTS[case] = CASES[case](N_EXPERTS, D, INTER, 7)
    return _EXPERTS[case]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case,shape,dtype,strategy", GPU_CASES, ids=lambda v: str(v).split(".")[-1]
)
def test_cuda_matches_reference(gpu, case, shape, dtype, strategy):
    layout, recs = _experts(case)
    x, arena, slots, idx = make_problem(layout, recs, SHAPES[shape], K, dtype, seed=11)
    fn = dispatch.kernel_for("cuda", layout)
    y = fn(x, arena, slots, idx, layout, strategy=strategy)
    ref = switch_glu_reference(x, arena[slots], layout, idx)
    mx.eval(y, ref)
    # Both sides accumulate in float32 in different orders; the reference also rounds gate, up
    # and (GGUF) the weights to the activation dtype, both round h and y to it. Each rounding
    # is <= eps/2 relative; through a random-signed sum it stays ~eps/2 of the output RMS, and
    # the largest of ~20M outputs (<= ~5 RMS, ~5.5 sigma of the noise) stays under 16 eps RMS.
    what = f"cuda {case} {shape} {dtype} strategy={strategy or 'auto'}"
    max_rel, frob_rel = _compare(y, ref, what, 16 * EPS[dtype], 2 * EPS[dtype])
    # the figures docs/benchmarks.md reports (pytest -s shows them)
    eps = EPS[dtype]
    print(f"\n{what}: max {max_rel / eps:.2f} eps x RMS, RMS error {frob_rel / eps:.3f} eps")


@pytest.mark.gpu
def test_cuda_prefill_tile_sizes_agree(gpu):
    layout, recs = _experts("IQ2_XS")
    x, arena, slots, idx = make_problem(layout, recs, 64, K, mx.float16, seed=5)
    fn = dispatch.kernel_for("cuda", layout)
    y1 = fn(x, arena, slots, idx, layout, strategy="fused", tile=1)
    y8 = fn(x, arena, slots, idx, layout, strategy="fused", tile=8)
    # the same per-pair float32 arithmetic in the same order (up to FMA contraction choices)
    _compare(y8, y1, "tile=8 vs tile=1", 2 * EPS[mx.float16], EPS[mx.float16])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", ["Q4_K", "IQ3_S+Q4_K-down", "IQ2_XS+Q2_K-down", "affine2-g64", "mxfp4"]
)
def test_cuda_dequant_kernel_exact(gpu, case):
    layout, recs = _experts(case)
    _, arena, slots, _ = make_problem(layout, recs, 1, K, mx.float16, seed=3)
    # fp16 output (the prefill kernels, already compiled): one rounding of the float32 value
    got = dispatch.kernel_for("cuda", layout).dequantize(arena, slots, mx.float16)
    views = component_views(arena[slots], layout)
    for p, spec in layout.quant.items():
        if spec["format"] == "gguf":  # float32 decode is exact: bit-identical to the reference
            n, out, _ = views[f"{p}.weight"].shape
            ref = dequantize(spec["type"], views[f"{p}.weight"], (n, out, spec["in_features"]))
            ref = ref.astype(mx.float16)
            ok = np.array_equal(np.array(got[p]).view(np.uint16), np.array(ref).view(np.uint16))
        elif spec["format"] == "mxfp4":  # exact in float32, then rounded once to fp16
            ref = dequantize_mxfp4(views[f"{p}.weight"], views[f"{p}.scales"], mx.float16)
            ok = np.array_equal(np.array(got[p]).view(np.uint16), np.array(ref).view(np.uint16))
        else:  # fp16 scale * q is exact in float32; + bias rounds once, as in mx.dequantize
            w, sc, b = (views[f"{p}.{c}"] for c in ("weight", "scales", "biases"))
            ref = mx.dequantize(
                w, sc.astype(mx.float32), b.astype(mx.float32), spec["group_size"], spec["bits"]
            )
            err = np.abs(np.array(got[p].astype(mx.float32)) - np.array(ref))
            ok = bool((err <= 2.0**-10 * np.abs(np.array(ref)) + 2.0**-24).all())  # <= 1 ulp
        assert ok, f"cuda dequant {case} {p} differs from the reference dequantizer"


@pytest.mark.gpu
def test_cuda_switch_glu_reads_arena_slots_in_place(gpu):
    from strata_mlx.runtime import kernels
    from strata_mlx.stream.arena import Arena

    layout, recs = _experts("affine4-g64")
    x, dense, slots, idx = make_problem(layout, recs, 3, K, mx.float16, seed=2)
    arena = Arena(dense.shape[0], layout.record_bytes)  # the runtime's buffer (offset view)
    arena_np = np.array(dense)
    for s in range(dense.shape[0]):
        arena.view(s)[:] = arena_np[s]
    assert kernels.backend() == "cuda"
    y = kernels.switch_glu(x, arena.rows, slots, idx, layout)
    ref = switch_glu_reference(x, dense[slots], layout, idx)
    _compare(y, ref, "switch_glu on Arena.rows", 16 * EPS[mx.float16], 2 * EPS[mx.float16])


@pytest.mark.parametrize("flag", ["--hidden", "--inter", "--top-k", "--tile"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_kernels_show_refuses_widths_and_counts_below_one(flag, value):
    """`kernels show Q4_K --hidden 0` printed kernels for an expert of no inputs, exit 0."""
    from typer.testing import CliRunner

    from strata_mlx.cli import app

    r = CliRunner().invoke(app, ["kernels", "show", "affine4-g64", flag, value])
    assert r.exit_code == 2 and r.output.strip() == (
        f"error: {flag} {value}: expected an integer in [1, 1048576]"
    ), r.output


@pytest.mark.parametrize("fmt", ["affine4-g0", "affine0-g64", "affine9-g64"])
def test_kernels_show_refuses_an_affine_format_of_no_bits_or_group(fmt):
    """`kernels show affine4-g0` was a ZeroDivisionError's traceback."""
    from typer.testing import CliRunner

    from strata_mlx.cli import app

    r = CliRunner().invoke(app, ["kernels", "show", fmt])
    assert r.exit_code == 2 and r.output.strip() == (
        f"error: {fmt}: bits 1 to 8 and a group of 1 input at least"
    ), r.output
