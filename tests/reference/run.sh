#!/usr/bin/env bash
# Runs one reference parity test with the Python that has transformers==5.17.0.
# Usage: run.sh PYTHON TEST.py. Exits 77 (reported by ctest as skipped) when PYTHON is empty or lacks
# the reference stack, so a machine without it still runs every other test.
set -u
python="${1:-}"
test_file="$2"
if [ -z "$python" ]; then
  echo "skipped: no reference Python configured (cmake -DGLMTUNE_PYTHON=/path/to/python, see docs/testing.md)"
  exit 77
fi
if ! "$python" -c 'import transformers, torch, safetensors, sys; sys.exit(0 if transformers.__version__ == "5.17.0" else 1)' 2>/dev/null; then
  echo "skipped: $python lacks torch + safetensors + transformers==5.17.0"
  exit 77
fi
exec "$python" "$test_file"
