"""The on-disk format: the store (manifest, record layouts, writer, checksummed files), the
quant formats of expert records and their reference dequantizers, the ggml block tables.

Imports nothing from the other layers: everything above reads the format through here."""
