#!/usr/bin/env bash
# The distributed GPU checks, on a machine with two or more GPUs and an MPI launcher (mpirun);
# tests/gpu/run.sh runs it there after the single-GPU binaries, with the library path set.
#
#  1. Data parallel over NCCL: `mpirun -np 2 glmtune train` on the tiny preset with the GPU
#     kernels' head dims (one pack per rank and step, gradients reduce-scattered over NCCL, the
#     optimizer sharded and updated on the GPUs) follows the one-GPU
#     run with two packs per step (the same packs) for 20 steps (bars in follows_one_gpu: bf16
#     compute, the two runs sum the same gradients in another order), and the saved checkpoint of
#     the 2-rank run resumes on one GPU for 2 more steps.
#  2. Expert parallel over NCCL: the same two ranks with train.ep_size = 2 (each GPU holds half of
#     the routed experts; tokens travel to them and back through NCCL all-to-alls) follow the
#     same one-GPU run within the same bar, and the ep checkpoint resumes on one GPU.
#  3. Fully sharded decoder layers over NCCL: the same two ranks with train.fsdp = true (each GPU
#     keeps half of every decoder layer's weights, gradients and optimizer state; layers are
#     all-gathered around each use and their gradients reduce-scattered) follow the same run, and
#     so does fsdp with ep_size = 2; both checkpoints resume on one GPU.
#  4. Sequence parallel over NCCL: the same two ranks with train.sp_size = 2 (each pack split into
#     two shards of rows, the mixers' heads split over the GPUs) and two packs per step follow the
#     same run, and so does sp with fsdp (the layers' partial gradients summed over sp on NCCL);
#     both checkpoints resume on one GPU.
#  5. A rank that stops (SIGSTOP) in the middle of an fsdp run on the GPUs: every rank must exit
#     non-zero within the --dist-timeout, the survivor naming the NCCL collective that did not
#     complete.
#  6. bench_cuda_nccl under mpirun: the dispatch all-to-all and the FSDP overlap (numbers only).
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
# NVLink multicast stays as the machine sets it (off on shared hosts) in every rank.
for v in NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS; do
  [[ -n "${!v:-}" ]] && launcher+=(-x "$v")
done

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
# follows_one_gpu LABEL DIR: the run in DIR against the one-GPU run. The first 3 steps within 2e-3
# (the same weights but for updates whose gradients were summed in another order), every step
# within 3e-2: bf16 rounding differences grow over a run at this learning rate (measured on two
# H200s at four model seeds: up to 8.1e-3 for data parallel and 1.3e-2 for sequence parallel,
# with the first steps below 1e-3).
follows_one_gpu() {
  python3 - "$1" "$work/dist-one/metrics.jsonl" "$2/metrics.jsonl" <<'EOF'
import json, statistics, sys
def losses(path):
    return [json.loads(line)["loss"] for line in open(path) if line.strip()]
label, one, two = sys.argv[1], losses(sys.argv[2]), losses(sys.argv[3])
if len(one) != 20 or len(two) != 20:
    sys.exit(f"dist_check: {label}: expected 20 steps, got {len(one)} and {len(two)}")
diffs = [abs(a - b) for a, b in zip(one, two)]
first, worst = max(diffs[:3]), max(diffs)
# The GPUs' time in NCCL collectives is logged for every step of a 2-rank run.
comm = [json.loads(line).get("comm_time") for line in open(sys.argv[3]) if line.strip()]
if any(c is None or c <= 0 for c in comm):
    sys.exit(f"dist_check: {label}: a step without its comm_time: {comm}")
steps = [json.loads(line)["step_time"] for line in open(sys.argv[3]) if line.strip()]
share = statistics.median(c / t for c, t in zip(comm[1:], steps[1:]))
print(f"{label}: loss {one[0]:.4f} -> {one[-1]:.4f} on one GPU, {two[0]:.4f} -> {two[-1]:.4f} "
      f"on two; first 3 steps within {first:.2e} (bar 2e-3), worst step {worst:.2e} (bar 3e-2); "
      f"NCCL busy {100 * share:.0f}% of the step (median)")
if first > 2e-3 or worst > 3e-2:
    sys.exit(f"dist_check: {label}: the 2-rank losses left the one-GPU curve")
EOF
}

