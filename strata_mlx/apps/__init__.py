"""Front doors: the CLI, the OpenAI-compatible server and its dashboard, plan, bench, the
mlx-lm baseline, plots, the built-in default model.

May import every other layer; no layer imports it (only strata_mlx/__main__.py does)."""
