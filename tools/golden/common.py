"""Setup shared by the golden-fixture scripts of tools/golden/: the command line, the pack offsets,
the check that the reference runs its PyTorch fallback, the tiny reference model built from a
`glmtune init` checkpoint, and writing a fixture so that a regenerated file is byte-identical.

Every helper that draws from a generator draws exactly what the code it replaced drew, in the
same order: the committed fixtures must regenerate bit for bit.
"""

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
GOLDEN_OPS = REPO / "tests" / "golden" / "ops"


def parse_out_arg(doc, file_name):
    """The scripts' one option, `--out PATH`, defaulting to tests/golden/ops/<file_name>."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=GOLDEN_OPS / file_name)
    return parser.parse_args().out


def cu_seqlens(docs):
    """The int32 document offsets [0, n0, n0 + n1, ...] of a pack."""
    out = [0]
    for n in docs:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def save_fixture(tensors, out, meta_key, meta, max_bytes):
    """Writes `tensors` to `out` with `meta` as JSON under the single metadata key `meta_key`:
    safetensors writes several keys in hash order, which would make the bytes of regenerated
    files differ although their content is the same."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={meta_key: json.dumps(meta, sort_keys=True)})
    size = out.stat().st_size
    print(f"wrote {os.path.normpath(out)}: {len(tensors)} tensors, {size} bytes")
    assert size < max_bytes, f"fixture is {size} bytes; keep it under {max_bytes}"


def assert_finite_and_nonzero(tensors):
    """A NaN, or a tensor of zeros that a broken port would match trivially, spoils a fixture."""
    for k, v in tensors.items():
        assert torch.isfinite(v.float()).all(), k
        if v.dtype.is_floating_point:
            assert v.abs().max() > 0, f"{k} is all zero"


def require_torch_fallback():
    """The reference calls FLA's, `causal_conv1d`'s or the `kernels` hub's kernels when they are
    importable; the fixtures record its PyTorch fallback, so refuse to run beside them."""
    for pkg in ("fla", "kernels", "causal_conv1d"):
        try:
            __import__(pkg)
        except ImportError:
            continue
        raise SystemExit(f"'{pkg}' is installed: the reference would not run its PyTorch fallback")


def tiny_reference(glmtune, seed, sets, loading_info=False):
    """`glmtune init --preset tiny --seed SEED --set ...` loaded by transformers as the f32 eager
    `Glm5NextForConditionalGeneration` (with the loading info when asked)."""
    from transformers import Glm5NextForConditionalGeneration

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "tiny"
        cmd = [glmtune, "init", "--preset", "tiny", "--out", str(ckpt), "--seed", str(seed)]
        for item in sets:
            cmd += ["--set", item]
        subprocess.run(cmd, check=True, capture_output=True)
        return Glm5NextForConditionalGeneration.from_pretrained(
            str(ckpt),
            dtype=torch.float32,
            attn_implementation="eager",
            experts_implementation="eager",
            output_loading_info=loading_info,
        )
