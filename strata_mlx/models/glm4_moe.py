"""GLM-4.5 / GLM-4.6 MoE (`glm4_moe`): attention with biased q/k/v projections, optional q/k
norms and partial rotary; the first `first_k_dense_replace` layers dense, the rest routed SwiGLU
experts chosen by sigmoid scores plus a correction bias (group-limited top-k: DeepSeek-V3's
router, imported from there), plus a dense shared expert added unweighted.

Only the routed experts go through the seam; the router (`mlp.gate`: weight and
`e_score_correction_bias`, both kept float) and the shared experts are dense weights. The
checkpoint's multi-token-prediction layer (`model.layers.{num_hidden_layers}`) is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .base import BaseModelArgs, KVCache, attention, create_attention_mask, swiglu
from .deepseek_v3 import Router, check_group_routing, keep_float32
from .rope import initialize_rope
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
    num_key_value_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    head_dim: int | None = None
    n_shared_experts: int | None = 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    use_qk_norm: bool = False
    attention_bias: bool = False
    partial_rotary_factor: float = 0.5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        check_group_routing(self)

    @property
    def num_experts(self) -> int:
        """The loader's and converter's name for the routed expert count."""
        return self.n_routed_experts


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        head_dim = args.head_dim
        self.scale = head_dim**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=False)
        self.use_qk_norm = args.use_qk_norm
        if self.use_qk_norm:
            self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        # Partial rotary: the first dims of each head rotate (halves, not pairs); the rest pass.
        self.rope = initialize_rope(
            int(head_dim * args.partial_rotary_factor),
            args.rope_theta,
            False,
            args.rope_scaling,
            kinds=("default", "linear"),
        )

    def __call__(self, x: mx.array, mask, cache: KVCache | None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
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
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.gate = Router(args)
        self.switch_mlp = SwitchGLU(layer)
        if args.n_shared_experts:
            self.shared_experts = MLP(
                args.hidden_size, args.moe_intermediate_size * args.n_shared_experts
            )

    def route(self, x: mx.array, bonus: mx.array | None = None):
        return self.gate(x, bonus)

    def __call__(self, x: mx.array) -> mx.array:
        inds, scores = self.route(x, self.switch_mlp.route_bonus())
        y = self.switch_mlp(x, inds, scores)  # the routed part alone
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        return y


def is_moe_layer(args: ModelArgs, i: int) -> bool:
    return args.n_routed_experts > 0 and i >= args.first_k_dense_replace


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if is_moe_layer(args, layer):
            self.mlp = MoE(args, layer)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size)

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Glm4MoeModel(nn.Module):
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
        self.model = Glm4MoeModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        out = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(out)
        return self.lm_head(out)

    def moe_blocks(self) -> dict[int, MoE]:
        return {i: l.mlp for i, l in enumerate(self.model.layers) if isinstance(l.mlp, MoE)}

    def make_cache(self) -> list[Any]:
        return [KVCache() for _ in self.model.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop the multi-token-prediction layers (numbered from num_hidden_layers on) and
        precomputed rotary frequencies."""
        weights = {
            k: v
            for k, v in weights.items()
            if not _beyond_layers(k, self.args.num_hidden_layers) and "rotary_emb.inv_freq" not in k
        }
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    @property
    def cast_predicate(self):
        return keep_float32

    @property
    def layers(self):
        return self.model.layers


def _beyond_layers(key: str, n: int) -> bool:
    parts = key.split(".")
    return (
        len(parts) > 2
        and parts[0] == "model"
        and parts[1] == "layers"
        and parts[2].isdigit()
        and int(parts[2]) >= n
    )
