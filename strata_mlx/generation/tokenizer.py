"""The tokenizer: Hugging Face `tokenizers` plus the chat template (chat_template.jinja, else
chat_template.json, else tokenizer_config.json's chat_template: transformers' order).

The template renders as transformers' apply_chat_template renders it: the same jinja
environment (sandboxed, trim_blocks and lstrip_blocks, loop controls, a `{% generation %}`
block that only renders its body) and the same globals and filters (`raise_exception`,
`strftime_now`, a `tojson` that does not escape HTML), which GPT-OSS's harmony template needs
(its system message carries strftime_now's date; tool arguments go through tojson).

Owns text <-> ids and incremental detokenization for streaming. Never touches the model.
"""

from __future__ import annotations

from pathlib import Path

from ..config import OptionError
from ..format.store import StoreError, read_json

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


class ChatTemplateError(ValueError):
    """The chat template refused the messages (its own raise_exception); one line."""


class Tokenizer:
    """Every file is checked when the tokenizer is loaded (and the chat template compiled),
    so a bad file is a StoreError naming it before any model work, not a failure mid-request."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        tj = path / "tokenizer.json"
        try:
            self._tok = HFTokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises a bare Exception with serde's message
            raise StoreError(f"{tj}: unreadable tokenizer ({_first_line(e)})") from None
        cfg_path = path / "tokenizer_config.json"
        self.config = _json_object(cfg_path) if cfg_path.is_file() else {}
        template = path / "chat_template.jinja"
        if template.is_file():
            try:
                self.chat_template = template.read_text()
            except (OSError, ValueError) as e:
                raise StoreError(f"{template}: unreadable ({_first_line(e)})") from None
            self._template_source = str(template)
        elif (path / "chat_template.json").is_file():  # {"chat_template": text}
            ct = path / "chat_template.json"
            self.chat_template = _template_text(_json_object(ct).get("chat_template"), ct)
            self._template_source = f"{ct}: chat_template"
        else:
            self.chat_template = _template_text(self.config.get("chat_template"), cfg_path)
            self._template_source = f"{cfg_path}: chat_template"
        self._template = self._compile() if self.chat_template else None
        self.bos_token = _token_str(self.config.get("bos_token"), cfg_path, "bos_token")
        self.eos_token = _token_str(self.config.get("eos_token"), cfg_path, "eos_token")
        self.eos_token_ids: set[int] = set()
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            self.eos_token_ids.add(self._tok.token_to_id(self.eos_token))
        gen = path / "generation_config.json"
        if gen.is_file():
            eos = _json_object(gen).get("eos_token_id")
            ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
            for i in ids:
                if not isinstance(i, int) or isinstance(i, bool) or i < 0:
                    raise StoreError(f"{gen}: eos_token_id: expected token ids, got {eos!r:.40}")
            self.eos_token_ids.update(ids)

    def _compile(self):
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _generation_block()]
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        try:
            return env.from_string(self.chat_template)
        except TemplateError as e:
            raise StoreError(
                f"{self._template_source}: bad chat template ({_first_line(e)})"
            ) from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; text that is not Unicode (a lone surrogate: a non-UTF-8 byte
        of a command-line argument, a JSON escape) is an OptionError naming the prompt."""
        check_text(text, "prompt")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs
    ) -> str:
        """`template_kwargs` are more variables for the template (e.g. Qwen3's enable_thinking),
        as Hugging Face's apply_chat_template passes them."""
        if not self.chat_template:
            # No template: plain "role: content" lines, then the assistant's turn.
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant: " if add_generation_prompt else "")
        try:
            text = self._template.render(
                **template_kwargs,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except ChatTemplateError:
            raise
        except Exception as e:  # a template bug (UndefinedError, TypeError, ...) at render time
            raise StoreError(
                f"{self._template_source}: the chat template failed ({_first_line(e)})"
            ) from None
        return text

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


def check_text(text: str, what: str) -> str:
    """`text` if it can be written as UTF-8. Python keeps a command line's non-UTF-8 bytes as
    lone surrogates (0xE9 as U+DCE9) and JSON can spell one out ("\\ud800"); the tokenizer
    library refuses both with a TypeError that names neither the input nor the byte."""
    if not isinstance(text, str):
        raise OptionError(f"{what}: expected text, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        what_char = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"U+{c:04X}"
        raise OptionError(
            f"{what}: not UTF-8 text ({what_char} at character {e.start}); give it in UTF-8"
        ) from None
    return text


def text_from_bytes(data: bytes, what: str) -> str:
    """Bytes a user gave as text (stdin, a prompt file) decoded as UTF-8, or an OptionError
    naming `what` and the first bad byte's offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OptionError(
            f"{what}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
            "give it in UTF-8"
        ) from None


# The most of standard input read as a prompt: far past any model's context in text (a
# million tokens is a few MB), short of exhausting memory on an endless stream (/dev/zero).
STDIN_LIMIT = 256 << 20


def read_stdin(what: str = "stdin", limit: int = STDIN_LIMIT) -> str:
    """Standard input as UTF-8 text, whatever the locale says (text_from_bytes); more than
    `limit` bytes is an OptionError, not a reader holding all of it."""
    import sys

    data = sys.stdin.buffer.read(limit + 1)
    if len(data) > limit:
        raise OptionError(f"{what}: more than {limit >> 20} MB; no model's context holds that")
    return text_from_bytes(data, what)


def _token_str(t, path: Path, field: str) -> str | None:
    if isinstance(t, dict):
        t = t.get("content")
    if t is not None and not isinstance(t, str):
        raise StoreError(f"{path}: {field}: expected a string, got {type(t).__name__}")
    return t


def _template_text(t, path: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or Hugging Face's list of named
    templates (the one named "default")."""
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default")
    if t is not None and not isinstance(t, str):
        raise StoreError(f"{path}: chat_template: expected a string, got {type(t).__name__}")
    return t


def _json_object(path: Path) -> dict:
    data = read_json(path)
    if not isinstance(data, dict):
        raise StoreError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _strftime_now(fmt: str) -> str:
    from datetime import datetime

    return datetime.now().strftime(fmt)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson: json.dumps as it is (jinja's own escapes <, >, & and ')."""
    import json

    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _generation_block():
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it for
    its training masks): rendered as its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return Generation


def _raise(msg: str):
    raise ChatTemplateError(str(msg).splitlines()[0] if str(msg) else "the chat template refused")


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The store's tokenizer, or None when the store has no tokenizer.json."""
    return Tokenizer(path) if (Path(path) / "tokenizer.json").is_file() else None
