"""`glmtune crop` output loads in transformers 5.17.0, from both released formats.

A tiny random model (`glmtune init --preset tiny`, BF16 in the released layout) is the BF16
source; an FP8 source is made from it here the way the release is made: the weights the release
stores in FP8 are quantised to float8 e4m3 in blocks with a float32 `weight_scale_inv` per block.
Both are cropped with the glmtune binary, and the crops must
  * load in Glm5NextForConditionalGeneration with no missing or mismatched key (only the MTP
    layer is unexpected: transformers has no MTP module),
  * hold the dequantised weights bit-exactly as a float64 reference rounded once to bfloat16, and
    every other tensor bit-identical to the source,
  * compute exactly the source model's logits when the crop keeps every layer.

Run through tests/reference/run.sh (ctest label `reference`); needs GLMTUNE_BIN. docs/PERF.md
uses make_fp8_source() to build its larger FP8 benchmark checkpoint.
"""
import json
import os
import shutil
import subprocess
import tempfile
import unittest

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Glm5NextForConditionalGeneration

BIN = os.environ.get("GLMTUNE_BIN", "glmtune")
# Smaller than the release's 128x128 so that the tiny model's weights span several blocks,
# partial edge blocks included (64 = 2*24 + 16, 96 = 3*32).
BLOCK = (32, 24)


def run(*args):
    return subprocess.run([BIN, *args], check=True, capture_output=True, text=True)


def read_checkpoint(path):
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                for key in f.keys():
                    out[key] = f.get_tensor(key)
    return out


def is_fp8_in_release(name, dsa_layers):
    """The released FP8 rule: expert, shared-expert and dense MLP weights, and the MLA projections
    of DSA layers (and the MTP layer) are FP8; everything else stays BF16 / F32."""
    if not name.startswith("model.language_model.layers.") or not name.endswith(".weight"):
        return False
    layer = int(name.split(".")[3])
    rest = ".".join(name.split(".")[4:])
    if rest.startswith(("mlp.experts.", "mlp.shared_experts.")):
        return True
    if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
        return True
    mla = ("self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight",
           "self_attn.kv_a_proj_with_mqa.weight", "self_attn.o_proj.weight")
    return layer in dsa_layers and rest in mla


def quantize_blocks(w, block=BLOCK):
    """float8 e4m3 weight and float32 block scales (amax / 448) as the release stores them."""
    rows, cols = w.shape
    br, bc = block
    sr, sc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(sr * br, sc * bc, dtype=torch.float32)  # zeros never raise an amax
    padded[:rows, :cols] = w.float()
    blocks = padded.view(sr, br, sc, bc)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).view(sr * br, sc * bc)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


def bf16_from_float64(x):
    """Rounds float64 to bfloat16 once (nearest, ties to even). torch's float64 -> bfloat16 goes
    through float32 and can round twice, so the reference does it by hand."""
    x = x.to(torch.float64)
    a = x.abs()
    _, e = torch.frexp(a)
    quantum = torch.ldexp(torch.ones_like(a), torch.clamp(e - 1, min=-126) - 7)
    r = torch.round(a / quantum) * quantum  # torch.round is half-to-even
    r = torch.where(a == 0, a, r)
    r = torch.where(r > (2 - 2**-7) * 2.0**127, torch.full_like(r, float("inf")), r)
    return torch.copysign(r, x).to(torch.float32).to(torch.bfloat16)  # exact from here


def reference_dequant(q, scale):
    br, bc = BLOCK
    s = scale.to(torch.float64).repeat_interleave(br, 0).repeat_interleave(bc, 1)
    s = s[: q.shape[0], : q.shape[1]]
    return bf16_from_float64(q.to(torch.float64) * s)


