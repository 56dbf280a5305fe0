#!/usr/bin/env python3
"""Writes the safetensors fixtures under tests/golden/safetensors/ with Hugging Face's own writers.

tests/unit/test_safetensors.cpp and test_checkpoint.cpp read them and check that glmtune's reader
sees the same tensors and that glmtune's writer produces the same bytes. Needs torch and
safetensors (and huggingface_hub for the sharded fixture). Usage:

    python tools/golden/make_safetensors_golden.py [OUTPUT_DIR]

The values follow closed formulas that the C++ tests recompute, so no expected-value files are
needed: element i of every float tensor is ((i * 7) % 23 - 11) / 4 (exact in every float dtype,
FP8 e4m3 included), integers are (i * 7919) % 2001 - 1000 (times 10^12 + i for I64), booleans
are (i % 3 == 0).
"""

import json
import os
import shutil
import sys

import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import save_file


def float_values(n, dtype):
    i = torch.arange(n, dtype=torch.float64)
    return (((i * 7) % 23) - 11).div(4).to(dtype)


def int_values(n, dtype):
    i = torch.arange(n, dtype=torch.int64)
    v = (i * 7919) % 2001 - 1000
    if dtype == torch.int64:
        v = v * 10**12 + i
    return v.to(dtype)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(__file__), "..", "..", "tests", "golden", "safetensors")
    os.makedirs(out, exist_ok=True)

    # One tensor per dtype glmtune supports, plus a scalar and an empty tensor, so the dtype sort
    # order, the header text and the padding of the reference writer are all pinned.
    tensors = {
        "f32.weight": float_values(6, torch.float32).reshape(2, 3),
        "f64.weight": float_values(5, torch.float64),
        "bf16.weight": float_values(12, torch.bfloat16).reshape(3, 4),
        "f16.weight": float_values(7, torch.float16),
        "fp8.weight": float_values(10, torch.float8_e4m3fn).reshape(2, 5),
        "i32.index": int_values(9, torch.int32).reshape(3, 3),
        "i64.index": int_values(4, torch.int64),
        "bool.mask": (torch.arange(11) % 3 == 0),
        "scalar": torch.tensor(1.5, dtype=torch.float32),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
    }
    save_file(tensors, os.path.join(out, "all_dtypes.safetensors"), metadata={"format": "pt"})
    # No metadata at all, and a name needing JSON escapes.
    save_file({"a\"b\\c\td": float_values(3, torch.float32)},
              os.path.join(out, "escaped_name.safetensors"))

    # A sharded checkpoint as huggingface_hub writes it: 4 tensors of 64 bytes, shards of at most
    # 128 bytes -> 2 shards and an index.
    sharded = os.path.join(out, "sharded")
    shutil.rmtree(sharded, ignore_errors=True)
    os.makedirs(sharded)
    state = {f"layers.{k}.weight": float_values(16, torch.float32) + k for k in range(4)}
    save_torch_state_dict(state, sharded, max_shard_size=128, metadata={"format": "pt"})
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        print(json.dumps(json.load(f)["weight_map"], indent=1))


if __name__ == "__main__":
    main()