# resumes_on_one_gpu DIR: the checkpoint of the 2-rank run in DIR trains 2 more steps on one GPU.
resumes_on_one_gpu() {
  cp -r "$1" "$1-resumed"
  "$bin" train "${common[@]}" --set train.micro_packs=2 --set train.total_steps=22 \
    --set "output.dir=$1-resumed" --resume >"$1-resumed.log" 2>&1 || {
    echo "dist_check: resuming the checkpoint of $1 on one GPU failed"
    tail -n 20 "$1-resumed.log"
    return 1
  }
  echo "resumed run: metrics.jsonl now holds $(grep -c '"step"' "$1-resumed/metrics.jsonl") steps"
}

# run_two_ranks NAME LABEL [--set ...]: the 2-rank run (one pack per rank and step unless the flags
# say otherwise), compared with the one-GPU run, then resumed on one GPU.
run_two_ranks() {
  local name="$1" label="$2"
  shift 2
  echo "== two ranks on two GPUs, $label"
  "${launcher[@]}" "$bin" train "${common[@]}" --set train.micro_packs=1 "$@" \
    --set "output.dir=$work/$name" >"$work/$name.log" 2>&1 || {
    echo "dist_check: the 2-rank run ($label) failed"
    tail -n 30 "$work/$name.log"
    return 1
  }
  grep -h "distributed:\|ep: this rank\|fsdp: this rank" "$work/$name.log" | head -n 3
  follows_one_gpu "$label over NCCL" "$work/$name" || return 1
  echo "== the 2-rank checkpoint ($label) resumed on one GPU"
  resumes_on_one_gpu "$work/$name"
}

run_two_ranks dist-two "data parallel" || fail=1
run_two_ranks dist-ep "expert parallel (ep_size 2)" --set train.ep_size=2 || fail=1
run_two_ranks dist-fsdp "fully sharded layers (fsdp)" --set train.fsdp=true || fail=1
run_two_ranks dist-fsdp-ep "fsdp with ep_size 2" --set train.fsdp=true --set train.ep_size=2 ||
  fail=1
# dp = 1: both ranks share every pack, so the step takes both packs as the one-GPU run does.
run_two_ranks dist-sp "sequence parallel (sp_size 2)" --set train.sp_size=2 \
  --set train.micro_packs=2 || fail=1
run_two_ranks dist-sp-fsdp "sp with fsdp (a dp group of one)" --set train.sp_size=2 \
  --set train.fsdp=true --set train.micro_packs=2 || fail=1

# A stopped rank: rank 1 is frozen after two steps; rank 0 waits in an NCCL collective until the
# deadline, then the job ends.
stopped_rank() {
  local out="$work/dist-stopped" timeout=15
  echo "== a rank stopped during a 2-rank fsdp run (--dist-timeout $timeout)"
  local start=$SECONDS
  "${launcher[@]}" "$bin" train "${common[@]}" --set train.micro_packs=1 --set train.fsdp=true \
    --set train.total_steps=100000 --set output.log_every=1 --set "output.dir=$out" \
    --dist-timeout "$timeout" >"$out.log" 2>&1 &
  local job=$!
  local frozen=""
  while kill -0 "$job" 2>/dev/null && ((SECONDS - start < 120)); do
    if [[ -z "$frozen" && "$(cat "$out/metrics.jsonl" 2>/dev/null | grep -c step)" -ge 2 ]]; then
      for pid in $(pgrep -f "$bin train"); do
        if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=1"; then
          kill -STOP "$pid" && frozen=$pid
        fi
      done
      [[ -n "$frozen" ]] && echo "rank 1 (pid $frozen) stopped after step 2"
    fi
    sleep 0.5
  done
  local rc=0
  if kill -0 "$job" 2>/dev/null; then
    kill -9 "$job"
    rc=1
    echo "dist_check: the job did not end within 120 s of a stopped rank"
  fi
  wait "$job"
  local status=$?
  [[ -n "$frozen" ]] && kill -9 "$frozen" 2>/dev/null
  if [[ -z "$frozen" ]]; then
    echo "dist_check: rank 1 was never found to stop"
    tail -n 20 "$out.log"
    return 1
  fi
  echo "job exit status $status after $((SECONDS - start)) s"
  grep -h "did not complete within" "$out.log" "$out"/logs/rank-*.log 2>/dev/null | head -n 2
  if [[ "$status" == 0 ]] || ! grep -qh "did not complete within" "$out.log" "$out"/logs/rank-*.log; then
    echo "dist_check: the stopped rank did not end the job with a message"
    tail -n 20 "$out.log"
    return 1
  fi
  return $rc
}
stopped_rank || fail=1

echo "== bench_cuda_nccl (2 ranks)"
if [[ -x "$carry/bench_cuda_nccl" ]]; then
  "${launcher[@]}" "$carry/bench_cuda_nccl" 2>&1 || fail=1
fi
exit $fail
