"""Dense Llama GGUF with `split_experts=E` (the built-in model is SmolLM2-135M-Instruct).

Each layer's MLP, down(silu(gate(x)) * up(x)) over I neurons, becomes E SwiGLU experts of
I/E neurons; the store is an ordinary MoE store, so the whole streaming path runs on it.

*Grouping: contiguous neuron ranges* (expert e owns neurons [e*I/E, (e+1)*I/E)). Any
partition of the neurons reproduces the dense MLP exactly when all E experts run, since the
down projection sums over neurons. Contiguous ranges are the only partition that keeps the
GGUF blocks intact: ggml blocks run along each row's input dimension, so gate/up experts are
whole rows (any grouping would do for them), but down's blocks run along the neuron axis, and
only a contiguous range whose width is a multiple of the block size (32 for Q4_0/Q4_1/Q8_0,
256 for K-quants) cuts whole blocks. A neuron permutation (e.g. clustering co-firing
neurons, which could help top-k < E) would force down to be requantized or stored in float.
Widths that are not a block multiple (e.g. E=32 for I=1536: 48 neurons) still convert: down
is then stored dequantized in float, exactly, at about 6x the bytes.

*Router: least squares.* Only used when a run asks for fewer than E experts (`--top-k`;
the default selects all E and is exact). For each layer the converter runs the model (all
E experts) over calibration text, records the MLP input x and each expert's output norm
||y_e(x)||, and fits logits = W x + b by ridge-regularised least squares to those norms; the
top-k logits then pick the experts predicted to contribute most. It is a linear probe fitted
in seconds, not a trained router: quality below E is a research question (docs/top_k.md).

llama.cpp's converter permutes q/k rows for its interleaved rotary; they are un-permuted here
(whole rows move, so quantized blocks survive) and the model uses transformers' rotary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ...format.store import StoreError
from ...format.writer import StoreWriter, save_profile
from ..common import CALIBRATION_TEXT
from .blocks import (
    build_layout,
    choose_format,
    dequantize_rows,
    projection_shapes,
    projection_tensors,
    qtype_name,
    raw_rows,
    slice_cols,
    to_dtype,
    unpermute_rows,
)
from .config import GgufConfig, check_heads, check_shapes, model_dtype
from .reading import GGUF_PROJ, MAX_LAYERS, Gguf
from .tokenizer import build_tokenizer
from .writing import DenseWriter, write_experts

# Extra prose for fitting the routers (with the shared calibration text: ~770 SmolLM2 tokens).
ROUTER_TEXT = (
    "Every winter the harbour froze for a few weeks, and the fishing boats were pulled up on "
    "the shingle and turned over like beetles. The children skated between them. Their "
    "grandparents remembered a year when the ice reached the lighthouse and a man walked out "
    "to it with a sack of coal on his back. Nobody believed him, but the story was told again "
    "every time the cold came back.\n\n"
    "A good recipe for bread needs only flour, water, salt and yeast. Mix them, knead the "
    "dough for ten minutes until it is smooth, and leave it somewhere warm until it has "
    "doubled in size. Shape the loaf, let it rise once more, and bake it in a hot oven for "
    "about forty minutes. The crust should sound hollow when you tap the bottom.\n\n"
    "The committee met on Tuesday to discuss the budget. Several members argued that the "
    "library should stay open in the evenings, because students and workers have no other "
    "quiet place to study. Others pointed out that heating and staff cost money and that the "
    "roof still leaks. In the end they agreed to try late opening on two nights a week and to "
    "count the visitors before deciding anything more.\n\n"
    "Light travels at about three hundred thousand kilometres per second. Sunlight takes a "
    "little over eight minutes to reach the Earth, and the light from the nearest star other "
    "than the Sun has been travelling for more than four years. When we look at the night "
    "sky we are looking into the past.\n\n"
    "User: Can you explain what a prime number is?\nAssistant: A prime number is a whole "
    "number greater than one whose only divisors are one and itself, such as 2, 3, 5, 7 and "
    "11. Every other whole number greater than one can be written as a product of primes.\n"
    "User: Write a short poem about autumn.\nAssistant: The maple lets its letters fall, / "
    "red notes the wind forgets to read; / the garden keeps them, one and all, / and folds "
    "them in around the seed.\n\n"
    "import json\n\ndef load(path):\n    with open(path) as f:\n        return json.load(f)\n\n"
    "for name, value in sorted(load('settings.json').items()):\n    print(name, value)\n\n"
    "History is not only the record of kings and battles. It is also the price of grain, the "
    "letters of merchants, the songs that farmers sang, and the tools that were found in the "
    "mud of a riverbank. Historians piece these things together to understand how ordinary "
    "people lived, what they feared, and what they hoped for their children.\n"
)


# ---- llama (dense) with split experts -----------------------------------------------------


def llama_config(g: Gguf, n_experts: int, dtype: str) -> dict[str, Any]:
    a = g.arch
    heads = g.int(f"{a}.attention.head_count")
    if isinstance(g.get(f"{a}.attention.head_count_kv"), list):
        raise StoreError(f"{g.path}: per-layer head counts are not supported")
    kv = g.int(f"{a}.attention.head_count_kv", heads)
    dim = g.int(f"{a}.embedding_length")
    head_dim = g.int(f"{a}.attention.key_length", max(dim // heads, 1))
    rope_dim = g.int(f"{a}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise StoreError(f"{g.path}: partial rotary ({rope_dim} of {head_dim}) is not supported")
    check_heads(g, heads, kv, head_dim)
    emb = g.tensor("token_embd.weight")
    vocab = g.int(f"{a}.vocab_size", int(emb.shape[1]))
    g.tensor("token_embd.weight", (vocab, dim))
    cfg: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": dim,
        "num_hidden_layers": g.int(f"{a}.block_count", hi=MAX_LAYERS),
        "intermediate_size": g.int(f"{a}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "rms_norm_eps": g.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
        "vocab_size": vocab,
        "rope_theta": g.float(f"{a}.rope.freq_base", 10000.0),
        "max_position_embeddings": g.int(f"{a}.context_length", 2048, hi=1 << 31),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "num_experts": n_experts,
        "num_experts_per_tok": n_experts,
        "torch_dtype": dtype,
    }
    scaling = g.str(f"{a}.rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {
            "rope_type": "linear",
            "factor": g.float(f"{a}.rope.scaling.factor"),
        }
    elif scaling not in (None, "none"):
        raise StoreError(f"{g.path}: rope scaling {scaling!r} is not supported")
    if "rope_freqs.weight" in g.tensors:
        t = g.tensor("rope_freqs.weight", (head_dim // 2,))
        factors = dequantize_rows(raw_rows(t), t).reshape(-1)
        if not (np.isfinite(factors) & (factors > 0)).all():
            raise StoreError(f"{g.path}: tensor rope_freqs.weight holds values that are not > 0")
        cfg["rope_freq_factors"] = factors.tolist()
    return cfg


def llama_split_config(g: Gguf, E: int) -> GgufConfig:
    """A dense llama whose MLPs become E experts of contiguous neuron ranges."""
    dtype = model_dtype(g.path)
    inter = g.int(f"{g.arch}.feed_forward_length")
    if E < 1 or inter % E:
        divisors = [d for d in range(1, min(inter, 64) + 1) if inter % d == 0]
        raise StoreError(
            f"{g.path}: --split-experts {E} must divide the MLP width {inter} "
            f"(one of {', '.join(map(str, divisors))}{', ...' if inter > 64 else ''})"
        )
    cfg = llama_config(g, E, dtype)
    L, D, n = cfg["num_hidden_layers"], cfg["hidden_size"], inter // E
    read = check_shapes(
        g, cfg, {"ffn_gate": (inter, D), "ffn_up": (inter, D), "ffn_down": (D, inter)}
    )

    # One record format per projection, for every layer.
    specs = {}
    for p, gp in GGUF_PROJ.items():
        ts = [g.tensor(f"blk.{i}.{gp}.weight") for i in range(L)]
        types = {qtype_name(t) for t in ts}
        ok = (
            all(slice_cols(raw_rows(t), t, 0, n) is not None for t in ts)
            if p == "down_proj"
            else True
        )
        specs[p] = choose_format(types, ok, dtype)
        if specs[p]["format"] == "gguf":
            specs[p]["in_features"] = n if p == "down_proj" else D
    shapes = {
        p: projection_shapes(specs[p], g.tensor(f"blk.0.{gp}.weight"), *shape)
        for (p, gp), shape in zip(GGUF_PROJ.items(), ((n, D), (n, D), (D, n)))
    }
    layout = build_layout(shapes, specs)
    experts = {f"blk.{i}.{gp}.weight" for i in range(L) for gp in GGUF_PROJ.values()}
    return GgufConfig(
        cfg,
        list(range(L)),
        {i: specs for i in range(L)},
        [layout] * L,
        experts,
        read - experts,
        E,
    )


def convert_llama(
    g: Gguf, c: GgufConfig, out: Path, calibration_tokens: int, progress: bool
) -> Path:
    cfg, E, specs = c.config, c.num_experts, c.layer_specs[0]
    L, D = cfg["num_hidden_layers"], cfg["hidden_size"]
    n = cfg["intermediate_size"] // E
    expert_parts = _expert_parts(g, specs, D, n)
    layout = c.layouts[0]
    dense = _dense_weights(g, cfg, c.dtype, E, progress)
    qcfg = dense.quantization_config()
    if qcfg:
        cfg["quantization"] = qcfg

    writer = StoreWriter(out, "llama", cfg, layout, list(range(L)), E)
    with writer:
        writer.manifest.extra = {
            "source": {"gguf": g.path.name, "architecture": g.arch},
            "split": {
                "experts": E,
                "neurons_per_expert": n,
                "grouping": "contiguous",
                "router": "ridge least squares on ||expert output||, calibration text",
                "formats": {p: s.get("_src", s["format"]) for p, s in specs.items()},
            },
        }
        has_tok = build_tokenizer(g, writer.path, cfg["vocab_size"])
        if E > 1 and calibration_tokens > 0 and has_tok:
            from ...generation.tokenizer import load_tokenizer

            ids = calibration_ids(load_tokenizer(writer.path), calibration_tokens, g.path)
            fit_routers(dense, g, cfg, ids, n, progress=progress)
        writer.write_dense(dense.weights)
        write_experts(writer, range(L), E, expert_parts, progress)
        if calibration_tokens > 0:
            # top_k == E by default: every token runs every expert, so the profile is flat.
            path = writer.finalize()
            save_profile(
                path,
                np.full((L, E), calibration_tokens),
                calibration_tokens,
                "split experts: every expert runs for every token at the default top_k",
            )
        return writer.commit()


def _expert_parts(g: Gguf, specs: dict[str, dict], D: int, n: int):
    """expert_parts(layer, e): expert e's slice of layer's MLP (n neurons) as record parts:
    gate/up rows as they are, down's columns cut from its blocks where they fall on whole
    blocks, else from the matrix dequantized (once a layer)."""
    full: dict[str, Any] = {}  # the last down matrix dequantized whole

    def expert_parts(layer: int, e: int) -> dict[str, dict[str, tuple]]:
        parts = {}
        for p, gp in GGUF_PROJ.items():
            t = g.tensor(f"blk.{layer}.{gp}.weight")
            data = raw_rows(t)
            if p == "down_proj":
                cut = slice_cols(data, t, e * n, (e + 1) * n)
                if cut is None:  # through a block: dequantize the rows (once), then cut
                    if full.get("name") != t.name:
                        full.update(name=t.name, w=dequantize_rows(data, t))
                    cut = full["w"][:, e * n : (e + 1) * n]
                    parts[p] = {"weight": (specs[p]["_dtype"], to_dtype(cut, specs[p]["_dtype"]))}
                    continue
                parts[p] = projection_tensors(specs[p], cut, t, D, n)
            else:
                parts[p] = projection_tensors(specs[p], data[e * n : (e + 1) * n], t, n, D)
        return parts

    return expert_parts


def _dense_weights(
    g: Gguf, cfg: dict[str, Any], dtype: str, E: int, progress: bool = False
) -> DenseWriter:
    """Everything but the experts: embeddings, norms, attention (q/k rows un-permuted) and
    the routers, which start at zero (unused while all experts run; fitted later).
    `progress`: a bar over the layers (seconds on a CPU for the built-in model)."""
    from tqdm import tqdm

    L, D = cfg["num_hidden_layers"], cfg["hidden_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dense = DenseWriter(dtype)
    # the embeddings first, in the bar too: the largest tensor, seconds to dequantize
    bar = tqdm(total=L + 1, desc="dense weights", unit="tensor group", disable=not progress)
    bar.refresh()
    dense.add("model.embed_tokens", g.tensor("token_embd.weight"))
    if not cfg["tie_word_embeddings"]:
        dense.add("lm_head", g.tensor("output.weight"))
    dense.add_array(
        "model.norm.weight",
        dequantize_rows(raw_rows(g.tensor("output_norm.weight")), g.tensor("output_norm.weight")),
    )
    bar.update(1)
    for i in range(L):
        bar.update(1)
        pre = f"model.layers.{i}"
        for gname, hname in (
            ("attn_norm", "input_layernorm"),
            ("ffn_norm", "post_attention_layernorm"),
        ):
            t = g.tensor(f"blk.{i}.{gname}.weight")
            dense.add_array(f"{pre}.{hname}.weight", dequantize_rows(raw_rows(t), t))
        for gname, hname, nh in (
            ("attn_q", "q_proj", heads),
            ("attn_k", "k_proj", kv),
            ("attn_v", "v_proj", None),
            ("attn_output", "o_proj", None),
        ):
            t = g.tensor(f"blk.{i}.{gname}.weight")
            data = raw_rows(t)
            if nh is not None:
                data = unpermute_rows(data, nh)
            dense.add(f"{pre}.self_attn.{hname}", t, data)
            if f"blk.{i}.{gname}.bias" in g.tensors:
                tb = g.tensor(f"blk.{i}.{gname}.bias")
                b = dequantize_rows(raw_rows(tb), tb).reshape(-1)
                if nh is not None:
                    b = unpermute_rows(b, nh)
                dense.add_array(f"{pre}.self_attn.{hname}.bias", b)
        dense.add_array(f"{pre}.mlp.gate.weight", np.zeros((E, D), np.float32))
        dense.add_array(f"{pre}.mlp.gate.bias", np.zeros((E,), np.float32))
    bar.close()
    return dense


def _rope_inv_freq(cfg: dict[str, Any]) -> np.ndarray:
    d = cfg["head_dim"]
    inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float64) / d)
    if cfg.get("rope_freq_factors"):
        inv = inv / np.asarray(cfg["rope_freq_factors"], dtype=np.float64)
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "linear":
        inv = inv / cfg["rope_scaling"]["factor"]
    return inv


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def mlp_inputs(g: Gguf, cfg: dict[str, Any], ids: list[int]):
    """Yield (layer, x [T, D], hidden [T, I], down [D, I]) of the dense model on `ids`: the MLP
    input, its SwiGLU activations and its down projection, float32, computed in numpy.

    A float32 reference forward of the GGUF's own (dequantized) weights: the routers are
    fitted on the activations the model really sees, and numpy's matmul is several times
    faster than MLX's CPU one, which keeps first-run conversion short.
    """
    L, H, KV = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps, T = cfg["head_dim"], cfg["rms_norm_eps"], len(ids)

    def deq(name, rows=None):
        t = g.tensor(name)
        data = raw_rows(t)
        return dequantize_rows(data if rows is None else data[rows], t)

    h = deq("token_embd.weight", np.asarray(ids))
    ang = np.arange(T)[:, None] * _rope_inv_freq(cfg)[None]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    def rope(x):  # [n, T, hd], transformers' rotate_half
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    causal = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
    for i in range(L):
        x = _rms(h, deq(f"blk.{i}.attn_norm.weight"), eps)
        proj = {}
        for gname, nh in (("attn_q", H), ("attn_k", KV), ("attn_v", None)):
            t = g.tensor(f"blk.{i}.{gname}.weight")
            w = dequantize_rows(raw_rows(t), t)
            if nh is not None:
                w = unpermute_rows(w, nh)
            y = x @ w.T
            if f"blk.{i}.{gname}.bias" in g.tensors:
                b = deq(f"blk.{i}.{gname}.bias").reshape(-1)
                y = y + (unpermute_rows(b, nh) if nh is not None else b)
            proj[gname] = y.reshape(T, -1, hd).transpose(1, 0, 2)
        q, k, v = rope(proj["attn_q"]), rope(proj["attn_k"]), proj["attn_v"]
        k, v = np.repeat(k, H // KV, axis=0), np.repeat(v, H // KV, axis=0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + causal
        s = np.exp(s - s.max(-1, keepdims=True))
        o = (s / s.sum(-1, keepdims=True)) @ v  # [H, T, hd]
        h = h + o.transpose(1, 0, 2).reshape(T, -1) @ deq(f"blk.{i}.attn_output.weight").T
        x = _rms(h, deq(f"blk.{i}.ffn_norm.weight"), eps)
        gate = x @ deq(f"blk.{i}.ffn_gate.weight").T
        hid = gate / (1 + np.exp(-gate)) * (x @ deq(f"blk.{i}.ffn_up.weight").T)
        down = deq(f"blk.{i}.ffn_down.weight")
        yield i, x, hid, down
        h = h + hid @ down.T


def calibration_ids(tok, tokens: int, source: str | Path = "tokenizer") -> list[int]:
    ids = tok.encode(CALIBRATION_TEXT + "\n\n" + ROUTER_TEXT)
    if not ids:
        raise StoreError(f"{source}: the tokenizer encodes the calibration text as no tokens")
    while len(ids) < tokens:
        ids = ids + ids
    return ids[: max(tokens, len(ids) if tokens <= len(ids) else tokens)]


def fit_routers(
    dense: DenseWriter,
    g: Gguf,
    cfg: dict[str, Any],
    ids: list[int],
    n: int,
    ridge: float = 1e-2,
    progress: bool = False,
) -> None:
    """Least-squares routers: logits_e = w_e . x + b_e fitted to ||expert e's output||.
    `progress`: a bar over the layers (the dense forward that feeds it takes seconds each)."""
    from tqdm import tqdm

    E = cfg["num_experts"]
    layers = tqdm(
        mlp_inputs(g, cfg, ids),
        total=cfg["num_hidden_layers"],
        desc="routers",
        unit="layer",
        disable=not progress,
    )
    for layer, x, hid, down in layers:
        X = x.astype(np.float64)
        norms = np.stack(
            [
                np.linalg.norm(
                    hid[:, e * n : (e + 1) * n] @ down[:, e * n : (e + 1) * n].T, axis=-1
                )
                for e in range(E)
            ],
            axis=-1,
        )  # [T, E]
        A = np.concatenate([X, np.ones((X.shape[0], 1))], axis=1)
        gram = A.T @ A
        reg = ridge * np.trace(gram) / A.shape[1] * np.eye(A.shape[1])
        reg[-1, -1] = 0.0  # the bias is not shrunk
        W = np.linalg.solve(gram + reg, A.T @ norms.astype(np.float64))  # [D + 1, E]
        dense.add_array(f"model.layers.{layer}.mlp.gate.weight", W[:-1].T)
        dense.add_array(f"model.layers.{layer}.mlp.gate.bias", W[-1])
