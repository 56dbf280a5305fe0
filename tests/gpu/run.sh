#!/usr/bin/env bash
# Runs the packed GPU tests and benchmarks (made by tests/gpu/build_carry.sh) on a GPU machine.
# Run it from the repository root:  tests/gpu/run.sh
#
# Every test binary and benchmark in .gpu-carry runs once, with a timeout each, and with the
# carried libraries first on the library path. The full output of every binary goes to
# $OUT/gpu_tests_full.log (or a temporary folder when OUT is unset), a summary table to
# $OUT/gpu_tests_summary.txt, and the summary is printed last: binary, status, tests passed /
# failed / skipped, seconds. The exit status is non-zero when any binary failed, timed out, or
# skipped all of its tests (a skip on a GPU machine means no GPU was visible).
#
# Environment: GLMTUNE_GPU_TIMEOUT (seconds per binary, default 360), GLMTUNE_GPU_BUDGET (seconds
# for the whole run, default 540: binaries that no longer fit are reported as not run),
# GLMTUNE_GPU_ALLOW_SKIP=1 (skipped suites do not fail the run), GLMTUNE_GPU_CARRY (the package
# folder, default .gpu-carry), GLMTUNE_MPIRUN (the MPI launcher of the distributed checks, default
# mpirun), GTEST_FILTER as usual. With two or more GPUs and a launcher, tests/gpu/dist_check.sh
# runs last (one summary row).
set -uo pipefail

carry="${GLMTUNE_GPU_CARRY:-.gpu-carry}"
source "$(dirname "${BASH_SOURCE[0]}")/carry_env.sh"
carry_unpack "$carry" || exit 2
per_binary="${GLMTUNE_GPU_TIMEOUT:-360}"
budget="${GLMTUNE_GPU_BUDGET:-540}"
t_start=$(date +%s)

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
logdir="${OUT:-$work}"
mkdir -p "$logdir"
full="$logdir/gpu_tests_full.log"
summary="$logdir/gpu_tests_summary.txt"
: >"$full"

# Large libraries are carried xz-compressed; unpack them next to the run.
carry_env "$carry" "$work" || exit 2

{
  echo "== glmtune GPU run $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
  [[ -f "$carry/MANIFEST" ]] && cat "$carry/MANIFEST"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader 2>&1 ||
    echo "nvidia-smi not available"
} | tee -a "$full"

binaries=()
for f in "$carry"/test_* "$carry"/bench_*; do
  [[ -f "$f" && -x "$f" ]] && binaries+=("$(basename "$f")")
