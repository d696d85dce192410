"""The store's checksums: what conversion records, and the dense file verified once at load."""

from __future__ import annotations

import json
import os
import shutil
import stat

import pytest

import strata_mlx
import strata_mlx.format.store as store_module
from strata_mlx.format.checksums import file_checksum
from strata_mlx.format.store import (
    DENSE,
    EXPERTS,
    VERIFIED,
    StoreError,
    load_manifest,
    read_record,
    verify_dense,
)
from strata_mlx.stream.reader import checksum

FAMILY = "qwen3_moe"


@pytest.fixture
def copy(store, tmp_path):
    path = tmp_path / "s"
    shutil.copytree(store(FAMILY), path)
    return path


def _flip_last_byte(path) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x01]))


def test_conversion_records_crc32c_of_records_and_dense(store):
    path = store(FAMILY)
    m = load_manifest(path)
    assert m.checksum == "crc32c"
    assert m.dense_checksum == file_checksum(path / DENSE, "crc32c")
    data = (path / EXPERTS).read_bytes()
    rb = m.layout.record_bytes
    for pos, layer in enumerate(m.moe_layers):
        for e in range(m.num_experts):
            off, expected = m.record(layer, e)
            assert checksum("crc32c", data[off : off + rb]) == expected == m.checksums[pos][e]
            assert read_record(path, m, layer, e) == data[off : off + rb]
    raw = json.loads((path / "manifest.json").read_text())
    assert raw["experts"]["checksum"] == "crc32c" and "crc32" not in raw["experts"]


def test_file_checksum_in_chunks(tmp_path):
    p = tmp_path / "f.bin"
    data = os.urandom(3 * 4096 + 17)
    p.write_bytes(data)
    assert file_checksum(p, "crc32c", chunk_bytes=4096) == checksum("crc32c", data)
    assert file_checksum(p, "crc32", chunk_bytes=1000) == checksum("crc32", data)


def test_dense_verified_once_then_when_it_changes(copy):
    m = load_manifest(copy)
    (copy / VERIFIED).unlink()  # the converter's calibration load stamped it
    assert verify_dense(copy, m)  # read and stamped
    stamp = json.loads((copy / VERIFIED).read_text())
    assert stamp["size"] == (copy / DENSE).stat().st_size and stamp["value"] == m.dense_checksum
    assert not verify_dense(copy, m)  # stamp current: not read again
    st = (copy / DENSE).stat()
    os.utime(copy / DENSE, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert verify_dense(copy, m)  # mtime changed: read again
    (copy / VERIFIED).write_text("{not json")
    assert verify_dense(copy, m)  # a broken stamp is no stamp


def test_corrupt_dense_file_is_an_error_at_load(copy):
    strata_mlx.load(copy)[0].expert_cache.close()  # stamps it
    _flip_last_byte(copy / DENSE)  # changes the mtime: the stamp no longer vouches
    with pytest.raises(StoreError, match=f"{DENSE}: checksum mismatch"):
        strata_mlx.load(copy)
    model, _ = strata_mlx.load(copy, verify=False)  # --no-verify loads it anyway
    model.expert_cache.close()


def test_read_only_store_verifies_at_every_load(copy, monkeypatch):
    """The record of a verified dense file cannot be written (through write_atomic's own
    rename, as a read-only mount refuses it): the store loads and verifies every time."""

    def refuse(src, dst):
        raise OSError(30, "Read-only file system", str(dst))

    monkeypatch.setattr(store_module.os, "replace", refuse)
    (copy / VERIFIED).unlink()
    m = load_manifest(copy)
    model, _ = strata_mlx.load(copy)
    model.expert_cache.close()
    assert not (copy / VERIFIED).exists()
    assert verify_dense(copy, m) and verify_dense(copy, m)


def test_store_without_a_dense_checksum_is_not_checked(copy):
    raw = json.loads((copy / "manifest.json").read_text())
    del raw["dense_checksum"]
    (copy / "manifest.json").write_text(json.dumps(raw))
    _flip_last_byte(copy / DENSE)
    m = load_manifest(copy)
    assert m.dense_checksum is None and not verify_dense(copy, m)


def test_bad_checksum_fields_are_store_errors(copy):
    raw = json.loads((copy / "manifest.json").read_text())
    for key, value, word in [
        ("checksum", "md5", "experts.checksum"),
        ("checksums", "x", "experts.checksums"),
    ]:
        bad = json.loads(json.dumps(raw))
        bad["experts"][key] = value
        (copy / "manifest.json").write_text(json.dumps(bad))
        with pytest.raises(StoreError, match=word):
            load_manifest(copy)
    bad = json.loads(json.dumps(raw))
    bad["dense_checksum"] = -1
    (copy / "manifest.json").write_text(json.dumps(bad))
    with pytest.raises(StoreError, match="dense_checksum"):
        load_manifest(copy)


def test_write_atomic_leaves_the_old_file_when_writing_fails(tmp_path):
    """bench --json, plan --json, --plot, --logits-out and the store's own files: a failed
    write leaves the file a user had, and no temporary beside it."""
    path = tmp_path / "figures.json"
    path.write_text("old")

    def half_then_fail(tmp):
        tmp.write_text("new, but only ha")
        raise OSError(28, "No space left on device")

    with pytest.raises(StoreError, match=r"figures.json: cannot write it \(No space left on "
                       r"device\); is the disk full\?$") as e:  # fmt: skip
        store_module.write_atomic(path, half_then_fail)
    assert path.read_text() == "old"
    # ... an OSError still: callers that let a cache's write fail (a read-only store's
    # .verified.json, the server's prompt cache directory, plan's calibration) go on
    assert isinstance(e.value, OSError)
    # MLX's own writers' words for a full disk
    with pytest.raises(StoreError, match=r"cannot write it \(\[write\] Unable to write 5"):
        store_module.write_atomic(path, lambda tmp: _raise(RuntimeError("[write] Unable to "
                                                                        "write 5 bytes to file.")))  # fmt: skip
    with pytest.raises(ValueError, match="a bug"):  # (anything else is not the file system's)
        store_module.write_atomic(path, lambda tmp: _raise(ValueError("a bug")))
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["figures.json"]
    store_module.write_text_atomic(path, "new")
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["figures.json"]


def test_write_atomic_takes_no_file_of_the_users_for_its_temporary(tmp_path):
    """The temporary file is a name of the write's own: a user's `figures.json.tmp` (once the
    fixed temporary name) is neither overwritten nor removed, and the new file gets the
    mode the process's umask gives, not a private temporary's."""
    path, mine = tmp_path / "figures.json", tmp_path / "figures.json.tmp"
    mine.write_text("precious")
    store_module.write_text_atomic(path, "new")
    assert path.read_text() == "new" and mine.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figures.json", "figures.json.tmp"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def _raise(e: BaseException):
    raise e


def test_write_atomic_writes_through_a_link_and_never_replaces_a_device_or_pipe(tmp_path):
    """A symbolic link's target gets the new file and the link stays a link; a path that is
    no regular file (a pipe here, /dev/null on a user's command line: it was replaced by a
    regular file) is refused and left as it was."""
    target, link = tmp_path / "real.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target)
    store_module.write_text_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(StoreError, match="pipe: not a regular file"):
        store_module.write_text_atomic(fifo, "x")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
