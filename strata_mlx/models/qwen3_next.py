"""Qwen3-Next: a hybrid of gated delta-net (linear attention) layers and gated full attention
layers with partial rotary, softmax top-k routing, routed SwiGLU experts plus a dense shared
expert behind a sigmoid gate.

Only the routed experts go through the seam; the shared expert is a dense module whose weights
live with the rest of the dense weights. Linear-attention layers keep their causal-conv window
and recurrent state in an ArraysCache (slots 0 and 1), full-attention layers a KVCache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .base import (
    ArraysCache,
    BaseModelArgs,
    KVCache,
    attention,
    create_attention_mask,
    swiglu,
    top_k_route,
)
from .rope import initialize_rope
from .switch import SwitchGLU

# Where the checkpoint keeps layer l's experts, and each projection's name there.
EXPERT_PREFIX = "model.layers.{layer}.mlp.experts"
EXPERT_NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}

# Dense norms that Hugging Face applies as x * (1 + w); sanitize() folds the 1 into w.
OFFSET_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    linear_num_value_heads: int
    linear_num_key_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    rope_scaling: dict[str, Any] | None = None
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    full_attention_interval: int = 4
    layer_types: list[str] | None = None
    norm_topk_prob: bool = False
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )

    def is_linear(self, i: int) -> bool:
        if self.layer_types:
            return self.layer_types[i] == "linear_attention"
        return (i + 1) % self.full_attention_interval != 0


@partial(mx.compile, shapeless=True)
def _gated_silu(h: mx.array, gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x in float32, back in h's dtype."""
    return (nn.silu(gate.astype(mx.float32)) * x.astype(mx.float32)).astype(h.dtype)


@partial(mx.compile, shapeless=True)
def _decay(A_log: mx.array, a: mx.array, dt_bias: mx.array) -> mx.array:
    """Per-head decay in linear space: exp(-exp(A_log) * softplus(a + dt_bias))."""
    return mx.exp(-mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias))


