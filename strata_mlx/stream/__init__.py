"""Streaming experts from the SSD: the native reader, the arena and its residency, the
scheduler of reads, prediction (lookahead, read-ahead), statistics, memory and drive probes.

Imports only strata_mlx.format (and strata_mlx.config); knows no model family."""
