"""Expert kernels vs mx.gather_qmm at the same bits, on the GPU machine (MLX's CUDA backend).

    python3 benchmarks/kernels.py            # from the repository root; prints a markdown table

Shapes (qwen3-next-80b-a3b's experts): D=2048, inter=512, 512 experts, top-10; decode = 1 token, prefill = 1024.
"expert kernel" is custom_kernels reading records in place from an arena of 512 slots with
its automatic strategy (decode: fused kernels; prefill: dequantize kernel + mx.gather_mm),
"fused tiles" the fused kernels with prefill tiles (Python glue included); "gather_qmm" is mlx-lm's SwitchGLU arithmetic on stacked
resident affine weights (pairs sorted by expert once there are >= 64, as mlx-lm does).
IQ2_XS (2.31 bits per weight) is compared with gather_qmm at 2 bits. Times are medians of
many iterations, each `mx.eval` + `mx.synchronize`. Eight distinct random experts are tiled
across the 512 slots (timing does not depend on the values; memory traffic is the same).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

D, INTER, TOP_K, N_EXPERTS, DISTINCT = 2048, 512, 10, 512, 8
PROJ_SHAPES = {"gate_proj": (INTER, D), "up_proj": (INTER, D), "down_proj": (D, INTER)}


def _timeit(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    mx.synchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def affine_experts(bits: int, group_size: int, rng):
    """(layout, arena [512, record_bytes], stacked {proj: (w, scales, biases)} [512, ...])."""
    from strata_mlx.format.quant import expert_tensors, layout_for, to_numpy

    recs, stacked = [], {p: [] for p in PROJ_SHAPES}
    layout = None
    for _ in range(DISTINCT):
        w = {
            p: mx.array(rng.standard_normal(s).astype(np.float32) / np.sqrt(s[1]))
            for p, s in PROJ_SHAPES.items()
        }
        t, table = expert_tensors(w, {"bits": bits, "group_size": group_size}, mx.float16)
        layout = layout_for(t, table)
        recs.append(np.frombuffer(layout.pack({k: to_numpy(v) for k, v in t.items()}), np.uint8))
        for p in PROJ_SHAPES:
            stacked[p].append(tuple(t[f"{p}.{c}"] for c in ("weight", "scales", "biases")))
    reps = N_EXPERTS // DISTINCT
    arena = mx.tile(mx.array(np.stack(recs)), (reps, 1))
    resident = {
        p: tuple(mx.tile(mx.stack([e[i] for e in v]), (reps, 1, 1)) for i in range(3))
        for p, v in stacked.items()
    }
    return layout, arena, resident


def gguf_experts(qtype: str, rng):
    from strata_mlx.format.gguf_quants import FORMATS, row_bytes
    from strata_mlx.format.store import RecordLayout

    comps, table = {}, {}
    for p, (o, i) in PROJ_SHAPES.items():
        comps[f"{p}.weight"] = ("uint8", (o, row_bytes(qtype, i)))
        table[p] = {"format": "gguf", "type": qtype, "in_features": i}
    layout = RecordLayout.build(comps, table)
    f = FORMATS[qtype]
    recs = []
    for _ in range(DISTINCT):
        arrays = {}
        for p, (o, i) in PROJ_SHAPES.items():
            raw = rng.integers(0, 256, (o, i // 256, f.type_size), dtype=np.uint8)
            d = (rng.uniform(0.5, 1.5, (o, i // 256)) / (50 * np.sqrt(i))).astype(np.float16)
            for off in f.f16_offsets:
                raw[:, :, off : off + 2] = d.view(np.uint8).reshape(o, i // 256, 2)
            arrays[f"{p}.weight"] = raw.reshape(o, -1)
        recs.append(np.frombuffer(layout.pack(arrays), np.uint8))
    arena = mx.tile(mx.array(np.stack(recs)), (N_EXPERTS // DISTINCT, 1))
    return layout, arena


def gather_qmm_swiglu(x, resident, ids, bits: int, group_size: int):
    """mlx-lm SwitchGLU over stacked affine weights: x [T, D], ids [T, k] -> [T, k, D]."""
    xe = mx.expand_dims(x, (-2, -3))
    sort = ids.size >= 64
    i = ids
    if sort:
        flat = ids.flatten()
        order = mx.argsort(flat)
        inv = mx.argsort(order)
        xe = xe.flatten(0, -3)[order // ids.shape[-1]]
        i = flat[order]

    def qmm(a, p):
        w, s, b = resident[p]
        return mx.gather_qmm(
            a, w, s, b, rhs_indices=i, transpose=True, group_size=group_size, bits=bits,
            sorted_indices=sort,
        )  # fmt: skip

    g = qmm(xe, "gate_proj")
    h = (g * mx.sigmoid(g)) * qmm(xe, "up_proj")
    y = qmm(h, "down_proj")
    if sort:
        y = mx.unflatten(y[inv], 0, ids.shape)
    return y.squeeze(-2)


def gathered_prefill(x, arena, slots, idx, layout, base, iters, notes, label) -> None:
    """The prefill through mx.gather_qmm on records gathered from the slots, as ms and x
    gather_qmm on stacked weights, into `notes`: each component gathered on its own
    (arena[slots, a:b]), the whole records taken then viewed (the reference path), and the
    component gathers alone."""
    from strata_mlx.format.quant import mx_dtype, switch_glu_reference

    def components():
        return {
            c.name: arena[slots, c.offset : c.offset + c.nbytes].view(mx_dtype(c.dtype))
            for c in layout.components
        }

    variants = {
        "records taken (the reference path)": lambda: switch_glu_reference(
            x, mx.take(arena, slots, axis=0), layout, idx
        ),
        "the component gathers alone": lambda: list(components().values()),
    }
    for name, fn in variants.items():
        ms = _timeit(fn, iters)
        vs = f", x{ms / base:.2f} gather_qmm" if base else ""
        notes.append(f"{label} prefill, {name}: {ms:.3f} ms{vs}")


def routing(n_tokens: int, rng):
    ids = np.stack([rng.choice(N_EXPERTS, TOP_K, replace=False) for _ in range(n_tokens)])
    needed = np.unique(ids)
    slots = mx.array(needed.astype(np.uint32))  # expert e lives in slot e
    idx = mx.array(np.searchsorted(needed, ids).astype(np.uint32))
    return mx.array(ids.astype(np.uint32)), slots, idx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode-iters", type=int, default=200)
    ap.add_argument("--prefill-iters", type=int, default=20)
    ap.add_argument("--group-size", type=int, default=64)
    args = ap.parse_args()
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()) and not mx.metal.is_available():
        print("benchmarks/kernels.py needs a GPU backend of MLX (CUDA or Metal)")
        return 2
    backend = "cuda" if hasattr(mx, "cuda") and mx.cuda.is_available() else "metal"
    from custom_kernels import dispatch

    mx.set_default_device(mx.gpu)
    rng = np.random.default_rng(0)
    gs = args.group_size
    shapes = {"decode": (1, args.decode_iters), "prefill": (1024, args.prefill_iters)}
    routes = {s: routing(t, rng) for s, (t, _) in shapes.items()}
    xs = {s: mx.random.normal((t, D)).astype(mx.float16) for s, (t, _) in shapes.items()}

    rows, failures, notes = [], [], []
    affine = {}
    for bits in (4, 2):
        try:
            affine[bits] = affine_experts(bits, gs, rng)
        except Exception:
            failures.append(f"building affine {bits}-bit experts:\n{traceback.format_exc()}")
    formats = [(f"affine {b}-bit g{gs}", b) for b in (4, 2)] + [("IQ2_XS", "IQ2_XS")]
    iq = None
    try:
        iq = gguf_experts("IQ2_XS", rng)
    except Exception:
        failures.append(f"building IQ2_XS experts:\n{traceback.format_exc()}")
    kernel_ms: dict[tuple[str, str], float] = {}
    for label, fmt in formats:
        for shape, (n_tokens, iters) in shapes.items():
            ids, slots, idx = routes[shape]
            x = xs[shape]
            try:
                if fmt == "IQ2_XS":
                    if iq is None:
                        continue
                    layout, arena = iq
                    base_bits = 2
                else:
                    if fmt not in affine:
                        continue
                    layout, arena, _ = affine[fmt]
                    base_bits = fmt
                fn = dispatch.kernel_for(backend, layout)
                t0 = time.perf_counter()
                mx.eval(fn(x, arena, slots, idx, layout))
                mx.synchronize()
                notes.append(
                    f"{label} {shape}: first call (JIT compile) {time.perf_counter() - t0:.2f} s"
                )
                ours = _timeit(lambda: fn(x, arena, slots, idx, layout), iters)  # noqa: B023
                kernel_ms[(label, shape)] = ours
                fused = "-"
                if shape == "prefill":
                    mx.eval(fn(x, arena, slots, idx, layout, strategy="fused"))
                    fused_ms = _timeit(
                        lambda: fn(x, arena, slots, idx, layout, strategy="fused"),  # noqa: B023
                        iters,
                    )
                    fused = f"{fused_ms:.3f}"
                base = None
                if base_bits in affine:
                    res = affine[base_bits][2]
                    base = _timeit(lambda: gather_qmm_swiglu(x, res, ids, base_bits, gs), iters)  # noqa: B023
                if shape == "prefill" and fmt != "IQ2_XS":
                    gathered_prefill(x, arena, slots, idx, layout, base, iters, notes, label)
                    deq = lambda: list(fn.dequantize(arena, slots, x.dtype).values())  # noqa: B023, E731
                    notes.append(f"{label} prefill, the kernel's dequantize alone: {_timeit(deq, iters):.3f} ms")  # fmt: skip
                ratio = f"{ours / base:.2f}" if base else "-"
                base_s = f"{base:.3f} ({base_bits}-bit)" if base else "-"
                rows.append(
                    f"| {label} | {shape} ({n_tokens} tok) | {ours:.3f} | {fused} | {base_s} "
                    f"| {ratio} |"
                )
            except Exception:
                failures.append(f"{label} {shape}:\n{traceback.format_exc()}")
                rows.append(f"| {label} | {shape} | FAILED | | | |")

    print(f"Device: {backend}, mlx {mx.__version__}; D={D}, inter={INTER}, top-{TOP_K}, "
          f"{N_EXPERTS} experts, fp16 activations; median ms per SwiGLU-experts call\n")  # fmt: skip
    print(
        "| format | shape | expert kernel (ms) | fused tiles (ms) | gather_qmm (ms) "
        "| kernel / gather_qmm |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    for shape in shapes:
        a2, iq2 = kernel_ms.get((f"affine 2-bit g{gs}", shape)), kernel_ms.get(("IQ2_XS", shape))
        if a2 and iq2:
            print(f"\nIQ2_XS kernel / affine 2-bit kernel, {shape}: {iq2 / a2:.2f}")
    print("\n" + "\n".join(notes))
    if failures:
        print("\nFAILED:\n" + "\n\n".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
