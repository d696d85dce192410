"""DeepSeek-V3 (`deepseek_v3`; Kimi K2 is the same architecture): multi-head latent attention,
the first `first_k_dense_replace` layers dense, the rest routed SwiGLU experts chosen by sigmoid
scores plus a correction bias with group-limited top-k ("noaux_tc"), plus dense shared experts
added unweighted.

Attention caches the latent, not per-head keys and values: per position one normalised
`kv_lora_rank` vector and one shared `qk_rope_head_dim` rotary key (a KVCache of one "head":
keys = latent, values = rotary key). The checkpoint's `kv_b_proj` is split at conversion into
per-head `embed_q` (latent -> no-rope key) and `unembed_out` (latent -> value). A prompt chunk
expands the latent into keys and values; a single decode token instead folds `embed_q` into its
query and attends over the latent itself, then applies `unembed_out` (mlx-lm's layout and
arithmetic, so its model built from our store gives the same logits bit for bit).

Only the routed experts go through the seam; the router (`mlp.gate`: weight and
`e_score_correction_bias`, both kept float) and the shared experts are dense weights. The
multi-token-prediction layer (`model.layers.{num_hidden_layers}`) is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .base import BaseModelArgs, KVCache, RotatingKVCache, causal_mask, swiglu
from .rope import YarnRoPE as YarnRoPE  # re-exported: gpt_oss imports it
from .rope import initialize_rope, yarn_attention_scale
from .rope import rope_kind as rope_kind  # re-exported: gpt_oss imports it
from .switch import SwitchGLU

# Where the checkpoint keeps layer l's experts, and each projection's name there.
EXPERT_PREFIX = "model.layers.{layer}.mlp.experts"
EXPERT_NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    n_shared_experts: int | None = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} {getattr(self, name)} must be > 0")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank {self.q_lora_rank} must be > 0 (or null)")
        if self.moe_layer_freq <= 0:
            raise ValueError(f"moe_layer_freq {self.moe_layer_freq} must be > 0")
        check_group_routing(self)

    @property
    def num_experts(self) -> int:
        """The loader's and converter's name for the routed expert count."""
        return self.n_routed_experts


# ---- routing (shared with glm4_moe, which routes the same way) ------------------------------


def check_group_routing(args) -> None:
    """Sigmoid group-limited routing's own constraints (ValueError, as the loader expects)."""
    if args.scoring_func != "sigmoid":
        raise ValueError(f"scoring_func {args.scoring_func!r}: only 'sigmoid' is supported")
    if args.topk_method != "noaux_tc":
        raise ValueError(f"topk_method {args.topk_method!r}: only 'noaux_tc' is supported")
    n, groups, k = args.n_routed_experts, args.n_group, args.num_experts_per_tok
    if not n:
        return
    if not groups or n % groups:
        raise ValueError(f"n_group {groups} does not divide n_routed_experts {n}")
    if not 0 < args.topk_group <= groups:
        raise ValueError(f"topk_group {args.topk_group} outside [1, n_group {groups}]")
    if groups > 1 and n // groups < 2:
        raise ValueError(f"groups of {n // groups} expert: group scores sum each group's top 2")
    if not 0 < k <= args.topk_group * (n // groups):
        raise ValueError(
            f"num_experts_per_tok {k} is more than the {args.topk_group * (n // groups)} "
            f"experts of topk_group {args.topk_group} groups"
        )


@partial(mx.compile, shapeless=True)
def _sigmoid_scores(logits: mx.array, bias: mx.array) -> tuple[mx.array, mx.array]:
    """(sigmoid scores in float32, the same plus the correction bias: what top-k sees)."""
    scores = mx.sigmoid(logits.astype(mx.float32))
    return scores, scores + bias


def group_limited_route(
    logits: mx.array,
    bias: mx.array,
    top_k: int,
    n_group: int,
    topk_group: int,
    scale: float,
    norm_topk_prob: bool,
) -> tuple[mx.array, mx.array]:
    """The "noaux_tc" router: (ids [..., k], weights [..., k] float32).

    Experts are ranked by sigmoid(logit) + bias, but only inside the `topk_group` groups whose
    two best biased scores sum highest; the weights are the unbiased sigmoid scores of the
    chosen experts, normalised to sum 1 if `norm_topk_prob`, times `scale`. Groups left out are
    masked with -inf (as transformers), so a negative biased score still beats them.
    """
    scores, choice = _sigmoid_scores(logits, bias)
    if n_group > 1:
        grouped = mx.unflatten(choice, -1, (n_group, -1))
        group_scores = mx.topk(grouped, 2, axis=-1).sum(axis=-1, keepdims=True)
        drop = n_group - topk_group
        if drop:
            worst = mx.argpartition(group_scores, kth=drop - 1, axis=-2)[..., :drop, :]
            grouped = mx.put_along_axis(
                grouped, mx.stop_gradient(worst), mx.array(-mx.inf, grouped.dtype), axis=-2
            )
        choice = mx.flatten(grouped, -2, -1)
    inds = mx.stop_gradient(mx.argpartition(-choice, kth=top_k - 1, axis=-1)[..., :top_k])
    weights = mx.take_along_axis(scores, inds, axis=-1)
    if norm_topk_prob and top_k > 1:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    elif norm_topk_prob:  # one expert: its weight w / w is 1
        weights = mx.ones_like(weights)
    return inds, weights * scale


class Router(nn.Module):
    """`mlp.gate`: a bare weight, not a Linear, so that quantization leaves it float (as
    mlx-lm does), and the correction bias."""

    def __init__(self, args):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.n_group = args.n_group
        self.topk_group = args.topk_group
        self.scale = args.routed_scaling_factor
        self.norm_topk_prob = args.norm_topk_prob
        self.weight = mx.zeros((args.n_routed_experts, args.hidden_size))
        self.e_score_correction_bias = mx.zeros((args.n_routed_experts,))

    def __call__(self, x: mx.array, bonus: mx.array | None = None):
        logits = x @ self.weight.T
        if bonus is not None:
            logits = logits + bonus
        return group_limited_route(
            logits,
            self.e_score_correction_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.scale,
            self.norm_topk_prob,
        )


def keep_float32(key: str) -> bool:
    """cast_predicate: the correction bias stays float32 when the rest is cast (as checkpoints
    ship it: bf16 would round biases that differ in the fourth digit, and they pick experts)."""
    return "e_score_correction_bias" not in key


# ---- attention -------------------------------------------------------------------------------


class MultiLinear(nn.Module):
    """One [out, in] matrix per head: weight [heads, out, in]; x [..., heads, L, in]."""

    def __init__(self, input_dims: int, output_dims: int, num_heads: int):
        super().__init__()
        self.weight = mx.zeros((num_heads, output_dims, input_dims))

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        """x @ W^T per head ([..., in] -> [..., out]); with transpose=False x @ W ([..., out]
        -> [..., in])."""
        return x @ (self.weight.swapaxes(-1, -2) if transpose else self.weight)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine"):
        heads, out, inp = self.weight.shape
        q = QuantizedMultiLinear(inp, out, heads, group_size, bits, mode)
        q.weight, q.scales, *biases = mx.quantize(self.weight, group_size, bits, mode=mode)
        q.biases = biases[0] if biases else None
        return q


class QuantizedMultiLinear(nn.Module):
    def __init__(
        self, input_dims: int, output_dims: int, num_heads: int, group_size: int, bits: int, mode
    ):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        w = mx.zeros((num_heads, output_dims, input_dims))
        self.weight, self.scales, *biases = mx.quantize(w, group_size, bits, mode=mode)
        self.biases = biases[0] if biases else None
        self.freeze()

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        return mx.quantized_matmul(
            x,
            self["weight"],
            scales=self["scales"],
            biases=self.get("biases"),
            transpose=transpose,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.nope = args.qk_nope_head_dim
        self.rope_dim = args.qk_rope_head_dim
        self.q_head_dim = self.nope + self.rope_dim
        self.scale = yarn_attention_scale(self.q_head_dim, args.rope_scaling)
        bias = args.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(dim, self.n_heads * self.q_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(dim, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = nn.RMSNorm(self.q_lora_rank, eps=1e-6)  # fixed in the reference
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.n_heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = nn.RMSNorm(self.kv_lora_rank, eps=1e-6)
        self.embed_q = MultiLinear(self.nope, self.kv_lora_rank, self.n_heads)
        self.unembed_out = MultiLinear(self.kv_lora_rank, args.v_head_dim, self.n_heads)
        self.o_proj = nn.Linear(self.n_heads * args.v_head_dim, dim, bias=bias)
        self.rope = initialize_rope(
            self.rope_dim,
            args.rope_theta,
            args.rope_interleave,  # interleaved pairs (x0, x1), (x2, x3), ...
            args.rope_scaling,
            kinds=("default", "linear", "yarn", "deepseek_yarn"),
        )

    def __call__(self, x: mx.array, mask: mx.array | None, cache: KVCache | None) -> mx.array:
        B, L, _ = x.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(B, L, self.n_heads, self.q_head_dim).transpose(0, 2, 1, 3)
        q_nope, q_pe = mx.split(q, [self.nope], axis=-1)
        latent, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
        k_pe = k_pe.reshape(B, L, 1, self.rope_dim).transpose(0, 2, 1, 3)
        latent = mx.expand_dims(self.kv_a_layernorm(latent), axis=1)  # [B, 1, L, rank]

        offset = cache.offset if cache is not None else 0
        q_pe = self.rope(q_pe, offset)
        k_pe = self.rope(k_pe, offset)
        if cache is not None:
            latent, k_pe = cache.update_and_fetch(latent, k_pe)

        # The rotary part of the scores goes in as the additive mask of the no-rope part.
        pe_scores = (q_pe * self.scale) @ k_pe.swapaxes(-1, -2)
        if mask is not None:
            pe_scores = mx.where(
                mask, pe_scores, mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype)
            )
        if L == 1:  # absorbed: attend over the latent itself (one shared "head")
            q_nope = self.embed_q(q_nope)
            k = v = latent
        else:
            k = self.embed_q(latent, transpose=False)
            v = self.unembed_out(latent)
        o = mx.fast.scaled_dot_product_attention(q_nope, k, v, scale=self.scale, mask=pe_scores)
        if L == 1:
            o = self.unembed_out(o)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


# ---- blocks ----------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class MoE(nn.Module):
    def __init__(self, args, layer: int):
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
    return (
        args.n_routed_experts > 0
        and i >= args.first_k_dense_replace
        and i % args.moe_layer_freq == 0
    )


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


class DeepseekV3Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        h = self.embed_tokens(inputs)
        cache = cache or [None] * len(self.layers)
        L = h.shape[1]
        # An explicit mask (the rotary scores are masked with it); none for one token.
        c = cache[0]
        if L == 1:
            mask = None
        elif isinstance(c, RotatingKVCache):  # each query sees the last max_size positions
            mask = causal_mask(L, min(c.max_size - 1, c.offset), window=c.max_size)
        else:
            mask = causal_mask(L, c.offset if c is not None else 0)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = DeepseekV3Model(args)
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

    # The latent cache feeds the absorbed attention's own matmuls, not attention()'s.
    quantized_kv = False

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Hugging Face dense names -> ours: drop the multi-token-prediction layers (numbered
        from num_hidden_layers on) and precomputed rotary frequencies, split each `kv_b_proj`
        [heads * (nope + v), rank] into embed_q [heads, rank, nope] and unembed_out
        [heads, v, rank] (an mlx-lm checkpoint's quantized one is dequantized, split and
        quantized again at its own bits, as mlx-lm does)."""
        a = self.args
        weights = {
            k: v
            for k, v in weights.items()
            if not _beyond_layers(k, a.num_hidden_layers) and "rotary_emb.inv_freq" not in k
        }
        if a.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        for layer in range(a.num_hidden_layers):
            prefix = f"model.layers.{layer}.self_attn"
            w = weights.pop(f"{prefix}.kv_b_proj.weight", None)
            if w is None:
                continue
            quant = None
            if f"{prefix}.kv_b_proj.scales" in weights:
                scales = weights.pop(f"{prefix}.kv_b_proj.scales")
                biases = weights.pop(f"{prefix}.kv_b_proj.biases")
                bits = w.shape[-1] * 32 // a.kv_lora_rank
                group_size = a.kv_lora_rank // scales.shape[-1]
                quant = (group_size, bits)
                w = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
            w = w.reshape(a.num_attention_heads, a.qk_nope_head_dim + a.v_head_dim, -1)
            parts = {
                "embed_q": mx.contiguous(w[:, : a.qk_nope_head_dim, :].swapaxes(-1, -2)),
                "unembed_out": mx.contiguous(w[:, a.qk_nope_head_dim :, :]),
            }
            for name, p in parts.items():
                if quant is None:
                    weights[f"{prefix}.{name}.weight"] = p
                    continue
                qw, qs, qb = mx.quantize(p, group_size=quant[0], bits=quant[1])
                weights[f"{prefix}.{name}.weight"] = qw
                weights[f"{prefix}.{name}.scales"] = qs
                weights[f"{prefix}.{name}.biases"] = qb
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
