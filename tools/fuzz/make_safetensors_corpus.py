#!/usr/bin/env python3
"""Writes the seed corpus of the safetensors fuzzer (tests/fuzz/corpus/safetensors/).

Plain Python, no dependencies. The seeds are small valid files (every dtype, scalars, empty
tensors, metadata, escaped names) and one file per malformed kind that the reader must reject
(see tests/unit/test_safetensors.cpp for the expected messages). The corpus also holds files this
script does not write and leaves alone: hf_*.safetensors are copies of the fixtures written by
Hugging Face's library (tests/golden/safetensors/), and crash-* are inputs the fuzzer once crashed
on, kept so that the replay test guards against regressions.

    python3 tools/fuzz/make_safetensors_corpus.py [OUTPUT_DIR]
"""

import json
import os
import struct
import sys


def build(header, data=b"", length=None):
    """A file from a header (dict -> compact JSON, or str/bytes as is) and raw data bytes."""
    if isinstance(header, dict):
        header = json.dumps(header, separators=(",", ":"))
    if isinstance(header, str):
        header = header.encode("utf-8")
    n = len(header) if length is None else length
    return struct.pack("<Q", n) + header + data


def padded(header_dict, data):
    """A valid file laid out as the reference writer lays it out (header padded to 8 bytes)."""
    text = json.dumps(header_dict, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def seeds():
    out = {}
    # Valid files.
    out["valid_empty"] = padded({}, b"")
    out["valid_metadata_only"] = padded({"__metadata__": {"format": "pt", "note": "x"}}, b"")
    out["valid_all_dtypes"] = padded(
        {
            "__metadata__": {"format": "pt"},
            "i64": entry("I64", [2], 0, 16),
            "f64": entry("F64", [1], 16, 24),
            "f32": entry("F32", [2, 2], 24, 40),
            "i32": entry("I32", [1], 40, 44),
            "bf16": entry("BF16", [3], 44, 50),
            "f16": entry("F16", [1], 50, 52),
            "fp8": entry("F8_E4M3", [2, 3], 52, 58),
            "bool": entry("BOOL", [2], 58, 60),
        },
        bytes(range(60)),
    )
    out["valid_scalar_and_empty"] = padded(
        {"s": entry("F32", [], 0, 4), "e": entry("BF16", [0, 5], 4, 4), "z": entry("F32", [0], 4, 4)},
        b"\x00\x00\xc0\x3f",
    )
    out["valid_unaligned"] = build(
        {"b": entry("BOOL", [1], 0, 1), "f": entry("F32", [2], 1, 9)}, bytes(range(9))
    )
    out["valid_escaped_name"] = padded({"a\"b\\c\td\u00e9\u0001": entry("F32", [1], 0, 4)}, b"\0\0\0\0")
    out["valid_out_of_order_entries"] = build(
        '{"second":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},'
        '"first":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
        bytes(8),
    )
    out["valid_null_metadata"] = build('{"__metadata__":null}')
    # Malformed: one file per kind the reader must reject.
    out["bad_shorter_than_prefix"] = b"\x05\x00\x00"
    out["bad_header_past_file"] = build("{}", length=4096)
    out["bad_header_over_cap"] = build("{}", length=100_000_001)
    out["bad_header_len_max"] = b"\xff" * 8 + b"{}"
    out["bad_json"] = build('{"a":')
    out["bad_json_trailing"] = build("{} x")
    out["bad_not_object"] = build("[1,2,3]")
    out["bad_utf8"] = build(b'{"\xff":1}')
    out["bad_unknown_dtype"] = build({"a": entry("F8_E5M2", [2], 0, 2)}, bytes(2))
    out["bad_dtype_type"] = build('{"a":{"dtype":3,"shape":[1],"data_offsets":[0,1]}}', bytes(1))
    out["bad_negative_dim"] = build({"a": entry("F32", [-2], 0, 8)}, bytes(8))
    out["bad_fractional_dim"] = build('{"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}}', bytes(8))
    out["bad_huge_dim"] = build('{"a":{"dtype":"F32","shape":[1e30],"data_offsets":[0,8]}}', bytes(8))
    out["bad_shape_mismatch"] = build({"a": entry("F32", [3], 0, 8)}, bytes(8))
    out["bad_numel_overflow"] = build({"a": entry("F32", [2**32, 2**32], 0, 8)}, bytes(8))
    out["bad_stride_overflow"] = build({"a": entry("F32", [0, 2**32, 2**32], 0, 0)})
    out["bad_offsets_past_data"] = build({"a": entry("F32", [2], 0, 8)}, bytes(4))
    out["bad_offsets_reversed"] = build({"a": entry("F32", [2], 8, 0)}, bytes(8))
    out["bad_offsets_arity"] = build('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}}', bytes(8))
    out["bad_overlap"] = build({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, bytes(12))
    out["bad_hole"] = build({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, bytes(12))
    out["bad_leading_hole"] = build({"a": entry("F32", [1], 4, 8)}, bytes(8))
    out["bad_trailing_bytes"] = build({"a": entry("F32", [1], 0, 4)}, bytes(9))
    out["bad_duplicate_name"] = build(
        '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
        '"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
        bytes(4),
    )
    out["bad_duplicate_field"] = build(
        '{"a":{"dtype":"F32","dtype":"I32","shape":[1],"data_offsets":[0,4]}}', bytes(4)
    )
    out["bad_metadata_value"] = build('{"__metadata__":{"format":1}}')
    out["bad_metadata_type"] = build('{"__metadata__":["pt"]}')
    out["bad_entry_type"] = build('{"a":[1,2]}')
    out["bad_missing_fields"] = build('{"a":{}}')
    return out


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(__file__), "..", "..", "tests", "fuzz", "corpus", "safetensors")
    os.makedirs(out_dir, exist_ok=True)
    for name, content in sorted(seeds().items()):
        with open(os.path.join(out_dir, name + ".safetensors"), "wb") as f:
            f.write(content)
    print(f"wrote {len(seeds())} seeds to {out_dir}")


if __name__ == "__main__":
    main()
