"""Prompt caches kept on disk (`serve --prompt-cache-dir`): conversations' KV and recurrent
state that outlive the server's memory and the server itself.

The server's in-memory caches (PromptCacheLRU) spill here what they evict, and all they hold
when the server stops; a request whose prompt continues a conversation kept here (further
than any cache in memory does) resumes from its file instead of prefilling it again: after an
eviction, or after a restart. One file per conversation state, written and read only through
strata_mlx.generation.prompt_cache's public functions (save_prompt_cache / load_prompt_cache: the
store's hash, the tokens covered and the file's own checks; a file of another model is
refused there), named by the sha256 of its token ids. At start the directory's files are
indexed by their safetensors header's metadata alone (no tensor is read until one is used). The files
of this model are bounded by `max_bytes` together, least recently used dropped first; files of
other models sharing the directory are neither counted nor touched.

Owns the directory and the spilling; never runs the model, never changes the file format, and
never reads or writes outside the directory it is given.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import OptionError
from ..generation.prompt_cache import (
    FORMAT,
    KVOptions,
    PromptCacheError,
    PromptCacheLRU,
    cache_nbytes,
    check_kv_matches,
    common_prefix,
    identity,
    load_prompt_cache,
    reusable_prefix,
    save_prompt_cache,
    trim_to,
)

SUFFIX = ".safetensors"
MAX_HEADER = 100 << 20  # safetensors' own bound on a header
DEFAULT_MAX_BYTES = 16 << 30  # a few long conversations of a 30B-class model's KV cache


@dataclass
class _Entry:
    path: Path
    tokens: list[int]
    nbytes: int
    used: float  # last written or read (the file's mtime): eviction order


def _metadata(path: Path) -> dict:
    """A safetensors file's string metadata, from its header alone (8 bytes of length, then
    JSON): a file whose tensors are cut short is still indexed, and dropped once read."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= MAX_HEADER:
            raise ValueError(f"{path}: header of {n} bytes")
        header = json.loads(f.read(n))
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: no metadata")
    return meta


class PromptCacheDir:
    """The prompt cache files of one model in `path`, at most `max_bytes` of them together."""

    def __init__(self, path: str | Path, model, kv: KVOptions | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES):  # fmt: skip
        self.path = Path(path)
        self.model = model
        self.kv = kv or KVOptions()
        self.max_bytes = max_bytes
        if self.path.exists() and not self.path.is_dir():
            raise OptionError(f"--prompt-cache-dir {self.path}: not a directory")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OptionError(f"--prompt-cache-dir {self.path}: {e.strerror}") from None
        self._store_id = identity(model)["store_id"]
        self._entries: dict[Path, _Entry] = {}
        self.hits = 0  # requests resumed from a file
        self.reused_tokens = 0  # prompt tokens those did not prefill
        self.written = 0  # files written
        self.dropped = 0  # files deleted: the size bound, or unreadable ones of this model
        self.failed_writes = 0  # states not kept: the write failed (a full disk)
        self.last_failure = ""  # why the latest of those failed
        self._scan()

    # ---- the index ------------------------------------------------------------------------

    def _scan(self) -> None:
        for p in sorted(self.path.glob("*" + SUFFIX)):
            if p.name.endswith(".tmp" + SUFFIX):  # a write cut short; its rename never came
                continue
            try:
                meta = _metadata(p)
                tokens = json.loads(meta.get("tokens", "null"))
            except (OSError, ValueError, TypeError):  # not a file of ours: left alone
                continue
            if meta.get("format") != FORMAT or meta.get("store_id") != self._store_id:
                continue
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                continue
            st = p.stat()
            self._entries[p] = _Entry(p, tokens, st.st_size, st.st_mtime)
        self._bound()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def file_for(self, tokens: list[int]) -> Path:
        digest = hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()
        return self.path / (digest[:32] + SUFFIX)

    def _drop(self, entry: _Entry) -> None:
        self._entries.pop(entry.path, None)
        entry.path.unlink(missing_ok=True)
        self.dropped += 1

    def _bound(self) -> None:
        while self._entries and self.nbytes > self.max_bytes:
            self._drop(min(self._entries.values(), key=lambda e: e.used))

    def _touch(self, entry: _Entry) -> None:
        entry.used = time.time()
        try:
            os.utime(entry.path, (entry.used, entry.used))
        except OSError:
            pass

    # ---- use --------------------------------------------------------------------------------

    def covers(self, prompt: list[int]) -> int:
        """The most of `prompt` a file here could stand for, judged by tokens alone."""
        return max((self._could_reuse(e, prompt) for e in self._entries.values()), default=0)

    @staticmethod
    def _could_reuse(entry: _Entry, prompt: list[int]) -> int:
        return min(common_prefix(entry.tokens, prompt), len(prompt) - 1)

    def take(self, prompt: list[int], more_than: int = 0) -> tuple[list | None, int]:
        """(a cache for the longest prefix of `prompt` a file here holds, that prefix's
        length) if it is longer than `more_than` tokens, else (None, 0). The file stays."""
        ranked = sorted(self._entries.values(), key=lambda e: -self._could_reuse(e, prompt))
        for entry in ranked:
            if self._could_reuse(entry, prompt) <= more_than:
                break
            try:
                cache, tokens, _ = load_prompt_cache(entry.path, self.model)
            except PromptCacheError:  # unreadable now (corrupt): never usable
                self._drop(entry)
                continue
            try:
                check_kv_matches(entry.path, cache, self.kv)
            except PromptCacheError:
                # made under other KV options: not usable by this server, kept for one that
                # runs with them (forgotten here, not deleted)
                self._entries.pop(entry.path, None)
                continue
            n = reusable_prefix(tokens, cache, prompt)  # a recurrent state is not trimmed
            if n <= more_than:
                continue
            trim_to(cache, n, len(tokens))
            self._touch(entry)
            self.hits += 1
            self.reused_tokens += n
            return cache, n
        return None, 0

    def put(self, tokens: list[int], cache: list) -> None:
        """Write `cache` (covering `tokens`) unless a file holds that state already; files of
        states it extends are dropped (it holds all they do), then the oldest past the bound."""
        if not tokens or cache_nbytes(cache) > self.max_bytes:
            return
        path = self.file_for(tokens)
        if path in self._entries and self._entries[path].tokens == list(tokens):
            self._touch(self._entries[path])
            return
        try:
            save_prompt_cache(path, cache, self.model, tokens)
        except (OSError, RuntimeError, ValueError) as e:
            # a full or read-only disk: the state is not kept, the request it ends is not failed
            self.failed_writes += 1
            self.last_failure = str(e).splitlines()[0] if str(e) else type(e).__name__
            return
        self.written += 1
        for e in [
            e for e in self._entries.values() if common_prefix(e.tokens, tokens) == len(e.tokens)
        ]:
            if e.path != path:
                self._drop(e)
        st = path.stat()
        self._entries[path] = _Entry(path, list(tokens), st.st_size, st.st_mtime)
        self._bound()

    def stats(self) -> dict:
        return {
            "path": str(self.path),
            "files": len(self._entries),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "hits": self.hits,
            "reused_tokens": self.reused_tokens,
            "written": self.written,
            "dropped": self.dropped,
            "failed_writes": self.failed_writes,
        }


