"""strata-mlx: MLX inference for Mixture-of-Experts models larger than memory.

model, tokenizer = strata_mlx.load("path/to/store", arena_gb=6.5)
for r in strata_mlx.stream_generate(model, tokenizer, "Hello", max_tokens=32):
    print(r.text, end="")
"""

from .generation.generate import GenerationResponse, generate, stream_generate
from .runtime.loader import RuntimeConfig, load

__all__ = ["load", "generate", "stream_generate", "GenerationResponse", "RuntimeConfig"]
__version__ = "0.1.0"
