"""The GGUF fixtures in tests/data/gguf/: tiny random MoE models built with transformers' own
classes, converted by llama.cpp's convert_hf_to_gguf.py to F32, then quantized by llama.cpp's
own `llama-quantize` (Q8_0, Q4_K_M, Q2_K; IQ3_S and IQ2_XS with an importance matrix from its
`llama-imatrix` on a short text). tests/convert/test_gguf_fixtures.py reads the committed files; CI never
builds llama.cpp.

    python tests/make_quantized_fixtures.py [FAMILY ...]

llama.cpp's tools are built once, CPU-only, from the vendor/llama.cpp of the llama-cpp-python
sdist that tests/llama_cpp_gguf.py fetches (17 min on 2 shared cores), under
~/.cache/strata-mlx/llama-tools (or $STRATA_LLAMA_TOOLS: a directory holding both binaries).

Each family's JSON (tests/data/gguf/FAMILY.json) records what rebuilds the transformers model
exactly (class, config, seed; a digest of its weights to prove it), the llama.cpp version, every
command run, and per file each tensor's type and the fallbacks llama-quantize reported.
Hidden and expert width are 256, one whole k-quant block, so that the experts keep k-quant
and i-quant blocks; vocabulary, layers and experts are as small as the family allows.
The tools run in one work directory on relative names, so a rerun writes the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import llama_cpp_gguf as lc

DATA = Path(__file__).parent / "data" / "gguf"
TYPES = ("Q8_0", "Q4_K_M", "Q2_K", "IQ3_S", "IQ2_XS")
# Q8_0 only for these (its import, an exact repack to MLX affine 8-bit, is the same for every
# family, and it is the largest file): 19 MB in all.
Q8_0_FAMILIES = ("qwen3_moe",)
NEEDS_IMATRIX = ("IQ3_S", "IQ2_XS")
WIDTH = 256  # hidden and expert width: one k-quant super-block
EXPERTS = 4
SEED = 11
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "strata-mlx"
TOOLS = CACHE / "llama-tools"

# family -> (llama.cpp converter extra arguments, {config key: value} over lc.hf_model's)
FAMILIES: dict[str, tuple[tuple[str, ...], dict]] = {
    "qwen3_moe": ((), {}),
    "mixtral": ((), {"num_hidden_layers": 1, "num_local_experts": EXPERTS, "head_dim": 32}),
    # llama.cpp loads OLMoE only without GQA (its attn_k_norm must be n_embd wide).
    "olmoe": ((), {"num_hidden_layers": 1, "num_experts": EXPERTS, "num_key_value_heads": 4}),
    # One delta-net layer and one attention layer (llama.cpp's converter cannot map a dense
    # Qwen3-Next MLP, mlp_only_layers: "Can not map tensor 'model.layers.1.mlp.down_proj'").
    "qwen3_next": (
        ("--no-mtp",),
        {
            "num_experts": EXPERTS,
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"],
        },
    ),
    # Layer 0 dense, layer 1 MoE (2 groups of 2 experts, one group eligible).
    "glm4_moe": (
        (),
        {"num_hidden_layers": 2, "n_routed_experts": EXPERTS, "n_group": 2, "topk_group": 1},
    ),
    "deepseek_v3": (
        (),
        {
            "num_hidden_layers": 2,
            "n_routed_experts": EXPERTS,
            "n_group": 2,
            "topk_group": 1,
            "n_shared_experts": 1,
        },
    ),
    "gpt_oss": (
        (),
        {
            "num_hidden_layers": 1,
            "num_local_experts": EXPERTS,
            "layer_types": ["sliding_attention"],
        },
    ),
}


# ---- the transformers model, rebuilt the same from (class, config, seed) ------------------


def family_config(family: str) -> tuple[str, dict]:
    """(transformers class name, config.to_dict()) of `family`'s fixture model."""
    import transformers as T

    if family == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(
            vocab_size=lc.VOCAB,
            hidden_size=WIDTH,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,  # o_proj's rows are 128 wide: llama-quantize's fallbacks
            max_position_embeddings=512,
            intermediate_size=2 * WIDTH,
            moe_intermediate_size=WIDTH,
            num_experts=EXPERTS,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            tie_word_embeddings=False,
            bos_token_id=len(lc.TOKENS) - 1,
            eos_token_id=len(lc.TOKENS) - 1,
        )
        return "Qwen3MoeForCausalLM", cfg.to_dict()
    model = lc.hf_model(family, hidden=WIDTH, expert=WIDTH)
    config = {**model.config.to_dict(), **FAMILIES[family][1]}
    return type(model).__name__, config


def build_model(class_name: str, config: dict, seed: int):
    """The float32 transformers model: `seed`'s random weights, norms and biases perturbed
    (llama_cpp_gguf.perturb, as its hf_model does, so that a misplaced norm shows)."""
    import torch
    import transformers as T

    config = dict(config)
    cfg = T.AutoConfig.for_model(config.pop("model_type"), **config)
    torch.manual_seed(seed)
    m = getattr(T, class_name)(cfg).to(torch.float32).eval()
    lc.perturb(m)
    return m


def weights_digest(model) -> str:
    """sha256 over every parameter and buffer (name, float32 bytes), in name order."""
    h = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


# ---- llama.cpp's tools ---------------------------------------------------------------------


def tools_dir() -> Path:
    env = os.environ.get("STRATA_LLAMA_TOOLS")
    d = Path(env) if env else TOOLS / "src" / "build" / "bin"
    if not (d / "llama-quantize").is_file() or not (d / "llama-imatrix").is_file():
        if env:
            raise SystemExit(f"$STRATA_LLAMA_TOOLS: no llama-quantize / llama-imatrix in {d}")
        d = build_tools()
    return d


