"""What importing strata_mlx does to the process before MLX starts: the CUDA hardware queues
it asks for (a reader thread's copy stream that shares a queue with MLX's waits behind MLX's
kernels), in place before MLX is imported, and a value the environment already has kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Records CUDA_DEVICE_MAX_CONNECTIONS as mlx.core is first imported: what MLX's CUDA context
# would be made with.
PROBE = """
import importlib.abc, os, sys
seen = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "mlx.core" and not seen:
            seen.append(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
        return None
sys.meta_path.insert(0, Watch())
import strata_mlx
print(seen[0], os.environ["CUDA_DEVICE_MAX_CONNECTIONS"])
"""


@pytest.mark.parametrize("given", [None, "", "4"], ids=["unset", "empty", "set"])
def test_cuda_hardware_queues_are_asked_for_before_mlx_is_imported(given):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    if given is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = given
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    want = given or "32"
    assert out.stdout.split() == [want, want]
