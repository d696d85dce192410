"""Prediction: which experts the next layer will want, before its routing is known.

Three read-ahead policies, selectable because every claim about them is a side-by-side
measurement:

- "demand": no read-ahead; every non-resident expert is an urgent miss.
- "static": the seed's baseline. After layer l's wait returns, the next layer's most popular
  experts from the routing profile, capped (default 256).
- "lookahead": right after layer l's routing, layer l+1's router (exact top-k) applied to
  layer l's MoE input for every token; predicted experts ordered most-tokens-first and all
  submitted (no cap) before layer l waits on its misses. Layer 0 comes from the profile rank.

This module only ranks expert ids; it never reads files or touches the arena.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

READ_AHEAD_POLICIES = ("demand", "static", "lookahead")


@dataclass
class ReadAhead:
    policy: str = "lookahead"
    static_cap: int = 256
    min_tokens: int = 1  # lookahead: a predicted expert needs at least this many tokens
    # Decode predicts only while the recent decode miss rate exceeds this: with a warm arena
    # (measured on the H200: ~1 % decode misses) the prediction's router work and its extra
    # kernels on each layer's critical path cost more than the reads it could hide
    # (lookahead decode 14.4 tok/s against demand 19.2). 0 predicts always.
    decode_min_miss: float = 0.02
    # lookahead: layers predicted from each layer's input (l+1 .. l+depth, each through its
    # own router), read in that order
    depth: int = 1

    def __post_init__(self):
        if self.policy not in READ_AHEAD_POLICIES:
            raise ValueError(
                f"unknown read-ahead policy {self.policy!r}; one of {READ_AHEAD_POLICIES}"
            )

    @property
    def predicts(self) -> bool:
        return self.policy == "lookahead"


def rank_by_tokens(ids: np.ndarray, min_tokens: int = 1) -> list[int]:
    """Distinct experts in `ids` ([T, k] top-k ids), most tokens first, ties by id."""
    experts, counts = np.unique(np.asarray(ids).reshape(-1), return_counts=True)
    keep = counts >= min_tokens
    experts, counts = experts[keep], counts[keep]
    order = np.lexsort((experts, -counts))
    return experts[order].tolist()


def profile_rank(counts: np.ndarray | None, num_experts: int) -> list[int]:
    """Experts of one layer, most popular in the calibration profile first."""
    if counts is None:
        return list(range(num_experts))
    counts = np.asarray(counts)
    return np.lexsort((np.arange(num_experts), -counts)).tolist()