class GatedRMSNorm(nn.Module):
    """RMSNorm (plain weight, no 1 + w) followed by a SiLU gate."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones(dims)

    def __call__(self, h: mx.array, gate: mx.array) -> mx.array:
        return _gated_silu(h, gate, mx.fast.rms_norm(h, self.weight, self.eps))


class GatedDeltaNet(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_k = args.linear_num_key_heads
        self.n_v = args.linear_num_value_heads
        self.d_k = args.linear_key_head_dim
        self.d_v = args.linear_value_head_dim
        self.key_dim = self.n_k * self.d_k
        self.value_dim = self.n_v * self.d_v
        self.kernel = args.linear_conv_kernel_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel_size=self.kernel,
            groups=self.conv_dim,
            padding=0,
            bias=False,
        )
        dim = args.hidden_size
        self.in_proj_qkvz = nn.Linear(dim, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(dim, 2 * self.n_v, bias=False)
        self.dt_bias = mx.ones(self.n_v)
        self.A_log = mx.zeros(self.n_v)
        self.norm = GatedRMSNorm(self.d_v, eps=args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, dim, bias=False)

    def _unpack(self, qkvz: mx.array, ba: mx.array):
        """The projections are grouped per key head: [q | k | v-group | z-group] and
        [b-group | a-group]; return q, k [B, S, Hk, Dk], v, z [B, S, Hv, Dv], b, a [B, S, Hv]."""
        B, S, _ = qkvz.shape
        r = self.n_v // self.n_k
        qkvz = qkvz.reshape(B, S, self.n_k, -1)
        ba = ba.reshape(B, S, self.n_k, -1)
        dk, gv = self.d_k, r * self.d_v
        q, k, v, z = mx.split(qkvz, [dk, 2 * dk, 2 * dk + gv], axis=-1)
        b, a = mx.split(ba, [r], axis=-1)
        return (
            q,
            k,
            v.reshape(B, S, self.n_v, self.d_v),
            z.reshape(B, S, self.n_v, self.d_v),
            b.reshape(B, S, self.n_v),
            a.reshape(B, S, self.n_v),
        )

    def __call__(self, x: mx.array, cache: ArraysCache | None) -> mx.array:
        B, S, _ = x.shape
        q, k, v, z, b, a = self._unpack(self.in_proj_qkvz(x), self.in_proj_ba(x))

        # Causal depthwise conv over [previous window | this step], then SiLU.
        window = cache[0] if cache is not None else None
        if window is None:
            window = mx.zeros((B, self.kernel - 1, self.conv_dim), dtype=x.dtype)
        mixed = mx.concatenate(
            [q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1
        )
        conv_in = mx.concatenate([window, mixed], axis=1)
        if cache is not None:
            cache[0] = mx.contiguous(conv_in[:, -(self.kernel - 1) :, :])
        conv_out = nn.silu(self.conv1d(conv_in))
        q, k, v = mx.split(conv_out, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = q.reshape(B, S, self.n_k, self.d_k)
        k = k.reshape(B, S, self.n_k, self.d_k)
        v = v.reshape(B, S, self.n_v, self.d_v)

        # L2-normalize q and k (eps 1e-6 on the sum of squares, as the reference), with the
        # d_k ** -0.5 read-out scale folded into q. rms_norm's eps sits on the mean of squares.
        inv = self.d_k**-0.5
        eps = 1e-6 * inv * inv
        q = (inv * inv) * mx.fast.rms_norm(q, None, eps)
        k = inv * mx.fast.rms_norm(k, None, eps)

        state = cache[1] if cache is not None else None
        if state is None:
            state = mx.zeros((B, self.n_v, self.d_v, self.d_k), dtype=mx.float32)
        gamma = _decay(self.A_log, a, self.dt_bias)
        beta = mx.sigmoid(b)
        out, state = mx.fast.gated_delta_update(q, k, v, gamma, beta, state)
        if cache is not None:
            cache[1] = state
            cache.offset += S

        out = self.norm(out, z)
        return self.out_proj(out.reshape(B, S, -1))


class Attention(nn.Module):
    """Full attention whose q projection also yields a per-channel output gate."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        head_dim = args.head_dim
        self.scale = head_dim**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, 2 * self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        # Partial rotary: only the first dims of each head rotate, the rest pass through.
        self.rope = initialize_rope(
            int(head_dim * args.partial_rotary_factor),
            args.rope_theta,
            False,
            args.rope_scaling,
            kinds=("default", "linear"),
        )

    def __call__(self, x: mx.array, mask, cache: KVCache | None) -> mx.array:
        B, L, _ = x.shape
        q, gate = mx.split(self.q_proj(x).reshape(B, L, self.n_heads, -1), 2, axis=-1)
        gate = gate.reshape(B, L, -1)
        q = self.q_norm(q).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        o = attention(q, k, v, cache, self.scale, mask)
        o = o.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(o * mx.sigmoid(gate))


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
        dim = args.hidden_size
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(layer)
        self.shared_expert = MLP(dim, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False)

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
        y = self.switch_mlp(x, inds, scores)  # the routed part alone
        shared = mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y + shared


def is_moe_layer(args: ModelArgs, i: int) -> bool:
    return (
        i not in args.mlp_only_layers
        and args.num_experts > 0
        and (i + 1) % args.decoder_sparse_step == 0
    )


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.is_linear = args.is_linear(layer)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.self_attn = Attention(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if is_moe_layer(args, layer):
            self.mlp = SparseMoeBlock(args, layer)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size)

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        if self.is_linear:
            r = self.linear_attn(self.input_layernorm(x), cache)
        else:
            r = self.self_attn(self.input_layernorm(x), mask, cache)
        h = x + r
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3NextModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        h = self.embed_tokens(inputs)
        cache = cache or [None] * len(self.layers)
        mask = create_attention_mask(h)  # full-attention layers; delta-net layers need none
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Qwen3NextModel(args)
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
        return [ArraysCache(2) if l.is_linear else KVCache() for l in self.model.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Hugging Face dense names -> ours: drop the multi-token-prediction head, move the
        conv kernel axis last-but-one ([C, 1, K] -> [C, K, 1]) and fold the 1 of the
        (1 + w) norms into w."""
        weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        for k, v in weights.items():
            if k.endswith("conv1d.weight") and v.ndim == 3 and v.shape[-1] != 1:
                weights[k] = v.moveaxis(2, 1)
            elif k.endswith(OFFSET_NORMS) and v.ndim == 1:
                weights[k] = v + 1.0
        return weights

    def sanitize_mlx_lm(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """An mlx-lm checkpoint's dense weights (convert's hook): mlx-lm moved the conv
        kernels and added the norms' 1 when it converted, and its own sanitize leaves a
        checkpoint of stacked experts as it is; `sanitize` would add the 1 a second time."""
        return weights

    @property
    def quant_predicate(self):
        def predicate(path, _):
            if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
                return {"group_size": 64, "bits": 8}
            return True

        return predicate

    @property
    def layers(self):
        return self.model.layers
