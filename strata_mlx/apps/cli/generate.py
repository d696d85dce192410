"""`strata-mlx generate`: a prompt, streamed through the arena, printed as it decodes."""

from __future__ import annotations

from pathlib import Path

import typer

from ...config import (
    OptionError,
    parse_tokens,
)
from ...progress import StatusLine
from .common import (
    KV_FLAGS,
    PANEL_RESEARCH,
    PANEL_SAMPLING,
    Model,
    Pipeline,
    PipelineSplit,
    PipelineTimeout,
    TraceFile,
    builtin_model,
    chat_flag,
    check_outputs,
    check_pipeline_flags,
    check_prompt_flags,
    kv_options,
    runtime_command,
    save_npy,
    switch,
    template_config,
)


def _sampling_flag(default, names: str, help: str):
    return typer.Option(default, names, help=help, rich_help_panel=PANEL_SAMPLING)


def _research_flag(names: str, help: str):
    return typer.Option(None, names, help=help, rich_help_panel=PANEL_RESEARCH)


@runtime_command
def generate(
    model: Model = None,
    prompt: str | None = typer.Option(
        None,
        "--prompt",
        "-p",
        help="Prompt text ('-' reads stdin; the built-in model's default: 'What is the "
        "capital of France?').",
    ),
    prompt_tokens: str | None = typer.Option(
        None, "--prompt-tokens", help="Prompt as token ids: 1,2,3."
    ),
    max_tokens: int = typer.Option(100, "--max-tokens", "-m", help="Tokens to generate."),
    ignore_chat_template: bool = switch(
        "--ignore-chat-template", "Use the prompt as given, not through the chat template."
    ),
    chat: bool | None = switch(
        "--chat/--no-chat",
        "--chat: the chat template (the default where the tokenizer has one); "
        "--no-chat: as --ignore-chat-template.",
        default=None,
    ),
    system_prompt: str | None = typer.Option(
        None, "--system-prompt", help="A system message before the prompt."
    ),
    chat_template_config: str | None = typer.Option(
        None,
        "--chat-template-config",
        help="More variables for the chat template, as a JSON object.",
    ),
    verbose: bool = switch("--verbose", "One trace line per prefill chunk."),
    prompt_cache_file: Path | None = typer.Option(
        None,
        "--prompt-cache-file",
        help="Start from a prompt cache written by cache-prompt (the prompt continues it).",
    ),
    temp: float = _sampling_flag(0.0, "--temp", "Sampling temperature (0: greedy)."),
    top_p: float = _sampling_flag(1.0, "--top-p", "Sampling top-p (1: off)."),
    min_p: float = _sampling_flag(0.0, "--min-p", "Sampling min-p (0: off)."),
    top_k: int = _sampling_flag(0, "--top-k", "Sampling top-k (0: off)."),
    min_tokens_to_keep: int = _sampling_flag(
        1, "--min-tokens-to-keep", "Minimum tokens to keep for min-p sampling."
    ),
    xtc_probability: float = _sampling_flag(
        0.0, "--xtc-probability", "Probability of XTC sampling at each token."
    ),
    xtc_threshold: float = _sampling_flag(
        0.1, "--xtc-threshold", "XTC drops the tokens above this probability but one."
    ),
    repetition_penalty: float | None = _sampling_flag(
        None, "--repetition-penalty", "Penalty on the logits of recent tokens (1: none)."
    ),
    repetition_context_size: int = _sampling_flag(
        20, "--repetition-context-size", "Tokens the repetition penalty looks back."
    ),
    seed: int | None = _sampling_flag(None, "--seed", "PRNG seed."),
    logits_out: Path | None = _research_flag(
        "--logits-out", "Write teacher-forced prompt logits [T, vocab] float32 .npy."
    ),
    logits_ref: Path | None = _research_flag(
        "--logits-ref", "Compare prompt logits with a .npy (KLD, top-1)."
    ),
    dump_moe: Path | None = _research_flag("--dump-moe", "Write per-layer MoE state (.npy) here."),
    trace_file: TraceFile = None,
    pipeline: Pipeline = False,
    pipeline_split: PipelineSplit = None,
    pipeline_timeout: PipelineTimeout = 300.0,
    max_kv_size: int | None = KV_FLAGS["max_kv_size"],
    kv_bits: int | None = KV_FLAGS["kv_bits"],
    kv_group_size: int = KV_FLAGS["kv_group_size"],
    quantized_kv_start: int = KV_FLAGS["quantized_kv_start"],
    runtime=None,
):
    """Generate text from a store, streaming experts through the arena."""
    args = dict(locals())
    check_prompt_flags(prompt, prompt_tokens, system_prompt, chat_template_config, chat)
    if ignore_chat_template and chat:
        raise OptionError("--ignore-chat-template and --chat: give one or the other")
    if prompt is None and prompt_tokens is None:
        if model is not None:
            raise OptionError("give --prompt/-p or --prompt-tokens")
        prompt = "What is the capital of France?"
    sampling = _sampling(args)  # every flag is checked before a model is loaded
    check_outputs(
        model,
        {"--logits-out": logits_out, "--trace": trace_file},
        inputs={"--prompt-cache-file": prompt_cache_file, "--logits-ref": logits_ref},
    )
    check_pipeline_flags(pipeline, pipeline_split, pipeline_timeout)
    kv = kv_options(args)
    template_kwargs = template_config(chat_template_config)
    # mlx-lm's default: the chat template where the tokenizer has one; a prompt cache is
    # continued as plain text unless the template is asked for
    auto_chat = chat is None and not ignore_chat_template and prompt_cache_file is None
    chat = chat_flag(False if ignore_chat_template else chat, system_prompt, chat_template_config)
    model, arena_gb = builtin_model(model, runtime.arena_gb)
    cfg = runtime.replace(arena_gb=arena_gb)
    _check_experts_per_token(model, cfg.experts_per_token)
    pipe = _pipeline(args, kv)
    cfg = _with_hooks(cfg, dump_moe, trace_file, pipe)
    from ...generation.tokenizer import load_tokenizer
    from ...runtime.loader import kv_past_a_chunk, load_model, store_args

    # (a path that is no store is told so before anything of the prompt)
    context = getattr(store_args(model), "max_position_embeddings", None)
    tok, ids, reserve = load_tokenizer(model), None, 0  # (its files checked before the model's)
    if pipe is None:  # the prompt first: the arena leaves room for its whole KV cache
        ids, chat, prompt = _prompt(tok, model, prompt, prompt_tokens, system_prompt, chat,
                                    auto_chat, template_kwargs, max_tokens, kv, context)  # fmt: skip
        positions = len(ids) + max_tokens
        reserve = kv_past_a_chunk(model, positions, cfg.prefill_step_size, kv.kv_bits,
                                  kv.kv_group_size, kv.max_kv_size)  # fmt: skip
    m = load_model(model, config=cfg, pipeline=pipe, reserve_bytes=reserve)
    from ...generation.prompt_cache import make_prompt_cache

    make_prompt_cache(m, kv, cli=True)  # a family that cannot take the KV flags: named here
    if pipe is not None and pipe.size > 1:
        if pipe.rank != 0:  # rank 0 prompts, samples and prints; the others compute
            from ...runtime.distributed import serve_stage

            serve_stage(m)
            return
        m.wait_ready()
    else:
        pipe = None
    if ids is None:  # (a pipeline's rank 0: the prompt read once its stages are ready)
        ids, chat, prompt = _prompt(tok, model, prompt, prompt_tokens, system_prompt, chat,
                                    auto_chat, template_kwargs, max_tokens, kv, context)  # fmt: skip
    _prompt_logits(m, ids, cfg.prefill_step_size, logits_out, logits_ref)
    prompt_cache, cached = _resume(m, tok, prompt_cache_file, kv, ids, prompt, prompt_tokens, chat)
    if prompt_cache is not None and ids[: len(cached)] == cached:
        ids = ids[len(cached) :]
    last, stopped = _print_stream(m, tok, ids, args, cfg, sampling, kv, prompt_cache, cached)
    _print_summary(m, last, verbose, pipe)
    # Ctrl-C: what was generated and its figures; the MoE dump closed with the layers it has,
    # no --trace of a part of the run, exit 130
    _close(m, cfg, None if stopped else trace_file)
    if stopped:
        raise SystemExit(130)


