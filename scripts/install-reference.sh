#!/usr/bin/env bash
# Optional: the Python reference stack (torch + transformers 5.17.0) in .venv-reference, used by
# the reference parity tests and by tools/golden/ to regenerate fixtures. About 3 GB (PyPI's torch
# wheel carries CUDA libraries).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-reference
.venv-reference/bin/pip install -q --upgrade pip
.venv-reference/bin/pip install -q torch torchvision pillow transformers==5.17.0 safetensors tokenizers jinja2 numpy
.venv-reference/bin/python -c "import torch, transformers; print('reference stack:', torch.__version__, transformers.__version__)"
