"""Writing a store: StoreWriter writes it into a temporary directory beside its destination
and commit() renames it into place (an existing store is replaced only whole, and a
conversion killed on the way is cleaned up by the next one); the routing profile. Never
reads a store for the runtime (store.py validates what is read)."""

from __future__ import annotations

import atexit
import errno
import glob
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from .checksums import CHECKSUM, checksum, file_checksum
from .store import (
    DENSE,
    EXPERTS,
    MANIFEST,
    PROFILE,
    Manifest,
    RecordLayout,
    StoreError,
    write_text_atomic,
)


def save_profile(store: str | Path, counts: np.ndarray, tokens: int, source: str) -> None:
    data = {
        "counts": np.asarray(counts).astype(int).tolist(),
        "tokens": int(tokens),
        "source": source,
    }
    write_text_atomic(Path(store) / PROFILE, json.dumps(data))


class StoreWriter:
    """Writes a store into a temporary directory beside `out`; `commit()` renames it into place.

    Nothing is left at `out` unless the whole store was written: a failed conversion removes
    the temporary directory.
    """

    def __init__(
        self,
        out: str | Path,
        model_type: str,
        config: dict,
        layout: RecordLayout,
        moe_layers: list[int],
        num_experts: int,
        layer_layouts: list[RecordLayout] | None = None,
    ):
        """`layer_layouts` (one per MoE layer, all of `layout.record_bytes`) where layers'
        formats differ; `layout` is then the first layer's."""
        if layer_layouts is not None and any(
            lay.record_bytes != layout.record_bytes for lay in layer_layouts
        ):
            raise ValueError("every layer's records must be the same size (pad them)")
        self.out = Path(out)
        remove_dead_temps(self.out)  # (may put back a store a dead conversion moved aside)
        # A store there now is the one the conversion was allowed to replace; one that
        # appears while it runs (another conversion to the same place) is not replaced.
        self.replacing = self.out.exists()
        self.tmp = _make_temp(self.out)
        try:
            self._start(model_type, config, layout, moe_layers, num_experts, layer_layouts)
        except BaseException:  # SIGTERM (SystemExit) or a full disk before __enter__
            _discard(self.tmp, self.out)
            raise

    def _start(self, model_type, config, layout, moe_layers, num_experts, layer_layouts):
        self.manifest = Manifest(
            model_type,
            config,
            layout,
            list(moe_layers),
            num_experts,
            offsets=[[-1] * num_experts for _ in moe_layers],
            checksums=[[0] * num_experts for _ in moe_layers],
            layer_layouts=layer_layouts,
        )
        with _writing(self.out):
            self._f = open(self.tmp / EXPERTS, "wb")
        self._pos = 0

    @property
    def path(self) -> Path:
        """The temporary directory (write tokenizer files and the profile here)."""
        return self.tmp

    def add_expert(self, layer: int, expert: int, arrays: dict[str, np.ndarray]) -> None:
        try:
            rec = self.manifest.layout_of(layer).pack(arrays)
        except ValueError as e:  # (an expert shaped unlike the layer's first: the source's)
            raise StoreError(f"layer {layer} expert {expert}: {e}") from None
        pos = self.manifest.layer_position(layer)
        self.manifest.offsets[pos][expert] = self._pos
        self.manifest.checksums[pos][expert] = checksum(CHECKSUM, rec)
        self._f.write(rec)
        self._pos += len(rec)

    def add_record(self, layer: int, expert: int, record: bytes) -> None:
        """A record already packed (e.g. GGUF blocks repacked without requantizing)."""
        if len(record) != self.manifest.layout.record_bytes:
            raise ValueError("record size does not match the layout")
        pos = self.manifest.layer_position(layer)
        self.manifest.offsets[pos][expert] = self._pos
        self.manifest.checksums[pos][expert] = checksum(CHECKSUM, record)
        self._f.write(record)
        self._pos += len(record)

    def write_dense(self, weights: dict[str, Any], metadata: dict[str, str] | None = None) -> None:
        import mlx.core as mx

        try:
            mx.save_safetensors(
                str(self.tmp / DENSE), weights, metadata=metadata or {"format": "mlx"}
            )
        except RuntimeError as e:  # MLX's "[write] Unable to write N bytes to file."
            raise StoreError(
                f"{self.out}: cannot write the store ({e}); is the disk full?"
            ) from None
        _check_safetensors_written(self.out, self.tmp / DENSE, weights)
        self.manifest.dense_checksum = file_checksum(self.tmp / DENSE, CHECKSUM)

    def finalize(self) -> Path:
        """Write the manifest into the temporary directory (loadable there, not yet in place)."""
        self._f.close()
        missing = [
            (self.manifest.moe_layers[p], e)
            for p, row in enumerate(self.manifest.offsets)
            for e, off in enumerate(row)
            if off < 0
        ]
        if missing:
            raise ValueError(
                f"store incomplete: {len(missing)} expert records never written, e.g. {missing[0]}"
            )
        write_text_atomic(self.tmp / MANIFEST, json.dumps(self.manifest.to_json()))
        return self.tmp

    def commit(self) -> Path:
        """Move the finished store into place. An existing store at `out` is kept until the
        new one is complete: it is moved into the temporary directory, the temporary directory
        is renamed to `out`, and only then is the old one deleted. A process killed between
        the renames leaves a temporary directory whose dead owner the next conversion finds
        (remove_dead_temps), and the old store is put back."""
        if not (self.tmp / MANIFEST).is_file():
            self.finalize()
        with _writing(self.out):
            _fsync_tree(self.tmp)  # on the drive before the old store is let go of
            os.chmod(self.tmp, 0o755)  # mkdtemp made it private
            if self.out.is_symlink() or self.out.is_file():
                raise StoreError(f"{self.out}: not a directory; refusing to replace it")
            with _RENAMES:
                if self.replacing and self.out.exists():
                    os.replace(self.out, self.tmp / REPLACED)
                    os.replace(self.tmp, self.out)
                else:
                    self._move_into_place()
                _UNFINISHED.pop(self.tmp, None)
                _COMMITTED.add(self.out)
                _fsync_dir(self.out.parent)  # the rename itself
                _finish_replacement(self.out)
                _COMMITTED.discard(self.out)
        return self.out

    def _move_into_place(self) -> None:
        """The temporary directory renamed to `out`, where no store was: the rename fails
        onto a directory holding anything (a store another process moved there meanwhile),
        which is left as it is."""
        try:
            os.rename(self.tmp, self.out)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise StoreError(
                f"{self.out}: another conversion wrote a store there meanwhile; this one "
                "was not moved over it"
            ) from None

    def abort(self) -> None:
        try:
            self._f.close()
        except OSError:
            pass  # flushing what a full disk refused fails again; the directory goes anyway
        finally:
            _discard(self.tmp, self.out)

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            if _STOPPING:  # a signal's thread removed the directory under us and is ending
                threading.Event().wait()  # the process: its line is the one to print
            self.abort()
            if issubclass(exc_type, OSError):  # a full disk, a read-only filesystem
                raise StoreError(
                    f"{self.out}: cannot write the store ({_os_reason(exc)})"
                ) from None


