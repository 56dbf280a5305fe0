"""`glmtune init` checkpoints load in transformers 5.17.0 with every tensor where it belongs.

Run through tests/reference/run.sh (ctest label `reference`); needs GLMTUNE_BIN.
"""
import os
import subprocess
import sys
import tempfile
import unittest

import torch
from safetensors import safe_open
from transformers import Glm5NextForConditionalGeneration

BIN = os.environ["GLMTUNE_BIN"]


def init(out, *sets, seed=7):
    args = [BIN, "init", "--preset", "tiny", "--out", out, "--seed", str(seed)]
    for s in sets:
        args += ["--set", s]
    subprocess.run(args, check=True, capture_output=True)


def load(path):
    return Glm5NextForConditionalGeneration.from_pretrained(path, output_loading_info=True, dtype=torch.float32)


def disk_tensors(path):
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                for key in f.keys():
                    out[key] = f.get_tensor(key)
    return out


class InitLoadsInReference(unittest.TestCase):
    def test_without_mtp_no_missing_or_unexpected_keys(self):
        with tempfile.TemporaryDirectory() as d:
            init(d, "text_config.num_nextn_predict_layers=0")
            model, info = load(d)
            self.assertEqual(list(info["missing_keys"]), [])
            self.assertEqual(list(info["unexpected_keys"]), [])
            self.assertEqual(list(info["mismatched_keys"]), [])
            self.check_values(model, disk_tensors(d))

    def test_with_mtp_only_the_mtp_layer_is_unused(self):
        # transformers 5.17.0 has no MTP module: it ignores `layers.45.` by a hard-coded pattern, so
        # the MTP layer of any other depth is reported unexpected and dropped. Nothing else may be.
        with tempfile.TemporaryDirectory() as d:
            init(d)
            model, info = load(d)
            layers = model.config.text_config.num_hidden_layers
            self.assertEqual(list(info["missing_keys"]), [])
            self.assertEqual(list(info["mismatched_keys"]), [])
            unexpected = list(info["unexpected_keys"])
            self.assertTrue(unexpected)
            for key in unexpected:
                self.assertTrue(key.startswith(f"model.language_model.layers.{layers}."), key)

    def check_values(self, model, disk):
        state = model.state_dict()
        checked = 0
        for name, value in disk.items():
            if ".experts." in name or "_conv1d" in name:
                continue  # fused by the reference's conversion; checked below
            target = name
            for a, b in (("hc_attn_", "attn_hc."), ("hc_ffn_", "ffn_hc.")):
                target = target.replace(a, b)
            for p in ("f_a_proj", "f_b_proj", "dt_bias", "A_log"):
                target = target.replace(f"self_attn.{p}", f"self_attn.forget_gate.{p}")
            self.assertIn(target, state, name)
            torch.testing.assert_close(state[target].float(), value.float(), rtol=0, atol=0, msg=name)
            checked += 1
        layer = 1  # a MoE layer of the tiny preset
        prefix = f"model.language_model.layers.{layer}."
        gate_up = state[prefix + "mlp.experts.gate_up_proj"]
        im = gate_up.shape[1] // 2
        torch.testing.assert_close(gate_up[3, :im].float(), disk[prefix + "mlp.experts.3.gate_proj.weight"].float(), rtol=0, atol=0)
        torch.testing.assert_close(gate_up[3, im:].float(), disk[prefix + "mlp.experts.3.up_proj.weight"].float(), rtol=0, atol=0)
        conv = state[prefix + "self_attn.conv1d.weight"]
        ql = conv.shape[0] // 3
        torch.testing.assert_close(conv[ql : 2 * ql].float(), disk[prefix + "self_attn.k_conv1d.weight"].float(), rtol=0, atol=0)
        self.assertGreater(checked, 100)
        # Initialisation rules visible in the values: padding row zero, norms one, A_log zero.
        emb = disk["model.language_model.embed_tokens.weight"].float()
        pad = model.config.text_config.pad_token_id
        self.assertEqual(float(emb[pad].abs().max()), 0.0)
        self.assertGreater(float(emb.std()), 0.015)
        self.assertLess(float(emb.std()), 0.025)


if __name__ == "__main__":
    unittest.main(verbosity=2)