# SamplingOptions' fields, as generate's flags of the same names
SAMPLING_FLAGS = ("temp", "top_p", "min_p", "min_tokens_to_keep", "top_k", "xtc_probability",
                  "xtc_threshold", "repetition_penalty", "repetition_context_size")  # fmt: skip


def _sampling(args: dict):
    """generate's sampling flags (`args`, by name) as checked SamplingOptions."""
    from ...config import check_sampling
    from ...generation.sampling import SamplingOptions

    sampling = SamplingOptions(**{name: args[name] for name in SAMPLING_FLAGS})
    check_sampling(args["max_tokens"], args["temp"], args["top_p"], args["seed"], cli=True)
    sampling.check(cli=True)
    return sampling


def _check_experts_per_token(model: str | Path, experts_per_token: int | None) -> None:
    """--experts-per-token: the store's count of experts bounds it, in every family."""
    if experts_per_token is None:
        return
    from ...config import check_int
    from ...format.store import load_manifest

    n = load_manifest(model).num_experts
    check_int("experts_per_token", experts_per_token, 1, n, cli=True)


def _with_hooks(cfg, dump_moe: Path | None, trace_file: Path | None, pipe):
    """`cfg` with the research hooks the flags ask for: --dump-moe's and --trace's."""
    if dump_moe is not None:
        from ...generation.tools import MoeDumper

        cfg = cfg.replace(dump=MoeDumper(dump_moe))
    if trace_file is not None:
        if pipe is not None:
            raise OptionError("--trace: a pipelined run's routing is not traced yet")
        from ...stream.stats import RoutingTrace

        cfg = cfg.replace(trace=RoutingTrace())
    return cfg


