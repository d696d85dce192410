"""Builds the native reader extension; all package metadata lives in pyproject.toml."""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "strata_mlx._reader",
            [
                "strata_mlx/_native/reader.c",
                "strata_mlx/_native/checksum.c",
                "strata_mlx/_native/devcopy.c",
            ],
            depends=["strata_mlx/_native/checksum.h", "strata_mlx/_native/devcopy.h"],
            extra_compile_args=["-O2"],
            libraries=[] if sys.platform == "darwin" else ["pthread", "dl"],
        )
    ]
)