# ---- writing safely ---------------------------------------------------------------------
# A conversion writes into `.{name}.{pid}-{start}-{host}.XXXXXXXX` beside its output: the
# name says who owns it (pid, the kernel's start time of that process, a hash of the host
# name) from the moment it exists, so a process killed at any point leaves nothing that the
# next conversion into the same output cannot recognise as dead and remove. The same owner
# goes into OWNER inside it, which stays with the store between commit()'s renames; a
# replacement killed there is undone or finished by the next run.

OWNER = ".strata-owner.json"
REPLACED = ".replaced"  # the old store, inside the temporary directory during commit()


def _process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (Linux /proc): tells a reused pid from its owner."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None  # field 22, starttime


def _host_tag() -> str:
    import socket
    import zlib

    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def _owner_tag() -> str:
    return f"{os.getpid()}-{_process_start(os.getpid()) or 0}-{_host_tag()}"


def _alive(pid: int, start: str | None, host: str) -> bool:
    """Whether process `pid` (started at `start`, on host tag `host`) still runs; True when
    unsure (a conversion on another machine sharing this drive)."""
    if host != _host_tag():
        return True
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = _process_start(pid)
    return start is None or now is None or now == start


def _temp_owner(d: Path, out: Path) -> tuple[int, str | None, str] | None:
    """(pid, start, host) from a temporary directory's name, or None: not one of ours."""
    import re

    m = re.match(r"(\d+)-(\d+)-([0-9a-f]{8})\.[^.]+$", d.name[len(out.name) + 2 :])
    return (int(m[1]), None if m[2] == "0" else m[2], m[3]) if m else None


