#!/usr/bin/env python3
"""Golden fixture for the whole text model forward (tiny preset) against transformers 5.17.0.

Writes a random tiny checkpoint with `glmtune init --preset tiny --seed INIT_SEED --set ...` (the
binary is the first argument; see INIT_SETS for the one override and why), loads it with `Glm5NextForConditionalGeneration.from_pretrained(dir,
dtype=torch.float32)` with eager attention and eager experts (the MTP layer's keys are reported
unexpected: transformers 5.17.0 has no MTP module), and runs several documents one at a time, batch
of one, no padding: exactly what glmtune's packed forward must reproduce per document.

The checkpoint itself stays out of the repository: `glmtune init` is deterministic for a given seed,
so tests/unit/test_model_forward.cpp re-creates it with `write_random_checkpoint` and the same seed.
Parameters whose init value is a constant (norm weights 1, mHC base 0 and scale 1, A_log 0, the
indexer's pool ape 0 and gate 1, k_norm, router correction bias 0) would leave whole code paths
untested (a port that ignores them would pass), so they are redrawn here and stored in the fixture
as `param.<released name>` (float32); the C++ test puts them into its parameter store before
building the model.

Top-k choices must not sit on near-ties: for every document, the indexer's pool scores and every
router's biased scores are recomputed from the captured layer inputs, and the document's token ids
are redrawn until every top-k boundary has a clear gap. The router correction bias must change at
least one expert choice, and the longest document must lose keys to the sparse selection.

Tensors (T = all tokens, documents back to back):
  input_ids int32 [T], cu_seqlens int32 [ndoc + 1], trained int32 [T] (1 = token is trained; one
  document has untrained tokens), labels int32 [T] (aligned next-token targets, -100 = ignored),
  logits f32 [T, V] (each document run alone), hidden f32 [T, D] (mean over streams, before the
  final norm), layer0_out / layer3_out f32 [T, H, D] (decoder layer outputs), layer3_indices int32
  [T, W] (the DSA layer's selection, GLOBAL token indices, -1 = empty), expert_counts int64
  [moe layers, E] (routed tokens per expert, over the whole pack), doc_loss f32 [ndoc] (the
  reference's loss of each document), doc_targets int64 [ndoc], loss f64 [1] (token mean over the
  pack), param.<name> f32.
Metadata key "fixture" (JSON): preset, init seed, the `--set` overrides of init, document lengths.

Usage: python tools/golden/model_forward.py GLMTUNE_BINARY [--out PATH]
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from common import require_torch_fallback, tiny_reference

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "golden" / "model" / "tiny_forward.safetensors"

INIT_SEED = 4242
# The tiny preset's indexer has 2 heads, so a pool's score is exactly 0 whenever both heads' dot
# products are negative (relu); about a quarter of all pool scores then tie exactly, and the
# reference's top-k order among exact ties is unspecified. With 8 heads exact zeros are rare enough
# that tie-free documents exist. Nothing else of the preset changes (init draws every tensor from
# its own name-keyed stream, so the other tensors are the preset's own).
INIT_SETS = ["text_config.index_n_heads=8"]
DRAW_SEED = 777
DOC_LENS = [5, 17, 40, 70]
# Document 1 gets a trained mask with holes (labels -100 inside the document).
MASKED_DOC = 1
# A top-k choice is accepted when the last chosen score beats the first rejected one by this much
# (relative to the row's largest magnitude for the indexer, absolute on sigmoid scores for the
# router); an fp32 port differs from the reference by ~1e-6 relative.
INDEXER_GAP = 1e-3
ROUTER_GAP = 1e-4


def released_name(module_name):
    """transformers module parameter name -> released on-disk name.

    The released layout is described in docs/checkpoints.md, "The released layout".
    """
    name = module_name
    for a, b in (("attn_hc.", "hc_attn_"), ("ffn_hc.", "hc_ffn_")):
        name = name.replace(a, b)
    return name.replace("self_attn.forget_gate.", "self_attn.")


def perturb(model, gen):
    """Redraws the constant-initialised parameters; returns {released name: tensor}."""
    out = {}
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not name.startswith("model.language_model."):
                continue
            if name.endswith("e_score_correction_bias"):
                t.copy_(0.05 * torch.randn(t.shape, generator=gen))
            elif name.endswith("_hc.base"):
                t.copy_(0.5 * torch.randn(t.shape, generator=gen))
            elif name.endswith("_hc.scale"):
                t.copy_(1.0 + 0.3 * torch.randn(t.shape, generator=gen))
            elif name.endswith("A_log"):
                t.copy_(0.5 * torch.randn(t.shape, generator=gen))
            elif name.endswith("index_kpool_compress_ape"):
                t.copy_(0.5 * torch.randn(t.shape, generator=gen))
            elif name.endswith("index_kpool_compress_gate"):
                t.copy_(1.0 + 0.5 * torch.randn(t.shape, generator=gen))
            elif name.endswith("k_norm.bias"):
                t.copy_(0.2 * torch.randn(t.shape, generator=gen))
            elif "norm" in name and name.endswith("weight"):
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=gen))
            else:
                continue
            out[released_name(name)] = t.detach().clone().float()
    return out


def pool_scores(indexer, x, q_resid):
    """The indexer's per-pool scores [S, NP] for one document (batch of one)."""
    s = x.shape[1]
    q = indexer.wq_b(q_resid).view(1, s, -1, indexer.head_dim)
    k = indexer.k_norm(indexer.wk(x))
    gate = F.linear(x, indexer.index_kpool_compress_gate)
    valid = torch.ones(1, s, 1, dtype=k.dtype)
    pool_keys, _, _ = indexer.get_pooled_states(torch.cat([k, gate, valid], dim=-1))
    scores = torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1))
    scores = F.relu(scores * indexer.softmax_scale)
    weights = indexer.weights_proj(x).float() * indexer.n_heads**-0.5
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)[0]


