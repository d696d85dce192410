"""The expert kernel algorithm, written once for every dialect, and its CPU interpreter.

Owns: (1) per weight format, the decode of one *chunk* (16 consecutive weights of a row) as
data: a few expression trees over byte loads, shifts, masks, table lookups and float32 ops;
(2) the kernel bodies (gate/up -> SwiGLU, then down) generated from those trees as C source in a
subset that Metal, CUDA and host C++ all accept; (3) a numpy interpreter of the same trees, so
the exact decode expressions a kernel runs are checked bit for bit against the reference
dequantizers (`strata_mlx.quant` / `gguf_quants`) on the CPU.

The generated body and header use only names that a dialect layer defines (metal.py, cuda.py,
host.py): `sk_gx`, `sk_gy` (global thread ids), `SK_FN`, `SK_GLOBAL`, `SK_U64`, `sk_as_float`,
`sk_tof`, `sk_store`, `sk_exp`, `sk_warp_sum`, and the template type `T` (x's dtype). Nothing
else in them differs between dialects; tests/test_kernels.py checks that.

Kernel structure. A warp (32 lanes) computes one output row for one *tile* of up to `tm` (token,
expert) pairs that share an arena slot: lanes stride over the row's 16-weight chunks, decode each
chunk once and dot it with every pair's activations (float32), then reduce across the warp.
Decode uses tm = 1 (tile = one pair); prefill sorts pairs by slot so a tile of tm pairs reuses
each decoded weight tm times. Kernel 1 writes h = silu(gate . x) * (up . x) in x's dtype (as the
reference rounds it), kernel 2 writes y = down . h. A third kernel (dequant_source) writes the
decoded weights of given slots, for prefill through a grouped matmul.

Never: touches MLX kernels or devices (dispatch.py and the dialect modules do), reads files.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

CHUNK = 16  # weights per chunk: every supported format keeps one (scale, offset) per chunk
WARP = 32
THREADGROUP = 128

# Names every dialect layer defines, and nothing more is assumed by the shared source.
DIALECT_NAMES = (
    "SK_FN",
    "SK_GLOBAL",
    "SK_U64",
    "sk_as_float",
    "sk_tof",
    "sk_store",
    "sk_exp",
    "sk_warp_sum",
    "sk_gx",
    "sk_gy",
)

# ---------------------------------------------------------------------------------------------
# Expression trees. Type "u" is uint32 (C unsigned wrap-around), "f" is float32.


class E:
    __slots__ = ("op", "args", "ty")

    def __init__(self, op: str, args: tuple, ty: str):
        self.op, self.args, self.ty = op, args, ty

    def _bin(self, other, op: str, rev: bool = False) -> E:
        o = _lift(other, self.ty)
        if o.ty != self.ty:
            raise TypeError(f"{op}: mixing {self.ty} and {o.ty}; convert with tof()")
        if self.ty == "f" and op in ("&", "|", ">>", "<<"):
            raise TypeError(f"{op} on float")
        a, b = (o, self) if rev else (self, o)
        return E(op, (a, b), self.ty)

    def __add__(self, o):
        return self._bin(o, "+")

    def __radd__(self, o):
        return self._bin(o, "+", True)

    def __sub__(self, o):
        return self._bin(o, "-")

    def __rsub__(self, o):
        return self._bin(o, "-", True)

    def __mul__(self, o):
        return self._bin(o, "*")

    def __rmul__(self, o):
        return self._bin(o, "*", True)

    def __and__(self, o):
        return self._bin(o, "&")

    def __or__(self, o):
        return self._bin(o, "|")

    def __rshift__(self, o):
        return self._bin(o, ">>")

    def __lshift__(self, o):
        return self._bin(o, "<<")

    def __neg__(self):
        if self.ty != "f":
            raise TypeError("negating an unsigned value")
        return E("neg", (self,), "f")


def _lift(v, ty: str) -> E:
    if isinstance(v, E):
        return v
    return U(v) if ty == "u" else F(v)


def U(v: int) -> E:
    if not 0 <= int(v) < 2**32:
        raise ValueError(v)
    return E("const", (int(v),), "u")


def F(v: float) -> E:
    if float(np.float32(v)) != float(v):
        raise ValueError(f"{v} is not exact in float32")
    return E("const", (float(v),), "f")


def var(name: str, ty: str = "u") -> E:
    return E("var", (name,), ty)


def ld8(base: str, off) -> E:
    return E("ld8", (base, _lift(off, "u")), "u")


def ld16(base: str, off) -> E:
    return E("ld16", (base, _lift(off, "u")), "u")


def ld32(base: str, off) -> E:
    return E("ld32", (base, _lift(off, "u")), "u")


def f16(bits: E) -> E:
    return E("f16", (bits,), "f")


def bf16(bits: E) -> E:
    return E("bf16", (bits,), "f")


def f32(bits: E) -> E:
    return E("f32", (bits,), "f")


def tof(u: E) -> E:
    return E("tof", (_lift(u, "u"),), "f")


def tab(name: str, index) -> E:
    return E("tab", (name, _lift(index, "u")), "u")


def sel(cond: E, a, b) -> E:
    """cond != 0 ? a : b (a and b of one type)."""
    ty = a.ty if isinstance(a, E) else b.ty
    a, b = _lift(a, ty), _lift(b, ty)
    return E("sel", (cond, a, b), ty)


# ---- rendering to C ------------------------------------------------------------------------

_LOADS = {"ld8": "sk_ld8", "ld16": "sk_ld16", "ld32": "sk_ld32"}
_FLOAT_FNS = {"f16": "sk_f16", "bf16": "sk_bf16", "f32": "sk_f32"}


def _c_float(v: float) -> str:
    s = repr(float(v))
    if "e" not in s and "." not in s:
        s += ".0"
    assert float(np.float32(float(s))) == v
    return s + "f"


def render(e: E, name: Callable[[str], str]) -> str:
    """C source of `e`; `name` maps variable, base-pointer and table names to C identifiers."""
    op, a = e.op, e.args
    if op == "const":
        return f"{a[0]}u" if e.ty == "u" else _c_float(a[0])
    if op == "var":
        return name(a[0])
    if op in _LOADS:
        return f"{_LOADS[op]}({name(a[0])}, {render(a[1], name)})"
    if op in _FLOAT_FNS:
        return f"{_FLOAT_FNS[op]}({render(a[0], name)})"
    if op == "tof":
        return f"((float)({render(a[0], name)}))"
    if op == "tab":
        return f"{name(a[0])}[{render(a[1], name)}]"
    if op == "sel":
        c, x, y = (render(t, name) for t in a)
        return f"(({c}) != 0u ? {x} : {y})"
    if op == "neg":
        return f"(-{render(a[0], name)})"
    return f"({render(a[0], name)} {op} {render(a[1], name)})"


# ---- numpy interpreter ---------------------------------------------------------------------


def _load(arr: np.ndarray, off: np.ndarray, nbytes: int) -> np.ndarray:
    """Little-endian load of `nbytes` at byte offsets `off` of each row of uint8 `arr`."""
    if np.any(off % nbytes):
        raise AssertionError(f"misaligned {8 * nbytes}-bit load")
    rows = arr.shape[0]
    shape = np.broadcast_shapes(off.shape, (rows, 1))
    o = np.broadcast_to(off, shape).astype(np.intp)
    out = np.zeros(shape, dtype=np.uint32)
    for i in range(nbytes):
        byte = np.take_along_axis(np.broadcast_to(arr, (rows, arr.shape[1])), o + i, axis=1)
        out |= byte.astype(np.uint32) << np.uint32(8 * i)
    return out


def evaluate(e: E, env: Mapping[str, Any]) -> np.ndarray:
    """Evaluate `e` with numpy: uint32 arrays wrap like C, float32 ops stay float32."""
    op, a = e.op, e.args
    if op == "const":
        return np.asarray(a[0], dtype=np.uint32 if e.ty == "u" else np.float32)
    if op == "var":
        return env[a[0]]
    if op in ("ld8", "ld16", "ld32"):
        return _load(env[a[0]], evaluate(a[1], env), {"ld8": 1, "ld16": 2, "ld32": 4}[op])
    if op == "f16":
        return (
            (evaluate(a[0], env) & np.uint32(0xFFFF))
            .astype(np.uint16)
            .view(np.float16)
            .astype(np.float32)
        )
    if op == "bf16":
        return (evaluate(a[0], env) << np.uint32(16)).astype(np.uint32).view(np.float32)
    if op == "f32":
        return evaluate(a[0], env).astype(np.uint32).view(np.float32)
    if op == "tof":
        return evaluate(a[0], env).astype(np.float32)
    if op == "tab":
        return env[a[0]][evaluate(a[1], env).astype(np.intp)]
    if op == "sel":
        c, x, y = (evaluate(t, env) for t in a)
        return np.where(c != 0, x, y)
    if op == "neg":
        return -evaluate(a[0], env)
    x, y = evaluate(a[0], env), evaluate(a[1], env)
    with np.errstate(over="ignore"):
        if op == "+":
            r = x + y
        elif op == "-":
            r = x - y
        elif op == "*":
            r = x * y
        elif op == "&":
            r = x & y
        elif op == "|":
            r = x | y
        elif op == ">>":
            r = x >> y
        elif op == "<<":
            r = x << y
        else:
            raise ValueError(op)
    return np.asarray(r, dtype=np.uint32 if e.ty == "u" else np.float32)


# ---------------------------------------------------------------------------------------------
# Decoders: one per format. A chunk is weights [16c, 16c + 16) of a row; its weights are
# w_j = scale * q_j + offset (offset 0 when None), each a float32 expression.


@dataclass(frozen=True)
class Decoder:
    name: str
    bases: tuple[str, ...]  # byte pointers of one row: "W" weights; "S", "B" affine scales/biases
    lets: tuple[tuple[str, E], ...]  # chunk-level values, in order (may use "c" and earlier lets)
    scale: E
    offset: E | None
    q: tuple[E, ...]  # CHUNK element values (float)
    tables: tuple[str, ...] = ()
    align: int = 1  # widest load in bytes: row bases must be aligned to it


def _scale_load(base: str, off: E, dtype: str) -> tuple[E, int]:
    if dtype == "float16":
        return f16(ld16(base, off * 2)), 2
    if dtype == "bfloat16":
        return bf16(ld16(base, off * 2)), 2
    if dtype == "float32":
        return f32(ld32(base, off * 4)), 4
    raise ValueError(f"unsupported scale dtype {dtype}")


@cache
def affine_decoder(bits: int, group_size: int, scale_dtype: str) -> Decoder:
    """MLX affine: the row is a little-endian bit stream, weight i at bits [i*b, i*b + b);
    w = scale[g] * q + bias[g] for group g = i // group_size."""
    if not 2 <= bits <= 8 or group_size % CHUNK:
        raise ValueError(f"affine bits={bits} group_size={group_size}")
    c = var("c")
    chunk_bytes = CHUNK * bits // 8
    word = 32 if chunk_bytes % 4 == 0 else 16
    n_words = CHUNK * bits // word
    load = ld32 if word == 32 else ld16
    lets = [(f"w{k}", load("W", c * chunk_bytes + k * (word // 8))) for k in range(n_words)]
    mask = (1 << bits) - 1
    q = []
    for j in range(CHUNK):
        o = j * bits
        k, s = divmod(o, word)
        v = var(f"w{k}") >> s if s else var(f"w{k}")
        if s + bits > word:
            v = v | (var(f"w{k + 1}") << (word - s))
        q.append(tof(v & mask))
    per = group_size // CHUNK  # chunks per group
    if per & (per - 1):
        raise ValueError(f"group_size {group_size} is not 16 * 2^n")
    gidx = c >> (per.bit_length() - 1)
    scale, sa = _scale_load("S", gidx, scale_dtype)
    bias, _ = _scale_load("B", gidx, scale_dtype)
    return Decoder(
        name=f"affine{bits}g{group_size}{scale_dtype}",
        bases=("W", "S", "B"),
        lets=tuple(lets),
        scale=scale,
        offset=bias,
        q=tuple(q),
        align=max(word // 8, sa),
    )


def _iq2_xs() -> Decoder:
    # block (74 bytes, 256 weights): d f16 | qs u16[32] (9-bit grid index | 7-bit sign index)
    # | scales u8[8] (a nibble per 16 weights). A chunk is 2 grid entries of 8 weights.
    c, e, bo = var("c"), var("e"), var("bo")
    lets = [
        ("bo", (c >> 4) * 74),
        ("e", c & 15),
        ("df", f16(ld16("W", bo))),
        ("qa", ld16("W", bo + 2 + e * 4)),
        ("qb", ld16("W", bo + 4 + e * 4)),
        ("sc", (ld8("W", bo + 66 + (e >> 1)) >> ((e & 1) * 4)) & 15),
        ("sa", tab("iq2xs_signs", var("qa") >> 9)),
        ("sb", tab("iq2xs_signs", var("qb") >> 9)),
        ("ga0", tab("iq2xs_grid", (var("qa") & 511) * 2)),
        ("ga1", tab("iq2xs_grid", (var("qa") & 511) * 2 + 1)),
        ("gb0", tab("iq2xs_grid", (var("qb") & 511) * 2)),
        ("gb1", tab("iq2xs_grid", (var("qb") & 511) * 2 + 1)),
    ]
    q = []
    for j in range(CHUNK):
        ab = "a" if j < 8 else "b"
        jj = j % 8
        g = tof((var(f"g{ab}{jj // 4}") >> (8 * (jj % 4))) & 255)
        q.append(sel((var(f"s{ab}") >> jj) & 1, -g, g))
    scale = var("df", "f") * (0.5 + tof(var("sc"))) * 0.25
    return Decoder(
        "IQ2_XS", ("W",), tuple(lets), scale, None, tuple(q), ("iq2xs_grid", "iq2xs_signs"), 2
    )


def _iq3_s() -> Decoder:
    # block (110 bytes): d f16 | qs u8[64] (low 8 bits of grid index) | qh u8[8] (9th bits)
    # | signs u8[32] (a bit per weight) | scales u8[4] (a nibble per 32 weights).
    # A chunk is 4 grid entries of 4 weights.
    c, e, bo = var("c"), var("e"), var("bo")
    lets = [
        ("bo", (c >> 4) * 110),
        ("e", c & 15),
        ("df", f16(ld16("W", bo))),
        ("sc", (ld8("W", bo + 106 + (e >> 2)) >> (((e >> 1) & 1) * 4)) & 15),
        ("hb", ld8("W", bo + 66 + (e >> 1)) >> ((e & 1) * 4)),
        ("sg", ld16("W", bo + 74 + e * 2)),
    ]
    for k in range(4):
        idx = ld8("W", bo + 2 + e * 4 + k) | (((var("hb") >> k) & 1) << 8)
        lets.append((f"g{k}", tab("iq3s_grid", idx)))
    q = []
    for j in range(CHUNK):
        g = tof((var(f"g{j // 4}") >> (8 * (j % 4))) & 255)
        q.append(sel((var("sg") >> j) & 1, -g, g))
    scale = var("df", "f") * tof(1 + 2 * var("sc"))
    return Decoder("IQ3_S", ("W",), tuple(lets), scale, None, tuple(q), ("iq3s_grid",), 2)


def _q4_k() -> Decoder:
    # block (144 bytes): d f16 | dmin f16 | scales u8[12] (8 6-bit scales and mins) | qs u8[128]
    # (32-byte run r holds sub-blocks 2r (low nibbles) and 2r+1 (high)). w = d*sc*q - dmin*m.
    c, e, s, bo = var("c"), var("e"), var("s"), var("bo")
    lets = [
        ("bo", (c >> 4) * 144),
        ("e", c & 15),
        ("s", e >> 1),
        ("df", f16(ld16("W", bo))),
        ("dm", f16(ld16("W", bo + 2))),
        ("sd", ld8("W", bo + 4 + (s & 3))),
        ("sm", ld8("W", bo + 8 + (s & 3))),
        ("smd", ld8("W", bo + 12 + (s & 3))),
        ("scv", sel(s >> 2, (var("smd") & 15) | ((var("sd") >> 2) & 48), var("sd") & 63)),
        ("mnv", sel(s >> 2, (var("smd") >> 4) | ((var("sm") >> 2) & 48), var("sm") & 63)),
        ("sh", (s & 1) * 4),
    ]
    base = bo + 16 + (s >> 1) * 32 + (e & 1) * 16
    lets += [(f"v{k}", ld32("W", base + 4 * k)) for k in range(4)]
    q = [tof((var(f"v{j // 4}") >> (var("sh") + 8 * (j % 4))) & 15) for j in range(CHUNK)]
    scale = var("df", "f") * tof(var("scv"))
    offset = -(var("dm", "f") * tof(var("mnv")))
    return Decoder("Q4_K", ("W",), tuple(lets), scale, offset, tuple(q), (), 4)


def _q2_k() -> Decoder:
    # block (84 bytes): scales u8[16] (low nibble scale, high nibble min, per 16 weights)
    # | qs u8[64] (two 32-byte halves; 2-bit plane p of half h = weights 128h + 32p + l)
    # | d f16 | dmin f16.
    c, e, bo = var("c"), var("e"), var("bo")
    lets = [
        ("bo", (c >> 4) * 84),
        ("e", c & 15),
        ("df", f16(ld16("W", bo + 80))),
        ("dm", f16(ld16("W", bo + 82))),
        ("sb", ld8("W", bo + e)),
        ("sh", ((e >> 1) & 3) * 2),
    ]
    base = bo + 16 + (e >> 3) * 32 + (e & 1) * 16
    lets += [(f"v{k}", ld32("W", base + 4 * k)) for k in range(4)]
    q = [tof((var(f"v{j // 4}") >> (var("sh") + 8 * (j % 4))) & 3) for j in range(CHUNK)]
    scale = var("df", "f") * tof(var("sb") & 15)
    offset = -(var("dm", "f") * tof(var("sb") >> 4))
    return Decoder("Q2_K", ("W",), tuple(lets), scale, offset, tuple(q), (), 4)


GGUF_DECODERS: dict[str, Callable[[], Decoder]] = {
    "IQ2_XS": _iq2_xs,
    "IQ3_S": _iq3_s,
    "Q4_K": _q4_k,
    "Q2_K": _q2_k,
}
GGUF_BLOCK = 256


@cache
def gguf_decoder(qtype: str) -> Decoder:
    return GGUF_DECODERS[qtype]()


# ---- tables (kernel inputs; one source: strata_mlx.gguf_quants) -----------------------------


@cache
def tables() -> dict[str, np.ndarray]:
    """uint32 tables as the kernels index them (little-endian: byte j of an entry is weight j)."""
    from strata_mlx import gguf_quants as gq

    out = {
        "iq2xs_grid": np.array(gq.iq2xs_grid()).reshape(-1).view(np.uint32),  # [512 * 2]
        "iq2xs_signs": np.array(gq.ksigns_iq2xs()).astype(np.uint32),  # [128]
        "iq3s_grid": np.array(gq.iq3s_grid()).reshape(-1).view(np.uint32),  # [512]
    }
    for a in out.values():
        a.setflags(write=False)
    return out


# ---- the interpreter over whole rows --------------------------------------------------------


def decode_rows(dec: Decoder, bases: Mapping[str, np.ndarray], in_features: int) -> np.ndarray:
    """float32 [rows, in_features]: the weights the kernels compute, from each base's row bytes
    (uint8 [rows, row_bytes]), by the decoder's own expressions."""
    if in_features % CHUNK:
        raise ValueError(in_features)
    env: dict[str, Any] = {
        **tables(),
        **bases,
        "c": np.arange(in_features // CHUNK, dtype=np.uint32)[None],
    }
    for n, e in dec.lets:
        env[n] = evaluate(e, env)
    scale = evaluate(dec.scale, env)
    q = np.stack([np.broadcast_to(evaluate(e, env), scale.shape) for e in dec.q], axis=-1)
    w = scale[..., None] * q
    if dec.offset is not None:
        w = w + evaluate(dec.offset, env)[..., None]
    rows = next(iter(bases.values())).shape[0]
    return np.ascontiguousarray(np.broadcast_to(w, (rows, *w.shape[1:]))).reshape(rows, -1)


# ---------------------------------------------------------------------------------------------
# Projection geometry from a record layout, and kernel sources.


@dataclass(frozen=True)
class Projection:
    """Where one projection's rows sit in a record, and how to decode them."""

    decoder: Decoder
    out_features: int
    in_features: int
    offsets: tuple[tuple[str, int, int], ...]  # (base, byte offset in record, row stride)


def projection(layout, proj: str) -> Projection | None:
    """The kernel view of `proj` in `layout` (a strata_mlx.store.RecordLayout), or None when
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
        from strata_mlx.gguf_quants import row_bytes

        dec = gguf_decoder(spec["type"])
        n_in = int(spec["in_features"])
        if n_in % GGUF_BLOCK or wc.dtype != "uint8" or wc.shape[1] != row_bytes(spec["type"], n_in):
            return None
        offs = (("W", wc.offset, wc.shape[1]),)
    else:
        return None
    for _, off, stride in offs:
        if off % dec.align or stride % dec.align:
            return None
    return Projection(dec, out, n_in, offs)


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
    """Compile through `factory` (mx.fast.cuda_kernel or mx.fast.metal_kernel: one signature)
    as run(inputs, grid, threadgroup, output_shapes, output_dtypes, template)."""
    kernel = factory(
        name=src.name,
        input_names=list(src.input_names),
        output_names=list(src.output_names),
        source=body,
        header=header,
        ensure_row_contiguous=True,
    )

    def run(inputs, grid, threadgroup, output_shapes, output_dtypes, template):
        return kernel(
            inputs=inputs,
            grid=grid,
            threadgroup=threadgroup,
            output_shapes=output_shapes,
            output_dtypes=output_dtypes,
            template=template,
        )

    return run


SHARED_HEADER = """\
SK_FN uint32_t sk_ld8(const SK_GLOBAL uint8_t* p, uint32_t o) {
  return (uint32_t)p[o];
}
SK_FN uint32_t sk_ld16(const SK_GLOBAL uint8_t* p, uint32_t o) {
  return (uint32_t)(*(const SK_GLOBAL uint16_t*)(p + o));
}
SK_FN uint32_t sk_ld32(const SK_GLOBAL uint8_t* p, uint32_t o) {
  return *(const SK_GLOBAL uint32_t*)(p + o);
}
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
"""


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


def _decode_chunk(p: str, dec: Decoder, indent: str) -> list[str]:
    """Lines defining l_{p}sc, l_{p}of (if any) and l_{p}q0..15 for chunk l_c."""

    def name(n: str) -> str:
        if n == "c":
            return "l_c"
        if n in ("W", "S", "B"):
            return f"l_{p}{n}"
        if n in tables():
            return n
        return f"l_{p}_{n}"

    out = []
    for n, e in dec.lets:
        ctype = "uint32_t" if e.ty == "u" else "float"
        out.append(f"{indent}const {ctype} {name(n)} = {render(e, name)};")
    out.append(f"{indent}const float l_{p}sc = {render(dec.scale, name)};")
    if dec.offset is not None:
        out.append(f"{indent}const float l_{p}of = {render(dec.offset, name)};")
    for j, e in enumerate(dec.q):
        out.append(f"{indent}const float l_{p}q{j} = {render(e, name)};")
    return out


def _projection_loop(p: str, proj: Projection, tm: int) -> list[str]:
    """Lines accumulating l_{p}acc{m} += row . src_m over this lane's chunks."""
    dec = proj.decoder
    out = ["  {", *_bases(p, proj, "    ")]
    n_chunks = proj.in_features // CHUNK
    out.append(f"    for (uint32_t l_c = l_lane; l_c < {n_chunks}u; l_c += {WARP}u) {{")
    out += _decode_chunk(p, dec, "      ")
    dot = " + ".join(f"l_{p}q{j} * l_x{j}" for j in range(CHUNK))
    xsum = " + ".join(f"l_x{j}" for j in range(CHUNK))
    for m in range(tm):
        out.append(f"      if (l_p{m} >= 0) {{")
        out.append(f"        const SK_GLOBAL T* l_xc = l_src{m} + l_c * {CHUNK}u;")
        for j in range(CHUNK):
            out.append(f"        const float l_x{j} = sk_tof(l_xc[{j}]);")
        if dec.offset is not None:
            out.append(f"        l_{p}acc{m} += l_{p}sc * ({dot}) + l_{p}of * ({xsum});")
        else:
            out.append(f"        l_{p}acc{m} += l_{p}sc * ({dot});")
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
    digest = hashlib.sha1((header + body).encode()).hexdigest()[:12]
    return KernelSource(f"sk_{role}_{name}_{digest}", inputs, outputs, header, body, rows)


def gate_up_source(gate: Projection, up: Projection, k: int, record_bytes: int, tm: int):
    """Kernel 1: h[p, i] = silu(gate_i . x[p // k]) * (up_i . x[p // k]) for each pair p of a
    tile; grid (32 * inter, n_tiles), pairs of tile t in tile_pairs[t*tm : t*tm + tm]."""
    rows, d = gate.out_features, gate.in_features
    lines = _tile_prologue(rows, tm, record_bytes, "x", lambda pm: f"(SK_U64)({pm} / {k}u) * {d}u")
    lines += [f"  float l_gacc{m} = 0.0f;" for m in range(tm)]
    lines += [f"  float l_uacc{m} = 0.0f;" for m in range(tm)]
    lines += _projection_loop("g", gate, tm)
    lines += _projection_loop("u", up, tm)
    for m in range(tm):
        lines += [
            f"  const float l_g{m} = sk_warp_sum(l_gacc{m});",
            f"  const float l_u{m} = sk_warp_sum(l_uacc{m});",
            f"  if (l_lane == 0u && l_p{m} >= 0) {{",
            f"    sk_store(h, (SK_U64)l_p{m} * {rows}u + l_row,"
            f" l_g{m} / (1.0f + sk_exp(-l_g{m})) * l_u{m});",
            "  }",
        ]
    used = tuple(sorted(set(gate.decoder.tables) | set(up.decoder.tables)))
    name = f"{gate.decoder.name}_{up.decoder.name}_tm{tm}"
    return _finish(name, used, "gate_up", SHARED_HEADER, "\n".join(lines) + "\n", rows)


def down_source(down: Projection, record_bytes: int, tm: int):
    """Kernel 2: y[p, o] = down_o . h[p] for each pair p of a tile; grid (32 * D, n_tiles)."""
    rows, inter = down.out_features, down.in_features
    lines = _tile_prologue(rows, tm, record_bytes, "h", lambda pm: f"(SK_U64)({pm}) * {inter}u")
    lines += [f"  float l_dacc{m} = 0.0f;" for m in range(tm)]
    lines += _projection_loop("d", down, tm)
    for m in range(tm):
        lines += [
            f"  const float l_d{m} = sk_warp_sum(l_dacc{m});",
            f"  if (l_lane == 0u && l_p{m} >= 0) {{",
            f"    sk_store(y, (SK_U64)l_p{m} * {rows}u + l_row, l_d{m});",
            "  }",
        ]
    used = tuple(sorted(set(down.decoder.tables)))
    name = f"{down.decoder.name}_tm{tm}"
    return _finish(name, used, "down", SHARED_HEADER, "\n".join(lines) + "\n", rows)


def dequant_source(proj: Projection, record_bytes: int, label: str) -> KernelSource:
    """Dequantize rows from arena slots: w[i, r, :] = row r of the record in slots[i], in T.
    One thread per (row, chunk); grid (rows * in / 16, n_slots). For prefill, where many pairs
    share each expert, this plus a grouped matmul (mx.gather_mm) decodes each weight once."""
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
        *_decode_chunk("w", dec, "  "),
        f"  const SK_U64 l_o = ((SK_U64)sk_gy * {rows}u + l_row) * {n_in}u + l_c * {CHUNK}u;",
    ]
    for j in range(CHUNK):
        v = f"l_wsc * l_wq{j}" + (" + l_wof" if dec.offset is not None else "")
        lines.append(f"  sk_store(w, l_o + {j}u, {v});")
    body = "\n".join(lines) + "\n"
    digest = hashlib.sha1((SHARED_HEADER + body).encode()).hexdigest()[:12]
    return KernelSource(
        f"sk_dequant_{label}_{dec.name}_{digest}",
        ("arena", "slots", *dec.tables),
        ("w",),
        SHARED_HEADER,
        body,
        rows,
    )
