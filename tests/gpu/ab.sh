#!/usr/bin/env bash
# Before and after on one GPU machine, in one call: runs `glmtune ARGS...` with the baseline CLI
# that tests/gpu/build_carry.sh packed (GLMTUNE_GPU_BASELINE=COMMIT) and with the tree's,
# alternating (baseline, tree, baseline, tree, ...), ROUNDS times each, so that clocks and the
# machine's state drift over both alike (docs/PERF.md compares runs made this way).
#
# Usage (from the repository root):
#   tests/gpu/ab.sh [-n ROUNDS] -- bench step --model-preset crop25b --pack 16384 --op-detail
#   tests/gpu/ab.sh -n 3 -- bench ops --no-peers --only 'absorbed MLA'
# ROUNDS defaults to 2. The full output goes to $OUT/ab_full.log (a temporary folder when OUT is
# unset); the lines that carry the numbers (tokens/s and peak memory of `bench step`, the table
# rows of `bench ops`; GLMTUNE_AB_KEEP, an extended regular expression, names others, such as
# '^mla_' for op-table rows) go per run to $OUT/ab_summary.txt, printed last. GLMTUNE_GPU_CARRY
# names the package (default .gpu-carry), GLMTUNE_AB_TIMEOUT bounds each run (default 300 s).
# The exit status is non-zero when a run failed or timed out.
set -uo pipefail

rounds=2
if [[ "${1:-}" == -n ]]; then
  rounds="${2:?ab.sh: -n needs a number of rounds}"
  shift 2
fi
[[ "${1:-}" == -- ]] && shift
if [[ $# -eq 0 || ! "$rounds" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: tests/gpu/ab.sh [-n ROUNDS] -- GLMTUNE_ARGS..." >&2
  exit 2
fi

carry="${GLMTUNE_GPU_CARRY:-.gpu-carry}"
source "$(dirname "${BASH_SOURCE[0]}")/carry_env.sh"
carry_unpack "$carry" || exit 2
for b in glmtune glmtune-baseline; do
  if [[ ! -x "$carry/$b" ]]; then
    echo "ab.sh: $carry/$b is missing; pack with GLMTUNE_GPU_BASELINE=COMMIT" \
      "tests/gpu/build_carry.sh" >&2
    exit 2
  fi
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
carry_env "$carry" "$work" || exit 2
logdir="${OUT:-$work}"
mkdir -p "$logdir"
full="$logdir/ab_full.log"
summary="$logdir/ab_summary.txt"
keep="${GLMTUNE_AB_KEEP:-tokens/s|^peak memory|^[^ ].*(TFLOP/s|GB/s)}"
limit="${GLMTUNE_AB_TIMEOUT:-300}"
{
  echo "== glmtune ab $(date -u +%Y-%m-%dT%H:%M:%SZ): glmtune $*"
  grep -E '^(commit|baseline):' "$carry/MANIFEST" 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
} | tee "$full" >"$summary"

status=0
for ((i = 1; i <= rounds; ++i)); do
  for b in glmtune-baseline glmtune; do
    name="baseline"
    [[ "$b" == glmtune ]] && name="tree"
    echo "== round $i: $name" | tee -a "$full" >>"$summary"
    timeout --kill-after=10 "$limit" "$carry/$b" "$@" >"$work/run.log" 2>&1
    rc=$?
    cat "$work/run.log" >>"$full"
    grep -E "$keep" "$work/run.log" >>"$summary"
    if ((rc != 0)); then
      status=1
      echo "   exit $rc; the last lines:" >>"$summary"
      tail -n 5 "$work/run.log" | sed 's/^/   | /' >>"$summary"
    fi
  done
done
cat "$summary"
exit "$status"
