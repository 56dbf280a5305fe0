#!/usr/bin/env bash
# Configures and builds glmtune into ${GLMTUNE_BUILD_DIR:-build}. Extra arguments go to cmake,
# e.g. scripts/build.sh -DGLMTUNE_CUDA=OFF.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${GLMTUNE_BUILD_DIR:-build}"
extra=()
# The reference parity tests run when a Python with transformers==5.17.0 is known
# (scripts/install-reference.sh makes one at .venv-reference).
python="${GLMTUNE_PYTHON:-}"
[ -z "$python" ] && [ -x .venv-reference/bin/python ] && python="$PWD/.venv-reference/bin/python"
[ -n "$python" ] && extra+=("-DGLMTUNE_PYTHON=$python")
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${extra[@]}" "$@"
cmake --build "$build_dir" -j "$(nproc)"
