"""strata-mlx: MLX inference for Mixture-of-Experts models larger than memory.

model, tokenizer = strata_mlx.load("path/to/store", arena_gb=6.5)
for r in strata_mlx.stream_generate(model, tokenizer, "Hello", max_tokens=32):
    print(r.text, end="")
"""

import os

# CUDA runs a context's streams on a fixed number of hardware work queues (8 unless this says
# otherwise, 32 at most), read when the process first uses CUDA; streams sharing a queue run
# its work in turn, so a reader thread's copy stream sharing one with MLX's would wait behind
# MLX's kernels. The reader runs a stream a thread (16 at 8 workers with the overlap), beside
# MLX's: 32 gives each its own. A value set before this package is imported wins; it must come
# before MLX first uses the GPU, as this does for the command line (a program that uses MLX's
# GPU before importing strata_mlx sets it itself).
if not os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"):
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "32"

from .generation.generate import GenerationResponse, generate, load, stream_generate
from .runtime.loader import RuntimeConfig

__all__ = ["load", "generate", "stream_generate", "GenerationResponse", "RuntimeConfig"]
__version__ = "0.1.0"