def make_fp8_source(bf16_dir, fp8_dir, block=BLOCK, pieces=3):
    """The FP8 release made from a BF16 checkpoint, one source shard at a time (each split in
    `pieces` output shards), with its index and config."""
    with open(os.path.join(bf16_dir, "config.json")) as f:
        config = json.load(f)
    text = config["text_config"]
    layers = text["num_hidden_layers"]
    dsa = {i for i, t in enumerate(text["layer_types"]) if t == "deepseek_sparse_attention"}
    dsa.add(layers)  # the MTP layer is a DSA layer
    shards = sorted(n for n in os.listdir(bf16_dir) if n.endswith(".safetensors"))
    count = len(shards) * pieces
    os.makedirs(fp8_dir)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        with safe_open(os.path.join(bf16_dir, shard), "pt") as f:
            names = sorted(f.keys())
            for p in range(pieces):
                tensors = {}
                for name in names[p::pieces]:
                    value = f.get_tensor(name)
                    if is_fp8_in_release(name, dsa):
                        tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(value, block)
                    else:
                        tensors[name] = value
                file = f"model-{k * pieces + p + 1:05d}-of-{count:05d}.safetensors"
                save_file(tensors, os.path.join(fp8_dir, file), metadata={"format": "pt"})
                weight_map.update({n: file for n in tensors})
                total += sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(fp8_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config["quantization_config"] = {
        "activation_scheme": "dynamic", "fmt": "e4m3", "modules_to_not_convert": ["lm_head"],
        "quant_method": "fp8", "weight_block_size": list(block)}
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in os.listdir(bf16_dir):
        if name.endswith(".json") and name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(os.path.join(bf16_dir, name), fp8_dir)


def load(path):
    return Glm5NextForConditionalGeneration.from_pretrained(
        path, output_loading_info=True, dtype=torch.float32)


class CropLoadsInReference(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="glmtune-crop-ref-")
        cls.bf16 = os.path.join(cls.tmp, "bf16")
        run("init", "--preset", "tiny", "--out", cls.bf16, "--seed", "11")
        cls.fp8 = os.path.join(cls.tmp, "fp8")
        make_fp8_source(cls.bf16, cls.fp8)
        cls.fp8_tensors = read_checkpoint(cls.fp8)
        cls.bf16_tensors = read_checkpoint(cls.bf16)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def crop(self, source, name, *args):
        out = os.path.join(self.tmp, name)
        run("crop", source, "--out", out, *args)
        return out

    def check_loads(self, path, layers):
        model, info = load(path)
        self.assertEqual(model.config.text_config.num_hidden_layers, layers)
        self.assertEqual(list(info["missing_keys"]), [])
        self.assertEqual(list(info["mismatched_keys"]), [])
        for key in info["unexpected_keys"]:
            # transformers has no MTP module; only the MTP layer (now right after the kept ones)
            # may be left over.
            self.assertTrue(key.startswith(f"model.language_model.layers.{layers}."), key)
        return model

    def test_fp8_crop_dequantises_exactly_and_loads(self):
        out = self.crop(self.fp8, "fp8-crop", "--layers", "0-3")
        model = self.check_loads(out, 4)
        crop = read_checkpoint(out)
        self.assertFalse([n for n in crop if n.endswith("_scale_inv")])
        dequantised = 0
        for name, value in crop.items():
            source = name.replace("layers.4.", "layers.5.")  # the MTP layer moved from 5 to 4
            stored = self.fp8_tensors[source]
            if stored.dtype == torch.float8_e4m3fn:
                expected = reference_dequant(stored, self.fp8_tensors[source + "_scale_inv"])
                self.assertEqual(value.dtype, torch.bfloat16, name)
                self.assertTrue(torch.equal(value.view(torch.int16), expected.view(torch.int16)), name)
                dequantised += 1
            else:
                self.assertEqual(value.dtype, stored.dtype, name)
                self.assertTrue(torch.equal(value, stored), name)
        self.assertGreater(dequantised, 50)
        # What transformers loaded is what the crop holds.
        state = model.state_dict()
        for name in ("model.language_model.layers.0.mlp.down_proj.weight",
                     "model.language_model.layers.3.self_attn.q_b_proj.weight",
                     "model.language_model.layers.3.self_attn.o_proj.weight"):
            self.assertTrue(torch.equal(state[name], crop[name].float()), name)
        with open(os.path.join(out, "config.json")) as f:
            config = json.load(f)
        self.assertNotIn("quantization_config", config)
        self.assertEqual(config["text_config"]["num_nextn_predict_layers"], 1)

    def test_bf16_layer_list_crop_loads_and_runs(self):
        out = self.crop(self.bf16, "bf16-crop", "--layers", "1,3", "--no-mtp")
        model = self.check_loads(out, 2)
        text = model.config.text_config
        self.assertEqual(text.layer_types, ["linear_attention", "deepseek_sparse_attention"])
        self.assertEqual(text.mlp_layer_types, ["sparse", "sparse"])
        crop = read_checkpoint(out)
        for name, value in crop.items():
            source = name.replace("layers.1.", "layers.3.").replace("layers.0.", "layers.1.")
            self.assertTrue(torch.equal(value, self.bf16_tensors[source]), name)
        ids = torch.tensor([[5, 17, 300, 42, 7, 99, 1000, 12]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        self.assertTrue(torch.isfinite(logits).all())

    def test_full_depth_crop_computes_the_source_logits(self):
        out = self.crop(self.bf16, "identity", "--layers", "0-4")
        cropped = self.check_loads(out, 5)
        source, _ = load(self.bf16)
        ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
        with torch.no_grad():
            a = source(input_ids=ids).logits
            b = cropped(input_ids=ids).logits
        self.assertTrue(torch.equal(a, b))


if __name__ == "__main__":
    unittest.main(verbosity=2)
