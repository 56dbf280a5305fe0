#!/usr/bin/env python3
"""Golden loss curve: 20 optimizer steps of the tiny model trained with transformers 5.17.0 and
torch.optim.AdamW, for tests/unit/test_train_curve.cpp to repeat with `glmtune train`.

Model: `glmtune init --preset tiny --seed INIT_SEED` with INIT_SETS, loaded with
`Glm5NextForConditionalGeneration.from_pretrained(dir, dtype=torch.float32)`, eager attention and
experts, train mode. The C++ test stores the same init in float32 (so the trainer's parameters are
their own fp32 masters); only the fused expert tensors, which glmtune always holds in bf16 with an
fp32 master, are rounded to bf16 after every update here too.

Data: real text (examples/tiny/data/text.jsonl lines and the chat data's message texts, joined
with spaces into documents of at least DOC_LEN tokens), written to tests/golden/train_curve/
text.jsonl as {"text": ...} lines. `glmtune train` reads them with format = "text", max_length =
pack_max_length = DOC_LEN, shuffle off: every sample is cut to its first DOC_LEN tokens and fills
one pack alone, and a step takes MICRO_PACKS packs in file order. The reference runs each document
alone (it has no packed-sequence path for KDA) and combines them as glmtune's reduction does:

    loss_step = Σ_docs Σ_i CE(logits_i, id_{i+1}) / Σ_docs (DOC_LEN − 1)

Optimizer as glmtune's recipe below: AdamW (β = BETAS, ε = EPS, weight decay WD on every trained
parameter: all text parameters except the DSA indexer and the router correction bias, which get no
gradient), global-norm clipping at CLIP (torch.nn.utils.clip_grad_norm_: coefficient
CLIP / (norm + 1e-6), at most 1), learning rate per step from glmtune's schedule (linear warmup of
WARMUP steps, then cosine from LR to LR_MIN). No MTP (mtp_scale 0), no balancing loss, no router
bias update.

Top-k choices are taken out of the picture: over 20 steps of real text some router and indexer
scores come within 1e-6 of a tie, where a float32 port may choose differently from the reference
and the curves part for reasons that say nothing about training. INIT_SETS therefore route every
token to every expert (num_experts_per_tok = n_routed_experts, topk_group = n_group) and let the
indexer keep every pool (index_topk = DOC_LEN); the MoE gate weights, the sparse-attention path
and their gradients run as usual. Every forward checks that no choice is left (the same checks as
the model fixtures).

Fixture tensors: input_ids int32 [NUM_DOCS, DOC_LEN] (the documents, in order), loss f64 [STEPS],
grad_norm f64 [STEPS], lr f64 [STEPS]. Metadata "fixture" (JSON): the init, data and recipe
settings above.

Usage: python tools/golden/train_curve.py GLMTUNE_BINARY   (a Python with transformers 5.17.0)
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_torch_fallback, save_fixture, tiny_reference  # noqa: E402
from model_forward import ROUTER_GAP, Capture, indexer_is_clear, router_gap  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OUT_DIR = REPO / "tests" / "golden" / "train_curve"
TOKENIZER = REPO / "examples" / "tiny" / "tokenizer" / "tokenizer.json"

INIT_SEED = 4242
INIT_SETS = [
    "text_config.num_experts_per_tok=8",
    "text_config.topk_group=2",
    "text_config.index_topk=64",
]
DOC_LEN = 64
MICRO_PACKS = 2
STEPS = 20
NUM_DOCS = STEPS * MICRO_PACKS
LR, LR_MIN, WARMUP = 2e-3, 2e-4, 2
BETAS, EPS, WD, CLIP = (0.9, 0.95), 1e-8, 0.01, 1.0


def schedule(step):
    """glmtune's learning rate of update `step` (0-based): src/glmtune/train/schedule.cpp."""
    if step < WARMUP:
        return LR * step / WARMUP
    if step == WARMUP:
        return LR
    progress = (step - WARMUP) / (STEPS - WARMUP)
    return LR_MIN + (LR - LR_MIN) * 0.5 * (1.0 + math.cos(math.pi * progress))


