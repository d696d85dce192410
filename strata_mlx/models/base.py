"""Pieces every model family shares: config args, caches, masks, activations.

Families live one per file beside this one (mlx-lm's shape). A family's MoE block routes,
then hands its experts to `strata_mlx.experts.SwitchGLU`; it never holds expert weights.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn


@dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, params: dict[str, Any]):
        return cls(**{k: v for k, v in params.items() if k in inspect.signature(cls).parameters})


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
