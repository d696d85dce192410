"""`strata-mlx serve`: an OpenAI-compatible HTTP server for one model (FastAPI + uvicorn).

The package: schemas (request bodies, errors), engine (the generation worker), routes (the
handlers), app (create_app, serve).

Endpoints: POST /v1/chat/completions, POST /v1/completions (both streaming as SSE or not),
POST /v1/messages (Anthropic's Messages API, strata_mlx.apps.anthropic_api), POST /v1/responses
(OpenAI's Responses API, strata_mlx.apps.responses_api), GET /v1/models, GET /v1/stats (also
/stats) with the expert cache's counters, GET /dashboard (a live page of them,
strata_mlx.apps.dashboard).

Sampling fields are mlx-lm's server's (temperature, top_p, top_k, min_p, xtc_probability,
xtc_threshold, logit_bias, repetition_penalty and repetition_context_size, presence_penalty,
frequency_penalty and their context sizes, seed, stop), built into one sampler by
strata_mlx.generation.sampling exactly as `generate`'s flags are; an omitted temperature is OpenAI's 1.
Chat requests' `tools` (OpenAI's function shape, checked) go through the model's chat template
(`tool_choice` "auto" or "none"), and so do `chat_template_kwargs` (the template's variables,
such as Qwen3's enable_thinking); `response_format` other than "text" is a 400 (no constrained
decoding);
the model's `<think>` reasoning comes back as `reasoning_content` and its Qwen3 `<tool_call>`
blocks as `tool_calls`, streamed as OpenAI streams them (strata_mlx.generation.chat_output).

One model, one expert cache, one KV cache per request: generation runs on a single worker
thread, so requests queue and never share state, and the event loop stays free to accept and
stream. What a request can get wrong is answered 4xx with an OpenAI-style error body
{"error": {"message", "type", "param", "code"}}, never 500 (kept for faults of the server
itself, e.g. a corrupt store):

- a request whose client disconnects is cancelled, queued or running, streaming or not: the
  worker stops at its next token, or mid-prefill at the next MoE layer of its chunk (a
  batched prefill forward once every request in it is gone);
- at most `max_queue` requests wait behind the running one; more are answered 429 with a
  Retry-After estimated from recent requests' durations;
- a prompt longer than `max_prompt_tokens` and a max_tokens above `max_tokens_limit` are 400s
  (both default to the model's context), and so is a prompt longer than the model's context;
  generation ends at the context's end (finish "length") when prompt + max_tokens is past it,
  unless the KV cache rotates (`kv`'s max_kv_size);
- with an API key every request must carry `Authorization: Bearer <key>` (compared in constant
  time) or gets 401 (/dashboard, a browser's page, also takes HTTP Basic with the key as the
  password); with allowed origins, browsers' CORS preflights from them succeed;
- a connection whose client sends nothing for 30 s while its request's head or body is due is
  closed, and past a cap of open connections a new one closes the quietest such connection
  (a request whose body is in is never cut; guard.guarded_http);
- on SIGTERM the server stops accepting, lets requests in flight finish for up to
  `shutdown_timeout` seconds, then cancels what is left and exits.
"""

from __future__ import annotations

from .app import create_app, model_context, serve
from .engine import Engine, Job, ServeState
from .routes import stats_body
from .schemas import APIError

__all__ = [
    "APIError",
    "Engine",
    "Job",
    "ServeState",
    "create_app",
    "model_context",
    "serve",
    "stats_body",
]
