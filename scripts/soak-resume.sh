#!/usr/bin/env bash
# Kill-and-resume soak: trains the bundled tiny model on the CPU, SIGKILLs the training at random
# moments (many during checkpoint saves) and resumes it each time, then checks that
#   - every checkpoint kept on disk verifies after every kill (glmtune inspect --verify),
#   - the final checkpoint's tensors (model and optimizer) equal those of an uninterrupted run bit
#     for bit, and metrics.jsonl holds the same steps with the same values (timings aside),
#   - a flipped byte in the newest checkpoint is detected on --resume, which falls back to the
#     previous checkpoint, keeps the corrupt one, and still ends on the same bits.
#
# usage: scripts/soak-resume.sh [--kills N] [--build DIR] [--work DIR] [--seed S] [--keep]
#   --kills N   SIGKILLs to deliver (default 50)
#   --build DIR build directory holding the glmtune binary (default build)
#   --bin PATH  the glmtune binary itself (instead of --build)
#   --work DIR  scratch directory (default: a new temporary one, removed at the end unless --keep)
#   --seed S    seed of the kill times (default: random, printed)
# Exits 0 when everything holds, 1 naming the first failure otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

kills=50
build=build
bin=""
work=""
seed=$((RANDOM * 32768 + RANDOM))
keep=0
while [ $# -gt 0 ]; do
  case "$1" in
    --kills) kills="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --bin) bin="$2"; shift 2 ;;
    --work) work="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --keep) keep=1; shift ;;
    *) echo "soak-resume: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$bin" ] || bin="$build/bin/glmtune"
bin="$(realpath "$bin")"
[ -x "$bin" ] || { echo "soak-resume: no glmtune binary at $bin (build first)" >&2; exit 2; }
command -v jq >/dev/null || { echo "soak-resume: needs jq (scripts/install-deps.sh)" >&2; exit 2; }
if [ -z "$work" ]; then work="$(mktemp -d "${TMPDIR:-/tmp}/glmtune-soak-XXXXXX")"; fi
mkdir -p "$work"
work="$(realpath "$work")"
cleanup() { if [ "$keep" = 0 ]; then rm -rf "$work"; fi; }
trap cleanup EXIT
RANDOM=$seed
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
fail() { echo "soak-resume: FAIL: $*" >&2; echo "  (work dir $work, seed $seed)" >&2; keep=1; exit 1; }
start_time=$(date +%s)
echo "soak-resume: $kills kills, seed $seed, work dir $work"

# The tiny model and a recipe over the bundled data: short packs so that a step is quick, a save
# every 2 steps (every save also sleeps, so that many kills land inside one), the last 3 kept.
steps=$((kills * 4 + 20))
[ "$steps" -ge 60 ] || steps=60  # short soaks too need runs longer than the longest kill delay
"$bin" init --preset tiny --seed 1 --out "$work/model" --tokenizer examples/tiny/tokenizer \
  >"$work/init.log" 2>&1 || fail "init: $(tail -3 "$work/init.log")"
recipe_for() {
  sed -e "s|^path = .*|path = \"$work/model\"|" -e "s|^tokenizer = .*|tokenizer = \"$work/model\"|" \
    -e "s|^files = .*|files = [\"$PWD/examples/tiny/data/chat.jsonl\"]|" \
    -e "s|^max_length = .*|max_length = 128|" -e "s|^pack_max_length = .*|pack_max_length = 128|" \
    -e "s|^total_steps = .*|total_steps = $steps|" -e "s|^dir = .*|dir = \"$1\"|" \
    -e "s|^save_every = .*|save_every = 2|" -e "s|^keep_last = .*|keep_last = 3|" \
    examples/tiny/recipe.toml >"$2"
}
recipe_for "$work/reference" "$work/reference.toml"
recipe_for "$work/soak" "$work/soak.toml"

echo "soak-resume: uninterrupted reference run of $steps steps"
"$bin" train --config "$work/reference.toml" >"$work/reference.log" 2>&1 ||
  fail "reference run: $(tail -5 "$work/reference.log")"
ref_seconds=$(( $(date +%s) - start_time ))

