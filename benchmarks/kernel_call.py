"""Host time of decode's expert-kernel call: `pairs` (the two fused kernels of one MoE layer,
one token) with each kernel's own header against all of formats.h, and the bare
mx.fast.cuda_kernel call by source size.

    python3 benchmarks/kernel_call.py STORE      # STORE: e.g. convert --synthetic qwen3-next-80b-a3b

Only the layout of the experts matters, so a one-layer store of that shape (36 MB, 2 s to
make) stands in for the 24 GB one:

    python3 -m strata_mlx convert --synthetic qwen3-next-80b-a3b --mlx-path /tmp/q3n-1 \\
        --calibration-tokens 0 --set num_hidden_layers=1 --set num_experts=16 --set vocab_size=256

For the record layout of STORE's first MoE layer (its top-k; activations in the store's dtype,
or --dtype), N calls of `pairs` are timed three ways, STRATA_MLX_KERNEL_HEADER's two headers
(custom_kernels/dispatch.py) in alternating rounds, medians of the rounds in us a call:
  graph  building the graph only, never evaluated: MLX's call copies the whole source;
  async  mx.async_eval every 48 calls (a decode token's layers), the device waited for after
         the clock stops: the host's whole share, the source's hash at eval included;
  eval   mx.eval every 48 calls: wall time, the kernels' device time included (when the device
         is slower than the host, this hides host savings).
Then `pairs` against the general call on the same pairs (an index of them, as pipelined and
gated decode's layers made before they called `pairs`), the same three ways. Then a trivial
kernel (one copy) with a header of 1 KB and of 20 KB of comment lines, the same
three ways: what a KB of source costs a call. Only the manifest is read, and an arena of zeros
of a few records stands in for the experts (the host's work does not depend on the values).
On a machine whose MLX has no CUDA or Metal device it prints the source sizes, says that
nothing was timed and exits 0; with --stub it times `pairs` against the general call there
(and anywhere) with stub kernels, one MLX op each: the host's glue around the kernels alone.
Sized for well under 90 s on a GPU: six JIT compiles (~1.5 s each on the H200), then 3 x 2 x 3
x --rounds measurements of --calls calls of ~0.2 ms at most.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from importlib import import_module

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from custom_kernels import dispatch  # noqa: E402
from strata_mlx.format.quant import mx_dtype  # noqa: E402
from strata_mlx.format.store import StoreError, load_manifest  # noqa: E402

LAYERS = 48  # calls between evals: a token of qwen3-next-80b-a3b's 48 MoE layers
MODES = ("graph", "async", "eval")


def gpu_dialect() -> str | None:
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return None


def per_call_us(call: Callable[[], mx.array], n: int, mode: str) -> float:
    """us a call over n calls of `call`, evaluated as `mode` says (MODES)."""
    outs = []
    t = time.perf_counter()
    for i in range(n):
        y = call()
        if mode == "graph":
            continue
        outs.append(y)
        if len(outs) == LAYERS or i == n - 1:
            (mx.async_eval if mode == "async" else mx.eval)(outs)
            outs = []
    seconds = time.perf_counter() - t
    mx.synchronize()
    return seconds / n * 1e6


def alternate(calls: dict[str, Callable[[], mx.array]], n: int, rounds: int) -> dict:
    """{(name, mode): median us a call}, every name and mode measured once a round."""
    for call in calls.values():  # compile and warm up
        mx.eval(call())
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for mode in MODES:
            for name, call in calls.items():
                times.setdefault((name, mode), []).append(per_call_us(call, n, mode))
    return {key: statistics.median(v) for key, v in times.items()}


def print_table(title: str, names: list[str], med: dict) -> None:
    print(f"\n{title}: us a call, medians")
    print(f"{'':14}" + "".join(f"{m:>9}" for m in MODES))
    for name in names:
        print(f"{name:14}" + "".join(f"{med[(name, m)]:9.2f}" for m in MODES))
    if len(names) == 2:
        a, b = names
        print(f"{'difference':14}" + "".join(f"{med[(a, m)] - med[(b, m)]:9.2f}" for m in MODES))


def trivial_kernel(dialect: str, header_bytes: int) -> Callable[[], mx.array]:
    """One copy; the header `header_bytes` (a multiple of 100) of comment lines."""
    line = "// " + "x" * 96 + "\n"
    header = line * (header_bytes // len(line))
    assert len(header) == header_bytes
    factory = mx.fast.cuda_kernel if dialect == "cuda" else mx.fast.metal_kernel
    kernel = factory(
        name=f"sk_bench_copy_{header_bytes}",
        input_names=["a"],
        output_names=["o"],
        source="  o[0] = a[0];\n",
        header=header,
        ensure_row_contiguous=True,
    )
    a = mx.zeros((1,), dtype=mx.float32)
    args = {
        "grid": (1, 1, 1),
        "threadgroup": (1, 1, 1),
        "output_shapes": [(1,)],
        "output_dtypes": [mx.float32],
        "template": [("T", mx.float32)],
    }
    return lambda: kernel(inputs=[a], **args)[0]


class StubDialect:
    """Kernels that are one MLX op each (zeros of the output's shape): what is left to time
    is the Python and the graph around them, on any machine."""

    MAX_GRID_Y = 65535

    @staticmethod
    def build(src):
        def run(inputs, output_shapes, output_dtypes, **kw):
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        return run


def one_token(kern, layout, k: int, dtype) -> tuple[mx.array, mx.array, mx.array]:
    """(x, arena, pair_slot) of one token's k pairs for `kern`: zeros stand in for records
    (the host's work does not depend on the values)."""
    arena = mx.zeros((max(k, 16), layout.record_bytes), dtype=mx.uint8)
    x = mx.random.normal((1, 1, kern.hidden)).astype(dtype)
    pair_slot = mx.arange(k, dtype=mx.uint32)
    mx.eval(arena, x, pair_slot)
    return x, arena, pair_slot


def pairs_against_general(kern, layout, problem, a, title: str) -> None:
    """`pairs` against the general call on the same pairs (an index of them, as pipelined
    and gated decode's layers made before they called `pairs`), timed as MODES say."""
    x, arena, pair_slot = problem
    k = pair_slot.size
    idx = mx.arange(k, dtype=mx.uint32).reshape(1, 1, k)
    mx.eval(idx)
    entries = {
        "pairs": lambda: kern.pairs(x, arena, pair_slot),
        "general": lambda: kern(x, arena, pair_slot, idx, layout),
    }
    print_table(title, list(entries), alternate(entries, a.calls, a.rounds))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", help="a strata-mlx store (only its manifest is read)")
    ap.add_argument("--calls", type=int, default=2000, help="calls a measurement (N)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (medians)")
    ap.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default=None)
    ap.add_argument(
        "--stub",
        action="store_true",
        help="time `pairs` against the general call with stub kernels (one op each): the "
        "Python and graph around the kernels, on any machine",
    )
    a = ap.parse_args()

    try:
        m = load_manifest(a.store)
    except StoreError as e:
        print(e)
        return 2
    layer = m.moe_layers[0]
    layout = m.layout_of(layer)
    k = int(m.config["num_experts_per_tok"])
    dtype_name = a.dtype or m.config.get("torch_dtype") or "float16"
    dtype = mx_dtype(dtype_name)
    projs = dispatch.plan(layout)
    if projs is None:
        print(f"{a.store}: layer {layer}'s experts have no kernel (the reference path runs them)")
        return 2
    dialect = gpu_dialect()
    mod = import_module(f"custom_kernels.{dialect or 'cuda'}")
    kerns = {h: dispatch.ExpertKernels(mod, layout, projs, header=h) for h in ("full", "own")}
    print(f"{a.store}: layer {layer}, top-{k}, {layout.record_bytes} B records, x {dtype_name}")
    print(f"source bytes handed to mx.fast.{dialect or 'cuda'}_kernel (header + body):")
    for h, kern in kerns.items():
        srcs = [*kern.sources(k, 1), *kern.dequant_sources().values()]
        sizes = [sum(map(len, mod.sources(s))) for s in srcs]
        print(
            f"  {h:4}: decode gate_up {sizes[0]}, down {sizes[1]} (a layer: {sum(sizes[:2])});"
            f" dequantize {', '.join(map(str, sizes[2:]))}"
        )
    if a.stub:
        kern = dispatch.ExpertKernels(StubDialect, layout, projs, header="own")
        title = "stub kernels (the glue alone): `pairs` against the general call"
        pairs_against_general(kern, layout, one_token(kern, layout, k, dtype), a, title)
        return 0
    if dialect is None:
        print(f"MLX {mx.__version__} here has no CUDA or Metal device: nothing timed.")
        return 0
    mx.set_default_device(mx.gpu)

    problem = one_token(kerns["own"], layout, k, dtype)
    x, arena, pair_slot = problem
    calls = {h: (lambda kern=kern: kern.pairs(x, arena, pair_slot)) for h, kern in kerns.items()}
    med = alternate(calls, a.calls, a.rounds)
    print_table(
        f"pairs, one layer's decode call ({a.calls} calls, {a.rounds} rounds)", list(calls), med
    )

    title = "one token's pairs: `pairs` against the general call"
    pairs_against_general(kerns["own"], layout, problem, a, title)

    sizes = {"20 KB header": 20_000, "1 KB header": 1_000}
    trivial = {name: trivial_kernel(dialect, size) for name, size in sizes.items()}
    med = alternate(trivial, a.calls, a.rounds)
    print_table(f"mx.fast.{dialect}_kernel alone (one copy)", list(trivial), med)
    names = list(trivial)
    per_kb = [(med[(names[0], mo)] - med[(names[1], mo)]) / 19 for mo in MODES]
    print(f"{'a KB of source':14}" + "".join(f"{v:9.3f}" for v in per_kb))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