def build_tools() -> Path:
    """CPU-only llama-quantize and llama-imatrix from the sdist's vendor/llama.cpp."""
    src = TOOLS / "src"
    if not (src / "CMakeLists.txt").is_file():
        TOOLS.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
            + ["-d", str(TOOLS), f"llama-cpp-python=={lc.LLAMA_CPP_PYTHON}"],
            check=True,
        )
        sdist = TOOLS / f"llama_cpp_python-{lc.LLAMA_CPP_PYTHON}.tar.gz"
        subprocess.run(["tar", "xzf", str(sdist), "-C", str(TOOLS)], check=True)
        shutil.move(TOOLS / f"llama_cpp_python-{lc.LLAMA_CPP_PYTHON}/vendor/llama.cpp", src)
    flags = ["-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF"]
    flags += ["-DGGML_OPENMP=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DCMAKE_BUILD_TYPE=Release"]
    subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), *flags], check=True)
    subprocess.run(
        ["cmake", "--build", str(src / "build"), "--target", "llama-quantize", "llama-imatrix"]
        + [f"-j{os.cpu_count() or 2}"],
        check=True,
    )
    return src / "build" / "bin"


def _run(cmd: list[str], log: list[str], cwd: Path) -> str:
    """Run a tool in `cwd` on file names relative to it: llama-quantize copies the imatrix's
    file and dataset names into its output's metadata, so the bytes do not depend on where
    the work directory is."""
    log.append(" ".join([Path(cmd[0]).name, *cmd[1:]]))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=cwd)
    if r.returncode:
        raise RuntimeError(f"{cmd[0]} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout + r.stderr


def llama_cpp_version(tools: Path) -> str:
    r = subprocess.run([str(tools / "llama-imatrix"), "--version"], capture_output=True, text=True)
    line = next((x for x in (r.stdout + r.stderr).splitlines() if "version" in x), "?")
    return f"llama-cpp-python {lc.LLAMA_CPP_PYTHON} sdist, vendor/llama.cpp: {line.strip()}"


def tensor_types(path: Path) -> dict[str, str]:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


# ---- making one family's fixtures ----------------------------------------------------------


def make(family: str, tools: Path, converter: Path, work: Path) -> dict:
    extra, _ = FAMILIES[family]
    class_name, config = family_config(family)
    model = build_model(class_name, config, SEED)
    ck = lc.save_checkpoint(model, work / "checkpoint")
    base = work / f"{family}-F32.gguf"
    convert = ["python convert_hf_to_gguf.py CHECKPOINT --outfile", base.name, "--outtype f32"]
    commands = [" ".join([*convert, *extra])]
    lc.convert_many(converter, [(ck, base, "f32", extra)])

    from strata_mlx.convert.common import CALIBRATION_TEXT

    text = work / "calibration.txt"
    text.write_text(CALIBRATION_TEXT)
    imatrix_log = _run(
        [str(tools / "llama-imatrix"), "-m", base.name, "-f", text.name, "-o", "imatrix.gguf"]
        + ["-c", "64", "-b", "64", "-t", "2", "--no-ppl"],
        commands,
        work,
    )
    files = {}
    for qtype in TYPES:
        if qtype == "Q8_0" and family not in Q8_0_FAMILIES:
            continue
        out = DATA / f"{family}-{qtype}.gguf"
        cmd = [str(tools / "llama-quantize")]
        if qtype in NEEDS_IMATRIX:
            cmd += ["--imatrix", "imatrix.gguf"]
        log = _run([*cmd, base.name, out.name, qtype, "2"], commands, work)
        shutil.copyfile(work / out.name, out)
        fallbacks = sorted(
            {
                re.sub(r"\s+", " ", x.split(" W ")[-1].strip())
                for x in log.splitlines()
                if "falling back" in x
            }
        )
        files[out.name] = {
            "type": qtype,
            "bytes": out.stat().st_size,
            "tensors": tensor_types(out),
            "fallbacks": fallbacks,
        }
    return {
        "family": family,
        "seed": SEED,
        "class": class_name,
        "config": config,
        "weights_sha256": weights_digest(model),
        "converter_args": list(extra),
        "converter": "llama.cpp's convert_hf_to_gguf.py through tests/llama_cpp_gguf.py "
        "(get_vocab_base_pre answers 'gpt-2': the toy tokenizer has no known fingerprint)",
        "llama_cpp": llama_cpp_version(tools),
        "imatrix_text": "strata_mlx.convert.common.CALIBRATION_TEXT",
        "imatrix_log": [
            x.split(" I ")[-1].split(" W ")[-1].strip()
            for x in imatrix_log.splitlines()
            if any(w in x for w in ("computing over", "entries", "partial", "storing"))
        ],
        "commands": commands,
        "files": files,
    }


def main(families: list[str]) -> None:
    tools = tools_dir()
    converter = lc.converter_dir()
    if converter is None:
        raise SystemExit("llama.cpp's convert_hf_to_gguf.py could not be fetched")
    DATA.mkdir(parents=True, exist_ok=True)
    for family in families:
        with tempfile.TemporaryDirectory() as t:
            record = make(family, tools, converter, Path(t))
        (DATA / f"{family}.json").write_text(json.dumps(record, indent=1) + "\n")
        sizes = {k: v["bytes"] for k, v in record["files"].items()}
        print(family, sizes, sum(sizes.values()))


if __name__ == "__main__":
    main(sys.argv[1:] or list(FAMILIES))
