#!/usr/bin/env bash
# Builds every libFuzzer target with clang under ASan + UBSan into ${GLMTUNE_FUZZ_BUILD_DIR:-build-fuzz},
# runs each for SECONDS (default 60) on its corpus, merges what the run found back into
# tests/fuzz/corpus/<corpus>/ (minimised with -merge=1), and prints per target: executions,
# executions per second, corpus size, coverage (cov = edges, ft = features) and crashes.
#
#   scripts/fuzz.sh [SECONDS]
#
# Environment:
#   FUZZ_TARGETS  targets to run (space-separated, e.g. "recipe dataset"); default all
#   FUZZ_RUNS     stop a target after this many executions as well (e.g. 10000000)
#   FUZZ_MERGE    0: leave tests/fuzz/corpus/ untouched (the run's corpus stays in the build dir)
#   FUZZ_NICE     niceness of the fuzzers (default 10: the machine stays usable)
#   FUZZ_KEEP_GOING  1: go on after a crash, OOM or timeout (libFuzzer -fork=1 -ignore_crashes=1
#                 ...) to measure a target whose known crash is not fixed yet; each is counted
#   FUZZ_JOBS     N > 1: one campaign in N worker processes (libFuzzer -fork=N; FUZZ_RUNS counts
#                 the executions of all of them), for a slow target on an otherwise idle machine
#   CC, CXX       the clang to use (default clang-14 / clang++-14)
# One target runs at a time, on one core (FUZZ_JOBS: on N). Crashing inputs are kept under
# <build dir>/artifacts/<target>/; the exit status is 1 when any target crashed.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
build_dir="${GLMTUNE_FUZZ_BUILD_DIR:-build-fuzz}"
nice_level="${FUZZ_NICE:-10}"
merge="${FUZZ_MERGE:-1}"

# target:corpus, as in tests/fuzz/CMakeLists.txt
all_targets=(safetensors_header:safetensors image:image video:video dataset:dataset chat_template:chat_template
             tokenizer_json:tokenizer_json tokenizer_encode:tokenizer_encode recipe:recipe
             model_config:model_config token_cache:token_cache)
