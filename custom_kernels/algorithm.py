"""The expert kernel algorithm, written once for every dialect.

Owns: (1) per weight format, which decoder of formats.h its rows take (formats as data: the
C function, its row bases and tables, the alignment its loads need); (2) the kernel bodies
(gate/up -> SwiGLU, then down; and a dequantizer), generated per layout as C source in a subset
that Metal, CUDA and host C++ all accept. The decoders themselves are C, in formats.h; a
kernel's header is the part of it that its body calls (kernel_header: its own format's
decoders and their helpers, each item's text as in the file); `strata-mlx kernels show FORMAT
--dialect D` prints a kernel's whole source as the dialect compiles it.

The header and body use only names that a dialect layer defines (metal.py, cuda.py, host.py):
`sk_gx`, `sk_gy` (global thread ids), `SK_FN`, `SK_GLOBAL`, `SK_U64`, `SK_UNROLL`,
`sk_as_float`, `sk_tof`, `sk_store`, `sk_exp`, `sk_warp_sum`, and the template type `T` (x's
dtype). Nothing else in them differs between dialects; tests/runtime/test_kernels.py checks that.

Kernel structure. A warp (32 lanes) computes one output row for one *tile* of up to `tm` (token,
expert) pairs that share an arena slot: lanes stride over the row's 16-weight chunks, decode each
chunk once and dot it with every pair's activations (float32), then reduce across the warp.
Decode uses tm = 1 (tile = one pair); prefill sorts pairs by slot so a tile of tm pairs reuses
each decoded weight tm times. Kernel 1 writes h = silu(gate . x) * (up . x) in x's dtype (as the
reference rounds it), kernel 2 writes y = down . h. A third kernel (dequant_source) writes the
decoded weights of given slots, for prefill through a grouped matmul.

Never: touches MLX kernels or devices (dispatch.py and the dialect modules do), reads files
other than formats.h.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from .formats import MXFP4_BLOCK

CHUNK = 16  # weights per chunk: every supported format keeps one (scale, offset) per chunk
# (MXFP4's blocks of 32 are two chunks that read the same scale)
WARP = 32
THREADGROUP = 128

# Names every dialect layer defines, and nothing more is assumed by the shared source.
DIALECT_NAMES = (
    "SK_FN",
    "SK_GLOBAL",
    "SK_U64",
    "SK_UNROLL",
    "sk_as_float",
    "sk_tof",
    "sk_store",
    "sk_exp",
    "sk_warp_sum",
    "sk_gx",
    "sk_gy",
)

# ---------------------------------------------------------------------------------------------
# Formats as data: which decoder of formats.h a projection calls, with which row bases and tables.


@dataclass(frozen=True)
class Decoder:
    name: str
    function: str  # the formats.h decoder, with template arguments where it has them
    bases: tuple[str, ...]  # byte pointers of one row: "W" weights; "S", "B" affine scales/biases
    offset: bool  # whether w = scale * q + offset has an offset (else w = scale * q)
    tables: tuple[str, ...] = ()  # lookup tables the decoder takes after the chunk index
    align: int = 1  # widest load in bytes: row bases must be aligned to it
    unaligned: tuple[str, ...] = ()  # bases read a byte at a time: exempt from `align`

    def call(self, bases: tuple[str, ...], chunk: str) -> str:
        """C call decoding chunk `chunk` of the row at `bases` (one C pointer per base)."""
        return f"{self.function}({', '.join((*bases, chunk, *self.tables))})"


SCALE_DTYPES = {
    "float16": "SK_SCALES_F16",
    "bfloat16": "SK_SCALES_BF16",
    "float32": "SK_SCALES_F32",
}


@cache
def affine_decoder(bits: int, group_size: int, scale_dtype: str) -> Decoder:
    """MLX affine (sk_decode_affine): w = scale[g] * q + bias[g]."""
    if not 2 <= bits <= 8 or group_size % CHUNK:
        raise ValueError(f"affine bits={bits} group_size={group_size}")
    per = group_size // CHUNK  # chunks per group
    if per & (per - 1):
        raise ValueError(f"group_size {group_size} is not 16 * 2^n")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"unsupported scale dtype {scale_dtype}")
    word = 4 if bits % 2 == 0 else 2  # a chunk is 2 * bits bytes: 32-bit words when even
    return Decoder(
        name=f"affine{bits}g{group_size}{scale_dtype}",
        function=f"sk_decode_affine<{bits}u, {group_size}u, {SCALE_DTYPES[scale_dtype]}>",
        bases=("W", "S", "B"),
        offset=True,
        align=max(word, 4 if scale_dtype == "float32" else 2),
    )


GGUF_DECODERS = {
    "IQ2_XS": Decoder(
        "IQ2_XS", "sk_decode_iq2_xs", ("W",), False, ("iq2xs_grid", "iq2xs_signs"), 2
    ),
    "IQ3_S": Decoder("IQ3_S", "sk_decode_iq3_s", ("W",), False, ("iq3s_grid",), 2),
    "Q4_K": Decoder("Q4_K", "sk_decode_q4_k", ("W",), True, (), 4),
    "Q2_K": Decoder("Q2_K", "sk_decode_q2_k", ("W",), True, (), 4),
}
GGUF_BLOCK = 256

# OCP MXFP4 (GPT-OSS's experts; strata_mlx.format.quant.dequantize_mxfp4): codes read as
# 32-bit words, the E8M0 scale row byte by byte (its stride, in / 32 bytes, is odd for GPT-OSS's
# 2880).
MXFP4_DECODER = Decoder("mxfp4", "sk_decode_mxfp4", ("W", "S"), False, (), 4, ("S",))


def gguf_decoder(qtype: str) -> Decoder:
    return GGUF_DECODERS[qtype]


# ---- tables (kernel inputs of the i-quants; one source: ggml.py, gguf-py's own tables) -----


@cache
def tables() -> dict[str, np.ndarray]:
    """uint32 tables as the kernels index them (little-endian: byte j of an entry is weight j).
    Imports gguf-py (through ggml.py): only kernels of i-quant formats call this."""
    from . import ggml

    out = {
        "iq2xs_grid": ggml.grid("IQ2_XS").reshape(-1).view(np.uint32),  # [512 * 2]
        "iq2xs_signs": ggml.ksigns_iq2xs().astype(np.uint32),  # [128]
        "iq3s_grid": ggml.grid("IQ3_S").reshape(-1).view(np.uint32),  # [512]
    }
    for a in out.values():
        a.setflags(write=False)
    return out


# ---------------------------------------------------------------------------------------------
# Projection geometry from a record layout, and kernel sources.


@dataclass(frozen=True)
class Projection:
    """Where one projection's rows sit in a record, and how to decode them."""

    decoder: Decoder
    out_features: int
    in_features: int
    offsets: tuple[tuple[str, int, int], ...]  # (base, byte offset in record, row stride)
    # GPT-OSS: (byte offset in record, SCALE_DTYPES key) of a float [out] added to the output
    bias: tuple[int, str] | None = None