def documents(tokenizer):
    pieces = [json.loads(line)["text"] for line in open(REPO / "examples/tiny/data/text.jsonl")]
    for line in open(REPO / "examples/tiny/data/chat.jsonl"):
        for m in json.loads(line)["messages"]:
            if isinstance(m.get("content"), str) and m["content"].strip():
                pieces.append(m["content"].strip())
    docs, current = [], []
    for p in pieces:
        current.append(p)
        text = " ".join(current)
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) >= DOC_LEN:
            docs.append((text, ids[:DOC_LEN]))
            current = []
            if len(docs) == NUM_DOCS:
                return docs
    raise RuntimeError("not enough text for the documents")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("glmtune", help="path to the glmtune binary")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    require_torch_fallback()
    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    docs = documents(tokenizer)

    model, info = tiny_reference(args.glmtune, INIT_SEED, INIT_SETS, loading_info=True)
    model.train()
    text = model.config.text_config
    assert not info["missing_keys"], info["missing_keys"]
    lm = model.model.language_model
    dsa_layers = [i for i, t in enumerate(text.layer_types) if t == "deepseek_sparse_attention"]
    moe_layers = [i for i, t in enumerate(text.mlp_layer_types) if t == "sparse"]

    trained = [
        (name, p)
        for name, p in model.named_parameters()
        if (name.startswith("model.language_model.") or name == "lm_head.weight")
        and ".indexer." not in name
        and not name.endswith("e_score_correction_bias")
    ]
    # glmtune fuses the experts into bf16 storage with an fp32 master: the optimizer updates the
    # master, the forward sees it rounded.
    masters = {}
    for name, p in trained:
        if ".mlp.experts." in name:
            masters[name] = torch.nn.Parameter(p.detach().clone())
    opt_params = [masters.get(name, p) for name, p in trained]
    opt = torch.optim.AdamW(opt_params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)

    cap = Capture(model)
    losses, norms, lrs = [], [], []
    for step in range(STEPS):
        batch = docs[step * MICRO_PACKS : (step + 1) * MICRO_PACKS]
        total = sum(len(ids) - 1 for _, ids in batch)
        model.zero_grad(set_to_none=True)
        step_sum = 0.0
        for _, ids in batch:
            x = torch.tensor([ids])
            cap.reset()
            logits = model(input_ids=x).logits[0].float()
            doc_sum = F.cross_entropy(logits[:-1], x[0, 1:], reduction="sum")
            (doc_sum / total).backward()
            step_sum += doc_sum.item()
            with torch.no_grad():
                for i in dsa_layers:
                    h, q_resid = cap.indexer_in[i]
                    indexer = lm.layers[i].self_attn.indexer
                    assert indexer_is_clear(indexer, h, q_resid, text.index_kpool, text.index_topk), (
                        f"step {step}: an indexer pool choice of layer {i} is near a tie"
                    )
                for i in moe_layers:
                    _, gap = router_gap(lm.layers[i].mlp.gate, cap.router_in[i])
                    assert gap > ROUTER_GAP, f"step {step}: router {i} is near a tie ({gap:.2e})"
        for (name, p), q in zip(trained, opt_params):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if q is not p:
                q.grad = grad
            elif p.grad is None:
                p.grad = grad
        norm = torch.nn.utils.clip_grad_norm_(opt_params, CLIP, foreach=False)
        lr = schedule(step)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        with torch.no_grad():
            for name, p in trained:
                if name in masters:
                    p.copy_(masters[name].bfloat16().float())
        losses.append(step_sum / total)
        norms.append(norm.item())
        lrs.append(lr)
        print(f"step {step + 1:2d}  loss {losses[-1]:.6f}  grad_norm {norms[-1]:.4f}  lr {lr:.3e}")
    for h in cap.handles:
        h.remove()

    args.out_dir.mkdir(parents=True, exist_ok=True)
    with open(args.out_dir / "text.jsonl", "w") as f:
        for t, _ in docs:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    tensors = {
        "input_ids": torch.tensor([ids for _, ids in docs], dtype=torch.int32),
        "loss": torch.tensor(losses, dtype=torch.float64),
        "grad_norm": torch.tensor(norms, dtype=torch.float64),
        "lr": torch.tensor(lrs, dtype=torch.float64),
    }
    meta = {
        "preset": "tiny",
        "init_seed": INIT_SEED,
        "init_sets": INIT_SETS,
        "doc_len": DOC_LEN,
        "micro_packs": MICRO_PACKS,
        "steps": STEPS,
        "lr": LR,
        "lr_min": LR_MIN,
        "warmup_steps": WARMUP,
        "betas": list(BETAS),
        "eps": EPS,
        "weight_decay": WD,
        "clip_grad_norm": CLIP,
    }
    save_fixture(tensors, args.out_dir / "curve.safetensors", "fixture", meta, 64 << 10)


if __name__ == "__main__":
    main()
