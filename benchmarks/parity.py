"""Teacher-forced logits of strata-mlx against mlx-lm's own model on the same store, beside
mlx-lm against itself, so "within numerical noise" has a measured scale.

    python benchmarks/parity.py STORE [-p 256] [--chunk 64]

Every prompt position's log-probabilities are compared (the same tokens fed to all, so one
difference cannot change what the next position sees). Rows:
  - mlx-lm vs mlx-lm: the prompt in one forward against chunks of --chunk (the same model and
    weights, attention over a KV cache in another order): the noise floor of that arithmetic;
  - strata-mlx vs mlx-lm, with the backend's expert kernels and with the reference kernels
    (STRATA_MLX_KERNELS=reference: MLX ops, the oracle), every expert resident;
  - strata-mlx kernels vs reference: what the custom kernels alone change;
  - mlx-lm with its experts multiplied in float32 (dequantized, mx.gather_mm, rounded back to
    the activations' dtype once per projection: what the custom kernels do, up to the SwiGLU's
    rounding) against mlx-lm: how far that one legitimate change of rounding moves the logits;
  - each of them against the float32 oracle: mlx-lm's same model with every float parameter
    (dense weights, quantization scales and biases) cast to float32, so activations and
    accumulations run in float32 on the same quantized weights. Two implementations that
    round differently are both "within numerical noise" when each is as far from the exact
    arithmetic as the other: this is the scale the kernels' distance is judged on.
Metrics: max |difference| of log-probabilities over all positions and vocabulary, mean KL
divergence per position (nats), and the share of positions whose top-1 token agrees.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os

import mlx.core as mx
import numpy as np

import strata_mlx
from strata_mlx.format.store import load_manifest


def logprobs(model, ids, chunk, cache):
    outs = []
    for s in range(0, len(ids), chunk):
        y = model(mx.array([ids[s : s + chunk]]), cache=cache)
        y = y.astype(mx.float32)
        y = y - mx.logsumexp(y, axis=-1, keepdims=True)
        mx.eval(y)
        outs.append(np.array(y[0]))
    return np.concatenate(outs)


@contextlib.contextmanager
def experts_in_float32():
    """mlx-lm's quantized SwitchLinear as dequantize + float32 gather_mm, rounded once."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    original = QuantizedSwitchLinear.__call__

    def call(self, x, indices, sorted_indices=False):
        ids = np.array(indices)
        used, local = np.unique(ids, return_inverse=True)
        u = mx.array(used.astype(np.uint32))
        w = mx.dequantize(
            self["weight"][u],
            self["scales"][u],
            None if self.get("biases") is None else self["biases"][u],
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        ).astype(mx.float32)
        y = mx.gather_mm(
            x.astype(mx.float32),
            w.swapaxes(-1, -2),
            rhs_indices=mx.array(local.reshape(ids.shape).astype(np.uint32)),
            sorted_indices=sorted_indices,
        ).astype(x.dtype)
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y

    QuantizedSwitchLinear.__call__ = call
    try:
        yield
    finally:
        QuantizedSwitchLinear.__call__ = original


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    pa = np.exp(a)
    kl = (pa * (a - b)).sum(axis=-1)
    return {
        "max_abs_logprob_diff": float(np.max(np.abs(a - b))),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "top1_agree": float((a.argmax(-1) == b.argmax(-1)).mean()),
    }


def strata_logprobs(store, ids, chunk, kernels=None):
    if kernels:
        os.environ["STRATA_MLX_KERNELS"] = kernels
    try:
        m = load_manifest(store)
        gb = m.expert_bytes / 1024**3 * 1.01 + 0.01
        model, _ = strata_mlx.load(store, arena_gb=gb, read_ahead="demand")
        model.expert_cache.warm()
        out = logprobs(model, ids, chunk, model.make_cache())
        model.expert_cache.close()
        del model
        gc.collect()
        mx.clear_cache()
        return out
    finally:
        os.environ.pop("STRATA_MLX_KERNELS", None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("-p", "--prompt-tokens", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-fp32", action="store_true", help="skip the float32 oracle")
    a = ap.parse_args()

    from mlx_lm.models.cache import make_prompt_cache

    from strata_mlx.apps.baseline import load_mlx_lm

    m = load_manifest(a.store)
    ids = np.random.default_rng(0).integers(0, m.config["vocab_size"], a.prompt_tokens).tolist()
    lm = load_mlx_lm(a.store)
    ref = logprobs(lm, ids, len(ids), make_prompt_cache(lm))
    lm_chunked = logprobs(lm, ids, a.chunk, make_prompt_cache(lm))
    with experts_in_float32():
        lm_f32_experts = logprobs(lm, ids, len(ids), make_prompt_cache(lm))
    exact = None
    if not a.no_fp32:
        lm.set_dtype(mx.float32)  # floating parameters only: packed weights stay uint32
        exact = logprobs(lm, ids, a.chunk, make_prompt_cache(lm))
    del lm
    gc.collect()
    mx.clear_cache()
    ours = strata_logprobs(a.store, ids, len(ids))
    ours_ref = strata_logprobs(a.store, ids, len(ids), "reference")
    rows = {
        f"mlx-lm vs mlx-lm (chunks of {a.chunk})": compare(ref, lm_chunked),
        "mlx-lm, experts in float32, vs mlx-lm": compare(ref, lm_f32_experts),
        "strata-mlx (kernels) vs mlx-lm": compare(ref, ours),
        "strata-mlx (reference) vs mlx-lm": compare(ref, ours_ref),
        "strata-mlx kernels vs reference": compare(ours_ref, ours),
    }
    if exact is not None:
        rows["mlx-lm vs float32 oracle"] = compare(exact, ref)
        rows["mlx-lm, experts in float32, vs float32 oracle"] = compare(exact, lm_f32_experts)
        rows["strata-mlx (kernels) vs float32 oracle"] = compare(exact, ours)
        rows["strata-mlx (reference) vs float32 oracle"] = compare(exact, ours_ref)
    for name, r in rows.items():
        print(
            f"{name:>46}: max |dlogprob| {r['max_abs_logprob_diff']:.4g}, mean KL "
            f"{r['mean_kl']:.3g} (max {r['max_kl']:.3g}), top-1 agree {100 * r['top1_agree']:.1f} %",
            flush=True,
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"store": a.store, "prompt": a.prompt_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
