"""`strata-mlx cache-prompt`: run a prompt once and save its KV / recurrent state."""

from __future__ import annotations

from pathlib import Path

import typer

from ...config import (
    OptionError,
    parse_tokens,
)
from .common import (
    KV_FLAGS,
    Model,
    builtin_model,
    chat_flag,
    check_outputs,
    check_prompt_flags,
    kv_options,
    runtime_command,
    template_config,
)


@runtime_command
def cache_prompt(
    prompt_cache_file: Path = typer.Option(
        ..., "--prompt-cache-file", help="The .safetensors file to write."
    ),
    model: Model = None,
    prompt: str | None = typer.Option(
        None, "--prompt", "-p", help="Prompt text ('-' reads stdin)."
    ),
    prompt_tokens: str | None = typer.Option(
        None, "--prompt-tokens", help="Prompt as token ids: 1,2,3."
    ),
    system_prompt: str | None = typer.Option(
        None, "--system-prompt", help="A system message (rendered by the chat template)."
    ),
    chat: bool | None = typer.Option(
        None,
        "--chat/--no-chat",
        metavar="",
        help="Render through the chat template (default: with "
        "--system-prompt or --chat-template-config), without the generation prompt.",
    ),
    chat_template_config: str | None = typer.Option(
        None, "--chat-template-config", help="More chat template variables (JSON object)."
    ),
    max_kv_size: int | None = KV_FLAGS["max_kv_size"],
    kv_bits: int | None = KV_FLAGS["kv_bits"],
    kv_group_size: int = KV_FLAGS["kv_group_size"],
    quantized_kv_start: int = KV_FLAGS["quantized_kv_start"],
    runtime=None,
):
    """Run a prompt once and save its KV / recurrent state (mlx-lm's cache_prompt); generate
    and serve start from it with --prompt-cache-file."""
    args = dict(locals())
    import json
    import time

    from ...generation.generate import cache_prompt as run_prompt
    from ...generation.generate import load
    from ...generation.prompt_cache import save_prompt_cache

    kv = kv_options(args)
    check_outputs(model, {"--prompt-cache-file": prompt_cache_file})
    template_kwargs = template_config(chat_template_config)
    chat = chat_flag(chat, system_prompt, chat_template_config)
    check_prompt_flags(prompt, prompt_tokens, system_prompt, chat_template_config, chat)
    if prompt is None and prompt_tokens is None and system_prompt is None:
        raise OptionError("give --prompt/-p, --prompt-tokens or --system-prompt")
    model, arena_gb = builtin_model(model, runtime.arena_gb)
    cfg = runtime.replace(arena_gb=arena_gb)
    m, tok = load(model, config=cfg)
    from ...generation.prompt_cache import make_prompt_cache

    make_prompt_cache(m, kv, cli=True)  # a family that cannot take the KV flags: named here
    if prompt == "-":
        from ...generation.tokenizer import read_stdin

        prompt = read_stdin("--prompt - (stdin)")  # non-UTF-8 input is one line
    if prompt_tokens is not None:
        ids = parse_tokens(prompt_tokens, "--prompt-tokens")
    elif tok is None:
        raise OptionError(f"{model}: the store has no tokenizer; use --prompt-tokens")
    elif chat:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if prompt is not None:
            messages.append({"role": "user", "content": prompt})
        text = tok.apply_chat_template(messages, add_generation_prompt=False, **template_kwargs)
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(prompt)
    vocab = m.args.vocab_size
    if any(not 0 <= i < vocab for i in ids):
        raise OptionError(f"prompt token ids must lie in [0, {vocab})")
    from ...config import check_context

    context = getattr(m.args, "max_position_embeddings", None)
    check_context(len(ids), 0, context, kv.max_kv_size is not None, cli=True)
    from .generate import PrefillBar, where_in_chunk

    t = time.perf_counter()
    bar = PrefillBar(where_in_chunk(m))
    try:
        cache = run_prompt(m, ids, kv, cfg.prefill_step_size, prompt_progress_callback=bar.update)
    finally:
        bar.close()
    dt = time.perf_counter() - t
    save_prompt_cache(prompt_cache_file, cache, m, ids,
                      {"chat_template_config": json.dumps(template_kwargs)})  # fmt: skip
    import mlx.core as mx

    typer.echo(f"Prompt: {len(ids)} tokens, {len(ids) / max(dt, 1e-9):.3f} tokens-per-sec")
    typer.echo(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
    typer.echo(f"Saved {prompt_cache_file}")
    m.expert_cache.close()
