"""Setup shared by the golden-fixture scripts of tools/golden/ (ops_kda_mhc.py, grads_kda_mhc.py,
ops_dsa_moe.py, grads_dsa_moe.py): the command line, the pack offsets, the reference modules
that two scripts build alike, and writing a fixture so that a regenerated file is byte-identical.

Every helper that draws from a generator draws exactly what the code it replaced drew, in the
same order: the committed fixtures must regenerate bit for bit.
"""

import argparse
import json
import os
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
