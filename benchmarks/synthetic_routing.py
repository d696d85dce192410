"""What a synthetic store's recipe does, measured without writing the store.

Builds the synthetic model of a shape (strata_mlx.convert.synthetic.build_synthetic: the same
dense weights and the same expert records, drawn in the same order, as `convert --synthetic`
writes) and runs one chunk of random tokens through it on the CPU, with each layer's experts
dequantized to float32 (MLX's CPU gather_qmm is far too slow for full-size shapes). Reports per
MoE layer:

  distinct   distinct experts the chunk routes to (the reference saw ~410 per 1024 tokens)
  recall     lookahead's per-token recall: layer l+1's router applied to layer l's MoE input,
             top-k, against layer l+1's true top-k
  set        the chunk-level version: share of layer l+1's distinct experts predicted by any
             token (what bench's streamed-ahead % can reach)
  overlap    per-token share of layer l's expert ids that layer l+1 picks too
  recall2    the same for layer l+2's router on layer l's input (the handshake's depth 2)
  union2     what that and layer l+2's router on layer l+1's input find together
  moe/h      norm of the MoE update over the residual it is added to (mean over tokens)
  cos_mu     cosine of the residual with the router's shared direction (popularity skew)
  top64      share of the chunk's picks that go to its 64 most picked experts
  plan       the distinct experts `strata-mlx plan` forecasts for the chunk from a profile of
             its first --profile-tokens tokens (Good-Turing smoothed: plan.smoothed_shares),
             and `seen`, what counting only the experts that profile saw gives

and how much the experts matter: the last positions' logits with one layer's expert output
zeroed (and with every layer's), against the intact model.

    python benchmarks/synthetic_routing.py --shape bench-small --tokens 1024
    python benchmarks/synthetic_routing.py --recipe weak-experts
    python benchmarks/synthetic_routing.py --set down_scale=8 --set growth=0.3
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import mlx.core as mx
import numpy as np

from strata_mlx.apps.plan import hit_probability, smoothed_shares
from strata_mlx.convert.synthetic import RECIPES, Recipe, build_synthetic, synthetic_config
from strata_mlx.format.store import PROJECTIONS


class FloatExperts:
    """Stands where the expert cache stands (the seam's run_layer) and computes each layer's
    experts from the synthetic records, dequantized; records every layer's MoE input and ids."""

    route_bonus = 0.0
    decoding = False
    dump = None

    def __init__(self, syn):
        self.syn = syn
        self.states: dict[int, dict] = {}  # layer -> rng state before its experts were drawn
        self.zero: set[int] = set()
        self.inputs: dict[int, np.ndarray] = {}
        self.ids: dict[int, np.ndarray] = {}
        self.out_norm: dict[int, np.ndarray] = {}

    def _experts(self, layer: int) -> list[dict]:
        rng = self.syn.rng.bit_generator
        if layer in self.states:  # a second pass draws the same records again
            rng.state = self.states[layer]
        else:
            self.states[layer] = rng.state
        i = self.syn.moe_layers.index(layer)
        return [self.syn.next_expert(i) for _ in range(self.syn.num_experts)]

    def run_layer(self, layer: int, x: mx.array, inds: mx.array) -> mx.array:
        lay, bits = self.syn.layout, self.syn.bits
        gs = lay.quant["gate_proj"]["group_size"]
        xs = np.array(x.astype(mx.float32)).reshape(-1, x.shape[-1])
        ids = np.array(inds).reshape(-1, inds.shape[-1])
        self.inputs[layer], self.ids[layer] = xs, ids
        y = np.zeros((*ids.shape, xs.shape[-1]), np.float32)
        records = self._experts(layer)
        if layer not in self.zero:
            for e in np.unique(ids):
                tok, slot = np.nonzero(ids == e)
                w = {
                    p: np.array(
                        mx.dequantize(
                            mx.array(records[e][f"{p}.weight"]),
                            mx.array(records[e][f"{p}.scales"]).astype(mx.float32),
                            mx.array(records[e][f"{p}.biases"]).astype(mx.float32),
                            group_size=gs,
                            bits=bits,
                        )
                    )
                    for p in PROJECTIONS
                }
                h = xs[tok]
                g = h @ w["gate_proj"].T
                a = g / (1 + np.exp(-g)) * (h @ w["up_proj"].T)
                y[tok, slot] = a @ w["down_proj"].T
        return mx.array(y.reshape(*inds.shape, xs.shape[-1])).astype(x.dtype)


def forward(model, experts: FloatExperts, ids: list[int]):
    """(final normed hidden [T, D], per-layer residual before its MoE update)."""
    inner = model.model
    h = inner.embed_tokens(mx.array([ids]))
    before = {}
    for i, layer in enumerate(inner.layers):
        a = h + layer.self_attn(layer.input_layernorm(h), "causal", None)
        m = layer.mlp(layer.post_attention_layernorm(a))
        mx.eval(a, m)
        before[i] = (np.array(a[0]), np.array(m[0]))
        h = a + m
    return inner.norm(h)[0], before


def measure(args) -> None:
    cfg = synthetic_config(args.shape)
    for item in args.set_config or []:
        k, _, v = item.partition("=")
        cfg[k] = type(cfg[k])(v)
    recipe = Recipe.named(args.recipe)
    for item in args.set or []:
        k, _, v = item.partition("=")
        recipe = dataclasses.replace(recipe, **{k: type(getattr(recipe, k))(v)})
    print(f"shape {args.shape} { ({k: cfg[k] for k in ('hidden_size', 'num_experts')}) }, {recipe}")
    syn = build_synthetic(args.shape, cfg, dtype="float32", recipe=recipe, seed=args.seed)
    model = syn.model
    experts = FloatExperts(syn)
    blocks = model.moe_blocks()
    for b in blocks.values():
        b.switch_mlp.attach(experts)
    vocab = syn.config["vocab_size"]
    ids = np.random.default_rng(args.seed + 1).integers(0, vocab, size=args.tokens).tolist()
    t = time.perf_counter()
    final, before = forward(model, experts, ids)
    print(f"forward {time.perf_counter() - t:.0f} s")
    layers = sorted(blocks)
    rows = []
    for l, nxt in zip(layers, layers[1:] + [None]):
        true = experts.ids[l]
        k = true.shape[1]
        a, m = before[l]
        prof = np.bincount(true[: args.profile_tokens].ravel(), minlength=syn.num_experts)
        p = np.clip(smoothed_shares(prof[None])[0] * k, 0, 1)
        row = {
            "layer": l,
            "distinct": len(np.unique(true)),
            "plan": float(np.sum(hit_probability(p, len(true)))),
            "seen": int((prof > 0).sum()),
            "moe/h": float(np.mean(np.linalg.norm(m, axis=1) / np.linalg.norm(a, axis=1))),
        }
        if syn.mu is not None:
            row["cos_mu"] = float(np.mean(a @ syn.mu / np.linalg.norm(a, axis=1)))
            row["top64"] = float(
                np.sort(np.bincount(true.ravel(), minlength=syn.num_experts))[-64:].sum()
                / true.size
            )
        if nxt is not None:
            pred, _ = blocks[nxt].route(mx.array(experts.inputs[l]))
            pred = np.array(pred)
            nt = experts.ids[nxt]
            row["recall"] = float(np.mean([len(set(p) & set(q)) / k for p, q in zip(pred, nt)]))
            row["set"] = len(set(pred.ravel()) & set(nt.ravel())) / len(np.unique(nt))
            row["overlap"] = float(np.mean([len(set(p) & set(q)) / k for p, q in zip(true, nt)]))
        after = layers[layers.index(l) + 2] if layers.index(l) + 2 < len(layers) else None
        if after is not None:  # layer l+2 from l's input, and with l+1's (the handshake's two)
            far, _ = blocks[after].route(mx.array(experts.inputs[l]))
            near, _ = blocks[after].route(mx.array(experts.inputs[nxt]))
            at = experts.ids[after]
            row["recall2"] = float(
                np.mean([len(set(p) & set(q)) / k for p, q in zip(np.array(far), at)])
            )
            row["union2"] = float(
                np.mean(
                    [
                        len((set(f) | set(n)) & set(q)) / k
                        for f, n, q in zip(np.array(far), np.array(near), at)
                    ]
                )
            )
        rows.append(row)
        print(
            "  ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
            )
        )
    mean = lambda key: np.mean([r[key] for r in rows if key in r])  # noqa: E731
    print(
        f"mean: distinct {mean('distinct'):.0f} (plan {mean('plan'):.0f} from "
        f"{args.profile_tokens} tokens, seen {mean('seen'):.0f}), recall {mean('recall'):.3f}, set "
        f"{mean('set'):.3f}, overlap {mean('overlap'):.3f}, moe/h {mean('moe/h'):.3f}, recall2 "
        f"{mean('recall2'):.3f}, union2 {mean('union2'):.3f}"
    )

    if args.no_zeroing:
        return
    n = args.logit_positions
    head = model.lm_head
    ref = np.array(head(final[-n:]))
    print(f"logits of the last {n} positions: std {ref.std():.3f}")
    for zero in ([layers[len(layers) // 2]], layers):
        experts.zero = set(zero)
        out, _ = forward(model, experts, ids)
        test = np.array(head(out[-n:]))
        changed = np.mean(ref.argmax(-1) != test.argmax(-1))
        what = f"layer {zero[0]}" if len(zero) == 1 else "every layer"
        print(
            f"experts of {what} zeroed: max |logit diff| {np.abs(test - ref).max():.3f}, "
            f"rms {np.sqrt(np.mean((test - ref) ** 2)):.3f}; argmax changed at "
            f"{100 * changed:.0f}% of positions"
        )
    experts.zero = set()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="bench-small")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipe", choices=list(RECIPES), default="default")
    p.add_argument("--set", action="append", help="a Recipe field, e.g. down_scale=8")
    p.add_argument("--set-config", action="append", help="a shape field, e.g. num_hidden_layers=4")
    p.add_argument("--profile-tokens", type=int, default=256, help="the plan column's profile")
    p.add_argument("--logit-positions", type=int, default=64)
    p.add_argument("--no-zeroing", action="store_true", help="skip the experts-matter passes")
    measure(p.parse_args())


if __name__ == "__main__":
    main()
