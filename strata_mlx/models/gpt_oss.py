"""GPT-OSS (`gpt_oss`): attention with biased projections and a learned sink logit per head,
alternating sliding-window and full layers, YaRN rotary; every layer routed (top-k of the
biased router logits, softmax over the k chosen) to experts whose gate and up projections
carry biases and feed a clamped SwiGLU: (clip(up, -l, l) + 1) * g * sigmoid(alpha * g) with
g = min(gate, l) (alpha 1.702, l = swiglu_limit), then a biased down projection.

Only the routed experts go through the seam: their weights and biases are one record each
(`{proj}.bias` components) and the store's layout names the activation (strata_mlx.format.quant),
so the expert cache and its reference path compute them like any other family's.

Sliding-window layers keep every position in their KV cache (a KVCache, like the full layers:
decode's rewind after a miss resets only the offset, which a rotating buffer could not
undo) and attend over the last `sliding_window` of them; a chunk reads only the keys its
queries can see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .base import BaseModelArgs, KVCache
from .rope import initialize_rope, rope_kind
from .switch import SwitchGLU

ROPE_KINDS = ("default", "yarn")  # what GPT-OSS checkpoints use

# Where the checkpoint keeps layer l's experts, and each projection's name there.
EXPERT_PREFIX = "model.layers.{layer}.mlp.experts"
EXPERT_NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_local_experts: int
    num_experts_per_tok: int
    vocab_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    sliding_window: int | None = 128
    layer_types: list[str] | None = None
    rope_theta: float = 150000.0
    rope_scaling: dict[str, Any] | None = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072

    LAYER_TYPES = ("sliding_attention", "full_attention")

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:  # transformers' default: sliding first, then alternate
            self.layer_types = [
                "sliding_attention" if i % 2 == 0 else "full_attention"
                for i in range(self.num_hidden_layers)
            ]
        if "sliding_attention" in self.layer_types[: self.num_hidden_layers] and not (
            self.sliding_window and self.sliding_window > 0
        ):
            raise ValueError(f"sliding_window {self.sliding_window} must be > 0")
        for name in ("swiglu_alpha", "swiglu_limit"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} {getattr(self, name)} must be > 0")
        kind = rope_kind(self.rope_scaling)
        if kind not in ROPE_KINDS:
            raise ValueError(f"unsupported rope scaling {kind!r}")
        for key in ("factor", "original_max_position_embeddings") if kind == "yarn" else ():
            if key not in self.rope_scaling:
                raise ValueError(f"rope_scaling: yarn needs {key}")

    @property
    def num_experts(self) -> int:
        return self.num_local_experts


def make_rope(args: ModelArgs) -> nn.Module:
    """Rotation of whole heads by halves (not pairs); YaRN as transformers computes it (its
    `truncate` included, which mlx-lm's YaRN ignores: docs/decisions.md)."""
    return initialize_rope(
        args.head_dim, args.rope_theta, False, args.rope_scaling, kinds=ROPE_KINDS
    )


def window_mask(n: int, offset: int, first: int, window: int) -> mx.array:
    """bool [n, offset + n - first]: query i (position offset + i) sees keys at positions
    first.. that are at most `window - 1` before it and not after it (transformers' rule)."""
    keys = mx.arange(first, offset + n)[None]
    queries = mx.arange(offset, offset + n)[:, None]
    return (keys <= queries) & (keys > queries - window)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, sliding: bool):
        super().__init__()
        dim, head_dim = args.hidden_size, args.head_dim
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.scale = head_dim**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        self.sinks = mx.zeros((self.n_heads,))
        self.window = args.sliding_window if sliding else None
        self.rope = make_rope(args)

    def __call__(self, x: mx.array, mask, cache: KVCache | None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None and type(cache) is not KVCache:
            # The window below counts positions in a cache that holds them all, in order.
            raise ValueError(
                f"gpt_oss: its attention needs a plain KV cache, not {type(cache).__name__} "
                "(no rotating or quantized KV cache: --max-kv-size, --kv-bits)"
            )
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if self.window is not None:
            # The first key any query of this chunk can see; earlier ones are not read.
            first = max(offset - self.window + 1, 0)
            if first:
                k, v = k[..., first:, :], v[..., first:, :]
            mask = None if L == 1 else window_mask(L, offset, first, self.window)
        o = mx.fast.scaled_dot_product_attention(
            q, k, v, scale=self.scale, mask=mask, sinks=self.sinks
        )
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLPBlock(nn.Module):
    """Router logits (biased) -> top-k -> softmax over the k chosen; experts through the seam."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.router = nn.Linear(args.hidden_size, args.num_local_experts, bias=True)
        self.switch_mlp = SwitchGLU(layer)

    def route(self, x: mx.array, bonus: mx.array | None = None):
        logits = self.router(x)
        if bonus is not None:
            logits = logits + bonus
        k = self.top_k
        # mlx-lm's order of the chosen k (the weighted sum over them is order-sensitive)
        inds = mx.stop_gradient(mx.argpartition(logits, kth=-k, axis=-1)[..., -k:])
        scores = mx.softmax(mx.take_along_axis(logits, inds, axis=-1), axis=-1, precise=True)
        return inds, scores

    def __call__(self, x: mx.array) -> mx.array:
        inds, scores = self.route(x, self.switch_mlp.route_bonus())
        y = self.switch_mlp(x, inds)
        y = (y * scores[..., None]).sum(axis=-2)
        self.switch_mlp.observe(x, inds, scores, y)
        return y


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args, args.layer_types[layer] == "sliding_attention")
        self.mlp = MLPBlock(args, layer)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class GptOssModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        h = self.embed_tokens(inputs)
        cache = cache or [None] * len(self.layers)
        mask = "causal" if h.shape[1] > 1 else None  # full layers; sliding ones make their own
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = GptOssModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        out = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(out)
        return self.lm_head(out)

    def moe_blocks(self) -> dict[int, MLPBlock]:
        return {i: l.mlp for i, l in enumerate(self.model.layers)}

    def make_cache(self) -> list[Any]:
        return [KVCache() for _ in self.model.layers]

    # Attention sinks have no quantized-cache path (mlx-lm refuses them there too), and the
    # sliding window counts positions in a cache that holds them all, in order: no rotating
    # or quantized cache (prompt_cache.make_prompt_cache says so in one line).
    quantized_kv = False
    plain_kv_only = "its attention sinks and sliding windows count on every position"

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    @property
    def expert_activation(self) -> dict[str, Any]:
        """The experts' gated activation, as the store's record layout names it."""
        a = self.args
        return {"name": "swiglu_oai", "alpha": a.swiglu_alpha, "limit": a.swiglu_limit}

    @property
    def quant_predicate(self):
        # As mlx-lm: the router at 8 bits, group size 64; the rest at the conversion's.
        def predicate(path, _):
            if path.endswith("router"):
                return {"group_size": 64, "bits": 8}
            return True

        return predicate

    @property
    def layers(self):
        return self.model.layers
