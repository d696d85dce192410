"""GGUF files (llama.cpp) -> a store, read with gguf-py's GGUFReader.

MoE GGUFs keep each expert's ggml blocks as they are, with each layer's own types (a Q4_K_M
file's down projection is Q6_K in some layers and Q4_K in others): the store then has
per-layer record layouts, padded to one record size. Architectures, as llama.cpp's
convert_hf_to_gguf.py writes them (tests/convert/test_gguf_moe.py runs it): "qwen3moe",
"qwen3next" (its changes to the delta-net tensors undone: qwen3next.py), "olmoe", "glm4moe",
"deepseek2", "gpt-oss" (MXFP4 experts, biases, sinks: gpt_oss.py), and "llama" with
blk.N.ffn_*_exps tensors, which is Mixtral: a llama GGUF is called dense only when it has no
expert tensors and no expert_count; a dense one is split into experts (llama.py).

Each architecture's header is read in one place, before any tensor data: `gguf_config` gives
the store's config, its MoE layers, each layer's record formats and layout, and which tensors
become experts and which dense weights (each ARCHITECTURES entry's `header`); its `write`
takes it from there, and `strata-mlx plan FILE.gguf` forecasts from the same reading.

The package, by concern: reading (the file), config (what the header says the store will
be), blocks (ggml blocks and record formats), writing (the store), tokenizer, and one module
per family group (softmax, qwen3next, sigmoid, gpt_oss, llama).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...format.store import StoreError
from ...progress import ticking
from ..common import check_output
from .config import GgufConfig, has_experts, moe_config
from .finite import check_finite_tensors
from .gpt_oss import convert_gpt_oss, gpt_oss_config
from .llama import convert_llama, llama_split_config
from .qwen3next import convert_qwen3next, qwen3next_config
from .reading import Gguf
from .sigmoid import convert_deepseek2, convert_glm4moe, deepseek2_config, glm4moe_config
from .softmax import (
    convert_mixtral,
    convert_qk_norm_moe,
    mixtral_config,
    olmoe_config,
    qwen3moe_config,
)


@dataclass(frozen=True)
class Architecture:
    """How one GGUF architecture with experts becomes a store: `header` reads its config, MoE
    layers and the tensors it uses from the header alone (config.moe_config makes the
    GgufConfig of them); `write` writes the store. `name` is how errors list it."""

    name: str
    header: Callable[[Gguf], tuple[dict[str, Any], list[int], set[str]]]
    write: Callable[..., Path]


# general.architecture -> its reading and writer. "llama" is here only with expert tensors
# (Mixtral); a dense llama GGUF is split into experts instead (llama.py, --split-experts).
ARCHITECTURES = {
    "qwen3moe": Architecture("qwen3moe", qwen3moe_config, convert_qk_norm_moe),
    "qwen3next": Architecture("qwen3next", qwen3next_config, convert_qwen3next),
    "olmoe": Architecture("olmoe", olmoe_config, convert_qk_norm_moe),
    "glm4moe": Architecture("glm4moe", glm4moe_config, convert_glm4moe),
    "deepseek2": Architecture(
        "deepseek2 (sigmoid routing: DeepSeek-V3, Kimi K2)", deepseek2_config, convert_deepseek2
    ),
    "gpt-oss": Architecture("gpt-oss", gpt_oss_config, convert_gpt_oss),
    "llama": Architecture("llama with ffn_*_exps (Mixtral)", mixtral_config, convert_mixtral),
}


def convert_gguf(
    gguf_path: str | Path,
    mlx_path: str | Path,
    split_experts: int | None = None,
    calibration_tokens: int = 256,
    progress: bool = True,
    overwrite: bool | None = None,
    allow_non_finite: bool = False,
) -> Path:
    """Convert a GGUF file into a store at mlx_path; returns the store's path. An existing
    store there is replaced only with `overwrite` (common.check_output). A tensor it reads
    holding NaN or inf (a float value or a block's scale) is refused before anything is
    written, unless `allow_non_finite` (--allow-non-finite)."""
    src = Path(gguf_path)
    out = check_output(mlx_path, src, overwrite=overwrite)
    with ticking(f"reading {src.name}", progress):
        g = Gguf(src)
    c = gguf_config(g, split_experts)
    if not allow_non_finite:
        with ticking(f"checking {src.name} for NaN and inf", progress):
            check_finite_tensors(g, c.expert_tensors | c.dense_tensors)
    if c.split_experts is not None:
        return convert_llama(g, c, out, calibration_tokens, progress)
    return ARCHITECTURES[g.arch].write(g, c, out, calibration_tokens, progress)


def gguf_config(g: Gguf, split_experts: int | None = None) -> GgufConfig:
    """The store `convert_gguf(g, split_experts=...)` writes, as far as the header says:
    every check the converter makes before reading tensor data, and its errors."""
    arch = ARCHITECTURES.get(g.arch)
    if arch is not None and (g.arch != "llama" or has_experts(g)):
        if split_experts is not None:
            raise StoreError(
                f"{g.path}: --split-experts is for dense models; this {g.arch} GGUF has experts"
            )
        cfg, moe_layers, read = arch.header(g)
        return moe_config(g, cfg, moe_layers, read)
    if g.arch == "llama":
        if split_experts is None:
            raise StoreError(
                f"{g.path}: a dense llama GGUF (no ffn_*_exps tensors) needs --split-experts E "
                "(e.g. 16): each MLP becomes E experts"
            )
        return llama_split_config(g, int(split_experts))
    known = ", ".join(a.name for a in ARCHITECTURES.values())
    raise StoreError(
        f"{g.path}: GGUF architecture {g.arch!r} is not supported (MoE: {known}; dense llama "
        "with --split-experts)"
    )


__all__ = ["ARCHITECTURES", "Architecture", "Gguf", "GgufConfig", "convert_gguf", "gguf_config"]
