"""StrataModel: a family's modules, the expert cache behind their seams, the decoder, the
runtime config and the store path, put together once, in the constructor.

Owns wiring each MoE layer's seam to the cache, registering the routers for lookahead and
choosing the decode strategy. Called and inspected like the family's model (mlx-lm's shape:
`model(x, cache=...)`, `make_cache()`, `layers`, `args`, parameters...), and a context manager
that closes the cache. Never loads weights or reads expert records (load() and the cache do),
and never sets attributes on the family's modules: they are built whole before it sees them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from ..models.switch import SwitchGLU
from .decode import WHOLE_TOKEN, Decoder, PipelinedDecoder, SyncDecoder
from .experts import ExpertCache

if TYPE_CHECKING:  # loader.py builds the model object: a runtime import would be circular
    from .distributed import Pipeline
    from .loader import RuntimeConfig


def decode_defaults(config: RuntimeConfig, cache: ExpertCache) -> RuntimeConfig:
    """`config` with the decode options left to their defaults (None) set for `cache`, each on
    its own: the routing board as its gate table has it (on where decode gates on the device,
    unless asked off); with it, layers submitted 4 at a time and checked 4 behind (the ungated
    tokens of such a decoder too), else 1 and 1; the quick misses' reserve as loaded (0: none;
    with them a gated token goes its own way: `gated_steps`)."""
    gate = cache.sched.residency.gate
    board = gate is not None and gate.board_on and cache.pipelined.device_gate
    quick = cache.sched.quick
    n = 4 if board else 1
    lag, chunk = config.decode_lag, config.decode_layers_chunk
    return config.replace(
        decode_gate_board=board,
        decode_lag=n if lag is None else lag,
        decode_layers_chunk=n if chunk is None else chunk,
        decode_quick_misses=quick.size if quick else 0,
    )


def gated_steps(asked: RuntimeConfig, cache: ExpertCache) -> tuple[int, int] | None:
    """(lag, chunk) of a gated token with quick misses, where a miss's read no longer waits
    for its layer's check: checked at its end and submitted 8 layers at a time, each unless
    asked for (`decode_lag`, `decode_layers_chunk` as given); None (the decoder's own, as its
    other tokens') without quick misses."""
    if cache.sched.quick is None:
        return None
    lag, chunk = asked.decode_lag, asked.decode_layers_chunk
    return (WHOLE_TOKEN if lag is None else lag, 8 if chunk is None else chunk)


def _wider(block, k: int):
    """`block`'s lookahead router with one token's `k` best ids, best first (lookahead_extra;
    Predictor.rank keeps that order); several tokens' (prefill's) top k as ever."""

    def route(x: mx.array) -> mx.array:
        if x.size != x.shape[-1]:
            return block.route_ids(x)
        # (the router's order: its softmax keeps the logits' order)
        return mx.argsort(-block.gate(x), axis=-1)[..., :k]

    return route


class StrataModel:
    """One loaded store. `blocks`: the MoE blocks this process computes (a pipeline stage
    owns some of the family's; default, every one); `pipeline` (runtime/distributed.py) this
    process's place in a pipeline, or None. The decoder is pipelined when `config`
    asks for it, else the per-layer handshake; a dump hook on the cache always gets the
    handshake, which hands every layer's tensors over as they are final."""

    def __init__(
        self,
        module: nn.Module,
        expert_cache: ExpertCache,
        config: RuntimeConfig,
        store_path: str | Path,
        blocks: dict[int, nn.Module] | None = None,
        pipeline: Pipeline | None = None,
    ):
        self.module = module
        self.expert_cache = expert_cache
        asked = config
        self.runtime = config = decode_defaults(config, expert_cache)
        self.store_path = Path(store_path)
        self.pipeline = pipeline
        self.blocks = dict(module.moe_blocks() if blocks is None else blocks)
        ahead, n = config.read_ahead, expert_cache.manifest.num_experts
        for layer, block in self.blocks.items():
            block.switch_mlp.attach(expert_cache)
            # A family's `route_ids` gives the ids without building the scores' graph.
            ids = getattr(block, "route_ids", None)
            if ahead.extra and ids is not None:
                ids = _wider(block, ahead.decode_width(block.top_k, n))
            expert_cache.register_router(layer, ids or (lambda x, b=block: b.route(x)[0]))
        for _, m in module.named_modules():
            if isinstance(m, SwitchGLU) and m.expert_cache is None:
                raise RuntimeError(f"layer {m.layer}: MoE block not listed by moe_blocks()")
        self.sync_decoder = SyncDecoder(self, expert_cache)
        # Public, so that a benchmark may run another strategy on the same loaded model.
        self.decoder: Decoder = self.sync_decoder
        if config.decode == "pipelined":
            self.decoder = PipelinedDecoder(
                self,
                config.decode_lag,
                config.decode_sync_above,
                config.decode_token_below,
                config.decode_chunk,
                config.decode_layers_chunk,
                token_while_predicting=config.decode_token_while_predicting,
                gate_give_ups=config.decode_gate_give_ups,
                gated=gated_steps(asked, expert_cache),
            )

    # ---- the family model's surface ----------------------------------------------------------

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        return self.module(inputs, cache=cache)

    def make_cache(self) -> list:
        return self.module.make_cache()

    @property
    def layers(self) -> list:
        return self.module.layers

    @property
    def args(self):
        return self.module.args

    def moe_blocks(self) -> dict[int, nn.Module]:
        """The MoE blocks this process computes, by layer."""
        return dict(self.blocks)

    def __getattr__(self, name: str):
        # Everything else a family model offers (model.model, lm_head, parameters(),
        # named_modules(), sanitize...) is the family module's own.
        if name == "module":  # not set yet: a failed constructor, or unpickling
            raise AttributeError(name)
        return getattr(self.module, name)

    # ---- the runtime -------------------------------------------------------------------------

    def decoding(self) -> Decoder:
        """The decoder for the next generation: the handshake while a dump hook is set."""
        return self.sync_decoder if self.expert_cache.dump is not None else self.decoder

    def close(self) -> None:
        """Stop the expert cache's reads and threads. Idempotent."""
        self.expert_cache.close()

    def __enter__(self) -> StrataModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
