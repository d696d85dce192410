"""Tiny models built with transformers' own classes (random weights, CPU torch), saved once
per session and converted by our converter: the oracles for every exactness test. And the
wait for a `strata_mlx serve` a test starts as a user does."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# Test modules share helpers and fixtures by module name (`from test_server import running`)
# across the layer folders: each folder goes on sys.path once, as pytest puts there the folder
# of a module it collects, so a module imported by name is the one pytest collected.
LAYER_FOLDERS = ("format", "stream", "models", "runtime", "generation", "convert", "apps")
for _folder in LAYER_FOLDERS:
    if str(Path(__file__).parent / _folder) not in sys.path:
        sys.path.append(str(Path(__file__).parent / _folder))

# Tests run on MLX's CPU backend unless a test asks for the GPU.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def _hf_model(family: str):
    import torch
    import transformers as T

    torch.manual_seed(0)
    if family == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(
            **TINY,
            intermediate_size=64,
            moe_intermediate_size=16,
            head_dim=8,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        )
        return T.Qwen3MoeForCausalLM(cfg)
    if family == "mixtral":
        cfg = T.MixtralConfig(
            **TINY, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2
        )
        return T.MixtralForCausalLM(cfg)
    if family == "olmoe":
        cfg = T.OlmoeConfig(**TINY, intermediate_size=16, num_experts=8, num_experts_per_tok=2)
        return T.OlmoeForCausalLM(cfg)
    if family == "qwen3_next":
        cfg = T.Qwen3NextConfig(
            **{**TINY, "num_hidden_layers": 4},
            intermediate_size=64,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            head_dim=8,
            num_experts=8,
            num_experts_per_tok=2,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            full_attention_interval=2,
            norm_topk_prob=True,
        )
        return T.Qwen3NextForCausalLM(cfg)
    if family == "glm4_moe":
        # Layer 0 dense; 8 experts in 2 groups, only the better group eligible (topk_group 1).
        cfg = T.Glm4MoeConfig(
            **{**TINY, "num_hidden_layers": 3},
            intermediate_size=64,
            moe_intermediate_size=16,
            head_dim=8,
            partial_rotary_factor=0.5,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
            use_qk_norm=True,
            attention_bias=True,
        )
        return T.Glm4MoeForCausalLM(cfg)
    if family == "deepseek_v3":
        # Layer 0 dense; 8 experts in 4 groups, 2 groups eligible; q through its low-rank
        # path; YaRN rotary (the scaled context, its mscale on the rotated dims and on the
        # attention scale).
        cfg = T.DeepseekV3Config(
            **{**TINY, "num_hidden_layers": 3, "num_key_value_heads": 4},
            intermediate_size=64,
            moe_intermediate_size=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=2,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=12,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
            },
        )
        return T.DeepseekV3ForCausalLM(cfg)
    if family == "gpt_oss":
        # Sliding, full, sliding layers with a window of 5 (the prompts are longer); the
        # default YaRN rotary (truncate false); swiglu_limit 0.05, about the size of the tiny
        # model's projections, so that the clamps bite (_randomize_norms scales the biases).
        cfg = T.GptOssConfig(
            **{**TINY, "num_hidden_layers": 3},
            intermediate_size=16,
            head_dim=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=5,
            swiglu_limit=0.05,
        )
        return T.GptOssForCausalLM(cfg)
    raise ValueError(family)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """family -> directory of a saved tiny transformers checkpoint (float32)."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            import torch

            d = tmp_path_factory.mktemp(f"hf_{family}")
            m = _hf_model(family).to(torch.float32).eval()
            _randomize_norms(m)
            m.save_pretrained(d)
            made[family] = d
        return made[family]

    return get


def _randomize_norms(m) -> None:
    """Norm weights start at 1 (or 0), attention biases, routers' correction biases and
    GPT-OSS's expert biases and sinks at 0: perturb them so that a misplaced one shows."""
    import torch

    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(("_proj_bias", "o_proj.bias", "sinks")):  # GPT-OSS: zeros
                p.add_(torch.randn_like(p) * 0.05)
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.05)


@pytest.fixture(scope="session")
def tiny_hf_model():
    """family -> a fresh tiny transformers model (seeded random weights, not saved)."""
    return _hf_model


@pytest.fixture(scope="session")
def randomize_norms():
    """Perturb a transformers model's norms and zero-initialised biases in place."""
    return _randomize_norms


@pytest.fixture(scope="session")
def store(hf_checkpoint, tmp_path_factory):
    """(family, quantized) -> converted store directory."""
    made: dict[tuple, Path] = {}

    def get(family: str, quantize: bool = False, bits: int = 4) -> Path:
        key = (family, quantize, bits)
        if key not in made:
            from strata_mlx.convert.hf import convert_hf

            out = tmp_path_factory.mktemp("stores") / f"{family}-{'q' if quantize else 'f'}{bits}"
            convert_hf(
                hf_checkpoint(family),
                out,
                quantize=quantize,
                q_bits=bits,
                q_group_size=32 if quantize else 64,
                progress=False,
                calibration_tokens=64,
            )
            made[key] = out
        return made[key]

    return get


def hf_logits(checkpoint: Path, ids: list[int]) -> np.ndarray:
    import torch
    import transformers as T

    m = T.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].float().numpy()


def prompt_ids(n: int = 64, seed: int = 0, vocab: int = 128) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


def evictable_as(rng, resident: set, protect: set, pinned: set, python: Callable) -> Any:
    """A victim search's `evictable` for a native policy: `python` (k[0] not in protect and
    k not in pinned) itself, or the same as strata_mlx._nextuse.Evictable, the arena's C
    check (pinned keys given as pinned slots or as `keep`), chosen by `rng`."""
    from strata_mlx._nextuse import Evictable

    r = rng.random()
    if r < 1 / 3:
        return python
    slot_of = {k: i for i, k in enumerate(sorted(resident))}
    if r < 2 / 3:
        return Evictable(slot_of, {slot_of[k] for k in pinned if k in slot_of}, set(), protect)
    return Evictable(slot_of, set(), set(), protect, set(pinned))


def wait_until_serving(
    procs: list[subprocess.Popen],
    request: Callable[[], Any],
    ready: Callable[[Any], bool] = lambda answer: True,
    timeout: float = 120.0,
    output: Callable[[], str] | None = None,
) -> Any:
    """The answer to `request` (an HTTP call to a `strata_mlx serve` just started in `procs`),
    tried every 0.1 s until the server accepts the connection and the answer is `ready`.
    Fails with the server's output (`output()`, or what a process printed) as soon as one of
    `procs` exits, and once `timeout` seconds have passed."""
    import httpx2 as httpx  # the HTTP client the openai package is built on

    t0 = time.monotonic()
    while True:
        for p in procs:
            assert p.poll() is None, output() if output is not None else _printed(p)
        assert time.monotonic() - t0 < timeout, "server did not start"
        with contextlib.suppress(httpx.TransportError):
            answer = request()
            if ready(answer):
                return answer
        time.sleep(0.1)


def _printed(p: subprocess.Popen) -> str:
    out = p.stdout.read() if p.stdout is not None else ""
    return out.decode() if isinstance(out, bytes) else out