def _stamp_alive(d: Path) -> bool:
    try:
        owner = json.loads((d / OWNER).read_text())
        pid, start, host = int(owner["pid"]), owner.get("start"), str(owner["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return True
    return _alive(pid, start, host)


def remove_dead_temps(out: str | Path) -> list[Path]:
    """Clean up after conversions into `out` that died: their temporary directories are
    removed, and an old store that a dead replacement had moved aside is put back."""
    out = Path(out)
    removed = []
    try:
        found = [d for d in out.parent.glob(f".{glob.escape(out.name)}.*") if d.is_dir()]
    except OSError:
        return removed
    for d in found:
        owner = _temp_owner(d, out)
        if owner is None or _alive(*owner):
            continue
        try:
            if (d / REPLACED).is_dir() and not out.exists():
                os.replace(d / REPLACED, out)  # killed between commit()'s two renames
            shutil.rmtree(d)
            removed.append(d)
        except OSError:
            pass  # not ours to fix (a read-only drive); the conversion itself will say
    if (out / OWNER).is_file() and not _stamp_alive(out):
        _finish_replacement(out)  # killed after the renames, before deleting the old store
    return removed


def _fsync_tree(root: Path) -> None:
    """Every file under `root`, and its directories, flushed to the drive: a crash after the
    rename into place must not leave a renamed store whose records are still in the page
    cache only, while the store it replaced is gone. (It also means a conversion's time
    includes its writeback, and a probe or bench right after it reads a drive at rest.)"""
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(d))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # a file system that cannot sync a directory (some network mounts)
    finally:
        os.close(fd)


def _finish_replacement(out: Path) -> None:
    shutil.rmtree(out / REPLACED, ignore_errors=True)
    (out / OWNER).unlink(missing_ok=True)


# This process's temporary directories not yet committed nor given up -> their output. At
# exit, however the process unwinds (convert turns SIGTERM into SystemExit), what is left here
# is given up: a SIGTERM between a directory's creation and the code that owns its cleanup
# (StoreWriter's constructor, the `with` around it, commit()'s two renames) leaves nothing
# behind, and an old store moved aside is put back.
_UNFINISHED: dict[Path, Path] = {}
# Held by commit() over its renames, and by discard_unfinished(), which a thread of its own may
# call while the main thread converts (a signal taken at once, apps/cli/convert.py).
_RENAMES = threading.RLock()
_STOPPING = False  # a signal's discard has run: no temporary directory is made after it
_COMMITTED: set[Path] = set()  # moved into place, the store it replaced not yet deleted


def finish_committed() -> list[Path]:
    """Stores this process moved into place whose commit() has not finished (the store each
    replaced still inside it, its owner stamp still there): finished now, before a signal's
    exit. The stores, which are written whole."""
    with _RENAMES:
        done = sorted(_COMMITTED)
        for out in done:
            _fsync_dir(out.parent)
            _finish_replacement(out)
        _COMMITTED.clear()
    return done


def _discard(tmp: Path, out: Path) -> None:
    """Give up temporary directory `tmp` of `out`: an old store that commit() had moved into
    it goes back to `out` first."""
    if (tmp / REPLACED).is_dir() and not out.exists():
        os.replace(tmp / REPLACED, out)  # commit() failed between its renames
    shutil.rmtree(tmp, ignore_errors=True)
    _UNFINISHED.pop(tmp, None)


@atexit.register
def discard_unfinished(stop: bool = False) -> list[Path]:
    """Give up every temporary store directory of this process (at exit, or at a signal): a
    store being moved into place, or a directory being made, is let finish first. `stop`:
    from another thread while the main one may still be writing (a signal's): no directory
    is made after, and one the main thread writes into as it goes is removed again. The
    stores given up."""
    global _STOPPING
    with _RENAMES:
        _STOPPING = _STOPPING or stop
        return _discard_all(tries=50 if stop else 1)


def _discard_all(tries: int) -> list[Path]:
    given_up = []
    for tmp, out in list(_UNFINISHED.items()):
        owner = _temp_owner(tmp, out)
        if owner is None or owner[0] != os.getpid():
            continue  # a forked child's exit: the directory is its parent's
        try:
            for _ in range(tries):  # (a file made inside meanwhile fails the rmdir: again)
                _discard(tmp, out)
                if not tmp.exists():
                    given_up.append(out)
                    break
                time.sleep(0.002)
        except OSError:
            pass  # left to the next conversion's remove_dead_temps (its name says whose)
    return given_up


def _make_temp(out: Path) -> Path:
    with _writing(out), _RENAMES:  # (a signal's discard waits for the stamp: it reads it)
        if _STOPPING:  # the signal's thread is ending the process: wait for it
            threading.Event().wait()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{_owner_tag()}.", dir=out.parent))
        _UNFINISHED[tmp] = out
        try:
            stamp = {"pid": os.getpid(), "host": _host_tag(), "start": _process_start(os.getpid())}
            (tmp / OWNER).write_text(json.dumps(stamp))
        except BaseException:  # SIGTERM or a full disk this early: nothing to keep
            _discard(tmp, out)
            raise
    return tmp


class _writing:
    """OSError (read-only filesystem, full disk, no permission) -> one-line StoreError."""

    def __init__(self, out: Path):
        self.out = out

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and issubclass(exc_type, OSError):
            raise StoreError(f"{self.out}: cannot write the store ({_os_reason(exc)})") from None


def _os_reason(e: OSError) -> str:
    where = f": {e.filename}" if getattr(e, "filename", None) else ""
    return f"{e.strerror or e}{where}"


def _check_safetensors_written(out: Path, path: Path, weights: dict[str, Any]) -> None:
    """MLX's save_safetensors does not always report a full disk (measured: writing to
    /dev/full returns normally): check that the file holds every byte."""
    want = sum(int(v.nbytes) for v in weights.values())
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise StoreError(f"{out}: cannot write the store ({_os_reason(e)})") from None
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 0 or size < 8 + n + want:
        raise StoreError(
            f"{out}: {path.name} written short ({size} of at least {8 + max(n, 0) + want} "
            "bytes); is the disk full?"
        )
