"""Llama (SmolLM2 is one) with its MLP split into E experts that stream through the arena.

A dense Llama MLP is down(silu(gate(x)) * up(x)) over I neurons. Cutting the I neurons into
E groups gives E SwiGLU experts whose outputs *sum* to the dense MLP's output, because the
down projection is a sum over neurons. So the block's combine weight is 1 for every selected
expert, and with `top_k == E` (the default) the block computes the dense MLP exactly (up to
float summation order). With `top_k < E` the router keeps the k experts with the largest
logits; how the converter made that router (strata_mlx.convert.gguf) decides how much
quality survives. That is a research knob (`--top-k`), not a trained MoE.

Attention, norms and rotary embeddings are transformers' LlamaForCausalLM (non-interleaved
rotary halves, so GGUF's permuted q/k rows are un-permuted by the converter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .base import BaseModelArgs, KVCache, attention, create_attention_mask
from .rope import initialize_rope
from .switch import SwitchGLU

# Where a store's experts came from, and each projection's name there (the split MLP).
EXPERT_PREFIX = "model.layers.{layer}.mlp.experts"
EXPERT_NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    rms_norm_eps: float
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    # llama.cpp's rope_freqs tensor (Llama 3.x GGUFs): per-frequency divisors, len head_dim/2.
    rope_freq_factors: list[float] | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    num_experts: int = 1  # neuron groups per MLP
    num_experts_per_tok: int | None = None  # None: all of them (the dense model, exactly)

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.mlp_bias:
            raise ValueError("llama: mlp_bias is not supported with split experts")
        if self.num_experts < 1 or self.intermediate_size % self.num_experts:
            raise ValueError(
                f"llama: num_experts {self.num_experts} must divide intermediate_size "
                f"{self.intermediate_size}"
            )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        head_dim = args.head_dim or dim // self.n_heads
        self.scale = head_dim**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        self.rope = initialize_rope(
            head_dim,
            args.rope_theta,
            False,
            args.rope_scaling,
            freq_factors=args.rope_freq_factors,
            kinds=("default", "linear", "llama3"),
        )

    def __call__(self, x: mx.array, mask, cache: KVCache | None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        o = attention(q, k, v, cache, self.scale, mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class SplitMLP(nn.Module):
    """The dense MLP as E neuron-group experts; selected experts' outputs are summed."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.num_experts = args.num_experts
        self.top_k = args.num_experts_per_tok or args.num_experts
        # Router logits (the converter fits them; see strata_mlx.convert.gguf). Unused while
        # top_k == num_experts.
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=True)
        self.switch_mlp = SwitchGLU(layer)

    def route(self, x: mx.array, bonus: mx.array | None = None):
        """(ids [..., k], scores [..., k]); every score is 1 (a split sums back to the MLP)."""
        n, k = self.num_experts, min(self.top_k, self.num_experts)
        if k >= n:
            inds = mx.broadcast_to(mx.arange(n, dtype=mx.uint32), (*x.shape[:-1], n))
            # The pipelined decoder's check (experts.check_deferred) takes a layer's evaluated
            # ids as proof that the layers before it are computed (their slots may then be
            # refilled). Constant ids would not prove it, so they are made to depend on x. (The
            # sync handshake evaluates x with the ids, and needs no such help: test_llama_split.)
            (inds,) = mx.depends([inds], [x])
        else:
            logits = self.gate(x)
            if bonus is not None:
                logits = logits + bonus
            inds = mx.stop_gradient(mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k])
        return inds, mx.ones(inds.shape, dtype=x.dtype)

    def __call__(self, x: mx.array) -> mx.array:
        inds, scores = self.route(x, self.switch_mlp.route_bonus())
        y = self.switch_mlp(x, inds).sum(axis=-2)
        self.switch_mlp.observe(x, inds, scores, y)
        return y


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = SplitMLP(args, layer)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        h = self.embed_tokens(inputs)
        cache = cache or [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        out = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(out)
        return self.lm_head(out)

    def moe_blocks(self) -> dict[int, SplitMLP]:
        return {i: layer.mlp for i, layer in enumerate(self.model.layers)}

    def make_cache(self) -> list[Any]:
        return [KVCache() for _ in self.model.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    @property
    def quant_predicate(self):
        def predicate(path, _):
            return not path.endswith("mlp.gate")

        return predicate

    @property
    def layers(self):
        return self.model.layers
