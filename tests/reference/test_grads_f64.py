"""glmtune's CPU path is at least as accurate as transformers' own float32 run.

On random small geometries and seeds (not only the goldens'), a checkpoint is evaluated three ways:
transformers 5.17.0 in float64 (the truth), transformers in float32, and `glmtune eval
--dump-grads --dump-logits` (the CPU reference path, f32). For every parameter family (a released
name with its layer and expert numbers dropped: `layers.N.hc_attn_scale`, ...), the root mean
square over all its tensors and cases of the relative error ||g - g64|| / ||g64|| of glmtune must be
at most RATIO times that of transformers' float32 run, plus FLOOR. The logits and the loss are held
to the same bound.

Errors are compared per family rather than per tensor: two equally accurate f32 computations of a
3-element tensor (an mHC `scale`) differ in error by more than 1.5x about one time in five by the
luck of rounding alone; pooled over every layer and case the ratio settles near 1.

The float64 run must be float64 throughout. transformers' modeling code casts to float32 in many
places (RMSNorm, the mHC mapping, the KDA core and gate, the router, softmax): in a model merely
converted with `.double()` those parts stay float32 and round exactly as the float32 run does, which
hides the float32 run's own error there (the mHC `scale` gradient of the float32 run then looks 3x
more accurate than it is). Within `float64_casts()` a cast to float32 keeps float64, and a forward
hook checks that every module output is float64.

Run through tests/reference/run.sh (ctest label `reference`); needs GLMTUNE_BIN and
GLMTUNE_SOURCE_DIR.
"""

import contextlib
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

BIN = os.environ["GLMTUNE_BIN"]
SOURCE = Path(os.environ["GLMTUNE_SOURCE_DIR"])
sys.path.insert(0, str(SOURCE / "tools" / "golden"))
from common import require_torch_fallback  # noqa: E402
from model_forward import ROUTER_GAP, Capture, indexer_is_clear, perturb, released_name, router_gap  # noqa: E402

# glmtune's error may exceed the float32 reference's by this factor (statistical slack of the pooled
# estimate), plus FLOOR: 64 units of f32 rounding (2^-24), the error of a result that is only a few
# roundings away from exact, where the float32 run's error is itself near zero.
RATIO = 1.5
FLOOR = 64 * 2.0**-24

VOCAB = 384
# The tiny preset's special ids moved inside a 384-token vocabulary (as tools/golden/model_backward.py
# does), and 8 indexer heads so that pool scores rarely tie exactly.
BASE_SETS = [
    "text_config.index_n_heads=8",
    "text_config.pad_token_id=300",
    "text_config.eos_token_id=[300]",
    "image_token_id=334",
    "video_token_id=335",
    "image_start_token_id=316",
    "image_end_token_id=317",
    "video_start_token_id=318",
    "video_end_token_id=319",
    f"text_config.vocab_size={VOCAB}",
]
CASES = 4
CASE_SEED = 20260


def random_case(rng):
    """One geometry: widths, streams, Sinkhorn steps, heads, MLP sizes and document lengths."""
    width = rng.choice([32, 48, 64, 80])
    sets = list(BASE_SETS) + [
        f"text_config.hidden_size={width}",
        f"vision_config.out_hidden_size={width}",
        f"text_config.hc_mult={rng.choice([2, 3, 4])}",
        f"text_config.hc_sinkhorn_iters={rng.choice([3, 8, 20])}",
        f"text_config.intermediate_size={rng.choice([48, 96, 112])}",
        f"text_config.moe_intermediate_size={rng.choice([16, 32, 40])}",
        f"text_config.linear_attn_config.num_heads={rng.choice([1, 2, 3])}",
        f"text_config.linear_attn_config.head_dim={rng.choice([8, 16])}",
    ]
    docs = [rng.randint(4, 64) for _ in range(rng.randint(2, 3))]
    return rng.randint(1, 1 << 30), sets, docs


@contextlib.contextmanager
def float64_casts():
    """Makes every cast to float32 of the modeling code keep float64 (see the module docstring)."""
    t = torch.Tensor
    saved = (t.float, t.to, t.type, F.softmax)

    def fix(dtype):
        return torch.float64 if dtype is torch.float32 else dtype

    def to(self, *args, **kwargs):
        args = tuple(fix(a) if isinstance(a, torch.dtype) else a for a in args)
        if "dtype" in kwargs:
            kwargs["dtype"] = fix(kwargs["dtype"])
        return saved[1](self, *args, **kwargs)

    def type_(self, dtype=None, *args, **kwargs):
        return saved[2](self, *args, **kwargs) if dtype is None else saved[2](self, fix(dtype), *args, **kwargs)

    def softmax(x, *args, dtype=None, **kwargs):
        return saved[3](x, *args, dtype=fix(dtype), **kwargs)

    t.float, t.to, t.type, F.softmax = (lambda self, *a, **k: self.double()), to, type_, softmax
    try:
        yield
    finally:
        t.float, t.to, t.type, F.softmax = saved


