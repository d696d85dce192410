"""The tokenizer, rebuilt from a GGUF's metadata.

The tokenizer is rebuilt from the GGUF metadata (tokenizer.ggml.model "gpt2": byte-level BPE
with the pre-tokenizer named by tokenizer.ggml.pre; "llama": SentencePiece BPE, merges from
the scores, byte fallback) and written as tokenizer.json and tokenizer_config.json with the
chat template.

Never: reads tensor data.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from ...format.store import StoreError
from .reading import Gguf, bool_field

# ---- tokenizer ----------------------------------------------------------------------------

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# o200k's (GPT-4o's, and GPT-OSS's tokenizer.json), as llama.cpp's "gpt-4o" pre-tokenizer.
GPT4O_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# tokenizer.ggml.pre -> (split digits one by one first?, split regex or None for GPT-2's).
# As llama.cpp's llama-vocab.cpp: "smollm" (and starcoder, refact, command-r) split every
# digit, then GPT-2's regex.
PRE_TOKENIZERS = {
    "gpt2": (False, None),
    "gpt-2": (False, None),
    "default": (False, None),
    "mpt": (False, None),
    "olmo": (False, None),
    "smollm": (True, None),
    "starcoder": (True, None),
    "refact": (True, None),
    "command-r": (True, None),
    "llama-bpe": (False, LLAMA3_PATTERN),
    "llama3": (False, LLAMA3_PATTERN),
    "dbrx": (False, LLAMA3_PATTERN),
    "smaug-bpe": (False, LLAMA3_PATTERN),
    "qwen2": (False, QWEN2_PATTERN),
    "qwen35": (False, QWEN2_PATTERN),
    "gpt-4o": (False, GPT4O_PATTERN),
}


def build_tokenizer(g: Gguf, out: Path, vocab_size: int) -> bool:
    """tokenizer.json + tokenizer_config.json from GGUF metadata; False when there is none."""
    try:
        return _build_tokenizer(g, out, vocab_size)
    except (StoreError, MemoryError):
        raise
    except BaseException as e:
        # tokenizers raises bare Exceptions (a merge of unknown tokens), and on some merges
        # panics: pyo3's PanicException, a BaseException, which nothing else raises here
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
            raise
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise StoreError(f"{g.path}: tokenizer metadata rejected by tokenizers ({msg})") from None


def _build_tokenizer(g: Gguf, out: Path, vocab_size: int) -> bool:
    kind = g.str("tokenizer.ggml.model")
    if kind is None:
        return False
    if kind not in ("gpt2", "llama"):
        warnings.warn(
            f"{g.path}: tokenizer model {kind!r} is not supported (gpt2 BPE and llama "
            "SentencePiece are); the store will need --prompt-tokens",
            stacklevel=3,
        )
        return False
    tokens = _str_list(g, "tokenizer.ggml.tokens", g.need("tokenizer.ggml.tokens"))
    if not 0 < len(tokens) <= vocab_size:
        g.fail("tokenizer.ggml.tokens", f"{len(tokens)} tokens for a vocabulary of {vocab_size}")
    types = g.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if not isinstance(types, list) or len(types) != len(tokens):
        g.fail("tokenizer.ggml.token_type", f"expected {len(tokens)} token types")
    tok = _sentencepiece_bpe(g, tokens) if kind == "llama" else _byte_level_bpe(g, tokens)
    _add_typed_tokens(tok, tokens, types)

    def tid(key):
        i = g.get(key)
        if i is not None and (not isinstance(i, int) or isinstance(i, bool)):
            g.fail(key, f"expected a token id, got {type(i).__name__}")
        return None if i is None or not 0 <= i < len(tokens) else i

    ids = {
        name: tid(f"tokenizer.ggml.{key}")
        for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))
    }  # fmt: skip
    bos, eos = ids["bos_token"], ids["eos_token"]
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
    add_bos = bool_field(g, "tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None
    add_eos = bool_field(g, "tokenizer.ggml.add_eos_token") and eos is not None
    _add_bos_eos(tok, tokens, bos if add_bos else None, eos if add_eos else None)
    tok.save(str(out / "tokenizer.json"))
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": g.int(f"{g.arch}.context_length", 2048, hi=1 << 31),
    }
    cfg.update({name: tokens[i] for name, i in ids.items() if i is not None})
    template = g.str("tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    if eos is not None:
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return True


def _byte_level_bpe(g: Gguf, tokens: list[str]):
    """A byte-level BPE vocabulary (tokenizer.ggml.model "gpt2": tokens and merges) as a
    tokenizers BPE, with the pre-tokenizer tokenizer.ggml.pre names (PRE_TOKENIZERS)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = _str_list(g, "tokenizer.ggml.merges", g.get("tokenizer.ggml.merges") or [])
    if any(" " not in m for m in merges):
        g.fail("tokenizer.ggml.merges", "a merge without a space")
    merges = [tuple(m.split(" ", 1)) for m in merges]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = g.str("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:  # stacklevel: the caller of build_tokenizer
        warnings.warn(f"{g.path}: pre-tokenizer {pre!r} unknown; using GPT-2's", stacklevel=4)
    digits, pattern = PRE_TOKENIZERS.get(pre, (False, None))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if pattern is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def _add_typed_tokens(tok, tokens: list[str], types: list) -> None:
    """ggml token types: 3 control (added as special tokens), 4 user-defined (added, not
    special)."""
    from tokenizers import AddedToken

    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, ty in enumerate(types)
        if ty == 3
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, ty in enumerate(types)
        if ty == 4
    ]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)


def _add_bos_eos(tok, tokens: list[str], bos: int | None, eos: int | None) -> None:
    """A post-processor that adds BOS (`bos`) and/or EOS (`eos`) to every encoding; none when
    both are None."""
    from tokenizers import processors

    single, pair, sp = "$A", "$A $B", []
    if bos is not None:
        single, pair = f"{tokens[bos]} {single}", f"{tokens[bos]} $A {tokens[bos]} $B"
        sp.append((tokens[bos], bos))
    if eos is not None:
        single, pair = f"{single} {tokens[eos]}", f"{pair} {tokens[eos]}"
        if bos is None or eos != bos:
            sp.append((tokens[eos], eos))
    if sp:
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=sp
        )


def _sentencepiece_bpe(g: Gguf, tokens: list[str]):
    """A SentencePiece BPE vocabulary (tokenizer.ggml.model "llama": tokens and scores, no
    merges) as a tokenizers BPE, the way Llama-2/Mistral/Mixtral's own tokenizer.json is:
    merges recovered from the scores (a token's merges rank by its score, best first, as
    transformers' generate_merges and llama.cpp's SPM tokenizer, which merges the
    best-scoring pair first), byte fallback to the <0xXX> tokens, spaces as U+2581 with one
    prefixed (unless tokenizer.ggml.add_space_prefix is false)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = g.need("tokenizer.ggml.scores")
    if (
        not isinstance(scores, list)
        or len(scores) != len(tokens)
        or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in scores)
    ):
        g.fail("tokenizer.ggml.scores", f"expected {len(tokens)} numbers")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    ranked = []
    for t, i in vocab.items():
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = g.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    tok = Tokenizer(
        models.BPE(
            vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True
        )
    )
    space = "\u2581"
    steps = [normalizers.Replace(" ", space)]
    decode = [decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse()]
    if bool_field(g, "tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend(space))
        decode.append(decoders.Strip(" ", 1, 0))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence(decode)
    return tok


def _str_list(g: Gguf, key: str, v) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        g.fail(key, "expected an array of strings")
    return v
