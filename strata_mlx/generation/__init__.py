"""Generation on a loaded model: prompts and tokenizers, chunked prefill and decode, sampling,
prompt (KV) caches, chat output parsing, measurement tools.

Imports the layers below it; never convert or apps."""
