"""Mixtral: Llama-style attention, top-k-then-softmax routing, routed SwiGLU experts (w1/w3/w2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .base import BaseModelArgs, KVCache, attention, create_attention_mask, top_k_route
from .rope import initialize_rope
from .switch import SwitchGLU

# Where the checkpoint keeps layer l's experts, and each projection's name there.
EXPERT_PREFIX = "model.layers.{layer}.block_sparse_moe.experts"
EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_local_experts: int
    num_experts_per_tok: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    rope_traditional: bool = False
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads


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
        self.rope = initialize_rope(
            head_dim,
            args.rope_theta,
            args.rope_traditional,
            args.rope_scaling,
            kinds=("default", "linear"),
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


class SparseMoeBlock(nn.Module):
    """Router logits -> top-k -> softmax over the k chosen logits (equal to transformers'
    softmax-then-renormalize); experts through the seam."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.gate = nn.Linear(args.hidden_size, args.num_local_experts, bias=False)
        self.switch_mlp = SwitchGLU(layer)

    def route(self, x: mx.array, bonus: mx.array | None = None):
        logits = self.gate(x)
        if bonus is not None:
            logits = logits + bonus
        return top_k_route(logits, self.top_k, norm_topk_prob=True, softmax_first=False)

    def route_ids(self, x: mx.array) -> mx.array:
        """route(x)'s ids alone (lookahead's router)."""
        return top_k_route(self.gate(x), self.top_k, True, softmax_first=False, ids=True)

    def __call__(self, x: mx.array) -> mx.array:
        inds, scores = self.route(x, self.switch_mlp.route_bonus())
        return self.switch_mlp(x, inds, scores)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args)
        self.block_sparse_moe = SparseMoeBlock(args, layer)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.block_sparse_moe(self.post_attention_layernorm(h))


class MixtralModel(nn.Module):
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
        self.model = MixtralModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        out = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(out)
        return self.lm_head(out)

    def moe_blocks(self) -> dict[int, SparseMoeBlock]:
        return {i: l.block_sparse_moe for i, l in enumerate(self.model.layers)}

    def make_cache(self) -> list[Any]:
        return [KVCache() for _ in self.model.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    @property
    def quant_predicate(self):
        # mlx-lm has no Mixtral-specific predicate: every quantizable layer, the router
        # included, takes the conversion's bits and group size.
        def predicate(path, _):
            return True

        return predicate

    @property
    def layers(self):
        return self.model.layers
