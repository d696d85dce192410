"""The chat template renders as transformers' apply_chat_template: GPT-OSS's harmony template
(the real text, tests/data/gpt_oss_chat_template.jinja) on a tiny tokenizer that has its
special tokens, carried by the converter into the store, rendered by the API, by
`generate --chat` and by the server to the token ids transformers' tokenizer gives.

The template text is the one transformers' own GPT-OSS converter writes as the checkpoint's
chat template (huggingface/transformers, src/transformers/models/gpt_oss/
convert_gpt_oss_weights_to_hf.py, write_tokenizer's chat_template, commit 44597b1d), copied
unchanged. Its system message carries strftime_now's date, tool arguments go through tojson:
both must be transformers' (the date, and json.dumps without jinja's HTML escapes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import llama_cpp_gguf as lc
import pytest

import strata_mlx
from strata_mlx.generation.tokenizer import load_tokenizer

HARMONY = Path(__file__).parents[1] / "data" / "gpt_oss_chat_template.jinja"
# GPT-OSS's special tokens (o200k_harmony), after the toy vocabulary's
SPECIALS = (
    "<|startoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
)

TWO_TURNS = [
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": "the cat in the hat"},
    {"role": "assistant", "content": "He came to play."},
    {"role": "user", "content": "in the rain?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "A city"},
                    "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
                },
                "required": ["city"],
            },
        },
    }
]
WITH_TOOLS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "<Paris> & 'Co'"}},
            }
        ],
    },
    {"role": "tool", "content": "<b>sunny</b> & 20°C"},
    {"role": "user", "content": "and tomorrow?"},
]


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    """(checkpoint, store): a tiny GptOssForCausalLM whose tokenizer transformers saved with the
    harmony template (chat_template.jinja), and its conversion."""
    import transformers as T

    from strata_mlx.convert.hf import convert_hf

    d = tmp_path_factory.mktemp("harmony")
    ck = d / "ck"
    lc.hf_model("gpt_oss").save_pretrained(ck)
    lc.write_tokenizer(ck, SPECIALS)
    tok = T.AutoTokenizer.from_pretrained(ck)
    tok.chat_template = HARMONY.read_text()
    tok.eos_token = "<|return|>"
    tok.save_pretrained(ck)
    assert (ck / "chat_template.jinja").read_text() == HARMONY.read_text()
    store = convert_hf(ck, d / "store", progress=False, calibration_tokens=0)
    return ck, store


def _transformers_ids(ck: Path, messages, **kw) -> list[int]:
    import transformers as T

    tok = T.AutoTokenizer.from_pretrained(ck)
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _ours(store: Path, messages, **kw) -> list[int]:
    tok = load_tokenizer(store)
    return tok.encode(tok.apply_chat_template(messages, **kw), add_special_tokens=False)


def test_the_store_carries_the_template(harmony):
    _, store = harmony
    assert load_tokenizer(store).chat_template == HARMONY.read_text()


@pytest.mark.parametrize(
    "messages, kw",
    [
        (TWO_TURNS, {}),
        (TWO_TURNS, {"reasoning_effort": "high", "model_identity": "You are a cat."}),
        (WITH_TOOLS, {"tools": TOOLS}),
    ],
    ids=["two-turns", "template-kwargs", "tools"],
)
def test_harmony_tokens_are_transformers(harmony, messages, kw):
    ck, store = harmony
    ids = _ours(store, messages, **kw)
    assert ids == _transformers_ids(ck, messages, **kw)
    tok = load_tokenizer(store)
    assert tok._tok.token_to_id("<|start|>") in ids  # the specials are whole tokens
    text = tok.apply_chat_template(messages, **kw)
    assert text.startswith("<|start|>system<|message|>") and text.endswith("<|start|>assistant")
    if kw.get("tools"):  # tojson as transformers' (jinja's own would write \u003c for <)
        assert "\"<Paris> & 'Co'\"" in text and '"<b>sunny</b> & 20°C"' in text


def test_generate_chat_and_the_server_render_it(harmony):
    """`generate --chat` and /v1/chat/completions count the prompt transformers tokenizes."""
    import httpx2 as httpx
    import openai
    from test_server import running

    from strata_mlx.apps.server import create_app

    ck, store = harmony
    want = _transformers_ids(ck, TWO_TURNS)
    r = subprocess.run(
        [sys.executable, "-m", "strata_mlx", "generate", "--model", str(store), "-m", "1"]
        + ["--system-prompt", TWO_TURNS[0]["content"], "-p", TWO_TURNS[1]["content"]],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    one_turn = _transformers_ids(ck, TWO_TURNS[:2])
    assert f"Prompt: {len(one_turn)} tokens" in r.stdout, r.stdout
    model, tok = strata_mlx.load(store)
    try:
        with running(create_app(model, tok, "tiny-gpt-oss")) as base:
            http = httpx.Client(trust_env=False, timeout=60)
            client = openai.OpenAI(
                base_url=base + "/v1", api_key="none", max_retries=0, http_client=http
            )
            reply = client.chat.completions.create(
                model="tiny-gpt-oss", messages=TWO_TURNS, max_tokens=1, temperature=0
            )
            http.close()
    finally:
        model.expert_cache.close()
    assert reply.usage.prompt_tokens == len(want)


def test_a_gguf_of_it_renders_the_same(harmony, tmp_path):
    """llama.cpp's converter writes the template into the GGUF (tokenizer.chat_template) and
    the special tokens as control tokens; the store made from that file renders the same ids."""
    from strata_mlx.convert.gguf import convert_gguf

    src = lc.converter_dir()
    if src is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py: pip could not fetch llama-cpp-python")
    ck, _ = harmony
    gguf = lc.convert(src, ck, tmp_path / "m.gguf")
    store = convert_gguf(gguf, tmp_path / "s", progress=False, calibration_tokens=0)
    assert load_tokenizer(store).chat_template == HARMONY.read_text()
    for messages, kw in ((TWO_TURNS, {}), (WITH_TOOLS, {"tools": TOOLS})):
        assert _ours(store, messages, **kw) == _transformers_ids(ck, messages, **kw)


# ---- text that is not UTF-8 -----------------------------------------------------------------


def test_non_utf8_text_is_one_line_naming_the_byte(tmp_path, monkeypatch):
    """A non-UTF-8 byte on the command line reaches Python as a lone surrogate (0xE9 as
    U+DCE9), one in a JSON request as "\\ud800": the tokenizer library raised a TypeError."""
    import io

    from strata_mlx.config import OptionError
    from strata_mlx.generation.tokenizer import read_stdin, text_from_bytes

    d = tmp_path / "s"
    d.mkdir()
    from test_server import write_tokenizer

    write_tokenizer(d)
    tok = load_tokenizer(d)
    for text, what in (("caf\udce9", "byte 0xe9 at character 3"), ("a\ud800", "U\\+D800")):
        with pytest.raises(OptionError, match=f"prompt: not UTF-8 text \\({what}") as e:
            tok.encode(text)
        assert "\n" not in str(e.value)
        rendered = tok.apply_chat_template([{"role": "user", "content": text}])
        with pytest.raises(OptionError, match="prompt: not UTF-8 text"):
            tok.encode(rendered)
    assert text_from_bytes("café".encode(), "stdin") == "café"
    with pytest.raises(OptionError, match="stdin: not UTF-8 text \\(byte 0xe9 at offset 3\\)"):
        text_from_bytes(b"caf\xe9", "stdin")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ok \xff")))
    with pytest.raises(OptionError, match="--prompt -: not UTF-8 text \\(byte 0xff at offset 3"):
        read_stdin("--prompt -")


def test_cli_non_utf8_prompt_and_system_prompt_are_one_line(store, tmp_path):
    """`-p $'caf\\xe9'`, `--system-prompt` and cache-prompt ended in a traceback."""
    import shutil

    from test_server import FAMILY, write_tokenizer

    d = shutil.copytree(store(FAMILY), tmp_path / "s")
    write_tokenizer(d)
    cli = [sys.executable, "-m", "strata_mlx"]
    for args in (
        ["generate", "--model", d, "-m", "2", "-p", b"caf\xe9"],
        ["generate", "--model", d, "-m", "2", "-p", "hi", "--system-prompt", b"\xff"],
        ["cache-prompt", "--model", d, "-p", b"caf\xe9", "--prompt-cache-file",
         tmp_path / "c.safetensors"],
    ):  # fmt: skip
        r = subprocess.run([*cli, *map(os.fsencode, args)], capture_output=True, text=True)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (args, r.stderr)
        assert "not UTF-8 text" in r.stderr
    assert not (tmp_path / "c.safetensors").exists()


def test_standard_input_past_its_limit_is_refused_not_held(monkeypatch):
    """An endless stream on stdin (`-p - < /dev/zero`) read as a prompt ended in a
    MemoryError: past the limit it is an OptionError, having read just past it."""
    import io
    import sys

    from strata_mlx.config import OptionError
    from strata_mlx.generation.tokenizer import read_stdin

    class Endless(io.RawIOBase):
        served = 0

        def readable(self):
            return True

        def readinto(self, b):
            b[:] = b"a" * len(b)
            Endless.served += len(b)
            return len(b)

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(Endless())))
    with pytest.raises(OptionError, match=r"^--prompt - \(stdin\): more than 1 MB; no model"):
        read_stdin("--prompt - (stdin)", limit=1 << 20)
    assert Endless.served < 2 << 20
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("café".encode())))
    assert read_stdin(limit=1 << 20) == "café"
