"""Qwen3-MoE: attention with q/k norms, softmax top-k routing, routed SwiGLU experts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .base import BaseModelArgs, KVCache, attention, create_attention_mask, swiglu, top_k_route
from .switch import SwitchGLU

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
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    num_key_value_heads: int
    rope_theta: float = 1e6
    head_dim: int | None = None
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    tie_word_embeddings: bool = False
    norm_topk_prob: bool = False
    max_position_embeddings: int = 32768


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        head_dim = args.head_dim or dim // self.n_heads
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.rope = nn.RoPE(head_dim, traditional=False, base=args.rope_theta)

    def __call__(self, x: mx.array, mask, cache: KVCache | None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        o = attention(q, k, v, cache, self.scale, mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(layer)

    def route(self, x: mx.array, bonus: mx.array | None = None):
        logits = self.gate(x)
        if bonus is not None:
            logits = logits + bonus
        return top_k_route(logits, self.top_k, self.norm_topk_prob)

    def route_ids(self, x: mx.array) -> mx.array:
        """route(x)'s ids alone (lookahead's router)."""
        return top_k_route(self.gate(x), self.top_k, self.norm_topk_prob, ids=True)

    def __call__(self, x: mx.array) -> mx.array:
        inds, scores = self.route(x, self.switch_mlp.route_bonus())
        return self.switch_mlp(x, inds, scores)


def is_moe_layer(args: ModelArgs, i: int) -> bool:
    return (
        i not in args.mlp_only_layers
        and args.num_experts > 0
        and (i + 1) % args.decoder_sparse_step == 0
    )


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if is_moe_layer(args, layer):
            self.mlp = SparseMoeBlock(args, layer)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size)

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3MoeModel(nn.Module):
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
        self.model = Qwen3MoeModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        out = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(out)
        return self.lm_head(out)

    def moe_blocks(self) -> dict[int, SparseMoeBlock]:
        return {
            i: l.mlp for i, l in enumerate(self.model.layers) if isinstance(l.mlp, SparseMoeBlock)
        }

    def make_cache(self) -> list[Any]:
        return [KVCache() for _ in self.model.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    @property
    def quant_predicate(self):
        def predicate(path, _):
            if path.endswith("mlp.gate"):
                return {"group_size": 64, "bits": 8}
            return True

        return predicate

    @property
    def layers(self):
        return self.model.layers