def projection(layout, proj: str) -> Projection | None:
    """The kernel view of `proj` in `layout` (a strata_mlx.format.store.RecordLayout), or None when
    its format has no kernel (float, other GGUF types, odd group sizes or alignment)."""
    spec = layout.quant.get(proj, {})
    fmt = spec.get("format")
    try:
        wc = layout.component(f"{proj}.weight")
    except KeyError:
        return None
    out = wc.shape[0]
    if fmt == "affine":
        bits, gs = int(spec["bits"]), int(spec["group_size"])
        sc, bc = layout.component(f"{proj}.scales"), layout.component(f"{proj}.biases")
        if wc.dtype != "uint32" or sc.dtype != bc.dtype:
            return None
        try:
            dec = affine_decoder(bits, gs, sc.dtype)
        except ValueError:
            return None
        n_in = wc.shape[1] * 32 // bits
        esz = 4 if sc.dtype == "float32" else 2
        offs = (
            ("W", wc.offset, wc.shape[1] * 4),
            ("S", sc.offset, sc.shape[1] * esz),
            ("B", bc.offset, bc.shape[1] * esz),
        )
        if n_in % gs or sc.shape != [out, n_in // gs] or bc.shape != sc.shape:
            return None
    elif fmt == "gguf" and spec.get("type") in GGUF_DECODERS:
        from .ggml import row_bytes

        dec = gguf_decoder(spec["type"])
        n_in = int(spec["in_features"])
        if n_in % GGUF_BLOCK or wc.dtype != "uint8" or wc.shape[1] != row_bytes(spec["type"], n_in):
            return None
        offs = (("W", wc.offset, wc.shape[1]),)
    elif fmt == "mxfp4":
        dec = MXFP4_DECODER
        sc = layout.component(f"{proj}.scales")
        n_in = wc.shape[1] * 2
        if wc.dtype != "uint8" or sc.dtype != "uint8" or n_in % MXFP4_BLOCK:
            return None
        if sc.shape != [out, n_in // MXFP4_BLOCK]:
            return None
        offs = (("W", wc.offset, wc.shape[1]), ("S", sc.offset, sc.shape[1]))
    else:
        return None
    for base, off, stride in offs:
        if base not in dec.unaligned and (off % dec.align or stride % dec.align):
            return None
    bias = None
    try:
        bc = layout.component(f"{proj}.bias")
    except KeyError:
        bc = None
    if bc is not None:
        if bc.dtype not in SCALE_DTYPES or bc.shape != [out] or bc.offset % 4:
            return None
        bias = (bc.offset, bc.dtype)
    return Projection(dec, out, n_in, offs, bias)


@dataclass(frozen=True)
class KernelSource:
    """One kernel, dialect-free: dialects prepend their prelude to `header` and their
    prologue to `body`, and hand `input_names`/`output_names` to MLX unchanged."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    header: str
    body: str
    rows: int  # output rows per pair (grid x = 32 * rows)


def wrap_mlx_kernel(factory: Callable, src: KernelSource, header: str, body: str) -> Callable:
    """Compile through `factory` (mx.fast.cuda_kernel or mx.fast.metal_kernel: one signature):
    the kernel MLX makes, called with keywords inputs, grid, threadgroup, output_shapes,
    output_dtypes, template (as host.build's callable takes them), without a Python wrapper
    between: dispatch calls it twice a layer on every decoded token."""
    return factory(
        name=src.name,
        input_names=list(src.input_names),
        output_names=list(src.output_names),
        source=body,
        header=header,
        ensure_row_contiguous=True,
    )


# The shared header: loads, fp16/bf16 fields and one decoder per format (formats.h).
SHARED_HEADER = (Path(__file__).parent / "formats.h").read_text()

# What a kernel's header holds (the `header` argument of the *_source functions): "own", the
# pieces of formats.h its body calls (kernel_header); "full", the whole file. MLX's CUDA
# kernel call concatenates the header and body on every call and hashes the result at eval
# (mx.fast.cuda_kernel), so every byte costs host time on every call: ~0.2 us a KB on a dev
# CPU for that copy and std::hash alone (a C++ loop doing just those); the call itself is
# timed on a GPU by benchmarks/kernel_call.py.
KERNEL_HEADERS = ("own", "full")

_IDENT = re.compile(r"[A-Za-z_]\w*")


@dataclass(frozen=True)
class _Piece:
    """A top-level item of formats.h (a function, struct or enum with the comment lines just
    above it), or a comment paragraph; with the blank lines after it."""

    text: str
    defines: frozenset[str]
    uses: frozenset[str]
    heading: bool  # a "// ----" paragraph: a section's heading, kept when an item under it is


def _code(line: str) -> str:
    return line.split("//", 1)[0].strip()


def _piece(lines: list[str]) -> _Piece:
    code = " ".join(c for c in map(_code, lines) if c)
    defines = set()
    if code:
        decl = re.sub(r"^template\s*<[^>]*>\s*", "", code)
        named = re.match(r"(struct|enum)\s+(\w+)", decl)
        if named:
            defines.add(named[2])
            if named[1] == "enum":  # its enumerators too
                defines.update(_IDENT.findall(decl[decl.index("{") : decl.index("}")]))
        else:  # a function: the name before its parameter list
            defines.add(_IDENT.findall(decl[: decl.index("(")])[-1])
    heading = not code and lines[0].startswith("// ----")
    uses = frozenset(_IDENT.findall(code)) - defines
    return _Piece("".join(lines), frozenset(defines), uses, heading)


def _pieces(text: str) -> tuple[_Piece, ...]:
    """formats.h cut into pieces whose texts, joined, are the file: an item ends where its
    braces close (a blank line inside one is refused), a comment paragraph at a blank line."""
    done: list[list[str]] = []
    buf: list[str] = []
    depth = 0
    for line in text.splitlines(keepends=True):
        if not buf and not line.strip():
            done[-1].append(line)  # blank lines end the piece before them
            continue
        buf.append(line)
        code = _code(line)
        depth += code.count("{") - code.count("}")
        if depth == 0 and code.endswith(("}", ";")):  # an item's end
            done.append(buf)
            buf = []
        elif not line.strip():
            if any(_code(b) for b in buf):
                raise ValueError(
                    f"formats.h: a blank line inside the item {buf[0]!r}: kernel_header cuts"
                    " the file into items at blank lines outside braces"
                )
            done.append(buf)  # a comment paragraph's end
            buf = []
    if buf:
        raise ValueError(f"formats.h ends inside an item: {buf[0]!r}")
    return tuple(_piece(lines) for lines in done)


_PIECES = _pieces(SHARED_HEADER)


def kernel_header(body: str, header: str = "own") -> str:
    """The formats.h text a kernel of `body` is compiled with: "own", the items its body
    names and those they name in turn (file order, each section's heading kept; the file's
    opening comment left out) -- every item's text as in the file, so one kernel's
    code is the same with either; "full", the whole file."""
    if header == "full":
        return SHARED_HEADER
    if header != "own":
        raise ValueError(f"kernel header {header!r}: one of {', '.join(KERNEL_HEADERS)}")
    where = {name: i for i, p in enumerate(_PIECES) for name in p.defines}
    todo = [name for name in _IDENT.findall(body) if name in where]
    used: set[int] = set()
    while todo:
        i = where[todo.pop()]
        if i not in used:
            used.add(i)
            todo += [name for name in _PIECES[i].uses if name in where]
    out, heading = [], None
    for i, p in enumerate(_PIECES):
        if p.heading:
            heading = p.text
        elif i in used:
            out += [heading or "", p.text]
            heading = None
    return "".join(out)


def _record_base(record_bytes: int) -> str:
    """The line pointing l_rec at slot l_slot's record. The slot offset is 64-bit: an arena of
    4 GiB or more overflows 32-bit arithmetic (slot * record_bytes). Offsets inside a record
    (_bases, the loads) stay 32-bit, so a record must stay under 4 GiB."""
    if not 0 < record_bytes < 2**32:
        raise ValueError(f"record_bytes {record_bytes}: in-record offsets are 32-bit")
    return f"  const SK_GLOBAL uint8_t* l_rec = arena + (SK_U64)l_slot * (SK_U64){record_bytes}u;"


def _bases(p: str, proj: Projection, indent: str) -> list[str]:
    """Row base pointers l_{p}W (l_{p}S, l_{p}B) of row l_row in record l_rec."""
    return [
        f"{indent}const SK_GLOBAL uint8_t* l_{p}{base} = l_rec + ({off}u + l_row * {stride}u);"
        for base, off, stride in proj.offsets
    ]


def _decode_chunk(p: str, dec: Decoder, indent: str) -> str:
    """The line decoding chunk l_c of this projection's row into l_{p}chunk."""
    bases = tuple(f"l_{p}{b}" for b in dec.bases)
    return f"{indent}const sk_chunk l_{p}chunk = {dec.call(bases, 'l_c')};"


def _projection_loop(p: str, proj: Projection, tm: int) -> list[str]:
    """Lines accumulating l_{p}acc{m} += row . src_m over this lane's chunks."""
    dec = proj.decoder
    out = ["  {", *_bases(p, proj, "    ")]
    n_chunks = proj.in_features // CHUNK
    out.append(f"    for (uint32_t l_c = l_lane; l_c < {n_chunks}u; l_c += {WARP}u) {{")
    out.append(_decode_chunk(p, dec, "      "))
    w = f"l_{p}chunk"
    for m in range(tm):
        out.append(f"      if (l_p{m} >= 0) {{")
        out.append(f"        const sk_x16 l_x = sk_load_x16(l_src{m} + l_c * {CHUNK}u);")
        acc = f"        l_{p}acc{m} += {w}.scale * sk_dot16({w}, l_x)"
        out.append(acc + (f" + {w}.offset * sk_sum16(l_x);" if dec.offset else ";"))
        out.append("      }")
    out += ["    }", "  }"]
    return out


def _tile_prologue(
    rows: int, tm: int, record_bytes: int, src: str, src_row: Callable[[str], str]
) -> list[str]:
    out = [
        "  const uint32_t l_row = sk_gx >> 5u;",
        "  const uint32_t l_lane = sk_gx & 31u;",
        f"  if (l_row >= {rows}u) return;",
    ]
    out += [f"  const int32_t l_p{m} = tile_pairs[sk_gy * {tm}u + {m}u];" for m in range(tm)]
    out += [
        "  if (l_p0 < 0) return;",
        "  const uint32_t l_slot = pair_slot[l_p0];",
        _record_base(record_bytes),
    ]
    for m in range(tm):
        pm = f"(uint32_t)l_p{m}" if m == 0 else f"(l_p{m} >= 0 ? (uint32_t)l_p{m} : 0u)"
        out.append(f"  const SK_GLOBAL T* l_src{m} = {src} + {src_row(pm)};")
    return out


def _finish(name: str, tables_used: tuple[str, ...], role: str, header: str, body: str, rows: int):
    inputs = ("x" if role == "gate_up" else "h", "arena", "pair_slot", "tile_pairs", *tables_used)
    outputs = ("h" if role == "gate_up" else "y",)
    text = kernel_header(body, header)
    digest = hashlib.sha1((text + body).encode()).hexdigest()[:12]
    return KernelSource(f"sk_{role}_{name}_{digest}", inputs, outputs, text, body, rows)


def _bias_term(proj: Projection) -> str:
    """` + bias[l_row]` of a biased projection (read from the record), else nothing."""
    if proj.bias is None:
        return ""
    off, dtype = proj.bias
    return f" + sk_scale_at<{SCALE_DTYPES[dtype]}>(l_rec + {off}u, l_row)"


def _f32(v: float) -> str:
    """A float32 literal that reads back as float32(v) (9 significant digits round-trip)."""
    text = f"{float(np.float32(v)):.9g}"
    return text + ("f" if "." in text or "e" in text else ".0f")


def _gated(m: int, activation: dict | None, indent: str) -> tuple[list[str], str]:
    """(lines, expression): h of pair m from its gate l_g{m} and up l_u{m} (float32): SwiGLU,
    or GPT-OSS's clamped variant (formats.swiglu_oai, op for op in float32)."""
    if activation is None:
        return [], f"l_g{m} / (1.0f + sk_exp(-l_g{m})) * l_u{m}"
    if activation["name"] != "swiglu_oai":
        raise ValueError(f"no kernel for activation {activation['name']!r}")
    lim, alpha = _f32(activation["limit"]), _f32(activation["alpha"])
    lines = [
        f"{indent}const float l_cg{m} = l_g{m} < {lim} ? l_g{m} : {lim};",
        f"{indent}const float l_cu{m} = l_u{m} < -{lim} ? -{lim}"
        f" : (l_u{m} > {lim} ? {lim} : l_u{m});",
    ]
    lines.append(
        f"{indent}const float l_h{m} = (l_cu{m} + 1.0f)"
        f" * (l_cg{m} / (1.0f + sk_exp(-{alpha} * l_cg{m})));"
    )
    return lines, f"l_h{m}"


def gate_up_source(
    gate: Projection,
    up: Projection,
    k: int,
    record_bytes: int,
    tm: int,
    activation: dict | None = None,
    header: str = "own",
):
    """Kernel 1: h[p, i] = silu(gate_i . x[p // k]) * (up_i . x[p // k]) for each pair p of a
    tile (with `activation` swiglu_oai: GPT-OSS's clamped form; biased projections add their
    bias first); grid (32 * inter, n_tiles), pairs of tile t in tile_pairs[t*tm : t*tm + tm].
    header: "own" or "full" (KERNEL_HEADERS), as each *_source takes it."""
    rows, d = gate.out_features, gate.in_features
    lines = _tile_prologue(rows, tm, record_bytes, "x", lambda pm: f"(SK_U64)({pm} / {k}u) * {d}u")
    lines += [f"  float l_gacc{m} = 0.0f;" for m in range(tm)]
    lines += [f"  float l_uacc{m} = 0.0f;" for m in range(tm)]
    lines += _projection_loop("g", gate, tm)
    lines += _projection_loop("u", up, tm)
    for m in range(tm):
        act_lines, h = _gated(m, activation, "    ")
        lines += [
            f"  const float l_g{m} = sk_warp_sum(l_gacc{m}){_bias_term(gate)};",
            f"  const float l_u{m} = sk_warp_sum(l_uacc{m}){_bias_term(up)};",
            f"  if (l_lane == 0u && l_p{m} >= 0) {{",
            *act_lines,
            f"    sk_store(h, (SK_U64)l_p{m} * {rows}u + l_row, {h});",
            "  }",
        ]
    used = tuple(sorted(set(gate.decoder.tables) | set(up.decoder.tables)))
    name = f"{gate.decoder.name}_{up.decoder.name}_tm{tm}"
    return _finish(name, used, "gate_up", header, "\n".join(lines) + "\n", rows)


def down_source(down: Projection, record_bytes: int, tm: int, header: str = "own"):
    """Kernel 2: y[p, o] = down_o . h[p] for each pair p of a tile; grid (32 * D, n_tiles)."""
    rows, inter = down.out_features, down.in_features
    lines = _tile_prologue(rows, tm, record_bytes, "h", lambda pm: f"(SK_U64)({pm}) * {inter}u")
    lines += [f"  float l_dacc{m} = 0.0f;" for m in range(tm)]
    lines += _projection_loop("d", down, tm)
    for m in range(tm):
        lines += [
            f"  const float l_d{m} = sk_warp_sum(l_dacc{m}){_bias_term(down)};",
            f"  if (l_lane == 0u && l_p{m} >= 0) {{",
            f"    sk_store(y, (SK_U64)l_p{m} * {rows}u + l_row, l_d{m});",
            "  }",
        ]
    used = tuple(sorted(set(down.decoder.tables)))
    name = f"{down.decoder.name}_tm{tm}"
    return _finish(name, used, "down", header, "\n".join(lines) + "\n", rows)


def dequant_source(
    proj: Projection, record_bytes: int, label: str, wide: bool = False, header: str = "own"
) -> KernelSource:
    """Dequantize rows from arena slots: w[i, r, :] = row r of the record in slots[i], in T.
    One thread per (row, chunk); grid (rows * in / 16, n_slots). For prefill, where many pairs
    share each expert, this plus a grouped matmul (mx.gather_mm) decodes each weight once.
    `wide`: a thread's 16 weights leave in 16-byte stores (sk_store16, the same rounding),
    not one store a weight, neighbouring threads 32 bytes apart. On the H200 the wide stores
    dequantize a 1024-token layer's 512 experts in 1.5-1.6 ms against the scalar stores'
    16.5 (~0.2 TB/s of fp16 writes), which took the prefill kernel from 1.76x gather_qmm's
    time to 0.57x. Metal's sk_store16 is the same 16 stores in one thread's loop."""
    rows, n_in = proj.out_features, proj.in_features
    n_chunks = n_in // CHUNK
    dec = proj.decoder
    lines = [
        "  const uint32_t l_t = sk_gx;",
        f"  if (l_t >= {rows * n_chunks}u) return;",
        f"  const uint32_t l_row = l_t / {n_chunks}u;",
        f"  const uint32_t l_c = l_t - l_row * {n_chunks}u;",
        "  const uint32_t l_slot = slots[sk_gy];",
        _record_base(record_bytes),
        *_bases("w", proj, "  "),
        _decode_chunk("w", dec, "  "),
        f"  const SK_U64 l_o = ((SK_U64)sk_gy * {rows}u + l_row) * {n_in}u + l_c * {CHUNK}u;",
    ]
    value = "l_wchunk.scale * l_wchunk.q[l_j]" + (" + l_wchunk.offset" if dec.offset else "")
    if wide:
        lines += [
            f"  float l_v[{CHUNK}];",
            "  SK_UNROLL",
            f"  for (uint32_t l_j = 0u; l_j < {CHUNK}u; ++l_j) {{",
            f"    l_v[l_j] = {value};",
            "  }",
            "  sk_store16(w, l_o, l_v);",
        ]
    else:
        lines += [
            "  SK_UNROLL",
            f"  for (uint32_t l_j = 0u; l_j < {CHUNK}u; ++l_j) {{",
            f"    sk_store(w, l_o + l_j, {value});",
            "  }",
        ]
    body = "\n".join(lines) + "\n"
    text = kernel_header(body, header)
    digest = hashlib.sha1((text + body).encode()).hexdigest()[:12]
    return KernelSource(
        f"sk_dequant_{label}_{dec.name}_{digest}",
        ("arena", "slots", *dec.tables),
        ("w",),
        text,
        body,
        rows,
    )