declare -A corpus_of dict_of
for pair in "${all_targets[@]}"; do corpus_of[${pair%%:*}]=${pair##*:}; done
dict_of=([dataset]=json [chat_template]=json [tokenizer_json]=json [model_config]=json
         [token_cache]=json [recipe]=toml)
targets=(${FUZZ_TARGETS:-${!corpus_of[@]}})
for t in "${targets[@]}"; do
  [ -n "${corpus_of[$t]:-}" ] || { echo "fuzz.sh: unknown target '$t' (known: ${!corpus_of[*]})" >&2; exit 2; }
done
# A stable order: the one of all_targets.
ordered=()
for pair in "${all_targets[@]}"; do
  for t in "${targets[@]}"; do [ "$t" = "${pair%%:*}" ] && ordered+=("$t"); done
done

export CC="${CC:-clang-14}" CXX="${CXX:-clang++-14}"
# CUDA, the benchmarks and glmtune_core are not needed: each fuzzer compiles the parsers it
# reaches (tests/fuzz/CMakeLists.txt), so only the fuzz targets are built.
# -O1 with line tables only: sanitizer reports keep file:line, and the build is about twice as fast
# as -O2 -g.
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only -DNDEBUG" -DGLMTUNE_FUZZ=ON \
  -DGLMTUNE_CUDA=OFF -DGLMTUNE_BENCH=OFF >/dev/null
nice -n "$nice_level" cmake --build "$build_dir" -j "$(nproc)" --target "${ordered[@]/#/fuzz_}"

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export OMP_NUM_THREADS=1
status=0
summary=()
for t in "${ordered[@]}"; do
  corpus=${corpus_of[$t]}
  seeds="tests/fuzz/corpus/$corpus"
  work="$build_dir/corpus/$corpus"
  artifacts="$build_dir/artifacts/$t"
  log="$build_dir/logs/$t.log"
  mkdir -p "$work" "$artifacts" "$(dirname "$log")"
  args=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
        -artifact_prefix="$artifacts/")
  [ -n "${FUZZ_RUNS:-}" ] && args+=(-runs="$FUZZ_RUNS")
  jobs="${FUZZ_JOBS:-1}"
  [[ "$jobs" =~ ^[1-9][0-9]*$ ]] || { echo "fuzz.sh: FUZZ_JOBS must be a positive integer, not '$jobs'" >&2; exit 2; }
  fork=0
  if [ "${FUZZ_KEEP_GOING:-0}" = "1" ]; then
    fork=1
    args+=(-fork="$jobs" -ignore_crashes=1 -ignore_ooms=1 -ignore_timeouts=1)
  elif [ "$jobs" -gt 1 ]; then
    fork=1
    args+=(-fork="$jobs")
  fi
  [ -n "${dict_of[$t]:-}" ] && args+=(-dict="tests/fuzz/dict/${dict_of[$t]}.dict")
  echo "== fuzz_$t: ${seconds}s on $seeds (log: $log)"
  start=$(date +%s)
  rc=0
  nice -n "$nice_level" "$build_dir/fuzz/fuzz_$t" "${args[@]}" "$work" "$seeds" >"$log" 2>&1 || rc=$?
  elapsed=$(( $(date +%s) - start ))
  if [ "$fork" = "1" ]; then
    # Fork mode: the totals are in the parent's status lines ("#N: cov: ... time: Ss"). The
    # jobs' own lines ("#N<tab>NEW ...") and the final stats an interrupted run prints are one
    # job's.
    last=$(grep -E '^#[0-9]+: cov:' "$log" | tail -1 || true)
    execs=$(sed -n 's/^#\([0-9]*\):.*/\1/p' <<<"$last")
    secs=$(sed -n 's/.* time: \([0-9]*\)s.*/\1/p' <<<"$last")
    rate=
    [ -n "$execs" ] && [ -n "$secs" ] && [ "$secs" -gt 0 ] && rate=$((execs / secs))
  else
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
    last=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
  fi
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  # crash-, leak-, timeout- and oom- inputs are failures; a slow-unit- input is an input that ran
  # longer than -report_slow_units seconds (on a loaded machine, often the load's doing): counted
  # apart, to be rerun alone.
  crashes=$(find "$artifacts" -type f ! -name 'slow-unit-*' | wc -l)
  slow=$(find "$artifacts" -type f -name 'slow-unit-*' | wc -l)
  [ "$slow" -gt 0 ] && echo "   fuzz_$t: $slow slow unit(s) in $artifacts/ (not failures; time each alone with $build_dir/fuzz/fuzz_$t FILE)"
  if [ "$rc" -ne 0 ] || [ "$crashes" -gt 0 ]; then
    status=1
    echo "   fuzz_$t FAILED (exit $rc); the report is in $log, the inputs in $artifacts/"
    grep -m1 -E 'ERROR: |runtime error|fuzz invariant broken|terminate called' "$log" || true
  fi
  if [ "$merge" = "1" ] && [ "$rc" -eq 0 ]; then
    # Minimise seeds + everything found into a fresh set; past crashers (crash-*) stay regardless.
    merged=$(mktemp -d)
    nice -n "$nice_level" "$build_dir/fuzz/fuzz_$t" -merge=1 -timeout=10 -rss_limit_mb=2048 "$merged" "$seeds" "$work" \
      >"$build_dir/logs/$t.merge.log" 2>&1
    find "$seeds" -maxdepth 1 -type f -name 'crash-*' -exec cp {} "$merged/" \;
    find "$seeds" -maxdepth 1 -type f -delete
    cp "$merged"/* "$seeds/"
    rm -rf "$merged"
  fi
  kept="$seeds"
  [ "$merge" = "1" ] && [ "$rc" -eq 0 ] || kept="$work"
  files=$(find "$kept" -type f | wc -l)
  bytes=$(du -sb "$kept" | cut -f1)
  summary+=("$(printf '%-18s %6ss %12s %9s %7s %9s %6s %6s %7s' "$t" "$elapsed" "${execs:-?}" \
    "${rate:-?}" "$files" "$bytes" "${cov:-?}" "${ft:-?}" "$crashes")")
done
echo
printf '%-18s %7s %12s %9s %7s %9s %6s %6s %7s\n' target time execs execs/s files bytes cov ft crashes
printf '%s\n' "${summary[@]}"
exit $status
