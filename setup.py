"""Builds the native extensions (the reader; the CPU expert matmuls; NextUse's core); all
package metadata lives in pyproject.toml."""

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
                "strata_mlx/_native/quick.c",
            ],
            depends=[
                "strata_mlx/_native/checksum.h",
                "strata_mlx/_native/devcopy.h",
                "strata_mlx/_native/reader.h",
                "strata_mlx/_native/quick.h",
            ],
            extra_compile_args=["-O2"],
            libraries=[] if sys.platform == "darwin" else ["pthread", "dl"],
        ),
        # -ffp-contract=off (both): no fused multiply-adds. NextUse's distances round as the
        # Python reference's do (equal victims); each product and sum rounds as MLX's
        # CPU quantized matmul rounds them (the outputs must agree bit for bit)
        Extension(
            "strata_mlx._cpu_experts",
            ["strata_mlx/_native/cpu_experts.c"],
            extra_compile_args=["-O3", "-ffp-contract=off"],
        ),
        Extension(
            "strata_mlx._nextuse",
            [
                "strata_mlx/_native/nextuse.c",
                "strata_mlx/_native/duel.c",
                "strata_mlx/_native/evictable.c",
            ],
            depends=["strata_mlx/_native/nextuse.h"],
            extra_compile_args=["-O2", "-ffp-contract=off"],
        ),
    ]
)
