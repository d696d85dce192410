#!/usr/bin/env bash
# The wheels `strata-mlx serve`, benchmarks/serve_concurrency.py and benchmarks/resume_ttft.py
# need on the GPU machine beyond MLX's CUDA install and what its image holds: the server stack
# (fastapi, starlette, uvicorn, pydantic and their needs), the openai client (httpx2 and its
# needs), greenlet (batched decode) and gguf. CPython 3.12, manylinux x86-64, binary wheels only
# (no sdist, nothing run at install: the GPU machine unzips them into /tmp/site). Versions are
# the ones the test suite runs against. Run here, from the repo root (.whl/ is git-ignored):
#   bash benchmarks/serve_wheels.sh        # fills .whl/serve (about 7 MB)
# There (carry .whl/serve):
#   python3 -c "import zipfile,glob; [zipfile.ZipFile(w).extractall('/tmp/site') for w in glob.glob('.whl/serve/*.whl')]"
#   export PYTHONPATH=/tmp/site
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
rm -rf .whl/serve && mkdir -p .whl/serve
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .whl/serve fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 \
  pydantic_core==2.50.5 openai==3.60.0 greenlet==3.2.5 gguf==0.19.0 2>&1 | grep -v "^WARNING: Location" || true
# gguf's own needs (numpy, pyyaml, requests, tqdm) are in the GPU machine's image
rm -f .whl/serve/numpy-* .whl/serve/PyYAML-* .whl/serve/pyyaml-* .whl/serve/requests-* \
  .whl/serve/tqdm-* .whl/serve/urllib3-* .whl/serve/charset_normalizer-* .whl/serve/certifi-*
ls .whl/serve | grep -v '\.whl$' && { echo "not a wheel in .whl/serve" >&2; exit 1; }
du -sh .whl/serve
