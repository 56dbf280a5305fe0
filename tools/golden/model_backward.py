#!/usr/bin/env python3
"""Golden fixture for the whole text model backward (tiny preset) against transformers 5.17.0.

The model is built as in model_forward.py (a `glmtune init` checkpoint loaded with
`Glm5NextForConditionalGeneration.from_pretrained(dir, dtype=torch.float32)`, eager attention and
experts, the constant-initialised parameters redrawn), with two changes to the init overrides: the
vocabulary is cut to VOCAB tokens (and the special ids moved inside it) so that the gradients of
the embedding and the head fit the fixture, and the indexer has 8 heads (the same reason as in
model_forward.py: fewer exact pool-score ties).

Several documents are run one at a time (batch of one, no padding) in train mode with autograd.
The loss is the global token mean over all documents, computed by hand from per-token
cross-entropies so that the C++ side reproduces it exactly:

    loss = Σ_docs Σ_{i: label_i != -100} CE(logits_i, label_i) / Σ_docs #labels

with labels aligned per document (label_i = id_{i+1} when that token is trained, -100 at the
document's last token). There is no MTP (transformers has no MTP forward) and no balancing loss.
The backward accumulates over the documents; every trainable parameter's gradient and the
gradient of the input embeddings (the output of embed_tokens, a retained grad) are saved. The
indexer's parameters must have no gradient.

Top-k choices are kept off near-ties exactly as in model_forward.py (the indexer's pool scores and
every router's biased scores are checked on each draw), so the C++ selection equals the reference's.

Tensors (T = all tokens, documents back to back):
  input_ids int32 [T], cu_seqlens int32 [ndoc + 1], labels int32 [T], loss f64 [1],
  lm_tokens int64 [1], d_embeddings f32 [T, D], grad.<internal name> f32 (the parameter's shape;
  the fused conv1d / gate_up_proj / down_proj as the module holds them, which is glmtune's
  internal layout), param.<released name> f32 (the redrawn parameters).
Metadata key "fixture" (JSON): preset, init seed, the `--set` overrides of init, document lengths.

Usage: python tools/golden/model_backward.py GLMTUNE_BINARY [--out PATH]   (a Python with transformers 5.17.0)
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_torch_fallback, tiny_reference  # noqa: E402
from model_forward import (  # noqa: E402  (shared helpers of the forward fixture)
    ROUTER_GAP,
    Capture,
    indexer_is_clear,
    perturb,
    released_name,
    router_gap,
)

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "golden" / "model" / "tiny_backward.safetensors"

INIT_SEED = 5151
VOCAB = 384
# The tiny preset numbers its special tokens from 2000; inside a 384-token vocabulary they move to
# 300.. in the release's order (only pad matters to the text model: it is the embedding's
# padding_idx). Each override is validated on its own, so the ids move before the vocabulary
# shrinks.
INIT_SETS = [
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
DRAW_SEED = 991
DOC_LENS = [6, 19, 41]
MASKED_DOC = 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("glmtune", help="path to the glmtune binary")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    require_torch_fallback()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(DRAW_SEED)

    model, info = tiny_reference(args.glmtune, INIT_SEED, INIT_SETS, loading_info=True)
    model.train()
    text = model.config.text_config
    assert text.vocab_size == VOCAB
    layers = text.num_hidden_layers
    assert not info["missing_keys"], info["missing_keys"]
    assert all(k.startswith(f"model.language_model.layers.{layers}.") for k in info["unexpected_keys"])
    params = perturb(model, gen)

    cap = Capture(model)
    lm = model.model.language_model
    dsa_layers = [i for i, t in enumerate(text.layer_types) if t == "deepseek_sparse_attention"]
    moe_layers = [i for i, t in enumerate(text.mlp_layer_types) if t == "sparse"]
    pad = text.pad_token_id

    # Draw tie-free documents first (no gradient), then differentiate them.
    docs = []
    with torch.no_grad():
        for d, length in enumerate(DOC_LENS):
            for _ in range(2000):
                ids = torch.randint(0, VOCAB, (1, length), generator=gen)
                ids[ids == pad] = 1  # the padding row gets no gradient; keep it out of the data
                cap.reset()
                model(input_ids=ids)
                clear = True
                for i in dsa_layers:
                    x, q_resid = cap.indexer_in[i]
                    indexer = lm.layers[i].self_attn.indexer
                    clear &= indexer_is_clear(indexer, x, q_resid, text.index_kpool, text.index_topk)
                for i in moe_layers:
                    _, gap = router_gap(lm.layers[i].mlp.gate, cap.router_in[i])
                    clear &= gap > ROUTER_GAP
                if clear:
                    break
            else:
                raise RuntimeError(f"no tie-free draw for a document of {length} tokens")
            trained = torch.ones(length, dtype=torch.bool)
            if d == MASKED_DOC:
                trained[torch.randperm(length, generator=gen)[: length // 3]] = False
            shifted = torch.where(trained, ids[0], torch.full_like(ids[0], -100))
            aligned = torch.cat([shifted[1:], torch.tensor([-100])])
            docs.append((ids, aligned))
    for h in cap.handles:
        h.remove()

    total = sum(int((a != -100).sum()) for _, a in docs)
    emb_out = []

    def keep_embedding_grad(module, inputs, output):
        output.retain_grad()
        emb_out.append(output)

    handle = lm.embed_tokens.register_forward_hook(keep_embedding_grad)
    model.zero_grad(set_to_none=True)
    loss_value = 0.0
    for ids, aligned in docs:
        logits = model(input_ids=ids).logits[0].float()
        doc_sum = F.cross_entropy(logits, aligned, ignore_index=-100, reduction="sum")
        (doc_sum / total).backward()
        loss_value += doc_sum.item()
    handle.remove()
    loss_value /= total

    tensors = {
        "input_ids": torch.cat([ids[0] for ids, _ in docs]).to(torch.int32),
        "cu_seqlens": torch.tensor([0] + list(torch.tensor(DOC_LENS).cumsum(0)), dtype=torch.int32),
        "labels": torch.cat([a for _, a in docs]).to(torch.int32),
        "loss": torch.tensor([loss_value], dtype=torch.float64),
        "lm_tokens": torch.tensor([total], dtype=torch.int64),
        "d_embeddings": torch.cat([e.grad[0] for e in emb_out]),
    }
    n_grads = 0
    for name, p in model.named_parameters():
        if not (name.startswith("model.language_model.") or name == "lm_head.weight"):
            continue
        if ".indexer." in name:
            assert p.grad is None, f"the indexer parameter {name} got a gradient"
            continue
        assert p.grad is not None, f"no gradient for {name}"
        tensors["grad." + released_name(name)] = p.grad.float()
        n_grads += 1
    for name, value in params.items():
        tensors["param." + name] = value
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "fixture": json.dumps(
            {"init_seed": INIT_SEED, "init_sets": INIT_SETS, "doc_lens": DOC_LENS, "preset": "tiny"},
            sort_keys=True,
        )
    }
    save_file(tensors, str(args.out), metadata=meta)
    size = args.out.stat().st_size
    assert size < 2 << 20, f"fixture is {size} bytes; keep it under 2 MiB"
    print(f"wrote {n_grads} gradients, {len(params)} parameters, {size} bytes; loss {loss_value:.6f}")


if __name__ == "__main__":
    main()
