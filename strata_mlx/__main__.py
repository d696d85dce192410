from .apps.cli import app

app(prog_name="strata-mlx")