def _close(model, cfg, trace_file: Path | None) -> None:
    """After the run: the MoE dump closed, the routing trace written, the cache stopped."""
    if cfg.dump is not None:
        cfg.dump.close()
    if trace_file is not None:
        from ...stream import trace

        trace.write(trace_file, trace.of_model(model))
    model.expert_cache.close()


def _pipeline(args: dict, kv):
    """--pipeline (under mlx.launch): this rank's Pipeline, or None without the flag."""
    if not args["pipeline"]:
        return None
    from ...runtime.distributed import Pipeline

    if kv.max_kv_size or kv.kv_bits or args["prompt_cache_file"]:  # each rank has its own cache
        raise OptionError(
            "--pipeline: --max-kv-size, --kv-bits and --prompt-cache-file are not pipelined yet"
        )
    return Pipeline(split=args["pipeline_split"], timeout_s=args["pipeline_timeout"])


def _prompt(tok, model, prompt, prompt_tokens, system_prompt, chat, auto_chat, template_kwargs,
            max_tokens: int, kv, context):  # fmt: skip
    """(the prompt's token ids, whether the chat template made them, its text: stdin's for
    '-'), the ids checked against the model's `context` with the tokens to generate."""
    if prompt == "-":
        from ...generation.tokenizer import read_stdin

        prompt = read_stdin("--prompt - (stdin)")  # non-UTF-8 input is one line
    chat = chat or (auto_chat and tok is not None and bool(tok.chat_template))
    ids = _prompt_ids(tok, model, prompt, prompt_tokens, system_prompt, chat, template_kwargs)
    from ...config import check_context

    check_context(len(ids), max_tokens, context, kv.max_kv_size is not None, cli=True)
    return ids, chat, prompt


