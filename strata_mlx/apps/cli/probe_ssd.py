"""`strata-mlx probe-ssd`: random record-sized direct reads at several worker counts."""

from __future__ import annotations

from pathlib import Path

import typer

from ...config import (
    OptionError,
    parse_tokens,
)


def probe_ssd(
    path: Path = typer.Argument(
        ..., help="A large file on the drive (e.g. a store's experts.bin)."
    ),
    record_bytes: int = typer.Option(1_474_560, "--record-bytes"),
    seconds: float = typer.Option(2.0, "--seconds"),
    workers: str = typer.Option("1,4,8,16", "--workers"),
):
    """Random record-sized direct reads at several worker counts: GB/s."""
    from ...config import MAX_IO_WORKERS, check_int, check_number
    from ...stream.probe import probe_ssd as probe
    from ...stream.reader import drive_note

    check_int("record_bytes", record_bytes, 1, 1 << 30, cli=True)
    check_number("seconds", seconds, 0, 3600, lo_open=True, cli=True)
    counts = tuple(parse_tokens(workers, "--workers"))
    for n in counts:
        check_int("workers", n, 1, MAX_IO_WORKERS, cli=True)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if not path.is_file():  # a directory, a device, a FIFO: no records to read at random
        raise OptionError(f"{path}: not a regular file; give a large file on the drive")
    rows = probe(path, record_bytes=record_bytes, seconds=seconds, workers_list=counts)
    if note := drive_note():
        typer.echo(note)
    if rows and rows[0]["record_bytes"] != record_bytes:  # (direct reads come in 4 KB units)
        typer.echo(
            f"records of {rows[0]['record_bytes']} bytes (--record-bytes {record_bytes}, "
            "rounded to 4 KB units and to the file's size)"
        )
    for row in rows:
        typer.echo(
            f"workers {row['workers']:>3}: {row['gb_per_s']:.2f} GB/s ({row['reads']} reads, direct={row['direct']})"
        )