def indexer_is_clear(indexer, x, q_resid, pool, topk):
    scores = pool_scores(indexer, x, q_resid)
    select_k = min(topk // pool, scores.shape[1])
    for s in range(scores.shape[0]):
        n_cand = (s + 1) // pool  # complete pools whose last token is visible to query s
        if n_cand <= select_k:
            continue
        row = scores[s, :n_cand].sort(descending=True).values
        if (row[select_k - 1] - row[select_k]).item() <= INDEXER_GAP * max(row.abs().max().item(), 1e-6):
            return False
    return True


def router_gap(gate, x, use_bias=True):
    """Group-limited top-k as the reference router; returns (sorted choice, smallest boundary gap)."""
    logits = F.linear(x.float(), gate.weight.float())
    scores = logits.sigmoid()
    choice = scores + gate.e_score_correction_bias if use_bias else scores.clone()
    t, e, g = choice.shape[0], gate.num_experts, gate.num_group
    group_scores = choice.view(t, g, e // g).topk(2, dim=-1)[0].sum(-1)
    gaps = []
    if gate.topk_group < g:
        srt = group_scores.sort(dim=-1, descending=True).values
        gaps.append(srt[:, gate.topk_group - 1] - srt[:, gate.topk_group])
    keep = torch.zeros_like(group_scores)
    keep.scatter_(1, group_scores.topk(gate.topk_group, dim=-1)[1], 1)
    keep = keep.unsqueeze(-1).expand(t, g, e // g).reshape(t, e).bool()
    choice = choice.masked_fill(~keep, float("-inf"))
    if gate.topk_group * (e // g) > gate.top_k:
        srt = choice.sort(dim=-1, descending=True).values
        gaps.append(srt[:, gate.top_k - 1] - srt[:, gate.top_k])
    sel = choice.topk(gate.top_k, dim=-1)[1].sort(dim=-1).values
    return sel, min(gap.min().item() for gap in gaps) if gaps else float("inf")


class Capture:
    """Forward hooks recording what the checks and the fixture need from one run."""

    def __init__(self, model):
        self.lm = model.model.language_model
        self.handles = []
        self.reset()
        for i, layer in enumerate(self.lm.layers):
            self.handles.append(layer.register_forward_hook(self._layer_hook(i)))
            attn = layer.self_attn
            if getattr(attn, "indexer", None) is not None:
                self.handles.append(
                    attn.indexer.register_forward_hook(self._indexer_hook(i), with_kwargs=True)
                )
            if hasattr(layer.mlp, "gate"):
                self.handles.append(layer.mlp.gate.register_forward_hook(self._router_hook(i)))
        self.handles.append(self.lm.hc_head.register_forward_hook(self._head_hook))

    def reset(self):
        self.layer_out, self.indexer_in, self.indices, self.router_in, self.router_sel = {}, {}, {}, {}, {}
        self.hidden = None

    def _layer_hook(self, i):
        def hook(module, args, output):
            self.layer_out[i] = output[0].detach().clone()

        return hook

    def _indexer_hook(self, i):
        def hook(module, args, kwargs, output):
            self.indexer_in[i] = (kwargs["hidden_states"].detach().clone(), kwargs["q_resid"].detach().clone())
            self.indices[i] = output.detach().clone()

        return hook

    def _router_hook(self, i):
        def hook(module, args, output):
            self.router_in[i] = args[0].detach().reshape(-1, args[0].shape[-1]).clone()
            self.router_sel[i] = output[2].detach().clone()

        return hook

    def _head_hook(self, module, args, output):
        self.hidden = output.detach().clone()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("glmtune", help="path to the glmtune binary")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    require_torch_fallback()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(DRAW_SEED)

    model, info = tiny_reference(args.glmtune, INIT_SEED, INIT_SETS, loading_info=True)
    model.eval()
    text = model.config.text_config
    layers = text.num_hidden_layers
    assert not info["missing_keys"], info["missing_keys"]
    assert all(k.startswith(f"model.language_model.layers.{layers}.") for k in info["unexpected_keys"])
    params = perturb(model, gen)

    cap = Capture(model)
    lm = model.model.language_model
    dsa_layers = [i for i, t in enumerate(text.layer_types) if t == "deepseek_sparse_attention"]
    moe_layers = [i for i, t in enumerate(text.mlp_layer_types) if t == "sparse"]
    assert dsa_layers == [3], dsa_layers
    vocab, pad = text.vocab_size, text.pad_token_id

    ids_all, trained_all, labels_all, logits_all, hidden_all = [], [], [], [], []
    l0_all, l3_all, idx_all = [], [], []
    counts = torch.zeros(len(moe_layers), text.n_routed_experts, dtype=torch.int64)
    doc_loss, doc_targets = [], []
    bias_matters = False
    drops = False
    start = 0
    with torch.no_grad():
        for d, length in enumerate(DOC_LENS):
            for _ in range(2000):
                ids = torch.randint(0, vocab, (1, length), generator=gen)
                ids[ids == pad] = 1  # the padding row of the embedding is zero
                cap.reset()
                out = model(input_ids=ids)
                clear = True
                for i in dsa_layers:
                    x, q_resid = cap.indexer_in[i]
                    indexer = lm.layers[i].self_attn.indexer
                    clear &= indexer_is_clear(indexer, x, q_resid, text.index_kpool, text.index_topk)
                for i in moe_layers:
                    gate = lm.layers[i].mlp.gate
                    _, gap = router_gap(gate, cap.router_in[i])
                    clear &= gap > ROUTER_GAP
                if clear:
                    break
            else:
                raise RuntimeError(f"no tie-free draw for a document of {length} tokens")
            for i in moe_layers:
                gate = lm.layers[i].mlp.gate
                with_bias, _ = router_gap(gate, cap.router_in[i])
                without, _ = router_gap(gate, cap.router_in[i], use_bias=False)
                bias_matters |= not torch.equal(with_bias, without)
            trained = torch.ones(length, dtype=torch.int32)
            if d == MASKED_DOC:
                trained[torch.randperm(length, generator=gen)[: length // 3]] = 0
            # The reference's own loss: labels are the ids where trained, shifted inside loss_function.
            ref_labels = torch.where(trained.bool(), ids[0], torch.full_like(ids[0], -100))
            loss = model(input_ids=ids, labels=ref_labels[None]).loss
            aligned = torch.cat([ref_labels[1:], torch.tensor([-100])]).to(torch.int32)
            n_targets = int((aligned != -100).sum())
            doc_loss.append(loss.item())
            doc_targets.append(n_targets)

            idx = cap.indices[3][0]
            drops |= bool(((idx >= 0).sum(-1) < torch.arange(1, length + 1)).any())
            ids_all.append(ids[0].to(torch.int32))
            trained_all.append(trained)
            labels_all.append(aligned)
            logits_all.append(out.logits[0])
            hidden_all.append(cap.hidden[0])
            l0_all.append(cap.layer_out[0][0])
            l3_all.append(cap.layer_out[3][0])
            idx_all.append(torch.where(idx >= 0, idx + start, idx).to(torch.int32))
            for j, i in enumerate(moe_layers):
                counts[j] += torch.bincount(cap.router_sel[i].flatten(), minlength=text.n_routed_experts)
            start += length
    assert bias_matters, "the correction bias never changes an expert choice"
    assert drops, "the sparse selection never drops a key; make a document longer"

    total = sum(n for n in doc_targets)
    pack_loss = sum(l * n for l, n in zip(doc_loss, doc_targets)) / total
    tensors = {
        "input_ids": torch.cat(ids_all),
        "cu_seqlens": torch.tensor([0] + list(torch.tensor(DOC_LENS).cumsum(0)), dtype=torch.int32),
        "trained": torch.cat(trained_all),
        "labels": torch.cat(labels_all),
        "logits": torch.cat(logits_all),
        "hidden": torch.cat(hidden_all),
        "layer0_out": torch.cat(l0_all),
        "layer3_out": torch.cat(l3_all),
        "layer3_indices": torch.cat(idx_all),
        "expert_counts": counts,
        "doc_loss": torch.tensor(doc_loss, dtype=torch.float32),
        "doc_targets": torch.tensor(doc_targets, dtype=torch.int64),
        "loss": torch.tensor([pack_loss], dtype=torch.float64),
    }
    for name, value in params.items():
        tensors["param." + name] = value
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"fixture": json.dumps(
            {"init_seed": INIT_SEED, "init_sets": INIT_SETS, "doc_lens": DOC_LENS, "preset": "tiny"}, sort_keys=True
        )}
    save_file(tensors, str(args.out), metadata=meta)
    size = args.out.stat().st_size
    assert size < 2 << 20, f"fixture is {size} bytes; keep it under 2 MiB"
    print(f"wrote {len(tensors)} tensors ({len(params)} parameters), {size} bytes; pack loss {pack_loss:.6f}")


if __name__ == "__main__":
    main()
