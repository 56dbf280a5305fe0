#!/usr/bin/env bash
# `glmtune eval --device cuda` and the CPU evaluation against transformers 5.17.0 at full width,
# on a GPU machine that has torch + transformers 5.17.0: a random crop25b model with 8 routed
# experts (`glmtune init`), pre-tokenised samples of 2,400 and 600 tokens (the indexer's top-2048
# pool selection active in the first), evaluated in one pack on the GPU and on the CPU, each
# compared with the reference run of every sample alone in float32 on the GPU
# (tests/gpu/eval_reference.py says the bars). Run from the repository root after
# tests/gpu/build_carry.sh:
#
#   tests/gpu/eval_reference.sh [WORK_DIR]
#
# The report goes to $OUT/eval_reference.json when OUT is set (else WORK_DIR). Environment:
# GLMTUNE_GPU_CARRY (default .gpu-carry), GLMTUNE_EVAL_PYTHON (default python3),
# GLMTUNE_EVAL_EXPERTS (routed experts, default 8).
set -euo pipefail

carry="${GLMTUNE_GPU_CARRY:-.gpu-carry}"
python="${GLMTUNE_EVAL_PYTHON:-python3}"
work="${1:-$(mktemp -d)}"
mkdir -p "$work"
source "$(dirname "${BASH_SOURCE[0]}")/carry_env.sh"
carry_env "$carry" "$work"
bin="$carry/glmtune"
here="$(dirname "${BASH_SOURCE[0]}")"
report="${OUT:-$work}/eval_reference.json"

t0=$(date +%s)
"$bin" init --preset crop25b --set "text_config.n_routed_experts=${GLMTUNE_EVAL_EXPERTS:-8}" \
  --seed 5 --out "$work/model" >"$work/init.log"
echo "init: $(($(date +%s) - t0)) s"
"$python" "$here/eval_reference.py" samples --model "$work/model" --out "$work/samples.jsonl"
run_eval() {
  local device="$1" data="$2" out="$3"
  shift 3
  local t0=$(date +%s)
  "$bin" eval --model "$work/model" --data "$data" --device "$device" --pack-length 4096 --json \
    "$@" >"$out"
  echo "eval on $device ($(basename "$data")$([[ $# -gt 0 ]] && echo ", logits dumped")):" \
    "$(($(date +%s) - t0)) s"
}
# Accuracy: every position's logits dumped.
for device in cuda cpu; do
  run_eval "$device" "$work/samples.jsonl" "$work/$device.json" \
    --dump-logits "$work/$device.safetensors"
done
# Speed, without the dump: the samples eight times on the GPU (its first pack pays the start-up),
# once on the CPU.
for i in 1 2 3 4 5 6 7 8; do cat "$work/samples.jsonl"; done >"$work/samples8.jsonl"
run_eval cuda "$work/samples8.jsonl" "$work/cuda_speed.json"
run_eval cpu "$work/samples.jsonl" "$work/cpu_speed.json"
"$python" "$here/eval_reference.py" compare --model "$work/model" --samples "$work/samples.jsonl" \
  --gpu "$work/cuda.json" --gpu-logits "$work/cuda.safetensors" \
  --cpu "$work/cpu.json" --cpu-logits "$work/cpu.safetensors" \
  --gpu-speed "$work/cuda_speed.json" --cpu-speed "$work/cpu_speed.json" --out "$report"