done
if [[ ${#binaries[@]} -eq 0 ]]; then
  echo "run.sh: $carry holds no test_* or bench_* binaries" >&2
  exit 2
fi

# Counts gtest's per-test result lines ("[       OK ] Suite.Test (12 ms)"); the closing summary
# repeats failed names without a time, so the time suffix keeps them from counting twice.
count() { grep -cE "^\[ *$1 *\] [^ ]+ \([0-9]+ ms\)$" "$2" || true; }

status_all=0
rows=()
failures=()
for b in "${binaries[@]}"; do
  log="$work/$b.log"
  elapsed=$(($(date +%s) - t_start))
  left=$((budget - elapsed))
  if ((left < 10)); then
    rows+=("$(printf '%-34s %-9s %6s %6s %7s %8s' "$b" "NOT RUN" - - - -)")
    failures+=("$b: not run, the run's time budget of ${budget}s was spent")
    status_all=1
    continue
  fi
  limit=$((per_binary < left ? per_binary : left))
  args=()
  [[ "$b" == test_* ]] && args=(--gtest_color=no)
  echo "== $b (timeout ${limit}s)" | tee -a "$full"
  t0=$(date +%s.%N)
  timeout --kill-after=10 "$limit" "$carry/$b" "${args[@]}" >"$log" 2>&1
  rc=$?
  secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
  cat "$log" >>"$full"
  echo "== $b exit $rc after ${secs}s" >>"$full"
  passed=- failed=- skipped=-
  if [[ "$b" == test_* ]]; then
    passed=$(count OK "$log")
    failed=$(count FAILED "$log")
    skipped=$(count SKIPPED "$log")
  fi
  if ((rc == 124 || rc == 137)); then
    status=TIMEOUT
  elif ((rc != 0)); then
    status=FAIL
  elif [[ "$b" == test_* ]] && ((passed == 0 && skipped > 0)); then
    status=SKIPPED
  else
    status=ok
  fi
  if [[ "$status" != ok ]]; then
    if [[ "$status" != SKIPPED || "${GLMTUNE_GPU_ALLOW_SKIP:-0}" != 1 ]]; then
      status_all=1
      failures+=("$b: $status (exit $rc)")
      # The failing tests and the first lines of what they said.
      while IFS= read -r line; do failures+=("    $line"); done < <(
        grep -E "^\[  FAILED  \] [^ ]+ \([0-9]+ ms\)$|Failure$|^Expected|^  Actual|^Value of|error|Error|what\(\)" \
          "$log" | head -n 30
      )
      [[ "$status" == TIMEOUT || "$status" == FAIL ]] &&
        while IFS= read -r line; do failures+=("    | $line"); done < <(tail -n 8 "$log")
    fi
  fi
  rows+=("$(printf '%-34s %-9s %6s %6s %7s %8s' "$b" "$status" "$passed" "$failed" "$skipped" "$secs")")
done

# Two or more GPUs and an MPI launcher: the distributed checks (data parallel over NCCL, the
# collectives' benchmark), one row of the summary.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if ((gpus >= 2)) && command -v "${GLMTUNE_MPIRUN:-mpirun}" >/dev/null; then
  left=$((budget - ($(date +%s) - t_start)))
  if ((left < 60)); then
    rows+=("$(printf '%-34s %-9s %6s %6s %7s %8s' "dist_check ($gpus GPUs)" "NOT RUN" - - - -)")
    failures+=("dist_check: not run, the run's time budget of ${budget}s was spent")
    status_all=1
  else
    echo "== dist_check (timeout ${left}s)" | tee -a "$full"
    t0=$(date +%s.%N)
    timeout --kill-after=10 "$left" "$(dirname "${BASH_SOURCE[0]}")/dist_check.sh" "$carry" \
      "$work" >"$work/dist_check.log" 2>&1
    rc=$?
    secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
    cat "$work/dist_check.log" | tee -a "$full"
    status=ok
    ((rc == 124 || rc == 137)) && status=TIMEOUT
    ((rc != 0 && rc != 124 && rc != 137)) && status=FAIL
    if [[ $status != ok ]]; then
      status_all=1
      failures+=("dist_check: $status (exit $rc)")
    fi
    rows+=("$(printf '%-34s %-9s %6s %6s %7s %8s' "dist_check ($gpus GPUs)" "$status" - - - "$secs")")
  fi
fi

# The benchmark tables (their last lines), then the failures, then the summary.
for b in "${binaries[@]}"; do
  if [[ "$b" == bench_* && -f "$work/$b.log" ]]; then
    echo
    echo "== $b table"
    grep -A200 -E "^op +shape" "$work/$b.log" || tail -n 40 "$work/$b.log"
  fi
done
if ((${#failures[@]} > 0)); then
  echo
  echo "== failures (full output: $full)"
  printf '%s\n' "${failures[@]}"
fi
{
  echo
  printf '%-34s %-9s %6s %6s %7s %8s\n' binary status passed failed skipped seconds
  printf '%s\n' "${rows[@]}"
  echo "total $(($(date +%s) - t_start))s; $([[ $status_all == 0 ]] && echo ALL PASSED || echo FAILURES)"
} | tee "$summary"
exit "$status_all"
