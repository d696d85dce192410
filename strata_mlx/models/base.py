"""Pieces every model family shares: config args, caches, masks, activations.

Families live one per file beside this one (mlx-lm's shape). A family's MoE block routes,
then hands its experts to `strata_mlx.experts.SwitchGLU`; it never holds expert weights.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# Config values are checked for type and range before a model is built from them: a string
# `hidden_size` or a `decoder_sparse_step` of 0 otherwise fails deep inside MLX (or divides by
# zero), and a size of 2^40 would be allocated.
MAX_DIM = (1 << 31) - 1
POSITIVE = {
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "linear_num_value_heads",
    "linear_num_key_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "decoder_sparse_step",
    "full_attention_interval",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "partial_rotary_factor",
    "clip_qkv",
}
# Upper bounds below MAX_DIM: a model is built layer by layer in Python before its weights are
# checked, so a num_hidden_layers of 2^31 - 1 would exhaust memory building modules.
AT_MOST = {"partial_rotary_factor": 1, "num_hidden_layers": 1 << 12}
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, params: dict[str, Any], source: str = "config", prefix: str = ""):
        """Build from a config dict, checking each field the dataclass declares for type and
        range first: a StoreError `{source}: {prefix}{field}: ...` on the first bad one."""
        from ..store import StoreError

        def fail(name: str, msg: str):
            raise StoreError(f"{source}: {prefix}{name}: {msg}")

        hints = typing.get_type_hints(cls)
        kw = {}
        for f in dataclasses.fields(cls):
            if f.name not in params:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    fail(f.name, "missing")
                continue
            v = params[f.name]
            if not _conforms(v, hints[f.name]):
                fail(f.name, f"expected {_type_name(hints[f.name])}, got {_short(v)}")
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                hi = AT_MOST.get(f.name, MAX_DIM)
                if f.name in POSITIVE and not v > 0:
                    fail(f.name, f"{v} must be > 0")
                if not 0 <= v <= hi:
                    fail(f.name, f"{v} outside [0, {hi}]")
            kw[f.name] = v
        _check_together(kw, fail)
        try:
            return cls(**kw)
        except (ValueError, ZeroDivisionError) as e:  # a family's own __post_init__ checks
            raise StoreError(f"{source}: {prefix[:-1] or 'config'}: {e}") from None


def _conforms(v: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(v, a) for a in typing.get_args(tp))
    if tp is type(None):
        return v is None
    if tp is bool:
        return isinstance(v, bool)
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if tp is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if tp is str:
        return isinstance(v, str)
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(v, list) and all(_conforms(x, item) for x in v)
    if origin is dict:
        return isinstance(v, dict) and all(isinstance(k, str) for k in v)
    return isinstance(v, tp)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _short(v: Any) -> str:
    r = repr(v)
    return f"{type(v).__name__} {r if len(r) <= 40 else r[:37] + '...'}"


def _check_together(kw: dict[str, Any], fail) -> None:
    """Fields that only make sense together (head counts, top-k, layer lists, rope scaling)."""
    heads, kv = kw.get("num_attention_heads"), kw.get("num_key_value_heads")
    if heads and kv and heads % kv:
        fail("num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}")
    head_dim = kw.get("head_dim") or 0
    if heads and (heads + (kv or 0)) * head_dim > MAX_DIM:  # MLX indexes widths as int32
        fail("head_dim", f"{head_dim} x {heads} heads is wider than {MAX_DIM}")
    if heads and kw.get("head_dim") is None and kw.get("hidden_size", 0) % heads:
        fail("hidden_size", f"{kw['hidden_size']} is not a multiple of num_attention_heads {heads}")
    n = kw.get("num_experts", kw.get("num_local_experts"))
    k = kw.get("num_experts_per_tok")
    if n is not None and k is not None and k > n:
        fail("num_experts_per_tok", f"{k} is more than num_experts {n}")
    layers = kw.get("num_hidden_layers", 0)
    for i in kw.get("mlp_only_layers") or []:
        if not 0 <= i < layers:
            fail("mlp_only_layers", f"layer {i} outside [0, {layers})")
    types_ = kw.get("layer_types")
    if types_ is not None:
        if len(types_) < layers:
            fail("layer_types", f"{len(types_)} entries for {layers} layers")
        bad = [t for t in types_ if t not in LAYER_TYPES]
        if bad:
            fail("layer_types", f"{bad[0]!r} is not one of {', '.join(LAYER_TYPES)}")
    for v in kw.get("rope_freq_factors") or []:
        if not v > 0:
            fail("rope_freq_factors", f"{v} must be > 0")
    scaling = kw.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind is not None and not isinstance(kind, str):
            fail("rope_scaling.rope_type", f"expected a string, got {_short(kind)}")
        for key in (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ):
            v = scaling.get(key)
            if key in scaling and not (_conforms(v, float) and v > 0):
                fail(f"rope_scaling.{key}", f"expected a number > 0, got {_short(v)}")
        if kind in ("linear", "llama3") and "factor" not in scaling:
            fail("rope_scaling.factor", "missing")
        if scaling.get("low_freq_factor", 1.0) == scaling.get("high_freq_factor", 4.0):
            fail("rope_scaling.high_freq_factor", "equals low_freq_factor")


def normalize_config(config: dict[str, Any]) -> dict[str, Any]:
    """Accept transformers 4 and 5 spellings: rope_parameters/rope_theta, num_local_experts."""
    c = dict(config)
    rp = c.get("rope_parameters")
    if isinstance(rp, dict):
        if "rope_theta" in rp and "rope_theta" not in c:
            c["rope_theta"] = rp["rope_theta"]
        if "partial_rotary_factor" in rp and "partial_rotary_factor" not in c:
            c["partial_rotary_factor"] = rp["partial_rotary_factor"]
        if rp.get("rope_type", "default") not in ("default", None) and not c.get("rope_scaling"):
            c["rope_scaling"] = rp
    if "num_local_experts" in c and "num_experts" not in c:
        c["num_experts"] = c["num_local_experts"]
    if "num_experts" in c and "num_local_experts" not in c:
        c["num_local_experts"] = c["num_experts"]
    return c


class KVCache:
    """Keys and values grown in steps of 256 positions (as mlx-lm's KVCache)."""

    step = 256

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        prev = self.offset
        if self.keys is None or prev + keys.shape[2] > self.keys.shape[2]:
            B, H, _, Dk = keys.shape
            n = (self.step + keys.shape[2] - 1) // self.step * self.step
            new_k = mx.zeros((B, H, n, Dk), keys.dtype)
            new_v = mx.zeros((B, H, n, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
        self.offset += keys.shape[2]
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @property
    def state(self):
        if self.keys is None:
            return []
        return [self.keys, self.values]


class ArraysCache:
    """Fixed slots of recurrent state (conv window, SSM / gated-delta state)."""

    def __init__(self, size: int):
        self.cache = [None] * size
        self.offset = 0

    def __getitem__(self, i):
        return self.cache[i]

    def __setitem__(self, i, v):
        self.cache[i] = v

    @property
    def state(self):
        return [c for c in self.cache if c is not None]


def create_attention_mask(h: mx.array, cache: KVCache | None = None):
    """ "causal" for a multi-token step (the fused kernel's own mask), None for one token."""
    return "causal" if h.shape[1] > 1 else None


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    return nn.silu(gate) * x


def top_k_route(gates: mx.array, k: int, norm_topk_prob: bool, softmax_first: bool = True):
    """Softmax router: (ids [..., k], scores [..., k]) as mlx-lm's Qwen/OLMoE/Mixtral blocks."""
    if softmax_first:
        probs = mx.softmax(gates, axis=-1, precise=True)
        inds = mx.stop_gradient(mx.argpartition(probs, kth=-k, axis=-1)[..., -k:])
        scores = mx.take_along_axis(probs, inds, axis=-1)
        if norm_topk_prob:
            scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        return inds, scores
    inds = mx.stop_gradient(mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k])
    scores = mx.softmax(mx.take_along_axis(gates, inds, axis=-1), axis=-1, precise=True)
    return inds, scores
