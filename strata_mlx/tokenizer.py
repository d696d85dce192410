"""The tokenizer: Hugging Face `tokenizers` plus the chat template from tokenizer_config.json.

Owns text <-> ids and incremental detokenization for streaming. Never touches the model.
"""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


class Tokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        self._tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = path / "chat_template.jinja"
        self.chat_template = (
            template.read_text() if template.is_file() else self.config.get("chat_template")
        )
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        self.eos_token_ids: set[int] = set()
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            self.eos_token_ids.add(self._tok.token_to_id(self.eos_token))
        gen = path / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            self.eos_token_ids.update(
                eos if isinstance(eos, list) else [eos] if eos is not None else []
            )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            # No template: plain "role: content" lines, then the assistant's turn.
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant: " if add_generation_prompt else "")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def detokenizer(self) -> StreamingDetokenizer:
        return StreamingDetokenizer(self)


class StreamingDetokenizer:
    """Text segments as tokens arrive; holds back an incomplete UTF-8 sequence."""

    def __init__(self, tokenizer: Tokenizer):
        self._t = tokenizer
        self.tokens: list[int] = []
        self._emitted = ""

    def add(self, token: int) -> str:
        self.tokens.append(token)
        text = self._t.decode(self.tokens)
        if text.endswith("\ufffd"):
            return ""
        seg = text[len(self._emitted) :] if text.startswith(self._emitted) else ""
        self._emitted = text
        return seg

    @property
    def text(self) -> str:
        return self._t.decode(self.tokens)


def _token_str(t) -> str | None:
    if isinstance(t, dict):
        return t.get("content")
    return t


def _raise(msg: str):
    raise ValueError(msg)


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The store's tokenizer, or None when the store has no tokenizer.json."""
    return Tokenizer(path) if (Path(path) / "tokenizer.json").is_file() else None
