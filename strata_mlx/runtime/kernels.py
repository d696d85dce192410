"""Expert kernels and their dispatch by backend.

`expert_kernel(layout)` resolves, once, the callable that computes a layer's routed SwiGLU
experts from arena slots; the expert cache resolves one per layer at load, so nothing on the
hot path re-inspects a layout (a profiler found ~9 ms/token of layout serialisation when this
was done per call). Backends:
  - "reference": gather the needed slots' records, decode them with plain MLX ops and run
    mlx-lm's SwitchGLU arithmetic (strata_mlx.quant). Runs everywhere; the oracle.
  - "cuda": custom_kernels/ compiled through mx.fast.cuda_kernel, reading weights straight
    from the slots (MLX's CUDA backend).
  - "metal": the same algorithm through mx.fast.metal_kernel (Apple silicon; not executed on
    Linux machines).
A format without a kernel for the running backend falls back to the reference. On MLX's CPU
device the automatic choice runs affine experts through native loops that give the
reference's outputs bit for bit, faster (runtime/cpu_experts.py), wherever they agree.
STRATA_MLX_KERNELS=reference|cuda|metal forces one (read when a kernel is resolved; forced
"reference" is the MLX-ops path alone).
STRATA_MLX_DEQUANT_STORES=wide|scalar picks the prefill dequantize kernel's stores (wide,
the default: 16-byte stores; scalar: one store a weight, the same values;
custom_kernels.dispatch.dequant_stores).
STRATA_MLX_KERNEL_HEADER=own|full picks what each kernel's header holds (own, the default: the
parts of custom_kernels/formats.h it calls; full: the whole file, the same code compiled;
custom_kernels.dispatch.kernel_header).

Self-check: the Metal kernels cannot run on this project's machines, so the first time a
(backend, layout) variant is resolved in a process, `self_check` runs it once on a few random
records in a small arena (2 decode tokens, 6 prefill tokens, in each activation dtype the
backend serves) against switch_glu_reference. A compile error, a non-finite output or an error
beyond SELF_CHECK_TOLERANCE sends that variant to the reference path, with one warning naming
the format and the backend. Never: resolves kernels per call or checks on the hot path.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ..config import OptionError
from ..format.quant import MXFP4_BLOCK, mx_dtype, switch_glu_reference, to_numpy
from ..format.store import PROJECTIONS, Component, RecordLayout

# fn(x [..., D], arena [n_slots, record_bytes] uint8, slots [n] uint32, idx [..., k] into
# slots) -> [..., k, D]
ExpertFn = Callable[[mx.array, mx.array, mx.array, mx.array], mx.array]


def backend() -> str:
    """The backend automatic dispatch picks on this machine."""
    env = os.environ.get("STRATA_MLX_KERNELS")
    if env:
        if env not in ("reference", "cuda", "metal"):
            raise OptionError(f"STRATA_MLX_KERNELS={env!r}: one of reference, cuda, metal")
        return env
    if mx.default_device() == mx.gpu:
        if mx.metal.is_available():
            return "metal"
        if hasattr(mx, "cuda") and mx.cuda.is_available():
            return "cuda"
    return "reference"


def expert_kernel(layout: RecordLayout, name: str | None = None) -> ExpertFn:
    """The expert computation for records of `layout` on backend `name` (default: backend()).

    A kernel that fails its self-check (once per process and variant) is replaced by the
    reference path, with one warning."""
    forced = name is not None or bool(os.environ.get("STRATA_MLX_KERNELS"))
    name = name or backend()
    if name == "reference" and not forced:
        from .cpu_experts import cpu_expert_kernel

        native = cpu_expert_kernel(layout)
        if native is not None:
            return native
    if name != "reference":
        from custom_kernels import dispatch

        try:  # the user's settings: refused here, not taken by the self-check for a failure
            dispatch.dequant_stores()
            dispatch.kernel_header()
        except ValueError as e:
            raise OptionError(str(e)) from None
        fn = dispatch.kernel_for(name, layout)
        if fn is not None and _checked(name, layout, fn):

            def run(x, arena, slots, idx):
                return fn(x, arena, slots, idx, layout)

            run.pairs = fn.pairs  # one token's pairs by their slots (LayerCompute.by_pair)
            return run

    def reference(x, arena, slots, idx):
        return switch_glu_reference(x, arena[slots], layout, idx)

    return reference


def switch_glu(
    x: mx.array, arena: mx.array, slots: mx.array, idx: mx.array, layout: RecordLayout
) -> mx.array:
    """One call of the expert computation (resolves the kernel each time: tests and tools)."""
    return expert_kernel(layout)(x, arena, slots, idx)


# Activation dtypes each backend's self-check runs (the host dialect runs float32 only; the GPU
# dialects serve models in fp16 or bf16, one template instantiation each).
SELF_CHECK_DTYPES = {"host": (mx.float32,)}
GPU_CHECK_DTYPES = (mx.float16, mx.bfloat16)
# Allowed error as multiples of the dtype's epsilon, relative to the reference output's RMS:
# (max over elements, RMS over elements). The kernels and the reference sum dots of up to D
# terms in different orders (and the reference may use TF32 matmuls for float32 on a GPU,
# hence 2^-10 for it too); these are the bounds tests/test_kernels.py holds the CUDA kernels
# to. A wrong decode or index is off by O(1) x RMS, far outside them.
SELF_CHECK_EPS = {mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7, mx.float32: 2.0**-10}
SELF_CHECK_TOLERANCE = (16, 2)

_CHECKED: dict[tuple[str, str], bool] = {}


def _checked(name: str, layout: RecordLayout, fn: Callable) -> bool:
    """Whether the kernel of this variant passed its self-check (run once, warned once)."""
    from custom_kernels.dispatch import layout_signature

    key = (name, layout_signature(layout))
    if key not in _CHECKED:
        failure = self_check(name, layout, fn)
        if failure:
            warnings.warn(
                f"expert kernel for {format_name(layout)} on {name} failed its self-check "
                f"({failure}); using the MLX-ops reference path",
                RuntimeWarning,
                stacklevel=3,
            )
        _CHECKED[key] = failure is None
    return _CHECKED[key]


def self_check(name: str, layout: RecordLayout, fn: Callable, seed: int = 0) -> str | None:
    """Run kernel `fn` (dispatch's signature) on small random problems against the
    reference: None if it agrees, else why not, in a few words."""
    dtypes = SELF_CHECK_DTYPES.get(name, GPU_CHECK_DTYPES)
    rng = np.random.default_rng(seed)
    n_experts, n_slots, k = 3, 4, 2
    arena = mx.array(random_arena(layout, n_experts, n_slots, rng))
    # 2 tokens: the decode kernels; 6 tokens (12 pairs over <= 3 experts): the prefill path
    for n_tokens in (2, 6):
        ids = np.stack([rng.choice(n_experts, k, replace=False) for _ in range(n_tokens)])
        needed = np.unique(ids)
        slots = mx.array(needed.astype(np.uint32) + 1)  # slot 0 holds random bytes
        idx = mx.array(np.searchsorted(needed, ids).astype(np.uint32))
        x32 = rng.standard_normal((n_tokens, hidden_of(layout))).astype(np.float32)
        for dtype in dtypes:
            x = mx.array(x32).astype(dtype)
            what = f"{n_tokens} tokens, {dtype}"
            try:
                y = fn(x, arena, slots, idx, layout)
                mx.eval(y)
            except Exception as e:  # a compile error surfaces at the first launch
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                return f"{what}: {type(e).__name__}: {first[:200]}"
            ref = switch_glu_reference(x, arena[slots], layout, idx)
            failure = _mismatch(y, ref, dtype)
            if failure:
                return f"{what}: {failure}"
    return None


def _mismatch(y: mx.array, ref: mx.array, dtype: mx.Dtype) -> str | None:
    if y.shape != ref.shape:
        return f"output shape {tuple(y.shape)}, reference {tuple(ref.shape)}"
    y64 = np.array(y.astype(mx.float32)).astype(np.float64)
    r64 = np.array(ref.astype(mx.float32)).astype(np.float64)
    if not np.isfinite(y64).all():
        return "non-finite output"
    rms = float(np.sqrt(np.mean(r64**2))) or 1.0
    err = np.abs(y64 - r64)
    max_rel, rms_rel = float(err.max()) / rms, float(np.sqrt(np.mean(err**2))) / rms
    eps = SELF_CHECK_EPS[dtype]
    max_tol, rms_tol = (t * eps for t in SELF_CHECK_TOLERANCE)
    if max_rel > max_tol or rms_rel > rms_tol:
        return (
            f"max error {max_rel:.3g} x RMS (allowed {max_tol:.3g}), "
            f"RMS error {rms_rel:.3g} x RMS (allowed {rms_tol:.3g})"
        )
    return None


MAX_WIDTH = 1 << 20  # example_layout's widths, kernel_source_text's top-k and tile


def example_layout(fmt: str, hidden: int, inter: int, down: str | None = None) -> RecordLayout:
    """The record layout of one expert (gate/up [inter, hidden], down [hidden, inter]) whose
    gate/up take format `fmt` and down `down` (default `fmt`): a GGUF type ("Q4_K", "Q2_K",
    "IQ2_XS", "IQ3_S"), "affine{bits}-g{group_size}" (fp16 scales, as mx.quantize gives
    an fp16 model) or "mxfp4". Widths are whole positive numbers (`--hidden 0` printed
    kernels for an expert of no inputs)."""
    for name, v in (("--hidden", hidden), ("--inter", inter)):
        if not (isinstance(v, int) and 0 < v <= MAX_WIDTH):
            raise ValueError(f"{name} {v}: expected an integer in [1, {MAX_WIDTH}]")
    shapes = {
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    comps, table = {}, {}
    for p, (out, n_in) in shapes.items():
        name = down if down and p == "down_proj" else fmt
        affine = re.fullmatch(r"affine(\d+)-g(\d+)", name)
        if affine:
            bits, gs = int(affine[1]), int(affine[2])
            if not (1 <= bits <= 8 and gs > 0):  # (affine0-g64, affine4-g0)
                raise ValueError(f"{name}: bits 1 to 8 and a group of 1 input at least")
            if n_in * bits % 32 or n_in % gs:
                raise ValueError(f"{name}: {n_in} inputs are not whole words and groups")
            comps[f"{p}.weight"] = ("uint32", (out, n_in * bits // 32))
            comps[f"{p}.scales"] = ("float16", (out, n_in // gs))
            comps[f"{p}.biases"] = ("float16", (out, n_in // gs))
            table[p] = {"format": "affine", "bits": bits, "group_size": gs}
        elif name == "mxfp4":
            if n_in % MXFP4_BLOCK:
                raise ValueError(f"mxfp4: {n_in} inputs are not whole blocks of {MXFP4_BLOCK}")
            comps[f"{p}.weight"] = ("uint8", (out, n_in // 2))
            comps[f"{p}.scales"] = ("uint8", (out, n_in // MXFP4_BLOCK))
            table[p] = {"format": "mxfp4"}
        else:
            from ..format.gguf_quants import row_bytes

            comps[f"{p}.weight"] = ("uint8", (out, row_bytes(name, n_in)))
            table[p] = {"format": "gguf", "type": name, "in_features": n_in}
    return RecordLayout.build(comps, table)


def kernel_source_text(layout: RecordLayout, dialect: str, top_k: int, tile: int = 1) -> str:
    """Every kernel of `layout` on `dialect` ("metal", "cuda", "host") as that dialect hands it
    to its compiler: each kernel's header (printed once where kernels share it) and body.
    tile: pairs per warp of the fused kernels (1 in decode; dispatch.PREFILL_TILE in prefill)."""
    from custom_kernels import dispatch

    for name, v in (("--top-k", top_k), ("--tile", tile)):
        if not (isinstance(v, int) and 0 < v <= MAX_WIDTH):
            raise ValueError(f"{name} {v}: expected an integer in [1, {MAX_WIDTH}]")
    kern = dispatch.kernel_for(dialect, layout)
    if kern is None:
        raise ValueError(f"{format_name(layout)} has no kernel (the reference path runs it)")
    srcs = [*kern.sources(top_k, tile), *kern.dequant_sources().values()]
    via = {"metal": "mx.fast.metal_kernel", "cuda": "mx.fast.cuda_kernel"}.get(dialect)
    out = [
        f"// {format_name(layout)} expert kernels, {dialect} dialect"
        f" (top-k {top_k}, {tile} pair(s) a warp)"
    ]
    wrap = f"{via} writes the signature around it" if via else "host.py wraps it"
    shown: dict[str, str] = {}  # header -> the first kernel printed with it
    for src in srcs:
        header, body = kern.dialect.sources(src)
        if header in shown:
            out.append(f"// ---- kernel {src.name}: header as kernel {shown[header]}'s")
        else:
            shown[header] = src.name
            out += [
                f"// ---- kernel {src.name}: header (the {dialect} prelude + the parts of"
                " custom_kernels/formats.h it calls)",
                header,
            ]
        out += [
            f"// ---- kernel {src.name}: body ({wrap})",
            f"// inputs {', '.join(src.input_names)}; outputs {', '.join(src.output_names)}",
            body,
        ]
    return "\n".join(out)


def format_name(layout: RecordLayout) -> str:
    """The experts' quant format in a few words, e.g. "affine 4-bit g64", "gguf IQ2_XS+Q2_K"."""
    names = []
    for p in PROJECTIONS:
        spec = layout.quant.get(p, {})
        fmt = spec.get("format", "?")
        if fmt == "affine":
            n = f"affine {spec.get('bits')}-bit g{spec.get('group_size')}"
        elif fmt == "gguf":
            n = f"gguf {spec.get('type')}"
        elif fmt == "mxfp4":
            n = "mxfp4"
        else:
            n = str(fmt)
        if n not in names:
            names.append(n)
    if all(n.startswith("gguf ") for n in names):
        return "gguf " + "+".join(n[5:] for n in names)
    return "+".join(names)


def hidden_of(layout: RecordLayout) -> int:
    """The experts' input width (the hidden size) in records of `layout`."""
    spec = layout.quant["gate_proj"]
    wc = layout.component("gate_proj.weight")
    if spec["format"] == "affine":
        return wc.shape[1] * 32 // int(spec["bits"])
    if spec["format"] == "mxfp4":
        return wc.shape[1] * 2
    return int(spec["in_features"])


def random_arena(layout: RecordLayout, n_experts: int, n_slots: int, rng) -> np.ndarray:
    """uint8 [n_slots, record_bytes]: slots 1..n_experts hold random records whose weights
    have RMS ~ 1/sqrt(in_features) (so activations stay O(1) in fp16); the rest random bytes."""
    arena = rng.integers(0, 256, (n_slots, layout.record_bytes), dtype=np.uint8)
    recs = arena[1 : 1 + n_experts]
    for p in PROJECTIONS:
        spec = layout.quant[p]
        wc = layout.component(f"{p}.weight")
        if any(c.name == f"{p}.bias" for c in layout.components):  # GPT-OSS: O(0.1) biases
            bc = layout.component(f"{p}.bias")
            _put(recs, bc, rng.standard_normal((n_experts, *bc.shape)) * 0.1)
        if spec["format"] == "affine":
            bits = int(spec["bits"])
            n_in = wc.shape[1] * 32 // bits
            sc, bc = layout.component(f"{p}.scales"), layout.component(f"{p}.biases")
            # w = s * q + b, q uniform in [0, 2^bits): b ~ -s * mid gives RMS ~ s 2^bits / sqrt(12)
            s = math.sqrt(12) / (2**bits * math.sqrt(n_in))
            scales = rng.uniform(0.5, 1.5, (n_experts, *sc.shape)) * s
            biases = -scales * (2**bits - 1) / 2 * rng.uniform(0.9, 1.1, scales.shape)
            _put(recs, sc, scales)
            _put(recs, bc, biases)
        elif spec["format"] == "mxfp4":
            # codes uniform over the 16 E2M1 values (RMS 2.93): scales 2^(s-127) about
            # 1 / (2.93 sqrt(in)), a power of two within a factor 2 either way
            sc = layout.component(f"{p}.scales")
            n_in = wc.shape[1] * 2
            s = 127 + round(math.log2(1 / (2.93 * math.sqrt(n_in))))
            scales = rng.integers(s - 1, s + 2, (n_experts, *sc.shape)).astype(np.uint8)
            recs[:, sc.offset : sc.offset + sc.nbytes] = scales.reshape(n_experts, -1)
        elif spec["format"] == "gguf":
            from ..format.gguf_quants import dequantize, get_format

            f = get_format(spec["type"])
            n_in, out = int(spec["in_features"]), wc.shape[0]
            shape = (n_experts, out, n_in // f.block_size, f.type_size)
            blocks = recs[:, wc.offset : wc.offset + wc.nbytes].reshape(shape)
            mags = rng.uniform(0.5, 1.5, (*shape[:3], len(f.f16_offsets)))
            mags *= rng.choice([-1.0, 1.0], mags.shape)
            for scale in (1.0, None):  # every weight is linear in the block's fp16 fields
                if scale is None:
                    w = dequantize(
                        f, mx.array(blocks.reshape(n_experts, out, -1)), (n_experts, out, n_in)
                    )
                    scale = 1.0 / (float(mx.sqrt(mx.mean(w * w)).item()) * math.sqrt(n_in))
                for j, off in enumerate(f.f16_offsets):
                    bits16 = (mags[..., j] * scale).astype(np.float16).view(np.uint8)
                    blocks[..., off : off + 2] = bits16.reshape(*shape[:3], 2)
            recs[:, wc.offset : wc.offset + wc.nbytes] = blocks.reshape(n_experts, -1)
    return arena


def _put(recs: np.ndarray, c: Component, values: np.ndarray) -> None:

    raw = to_numpy(mx.array(values.astype(np.float32)).astype(mx_dtype(c.dtype)))
    recs[:, c.offset : c.offset + c.nbytes] = raw.view(np.uint8).reshape(recs.shape[0], -1)
