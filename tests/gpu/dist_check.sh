#!/usr/bin/env bash
# The distributed GPU checks, on a machine with two or more GPUs and an MPI launcher (mpirun);
# tests/gpu/run.sh runs it there after the single-GPU binaries, with the library path set.
#
#  1. Data parallel over NCCL: `mpirun -np 2 glmtune train` on the tiny preset with the GPU
#     kernels' head dims (one pack per rank
#     and step, gradients reduce-scattered over NCCL, the optimizer sharded) follows the one-GPU
#     run with two packs per step (the same packs) for 20 steps: every step's loss within 1e-2
#     (bf16 compute; the two runs sum the same gradients in another order), and the saved
#     checkpoint of the 2-rank run resumes on one GPU for 2 more steps.
#  2. Expert parallel over NCCL: the same two ranks with train.ep_size = 2 (each GPU holds half of
#     the routed experts; tokens travel to them and back through NCCL all-to-alls) follow the
#     same one-GPU run within the same bar, and the ep checkpoint resumes on one GPU.
#  3. bench_cuda_nccl under mpirun: the dispatch all-to-all and the FSDP overlap (numbers only).
#
# Usage (from the repository root): tests/gpu/dist_check.sh CARRY_DIR WORK_DIR
# Environment: GLMTUNE_MPIRUN (the launcher, default mpirun; an Open MPI one takes -x).
# Exit status non-zero when a check failed.
set -uo pipefail

carry="$1"
work="$2"
bin="$carry/glmtune"
launcher=("${GLMTUNE_MPIRUN:-mpirun}" -np 2 --bind-to none)
[[ "$(id -u)" == 0 ]] && launcher+=(--allow-run-as-root)
# Every rank sees the library path of this shell (local ranks inherit it; -x says so explicitly).
launcher+=(-x LD_LIBRARY_PATH -x PATH)

fail=0
model="$work/dist-model"
# The tiny preset with the head dims the GPU kernels take (KDA 128, attention 32).
"$bin" init --preset tiny --seed 1 --out "$model" --tokenizer examples/tiny/tokenizer --force \
  --set text_config.linear_attn_config.head_dim=128 --set text_config.qk_nope_head_dim=32 \
  --set text_config.qk_head_dim=32 --set text_config.v_head_dim=32 \
  >"$work/dist-init.log" 2>&1 || {
  echo "dist_check: glmtune init failed"
  tail -n 20 "$work/dist-init.log"
  exit 1
}
common=(--config examples/tiny/recipe.toml --set "model.path=$model" --set "model.tokenizer=$model"
  --set train.device=cuda --set train.total_steps=20 --set output.save_every=20
  --set output.log_every=5)

echo "== one GPU, two packs per step"
"$bin" train "${common[@]}" --set train.micro_packs=2 --set "output.dir=$work/dist-one" \
  >"$work/dist-one.log" 2>&1 || {
  echo "dist_check: the one-GPU run failed"
  tail -n 20 "$work/dist-one.log"
  exit 1
}
echo "== two ranks on two GPUs, one pack each per step"
"${launcher[@]}" "$bin" train "${common[@]}" --set train.micro_packs=1 \
  --set "output.dir=$work/dist-two" >"$work/dist-two.log" 2>&1 || {
  echo "dist_check: the 2-rank run failed"
  tail -n 30 "$work/dist-two.log"
  exit 1
}
grep -h "distributed:" "$work/dist-two.log" | head -n 2

python3 - "$work/dist-one/metrics.jsonl" "$work/dist-two/metrics.jsonl" <<'EOF' || fail=1
import json, sys
def losses(path):
    return [json.loads(line)["loss"] for line in open(path) if line.strip()]
one, two = losses(sys.argv[1]), losses(sys.argv[2])
if len(one) != 20 or len(two) != 20:
    sys.exit(f"dist_check: expected 20 steps, got {len(one)} and {len(two)}")
worst = max(abs(a - b) for a, b in zip(one, two))
print(f"data parallel over NCCL: loss {one[0]:.4f} -> {one[-1]:.4f} on one GPU, "
      f"{two[0]:.4f} -> {two[-1]:.4f} on two; worst step difference {worst:.2e} (bar 1e-2)")
if worst > 1e-2:
    sys.exit("dist_check: the 2-rank losses left the one-GPU curve")
EOF

echo "== the 2-rank checkpoint resumed on one GPU"
cp -r "$work/dist-two" "$work/dist-resumed"
"$bin" train "${common[@]}" --set train.micro_packs=2 --set train.total_steps=22 \
  --set "output.dir=$work/dist-resumed" --resume >"$work/dist-resumed.log" 2>&1 || {
  echo "dist_check: resuming the 2-rank checkpoint on one GPU failed"
  tail -n 20 "$work/dist-resumed.log"
  fail=1
}
[[ $fail == 0 ]] && grep -c '"step"' "$work/dist-resumed/metrics.jsonl" |
  xargs -I{} echo "resumed run: metrics.jsonl now holds {} steps"

echo "== two ranks on two GPUs, expert parallel (ep_size 2), one pack each per step"
if "${launcher[@]}" "$bin" train "${common[@]}" --set train.micro_packs=1 --set train.ep_size=2 \
  --set "output.dir=$work/dist-ep" >"$work/dist-ep.log" 2>&1; then
  grep -h "distributed:\|ep: this rank" "$work/dist-ep.log" | head -n 2
  python3 - "$work/dist-one/metrics.jsonl" "$work/dist-ep/metrics.jsonl" <<'EOF' || fail=1
import json, sys
def losses(path):
    return [json.loads(line)["loss"] for line in open(path) if line.strip()]
one, ep = losses(sys.argv[1]), losses(sys.argv[2])
if len(one) != 20 or len(ep) != 20:
    sys.exit(f"dist_check: expected 20 steps, got {len(one)} and {len(ep)}")
worst = max(abs(a - b) for a, b in zip(one, ep))
print(f"expert parallel over NCCL: loss {ep[0]:.4f} -> {ep[-1]:.4f} with ep 2; worst step "
      f"difference from one GPU {worst:.2e} (bar 1e-2)")
if worst > 1e-2:
    sys.exit("dist_check: the expert-parallel losses left the one-GPU curve")
EOF
  echo "== the ep checkpoint resumed on one GPU"
  cp -r "$work/dist-ep" "$work/dist-ep-resumed"
  "$bin" train "${common[@]}" --set train.micro_packs=2 --set train.total_steps=22 \
    --set "output.dir=$work/dist-ep-resumed" --resume >"$work/dist-ep-resumed.log" 2>&1 || {
    echo "dist_check: resuming the ep checkpoint on one GPU failed"
    tail -n 20 "$work/dist-ep-resumed.log"
    fail=1
  }
else
  echo "dist_check: the expert-parallel run failed"
  tail -n 30 "$work/dist-ep.log"
  fail=1
fi

echo "== bench_cuda_nccl (2 ranks)"
if [[ -x "$carry/bench_cuda_nccl" ]]; then
  "${launcher[@]}" "$carry/bench_cuda_nccl" 2>&1 || fail=1
fi
exit $fail