# Random kill times up to twice the reference run's time per step, plus the start-up.
ms_per_step=$(( ref_seconds * 1000 / steps + 1 ))
export GLMTUNE_TEST_SAVE_DELAY_MS=150
delivered=0 in_save=0 runs=0
ck="$work/soak/checkpoints"
while [ "$delivered" -lt "$kills" ]; do
  runs=$((runs + 1))
  "$bin" train --config "$work/soak.toml" --resume >>"$work/soak.log" 2>&1 &
  pid=$!
  delay_ms=$(( 300 + RANDOM % (ms_per_step * 6 + 1500) ))
  sleep "$(printf '%d.%03d' $((delay_ms / 1000)) $((delay_ms % 1000)))"
  if ! kill -0 "$pid" 2>/dev/null; then
    wait "$pid" || fail "run $runs ended with an error: $(tail -5 "$work/soak.log")"
    fail "the run finished after $delivered kills: raise the step count"
  fi
  saving=0
  compgen -G "$ck/.step-*.tmp-*" >/dev/null && saving=1
  kill -KILL "$pid"
  wait "$pid" 2>/dev/null || true
  delivered=$((delivered + 1))
  in_save=$((in_save + saving))
  # Every checkpoint that is kept verifies, whatever the moment of the kill.
  if [ -d "$ck" ] && compgen -G "$ck/step-*" >/dev/null; then
    "$bin" inspect --verify "$work/soak" >"$work/verify.log" 2>&1 ||
      fail "after kill $delivered: $(cat "$work/verify.log")"
    kept=$(grep -c ': OK' "$work/verify.log" || true)
  else
    kept=0
  fi
  last=$(tail -n 1 "$work/soak/metrics.jsonl" 2>/dev/null | jq -r .step 2>/dev/null || echo 0)
  echo "  kill $delivered/$kills after ${delay_ms} ms$([ $saving = 1 ] && echo ' (during a save)'): step $last logged, $kept checkpoints verified"
done
unset GLMTUNE_TEST_SAVE_DELAY_MS

"$bin" train --config "$work/soak.toml" --resume >>"$work/soak.log" 2>&1 ||
  fail "final resume: $(tail -5 "$work/soak.log")"

# The final checkpoints: identical tensor files (header and bytes), identical checksums.
compare_final() {
  local a="$work/reference/checkpoints/step-$steps" b="$work/soak/checkpoints/step-$steps" f
  for part in model optimizer; do
    for f in "$a/$part"/*.safetensors "$a/$part/glmtune-checksums.json"; do
      cmp -s "$f" "$b/$part/$(basename "$f")" || fail "$1: $part/$(basename "$f") differs"
    done
  done
  # metrics.jsonl: each step once, the same values; the timings are the machine's.
  local drop='del(.tgs, .seqlen_tgs, .exp_tgs, .eta, .model_tflops, .mfu, .max_memory, .reserved_memory, .comm_time, .time, .elapsed, .step_time)'
  diff <(jq -cS "$drop" "$work/reference/metrics.jsonl") <(jq -cS "$drop" "$work/soak/metrics.jsonl") \
    >"$work/metrics.diff" || fail "$1: metrics.jsonl differs: $(head -4 "$work/metrics.diff")"
}
compare_final "after $delivered kills"
echo "soak-resume: final checkpoint and metrics.jsonl bit-identical to the uninterrupted run"

# A flipped byte in the newest checkpoint: resume names it, uses the previous one, keeps it.
newest="$ck/step-$steps"
previous=$(cd "$ck" && ls -d step-* | grep -E '^step-[0-9]+$' | sort -t- -k2 -n | tail -2 | head -1)
shard=$(ls "$newest/model"/*.safetensors | head -1)
header=$(( $(od -An -tu8 -N8 "$shard" | tr -d ' ') + 8 ))
size=$(stat -c %s "$shard")
at=$(( header + (size - header) / 2 ))
byte=$(od -An -tu1 -j "$at" -N1 "$shard" | tr -d ' ')
printf "$(printf '\\%03o' $(( byte ^ 1 )))" | dd of="$shard" bs=1 seek="$at" conv=notrunc status=none
[ "$(stat -c %s "$shard")" = "$size" ] || fail "the flip changed the size"
"$bin" inspect --verify "$newest" >"$work/flip-verify.log" 2>&1 &&
  fail "inspect --verify missed the flipped byte"
grep -q 'checksum mismatch' "$work/flip-verify.log" || fail "inspect: $(cat "$work/flip-verify.log")"
"$bin" train --config "$work/soak.toml" --resume >"$work/flip.log" 2>&1 ||
  fail "resume after the flip: $(tail -5 "$work/flip.log")"
grep -q "checkpoint $newest is corrupt" "$work/flip.log" || fail "no corrupt report: $(cat "$work/flip.log")"
grep -q "model/$(basename "$shard"): tensor" "$work/flip.log" || fail "the bad tensor is not named"
grep -q "falling back to $previous," "$work/flip.log" || fail "no fall back to $previous"
[ -d "$newest.corrupt" ] || fail "the corrupt checkpoint was not kept"
grep -i download "$work/flip.log" && fail "the advice mentions downloading"
compare_final "after the fall back"
echo "soak-resume: flipped byte detected ($(grep -o 'tensor "[^"]*"' "$work/flip-verify.log" | head -1)), resumed from $previous, corrupt copy kept"

seconds=$(( $(date +%s) - start_time ))
echo "soak-resume: PASS: $delivered SIGKILLs ($in_save during a save) over $runs runs of $steps steps, 0 corrupt checkpoints, in ${seconds}s"
