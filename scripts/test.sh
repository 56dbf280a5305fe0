#!/usr/bin/env bash
# Installs the dependencies, builds, and runs the whole test suite (unit, golden parity, fuzz
# corpus, and the reference tests when a reference Python is present). Exits non-zero on any
# failure.
set -euo pipefail
cd "$(dirname "$0")/.."
# Passive OpenMP waiting keeps concurrent processes on small machines from starving each other.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
scripts/install-deps.sh
scripts/build.sh "$@"
build_dir="${GLMTUNE_BUILD_DIR:-build}"
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)" --timeout 900
