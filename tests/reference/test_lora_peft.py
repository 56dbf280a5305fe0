"""LoRA adapters against PEFT on transformers 5.17.0, both ways, in float32 on the CPU.

- PEFT to glmtune: a tiny model with random nonzero A and B on every projection glmtune adapts,
  saved by PEFT's save_pretrained and evaluated by `glmtune eval --adapter`: logits within 1e-5
  (max |diff| / max |ref| per document) and every adapter gradient within 1e-4 of PEFT's autograd.
- glmtune to PEFT: an adapter trained by `glmtune train` ([lora]) loads with
  PeftModel.from_pretrained and gives glmtune's logits.
- Merging: `glmtune merge` equals PEFT's merge_and_unload() within bf16 rounding of the weights.
- The LM head is among the targets of all of them (named: PEFT's all-linear leaves it out).
- The same three with adapters on the routed experts too (PEFT's target_parameters on the fused
  mlp.experts.gate_up_proj and down_proj, its ParamWrapper layout: lora_A [r·E, in], lora_B
  [out, r·E] with expert e's column k at k·E + e).

Every expert is routed and every key pool kept (2 experts, top-2; index_topk 16 over documents of
at most 16 tokens), so no top-k choice can fall differently in the two float32 computations.

Run through tests/reference/run.sh (ctest label `reference`); needs GLMTUNE_BIN and
GLMTUNE_SOURCE_DIR, and the peft package (skipped without it).
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

try:
    import peft
except ImportError:
    print("skipped: this Python has no peft")
    sys.exit(77)

BIN = os.environ["GLMTUNE_BIN"]
SOURCE = Path(os.environ["GLMTUNE_SOURCE_DIR"])
sys.path.insert(0, str(SOURCE / "tools" / "golden"))
from common import require_torch_fallback  # noqa: E402

SETS = [
    "text_config.n_group=1",
    "text_config.topk_group=1",
    "text_config.n_routed_experts=2",
    "text_config.num_experts_per_tok=2",
    "text_config.index_topk=16",
]
# Every projection glmtune adapts, under PEFT's (the reference model's) module names: the decoder
# layers' and the LM head.
TARGETS = (
    r"model\.language_model\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|forget_gate\.f_a_proj|"
    r"forget_gate\.f_b_proj|b_proj|g_a_proj|g_b_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|"
    r"kv_b_proj)|mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj))|lm_head"
)
RANK, ALPHA = 4, 8.0
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def load_base(path):
    import transformers
    from transformers import Glm5NextForConditionalGeneration

    transformers.logging.set_verbosity_error()
    return Glm5NextForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )


def draw_docs(gen, vocab, pad):
    docs = []
    for length in (9, 16, 12):
        ids = torch.randint(0, vocab, (1, length), generator=gen)
        ids[ids == pad] = 1
        trained = torch.rand(length, generator=gen) > 0.2
        docs.append((ids, torch.where(trained, ids[0], torch.full_like(ids[0], -100))))
    return docs


def peft_run(model, docs):
    """Loss (mean CE over every label token), per-document logits, adapter gradients by PEFT name."""
    model.zero_grad(set_to_none=True)
    total = sum(int((labels[1:] != -100).sum()) for _, labels in docs)
    logits = []
    for ids, labels in docs:
        out = model(input_ids=ids).logits[0]
        s = F.cross_entropy(out[:-1], labels[1:], ignore_index=-100, reduction="sum")
        (s / total).backward()
        logits.append(out.detach().double())
    grads = {
        n: p.grad.detach().double()
        for n, p in model.named_parameters()
        if "lora_" in n and p.grad is not None
    }
    return logits, grads


def glmtune_eval(model_dir, adapter, docs, tmp, grads=True):
    data = os.path.join(tmp, "docs.jsonl")
    with open(data, "w") as f:
        for ids, labels in docs:
            f.write(json.dumps({"input_ids": ids[0].tolist(), "labels": labels.tolist()}) + "\n")
    lpath, gpath = os.path.join(tmp, "logits.safetensors"), os.path.join(tmp, "grads.safetensors")
    cmd = [BIN, "eval", "--model", model_dir, "--data", data, "--dump-logits", lpath, "--json", "--no-mtp"]
    if adapter:
        cmd += ["--adapter", adapter]
    if grads:
        cmd += ["--dump-grads", gpath]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    with safe_open(lpath, "pt") as f:
        logits = [f.get_tensor(f"logits.{i}").double() for i in range(len(docs))]
    g = {}
    if grads:
        with safe_open(gpath, "pt") as f:
            g = {k: f.get_tensor(k).double() for k in f.keys() if "lora_" in k}
    return logits, g


def rel(a, ref):
    return float((a - ref).abs().max()) / float(ref.abs().max())


def peft_name(glmtune_name):
    """PEFT's parameter name of glmtune's dumped adapter gradient."""
    module, which = glmtune_name.rsplit(".lora_", 1)
    for gate in ("f_a_proj", "f_b_proj"):
        module = module.replace(f".self_attn.{gate}", f".self_attn.forget_gate.{gate}")
    # Both fused expert parameters adapted: PEFT nests down_proj's wrapper around gate_up_proj's.
    module = module.replace(".mlp.experts.gate_up_proj", ".mlp.experts.base_layer")
    module = module.replace(".mlp.experts.down_proj", ".mlp.experts")
    return f"base_model.model.{module}.lora_{which[0]}.default.weight"


def to_peft_layout(glmtune_name, g):
    """glmtune's expert adapter (A [E, r, in], B [E, out, r]) in PEFT's [r·E, in] / [out, r·E]."""
    if ".mlp.experts." not in glmtune_name:
        return g
    if ".lora_A." in glmtune_name:
        return g.reshape(-1, g.shape[-1])
    return g.permute(1, 2, 0).reshape(g.shape[1], -1)


class LoraAgainstPeft(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        require_torch_fallback()
        torch.set_num_threads(2)
        cls.tmp = tempfile.TemporaryDirectory()
        cls.model = os.path.join(cls.tmp.name, "model")
        cmd = [BIN, "init", "--preset", "tiny", "--out", cls.model, "--seed", "5", "--force"]
        cmd += ["--tokenizer", str(SOURCE / "examples" / "tiny" / "tokenizer")]
        for s in SETS:
            cmd += ["--set", s]
        subprocess.run(cmd, check=True, capture_output=True)
        cls.gen = torch.Generator().manual_seed(1234)
        text = load_base(cls.model).config.text_config
        cls.docs = draw_docs(cls.gen, text.vocab_size, text.pad_token_id)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def check_peft_adapter_in_glmtune(self, name, target_parameters=None):
        torch.manual_seed(99)
        config = peft.LoraConfig(
            r=RANK,
            lora_alpha=ALPHA,
            target_modules=TARGETS,
            target_parameters=target_parameters,
            init_lora_weights=False,
        )
        model = peft.get_peft_model(load_base(self.model), config)
        adapter = os.path.join(self.tmp.name, name)
        model.save_pretrained(adapter)
        ref_logits, ref_grads = peft_run(model, self.docs)
        with tempfile.TemporaryDirectory() as tmp:
            logits, grads = glmtune_eval(self.model, adapter, self.docs, tmp)
        worst_logits = 0.0
        for i, (a, r) in enumerate(zip(logits, ref_logits)):
            worst_logits = max(worst_logits, rel(a, r))
            self.assertLessEqual(rel(a, r), 1e-5, f"logits of document {i}")
        self.assertEqual(len(grads), len(ref_grads), "one gradient per adapter tensor")
        self.assertGreater(len(grads), 80)
        self.assertIn("lm_head.lora_A.weight", grads)
        self.assertIn("lm_head.lora_B.weight", grads)
        errs = {n: rel(to_peft_layout(n, g), ref_grads[peft_name(n)]) for n, g in grads.items()}
        worst = max(errs.values())
        experts = [e for n, e in errs.items() if ".mlp.experts." in n]
        print(
            f"\n{name}: logits rel err {worst_logits:.3g}; {len(grads)} adapter gradients, worst rel err "
            f"{worst:.3g} ({len(experts)} on the routed experts, worst {max(experts, default=0):.3g}; "
            f"the LM head's {max(e for n, e in errs.items() if n.startswith('lm_head.')):.3g})",
            file=sys.stderr,
        )
        self.assertLessEqual(worst, 1e-4)
        if target_parameters:
            self.assertGreaterEqual(len(experts), 4)
            # Merging the random adapter: a large delta on every expert, so a merge that missed
            # an expert or a layout slip could not pass within bf16 rounding.
            merged = os.path.join(self.tmp.name, name + "_merged")
            subprocess.run(
                [BIN, "merge", "--model", self.model, "--adapter", adapter, "--out", merged],
                check=True,
                capture_output=True,
            )
            base = load_base(self.model).state_dict()
            peft_merged = model.merge_and_unload().state_dict()
            ours = load_base(merged).state_dict()
            worst_merge = 0.0
            for n, w in peft_merged.items():
                if n.startswith("model.language_model.") and n.endswith(
                    ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
                ):
                    self.assertGreater(rel(base[n].double(), w.double()), 2.0**-4, n)
                    worst_merge = max(worst_merge, rel(ours[n].double(), w.double()))
            print(f"{name}: routed experts merged, rel err {worst_merge:.3g}", file=sys.stderr)
            self.assertLessEqual(worst_merge, 2.0**-8)

    def test_peft_adapter_in_glmtune(self):
        self.check_peft_adapter_in_glmtune("peft_adapter")

    def test_peft_expert_adapter_in_glmtune(self):
        self.check_peft_adapter_in_glmtune("peft_expert_adapter", EXPERT_PARAMS)

    def check_glmtune_adapter_in_peft_and_merge(self, name, target_parameters=""):
        out = os.path.join(self.tmp.name, name)
        recipe = os.path.join(self.tmp.name, name + ".toml")
        with open(recipe, "w") as f:
            f.write(
                f"""[model]
