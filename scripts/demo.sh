#!/usr/bin/env bash
# The main job on a fresh machine: install, build, create the bundled tiny GLM-5.3-Flash model with
# its tokenizer, show what it holds, fine-tune it on the bundled chat data, and evaluate the
# trained checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
# Passive OpenMP waiting keeps concurrent processes on small machines from starving each other.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
scripts/install-deps.sh
scripts/build.sh
bin="${GLMTUNE_BUILD_DIR:-build}/bin/glmtune"
model="runs/tiny-model"
"$bin" init --preset tiny --seed 1 --out "$model" --tokenizer examples/tiny/tokenizer --force
"$bin" inspect "$model"
echo "== held-out loss before training"
"$bin" eval --model "$model" --data examples/tiny/data/heldout.jsonl --pack-length 512
# examples/tiny/recipe.toml trains runs/tiny-model into runs/tiny-train; a previous demo's run is
# removed first (train refuses to overwrite a run directory that holds checkpoints).
run="runs/tiny-train"
rm -rf "$run"
"$bin" train --config examples/tiny/recipe.toml
trained="$run/checkpoints/$(cat "$run/checkpoints/latest")/model"
echo "== held-out loss after training"
"$bin" eval --model "$trained" --data examples/tiny/data/heldout.jsonl --pack-length 512