class SpillingPromptCacheLRU(PromptCacheLRU):
    """The server's in-memory prompt caches over a PromptCacheDir: what memory evicts, or
    trims for another conversation, is written there first, `flush` writes the rest (at
    shutdown), and `take` resumes from a file when one covers more of the prompt than any
    cache in memory. `hits` and `reused_tokens` count
    both; `disk.stats()` says what came from files."""

    def __init__(self, disk: PromptCacheDir, max_entries: int = 10, max_bytes: int = 1 << 30):
        super().__init__(max_entries, max_bytes)
        self.disk = disk

    def take(self, prompt: list[int]) -> tuple[list | None, int]:
        best, best_n = None, 0  # the entry PromptCacheLRU.take picks
        for key, (tokens, cache) in self._entries.items():
            n = reusable_prefix(tokens, cache, prompt)
            if n > best_n:
                best, best_n = key, n
        cache, n = self.disk.take(prompt, more_than=best_n)
        if cache is not None:
            self.hits += 1
            self.reused_tokens += n
            return cache, n
        if best is not None and best_n < len(self._entries[best][0]):
            # another conversation sharing a prefix (a system prompt) takes this cache and
            # trims it: what lies past the prefix would be lost, so it is written first
            self.disk.put(*self._entries[best])
        return super().take(prompt)

    def put(self, tokens: list[int], cache: list) -> None:
        if not tokens:
            return
        if self.max_entries == 0 or cache_nbytes(cache) > self.max_bytes:
            self.disk.put(tokens, cache)  # memory keeps none of this size: straight to disk
            return
        # as PromptCacheLRU.put, with what it evicts written to disk first
        for key in [k for k, (t, c) in self._entries.items() if common_prefix(t, tokens) == len(t)]:
            del self._entries[key]
        self._entries[self._next] = (list(tokens), cache)
        self._next += 1
        while self._entries and (
            len(self._entries) > self.max_entries or self.nbytes > self.max_bytes
        ):
            _, (old_tokens, old_cache) = self._entries.popitem(last=False)
            self.disk.put(old_tokens, old_cache)

    def flush(self) -> None:
        """Write every cache held in memory to disk (they stay in memory too)."""
        for tokens, cache in list(self._entries.values()):
            self.disk.put(tokens, cache)


def attach(app, path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> SpillingPromptCacheLRU:
    """Give the served `app` (strata_mlx.apps.server.create_app's) a prompt cache directory: its
    engine's in-memory caches, with the bounds they had, spill to `path`, and are all written
    there when the app shuts down with its worker idle (a generation still running owns its
    cache)."""
    import asyncio
    import contextlib
    import sys

    engine = app.state.engine
    old = engine.prompt_caches
    disk = PromptCacheDir(path, engine.model, engine.kv, max_bytes)
    caches = SpillingPromptCacheLRU(disk, old.max_entries, old.max_bytes)
    engine.prompt_caches = caches
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        async with inner(a) as state:
            yield state
        if not engine.active:
            failed = disk.failed_writes
            from ..runtime.threads import last_on_thread

            await asyncio.get_running_loop().run_in_executor(None, last_on_thread, caches.flush)
            if disk.failed_writes > failed:  # said once, as the server stops
                print(
                    f"strata-mlx: {disk.failed_writes - failed} conversation(s) not written to "
                    f"--prompt-cache-dir {disk.path}: {disk.last_failure}",
                    file=sys.stderr,
                    flush=True,
                )

    app.router.lifespan_context = lifespan
    return caches
