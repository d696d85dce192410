"""The console script's entry point as installs made before the layers became folders name it
(`strata_mlx.cli:app`); pyproject.toml now names strata_mlx.apps.cli:app. Owns nothing else."""

from .apps.cli import app

__all__ = ["app"]