path = "{self.model}"
[data]
files = ["{SOURCE / 'examples' / 'tiny' / 'data' / 'chat.jsonl'}"]
format = "chat"
max_length = 256
pack_max_length = 256
[train]
total_steps = 3
seed = 2
device = "cpu"
recompute = "none"
[optimizer]
lr = 1e-2
warmup_steps = 0
[output]
dir = "{out}"
save_every = 0
[lora]
rank = {RANK}
alpha = {ALPHA}
target_modules = ["all-linear", "lm_head"]
{target_parameters}
"""
            )
        subprocess.run([BIN, "train", "--config", recipe], check=True, capture_output=True)
        adapter = os.path.join(out, "checkpoints", "step-3", "adapter")
        model = peft.PeftModel.from_pretrained(load_base(self.model), adapter)
        b = {n: p for n, p in model.named_parameters() if "lora_B" in n}
        self.assertGreater(len(b), 40)
        head_b = [p for n, p in b.items() if n.startswith("base_model.model.lm_head.")]
        self.assertEqual(len(head_b), 1, "PEFT loaded no adapter on lm_head")
        self.assertGreater(float(head_b[0].abs().max()), 0, "training moved no lm_head B")
        self.assertTrue(any(float(p.abs().max()) > 0 for p in b.values()), "training moved no B")
        if target_parameters:
            experts = [p for n, p in b.items() if ".mlp.experts." in n]
            self.assertGreaterEqual(len(experts), 2)
            self.assertTrue(any(float(p.abs().max()) > 0 for p in experts), "training moved no expert B")
        with torch.no_grad():
            ref = [model(input_ids=ids).logits[0].double() for ids, _ in self.docs]
        with tempfile.TemporaryDirectory() as tmp:
            logits, _ = glmtune_eval(self.model, adapter, self.docs, tmp, grads=False)
        worst_logits = max(rel(a, r) for a, r in zip(logits, ref))
        for i, (a, r) in enumerate(zip(logits, ref)):
            self.assertLessEqual(rel(a, r), 1e-5, f"logits of document {i}")

        merged = os.path.join(self.tmp.name, name + "_merged")
        subprocess.run(
            [BIN, "merge", "--model", self.model, "--adapter", adapter, "--out", merged], check=True, capture_output=True
        )
        peft_merged = model.merge_and_unload().state_dict()
        ours = load_base(merged).state_dict()
        worst, worst_experts = 0.0, 0.0
        for n, w in peft_merged.items():
            if not n.startswith("model.language_model."):
                continue
            if n.endswith("proj.weight"):
                worst = max(worst, rel(ours[n].double(), w.double()))
            elif n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                worst_experts = max(worst_experts, rel(ours[n].double(), w.double()))
        # The head, merged as PEFT merges it.
        worst = max(worst, rel(ours["lm_head.weight"].double(), peft_merged["lm_head.weight"].double()))
        print(
            f"\n{name}: PEFT logits rel err {worst_logits:.3g}; merge rel err {worst:.3g} "
            f"(routed experts {worst_experts:.3g})",
            file=sys.stderr,
        )
        # bf16 keeps 8 significant bits: half a unit in the last place, relative to the largest entry.
        self.assertLessEqual(max(worst, worst_experts), 2.0**-8)

    def test_glmtune_adapter_in_peft_and_merge(self):
        self.check_glmtune_adapter_in_peft_and_merge("run")

    def test_glmtune_expert_adapter_in_peft_and_merge(self):
        self.check_glmtune_adapter_in_peft_and_merge(
            "expert_run", 'target_parameters = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]'
        )


if __name__ == "__main__":
    unittest.main()
