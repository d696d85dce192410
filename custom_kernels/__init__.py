"""Quantized expert kernels reading weights straight from arena slots.

One decoder per weight format, in C (formats.h: each kernel's header is the part it calls), kernel
bodies generated from the layout (algorithm.py), and thin dialect layers: Metal (metal.py,
mx.fast.metal_kernel; not executed on this project's Linux machines), CUDA (cuda.py,
mx.fast.cuda_kernel; verified on the GPU machine) and host C++ (host.py; tests only).
`dispatch.kernel_for(backend, layout)` builds and caches them; strata_mlx.runtime.kernels
calls it. The formats as data (formats.py, ggml.py) live here too, and strata_mlx imports them
from here: this package imports nothing from strata_mlx.
"""

from .dispatch import kernel_for, supported

__all__ = ["kernel_for", "supported"]