def _prompt_ids(tok, model, prompt, prompt_tokens, system_prompt, chat, template_kwargs):
    """The prompt's token ids: --prompt-tokens as given, else the text (through the chat
    template with `chat`) encoded by the store's tokenizer."""
    if prompt_tokens is not None:
        return parse_tokens(prompt_tokens, "--prompt-tokens")
    if tok is None:
        raise OptionError(f"{model}: the store has no tokenizer; use --prompt-tokens")
    messages = [{"role": "user", "content": prompt}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    text = tok.apply_chat_template(messages, **template_kwargs) if chat else prompt
    return tok.encode(text, add_special_tokens=not chat)  # a template carries its own BOS


def _prompt_logits(model, ids, step: int, logits_out, logits_ref) -> None:
    """--logits-out / --logits-ref: the prompt's teacher-forced logits, saved or compared."""
    if logits_out is None and logits_ref is None:
        return
    from ...generation.generate import teacher_forced_logits

    logits = teacher_forced_logits(model, ids, step)
    if logits_out is not None:
        save_npy(logits_out, logits)
    if logits_ref is not None:
        from ...generation.tools import kld_report, load_logits

        typer.echo(kld_report(load_logits(logits_ref), logits).line())


def _print_stream(model, tok, ids, args: dict, cfg, sampling, kv, prompt_cache, cached):
    """Generate and print each piece as it comes (text, or token ids without a tokenizer):
    (the last response or None when nothing was generated, whether Ctrl-C stopped it)."""
    last = None
    bar = PrefillBar(where_in_chunk(model))
    try:
        for last in _stream(model, tok, ids, args, cfg, sampling, kv, prompt_cache, cached, bar):
            bar.close()
            if tok is not None:
                typer.echo(last.text, nl=False)
            else:
                typer.echo(f"{last.token} ", nl=False)
    except KeyboardInterrupt:
        bar.close()
        if last is not None:
            typer.echo("")  # (the shell's prompt on a line of its own)
        return last, True
    bar.close()
    typer.echo("")
    return last, False


def _stream(model, tok, ids, args: dict, cfg, sampling, kv, prompt_cache, cached, bar):
    """stream_generate with generate's flags."""
    from ...generation.generate import stream_generate

    return stream_generate(
        model,
        tok,
        ids,
        max_tokens=args["max_tokens"],
        seed=args["seed"],
        prefill_step_size=cfg.prefill_step_size,
        sampler=sampling.sampler(tok),
        logits_processors=sampling.logits_processors(model.args.vocab_size),
        prompt_cache=prompt_cache,
        cached_tokens=cached,
        max_kv_size=kv.max_kv_size,
        kv_bits=kv.kv_bits,
        kv_group_size=kv.kv_group_size,
        quantized_kv_start=kv.quantized_kv_start,
        prompt_progress_callback=bar.update,
    )


def where_in_chunk(model):
    """The MoE layer a chunk's handshake has reached, as "layer 12/48" (a chunk of a long
    prompt takes seconds: its bar moves a chunk at a time)."""
    cache = model.expert_cache
    position = {l: i for i, l in enumerate(cache.layers)}

    def where() -> str:
        at = position.get(cache.arena.layer)
        return "" if at is None else f"layer {at + 1}/{len(position)}"

    return where


class PrefillBar:
    """The prompt's progress on stderr (StatusLine): positions done, a chunk at a time, the
    MoE layer the chunk has reached (`where()`) and the time elapsed; made at the prompt's
    first call, which gives its length. Shown where stderr is not a terminal too, as
    conversion's bars are."""

    def __init__(self, where=None):
        self.line = None
        self.closed = False
        self.where = where

    def update(self, done: int, total: int) -> None:
        if self.line is None and not self.closed:
            self.line = StatusLine(enabled=True, desc="prefill", total=total, unit="tok",
                                   bar_format=None, poll=self.where)  # fmt: skip
        if self.line is not None:
            self.line.count(done)

    def close(self) -> None:
        self.closed = True
        if self.line is not None:
            self.line.close()


def _print_summary(model, last, verbose: bool, pipe) -> None:
    """The run's summary line (and with --verbose a line per prefill chunk); with a pipeline,
    each rank's line, then the pipeline closed."""
    if last is not None:
        from ...generation.generate import summary

        if verbose:
            for i, c in enumerate(last.chunks):
                typer.echo(chunk_line(i, c), err=True)
        slots = model.expert_cache.arena.n_slots
        arena = (slots * model.expert_cache.manifest.layout.record_bytes, slots)
        typer.echo(summary(last, arena))
    if pipe is not None:
        from ...runtime.distributed import rank_lines

        for line in rank_lines(model.rank_stats()):
            typer.echo(line)
        model.close()


def _resume(model, tok, path, kv, ids, prompt, prompt_tokens, chat):
    """--prompt-cache-file: (cache, the tokens it covers), or (None, None). A prompt whose
    tokens begin with the cached ones skips them; any other prompt continues the cache (raw
    text encoded without a BOS, as mlx-lm's generate continues one)."""
    if path is None:
        return None, None
    from ...generation.prompt_cache import check_kv_matches, load_prompt_cache

    cache, cached, _ = load_prompt_cache(path, model)
    check_kv_matches(path, cache, kv, cli=True)
    if ids[: len(cached)] == cached and len(ids) > len(cached):
        return cache, cached
    if chat:
        raise OptionError(
            f"{path}: the cached tokens are not the beginning of this prompt as the chat "
            "template renders it (cache-prompt it with the same --system-prompt)"
        )
    if prompt_tokens is None and tok is not None:
        ids[:] = tok.encode(prompt, add_special_tokens=False)
    return cache, cached


def chunk_line(i: int, c) -> str:
    return (
        f"[chunk {i}] {c.tokens} tok {c.wall_s * 1e3:.1f} ms ({c.tokens / max(c.wall_s, 1e-9):.1f} tok/s) "
        f"ahead {c.streamed_ahead_pct:.1f}% miss {c.miss_pct:.1f}% wait {c.exposed_wait_s * 1e3:.1f} ms "
        f"read {c.experts_read} ({c.gb_read:.3f} GB, {c.gb_per_s:.2f} GB/s) wasted {c.wasted_readahead} "
        f"dropped {c.readahead_dropped} sync {c.route_sync_s * 1e3:.1f} ms host {c.host_s * 1e3:.1f} ms"
    )