def all_float64(model):
    """Forward hooks failing on any floating module output that is not float64."""

    def check(module, args, output):
        outs = output if isinstance(output, (tuple, list)) else [output]
        for o in outs:
            if isinstance(o, torch.Tensor) and o.is_floating_point():
                assert o.dtype == torch.float64, f"{type(module).__name__} returned {o.dtype}"

    return [m.register_forward_hook(check) for m in model.modules()]


def load(path, dtype):
    from transformers import Glm5NextForConditionalGeneration

    return Glm5NextForConditionalGeneration.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    )


def write_checkpoint(d, seed, sets, gen):
    """`glmtune init` with the constant-initialised parameters redrawn (as the goldens do), each
    written back in the dtype the file stores it in, so every run reads the same values."""
    cmd = [BIN, "init", "--preset", "tiny", "--out", d, "--seed", str(seed), "--force"]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, capture_output=True)
    drawn = perturb(load(d, torch.float32), gen)
    for name in sorted(os.listdir(d)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(d, name)
        with safe_open(path, "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            meta = f.metadata()
        for k, v in tensors.items():
            if k in drawn:
                tensors[k] = drawn[k].to(v.dtype)
        save_file(tensors, path, metadata=meta)


def draw_docs(model, lengths, gen):
    """Documents (ids, HF labels) whose top-k choices sit clear of ties in the float64 model."""
    text = model.config.text_config
    lm = model.model.language_model
    cap = Capture(model)
    dsa = [i for i, t in enumerate(text.layer_types) if t == "deepseek_sparse_attention"]
    moe = [i for i, t in enumerate(text.mlp_layer_types) if t == "sparse"]
    docs = []
    with torch.no_grad():
        for length in lengths:
            for _ in range(500):
                ids = torch.randint(0, VOCAB, (1, length), generator=gen)
                ids[ids == text.pad_token_id] = 1
                cap.reset()
                model(input_ids=ids)
                clear = all(
                    indexer_is_clear(lm.layers[i].self_attn.indexer, *cap.indexer_in[i], text.index_kpool, text.index_topk)
                    for i in dsa
                ) and all(router_gap(lm.layers[i].mlp.gate, cap.router_in[i])[1] > ROUTER_GAP for i in moe)
                if clear:
                    break
            else:
                raise RuntimeError(f"no tie-free draw for a document of {length} tokens")
            trained = torch.rand(length, generator=gen) > 0.2
            docs.append((ids, torch.where(trained, ids[0], torch.full_like(ids[0], -100))))
    for h in cap.handles:
        h.remove()
    return docs


def reference_run(model, docs):
    """Loss (mean CE over every label token), per-document logits and gradients by released name."""
    model.train()
    model.zero_grad(set_to_none=True)
    total = sum(int((labels[1:] != -100).sum()) for _, labels in docs)
    loss, logits = 0.0, []
    for ids, labels in docs:
        out = model(input_ids=ids).logits[0]
        s = F.cross_entropy(out[:-1], labels[1:], ignore_index=-100, reduction="sum")
        (s / total).backward()
        loss += s.item()
        logits.append(out.detach().double())
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None or not (name.startswith("model.language_model.") or name == "lm_head.weight"):
            continue
        grads.update(split_released(released_name(name), p.grad.detach().double()))
    return loss / total, logits, grads


def split_released(name, g):
    """A module gradient under its released name(s): fused experts and short convolutions split."""
    if name.endswith("mlp.experts.gate_up_proj"):
        prefix, im = name[: -len("gate_up_proj")], g.shape[1] // 2
        out = {}
        for e in range(g.shape[0]):
            out[f"{prefix}{e}.gate_proj.weight"] = g[e, :im]
            out[f"{prefix}{e}.up_proj.weight"] = g[e, im:]
        return out
    if name.endswith("mlp.experts.down_proj"):
        prefix = name[: -len("down_proj")]
        return {f"{prefix}{e}.down_proj.weight": g[e] for e in range(g.shape[0])}
    if name.endswith("self_attn.conv1d.weight"):
        prefix, ql = name[: -len("conv1d.weight")], g.shape[0] // 3
        return {f"{prefix}{c}_conv1d.weight": g[i * ql : (i + 1) * ql] for i, c in enumerate("qkv")}
    return {name: g}


def glmtune_run(d, docs, tmp):
    data = os.path.join(tmp, "docs.jsonl")
    with open(data, "w") as f:
        for ids, labels in docs:
            f.write(json.dumps({"input_ids": ids[0].tolist(), "labels": labels.tolist()}) + "\n")
    gpath, lpath = os.path.join(tmp, "grads.safetensors"), os.path.join(tmp, "logits.safetensors")
    out = subprocess.run(
        [BIN, "eval", "--model", d, "--data", data, "--dump-grads", gpath, "--dump-logits", lpath, "--json"],
        check=True,
        capture_output=True,
        text=True,
    )
    loss = json.loads(out.stdout)["loss"]
    with safe_open(gpath, "pt") as f:
        grads = {k: f.get_tensor(k).double() for k in f.keys()}
    with safe_open(lpath, "pt") as f:
        logits = [f.get_tensor(f"logits.{i}").double() for i in range(len(docs))]
    return loss, logits, grads


def family(name):
    return re.sub(r"\.\d+\.", ".N.", name)


class Pooled:
    """Sum of squared relative errors of the float32 reference and of glmtune, per family."""

    def __init__(self):
        self.sums = {}

    def add(self, key, ref, f32, ours):
        scale = float(ref.norm())
        e32 = float((f32 - ref).norm()) / scale
        eg = float((ours - ref).norm()) / scale
        s = self.sums.setdefault(key, [0.0, 0.0, 0])
        s[0] += e32 * e32
        s[1] += eg * eg
        s[2] += 1

    def rms(self):
        return {k: (math.sqrt(a / n), math.sqrt(b / n), n) for k, (a, b, n) in self.sums.items()}


class GradsAgainstFloat64(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        require_torch_fallback()
        torch.set_num_threads(1)
        rng = random.Random(CASE_SEED)
        cls.pooled = Pooled()
        cls.zero_ref = []
        for case in range(CASES):
            seed, sets, lengths = random_case(rng)
            gen = torch.Generator().manual_seed(seed)
            with tempfile.TemporaryDirectory() as tmp:
                d = os.path.join(tmp, "ckpt")
                write_checkpoint(d, seed, sets, gen)
                m64 = load(d, torch.float64)
                with float64_casts():
                    docs = draw_docs(m64, lengths, gen)
                    hooks = all_float64(m64)
                    loss64, logits64, g64 = reference_run(m64, docs)
                    for h in hooks:
                        h.remove()
                loss32, logits32, g32 = reference_run(load(d, torch.float32), docs)
                lossg, logitsg, gg = glmtune_run(d, docs, tmp)
            cls.check_names(g64, gg, case)
            p = cls.pooled
            p.add("loss", *(torch.tensor([v], dtype=torch.float64) for v in (loss64, loss32, lossg)))
            for i in range(len(docs)):
                p.add("logits", logits64[i], logits32[i], logitsg[i])
            for name, ref in g64.items():
                if float(ref.norm()) == 0:
                    cls.zero_ref.append((case, name, float(g32[name].norm()), float(gg[name].norm())))
                    continue
                p.add(family(name), ref, g32[name], gg[name])
        cls.rms = p.rms()
        print(f"\n{'family':64s} {'f32 rms rel err':>16s} {'glmtune':>12s} {'ratio':>7s}  n", file=sys.stderr)
        for k, (e32, eg, n) in sorted(cls.rms.items()):
            print(f"{k:64s} {e32:16.3e} {eg:12.3e} {eg / max(e32, 1e-30):7.2f}  {n}", file=sys.stderr)

    @classmethod
    def check_names(cls, g64, gg, case):
        missing = sorted(set(g64) - set(gg))
        assert not missing, f"case {case}: glmtune dumped no gradient for {missing[:5]}"

    def test_float32_reference_has_error(self):
        # Guards the comparison itself: a float64 run leaking float32 would shrink these to zero.
        for k, (e32, _, _) in self.rms.items():
            self.assertGreater(e32, 0.0, k)

    def test_every_family_as_accurate_as_float32_reference(self):
        worse = [
            f"{k}: glmtune {eg:.3e} > {RATIO} x float32 {e32:.3e} + {FLOOR:.1e} over {n} tensors"
            for k, (e32, eg, n) in sorted(self.rms.items())
            if eg > RATIO * e32 + FLOOR
        ]
        self.assertEqual(worse, [])

    def test_gradients_zero_where_the_reference_is(self):
        # An expert no token reached has an exactly zero gradient in the reference.
        for case, name, n32, ng in self.zero_ref:
            self.assertEqual(ng, 0.0, f"case {case}: {name}")


if __name__ == "__main__":
    unittest.main(verbosity=2)
