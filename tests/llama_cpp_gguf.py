"""GGUF files written by llama.cpp's own converter (convert_hf_to_gguf.py) from tiny random
models built with transformers' own classes: the oracles for GGUF import of the MoE families.

llama.cpp's converter ships in the llama-cpp-python sdist on PyPI (vendor/llama.cpp). It is
fetched once with pip (`pip download --no-deps --no-binary :all:`), and only the converter's
own files are kept, under ~/.cache/strata-mlx (or $STRATA_LLAMA_CPP: a llama.cpp checkout).

The converter is run unmodified but for one thing: the toy tokenizer (256 byte symbols and a
few merges) is not a published one, so the converter's fingerprint lookup, which maps the
token ids of a fixed text to a pre-tokenizer name, would refuse it; `get_vocab_base_pre` is
replaced by the name we pass. Every tensor and every other metadata key is the converter's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"
KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")

EOT = "<|endoftext|>"


def converter_dir() -> Path | None:
    """A directory holding convert_hf_to_gguf.py (fetched once), or None when it cannot be
    had (no network and no cache)."""
    env = os.environ.get("STRATA_LLAMA_CPP")
    if env:
        return Path(env)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "strata-mlx"
    dest = cache / f"llama.cpp-{LLAMA_CPP_PYTHON}"
    if (dest / "convert_hf_to_gguf.py").is_file():
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.is_file():
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
            + ["-d", str(cache), f"llama-cpp-python=={LLAMA_CPP_PYTHON}"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if r.returncode or not sdist.is_file():
            return None
    tmp = cache / f"llama.cpp-{LLAMA_CPP_PYTHON}.partial"
    shutil.rmtree(tmp, ignore_errors=True)  # a run killed while extracting
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name[len(prefix) :] if m.name.startswith(prefix) else None
            if rel and rel.startswith(KEEP) and (m.isfile() or m.isdir()):
                m.name = rel
                members.append(m)
        tar.extractall(tmp, members=members, filter="data")
    tmp.rename(dest)
    sdist.unlink()
    return dest


# ---- a toy byte-level BPE tokenizer --------------------------------------------------------


def byte_symbols() -> list[str]:
    """GPT-2's bytes_to_unicode(): one printable symbol per byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
TOKENS = byte_symbols() + ["".join(m) for m in MERGES] + [EOT]  # 262 ids


# The added tokens llama.cpp's converter looks up by name in GLM-4.5's vocabulary (ids 262..).
GLM_SPECIALS = ("[gMASK]", "<|user|>", "<|observation|>")


def write_tokenizer(d: Path, specials: tuple[str, ...] = ()) -> None:
    """A byte-level BPE (GPT-2 pre-tokenizer) with an end-of-text token (and `specials` after
    it), as transformers saves one (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(TOKENS + list(specials))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (EOT, *specials)]
    )
    tok.save(str(d / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}",
    }
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


def write_sentencepiece(d: Path, vocab_size: int = 400) -> None:
    """A SentencePiece BPE model (byte fallback, as Llama-2/Mistral/Mixtral's), trained on our
    calibration text, saved as tokenizer.model with a tokenizer_config.json."""
    import io

    import sentencepiece as spm

    from strata_mlx.convert.common import CALIBRATION_TEXT
    from strata_mlx.convert.gguf.llama import ROUTER_TEXT

    lines = [x for x in (CALIBRATION_TEXT + "\n" + ROUTER_TEXT).splitlines() if x.strip()]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        # As Llama-2's and Mistral's: no text normalization, whitespace kept as it is (which
        # is also all that llama.cpp's SPM tokenizer does).
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    (d / "tokenizer.model").write_bytes(buf.getvalue())
    cfg = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>"}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


# ---- tiny random models --------------------------------------------------------------------

VOCAB = 288  # > len(TOKENS); the converter pads the vocabulary with [PAD] tokens


def hf_model(
    family: str,
    hidden: int = 32,
    expert: int = 32,
    layers: int = 2,
    seed: int = 0,
    vocab: int = VOCAB,
    bos_eos: tuple[int, int] = (len(TOKENS) - 1, len(TOKENS) - 1),
):
    """A tiny transformers model of `family`, float32, random weights (norms perturbed so
    that a misplaced norm shows)."""
    import torch
    import transformers as T

    torch.manual_seed(seed)
    base = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        bos_token_id=bos_eos[0],
        eos_token_id=bos_eos[1],
    )
    if family == "mixtral":
        cfg = T.MixtralConfig(**base, intermediate_size=expert, num_local_experts=8)
        m = T.MixtralForCausalLM(cfg)
    elif family == "olmoe":
        cfg = T.OlmoeConfig(**base, intermediate_size=expert, num_experts=8)
        m = T.OlmoeForCausalLM(cfg)
    elif family == "qwen3_next":
        cfg = T.Qwen3NextConfig(
            **{**base, "num_hidden_layers": max(layers, 4)},
            intermediate_size=2 * expert,
            moe_intermediate_size=expert,
            shared_expert_intermediate_size=expert,
            head_dim=16,
            num_experts=8,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            full_attention_interval=2,
            norm_topk_prob=True,
        )
        m = T.Qwen3NextForCausalLM(cfg)
    elif family == "glm4_moe":
        # Layer 0 dense; 8 experts in 2 groups, one eligible; partial rotary, q/k norms.
        cfg = T.Glm4MoeConfig(
            **{**base, "num_hidden_layers": max(layers, 3)},
            intermediate_size=2 * expert,
            moe_intermediate_size=expert,
            head_dim=16,
            partial_rotary_factor=0.5,
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
            use_qk_norm=True,
            attention_bias=True,
        )
        m = T.Glm4MoeForCausalLM(cfg)
    elif family == "deepseek_v3":
        # Layer 0 dense; 8 experts in 4 groups, 2 eligible; q through its low-rank path; YaRN.
        cfg = T.DeepseekV3Config(
            **{**base, "num_hidden_layers": max(layers, 3), "num_key_value_heads": 4},
            intermediate_size=2 * expert,
            moe_intermediate_size=expert,
            n_routed_experts=8,
            n_shared_experts=2,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            kv_lora_rank=32,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32,
                "beta_slow": 1,
                # llama.cpp keeps only mscale_all_dim (yarn_log_multiplier) and scales the
                # attention by it: equal to transformers where mscale is the same, as in
                # DeepSeek-V3's own config.
                "mscale": 0.8,
                "mscale_all_dim": 0.8,
            },
        )
        m = T.DeepseekV3ForCausalLM(cfg)
    elif family == "gpt_oss":
        # Every expert axis a multiple of 32 (MXFP4 blocks); sliding layers of 5 positions;
        # YaRN as GPT-OSS's own config has it (truncate false). llama.cpp's converter writes
        # no swiglu limit or alpha (llama.cpp fixes them at 7.0 and 1.702): the defaults.
        cfg = T.GptOssConfig(
            **{**base, "num_hidden_layers": max(layers, 3)},
            intermediate_size=expert,
            head_dim=16,
            num_local_experts=8,
            sliding_window=5,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        )
        m = T.GptOssForCausalLM(cfg)
    else:
        raise ValueError(family)
    m = m.to(torch.float32).eval()
    perturb(m)
    return m


def perturb(m) -> None:
    """Norms, biases and sinks moved off their init values (ones / zeros), in place, from
    torch's random stream: a misplaced or dropped one then shows in the logits."""
    import torch

    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(("_proj_bias", "o_proj.bias", "router.bias", "sinks")):
                p.add_(torch.randn_like(p) * 0.05)  # GPT-OSS's, zeros at init
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.05)


def save_checkpoint(model, d: Path, sentencepiece: bool = False) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(d)
    if sentencepiece:
        write_sentencepiece(d)
    else:
        glm = model.config.model_type == "glm4_moe"
        write_tokenizer(d, GLM_SPECIALS if glm else ())
    if model.config.model_type == "deepseek_v3":
        # DeepSeek-V3's own config.json names its router (transformers 5 leaves it out, and
        # llama.cpp's converter writes expert_gating_func only from it).
        config = json.loads((d / "config.json").read_text())
        config.update(scoring_func="sigmoid", topk_method="noaux_tc")
        (d / "config.json").write_text(json.dumps(config, indent=2))
    return d


# ---- running the converter -----------------------------------------------------------------

_RUN = """
import json, os, runpy, sys
src, jobs = sys.argv[1], json.loads(sys.argv[2])
sys.path[:0] = [src, os.path.join(src, "gguf-py")]
from conversion.base import TextModel
for pre, argv in jobs:
    TextModel.get_vocab_base_pre = lambda self, tokenizer, pre=pre: pre
    sys.argv = [os.path.join(src, "convert_hf_to_gguf.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_many(llama_cpp: Path, jobs: list[tuple[Path, Path, str, tuple[str, ...]]]) -> None:
    """Run llama.cpp's convert_hf_to_gguf.py on each (checkpoint, out, outtype, extra args),
    in one process (importing torch once)."""
    argv = [
        ("gpt-2", [str(ck), "--outfile", str(out), "--outtype", outtype, *extra])
        for ck, out, outtype, extra in jobs
    ]
    cmd = [sys.executable, "-c", _RUN, str(llama_cpp), json.dumps(argv)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{r.stderr[-4000:]}")


def convert(llama_cpp: Path, checkpoint: Path, out: Path, outtype: str = "f32", *extra) -> Path:
    convert_many(llama_cpp, [(checkpoint, out, outtype, extra)])
    return out


def reader_summary(path: Path) -> dict:
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    meta = {}
    for k, f in r.fields.items():
        if k.startswith("tokenizer.ggml.") and k not in ("tokenizer.ggml.pre",):
            continue
        try:
            meta[k] = f.contents()
        except Exception:
            meta[k] = "?"
    tensors = {t.name: (t.tensor_type.name, [int(x) for x in t.shape]) for t in r.tensors}
    return {"meta": meta, "tensors": tensors}


if __name__ == "__main__":  # a look at what the converter writes: python tests/llama_cpp_gguf.py
    import tempfile

    lc = converter_dir()
    assert lc is not None
    for fam in sys.argv[1:] or ["mixtral", "olmoe", "qwen3_next"]:
        with tempfile.TemporaryDirectory() as t:
            ck = save_checkpoint(hf_model(fam), Path(t) / "ck")
            print(fam, sorted(p.name for p in ck.iterdir()))
            g = convert(
                lc, ck, Path(t) / "m.gguf", "f32", *(["--no-mtp"] if fam == "qwen3_next" else [])
            )
            s = reader_summary(g)
            for k, v in s["meta"].items():
                print("  ", k, v if not isinstance(v, list) or len(v) < 20 else f"[{len(v)}]")
            for k, v in s["tensors"].items():
                if ".1." not in k and ".2." not in k and ".3." not in k:
                    print("  ", k, v)
