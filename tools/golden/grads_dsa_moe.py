#!/usr/bin/env python3
"""Golden gradients for the sparse MLA attention, dense MLP, MoE, embedding and LM loss.

Uses the transformers 5.17.0 reference modules on CPU in float32 with eager attention, and their
autograd: `Glm5NextTextAttention` (with its own `Glm5NextTextIndexer`, which runs under no_grad),
`Glm5NextTextMLP`, `Glm5NextTextMoE`, `nn.Embedding(padding_idx=pad)` and the reference's
`ForCausalLMLoss`. A fixed random upstream gradient is back-propagated through each module and
every parameter's gradient plus the input gradient is written to
tests/golden/ops/grads_dsa_moe.safetensors, read by tests/unit/test_grad_{mla,mlp,moe,embedding,
cross_entropy}.cpp.

The configurations, weight draws and tie avoidance are those of tools/golden/ops_dsa_moe.py
(imported from it): config "a" has attention biases, pool 4, top-k 8; config "b" has
v_head_dim != qk_nope_head_dim, three heads, pool 2, expert groups, no top-k normalisation and two
shared experts. Inputs are redrawn until no indexer or router top-k boundary is near a tie, so a
port recomputes the same selections. Documents are long enough that the indexer drops keys.

Packs: every document runs through the attention module on its own (batch of one, no padding),
which is what glmtune's packed ops reproduce; parameter gradients therefore accumulate (sum) over
the documents, and the input gradient is the concatenation of the per-document ones. The MLP and
MoE are position-wise, so the whole pack runs as one sequence.

Tensor names (prefix = config name): `<c>.x`, `<c>.cu_seqlens` (int32), `<c>.indices` (int32,
GLOBAL indices into the pack, -1 = empty), `<c>.attn.<param>` (state-dict names, the indexer under
`attn.indexer.`), `<c>.attn_dy` (upstream gradient), `<c>.attn_out`, `<c>.attn_dx`,
`<c>.attn_grad.<param>` (only the parameters that received a gradient); the same for the MLP and
MoE with `mlp`/`moe` in place of `attn` and `<c>.ffn_x` as their shared input (`<c>.mlp_dx`,
`<c>.moe_dx`). Embedding: `emb.weight`, `emb.ids` (int64), `emb.dy`, `emb.out`, `emb.grad`.
LM loss: `lm.hidden`, `lm.weight`, `lm.labels` (int64, unshifted, -100 = ignored) and, for the
token mean (`mean`) and an external denominator (`sum`, `num_items_in_batch` in the metadata),
`lm.<r>.loss`, `lm.<r>.dhidden`, `lm.<r>.dweight`. Metadata key "fixture" (JSON) repeats the
configs, document lengths, which parameters got gradients (the indexer's and the router bias must
not), the pad id and the external denominator.

Usage: python tools/golden/grads_dsa_moe.py [--out PATH]
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.loss.loss_utils import ForCausalLMLoss

# The sibling script ops_dsa_moe.py holds the configurations and draw rules; make it importable.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cu_seqlens, parse_out_arg, save_fixture  # noqa: E402
from ops_dsa_moe import (  # noqa: E402
    CONFIGS,
    clear_document_input,
    clear_moe_input,
    eager_config,
    random_attention,
    random_mlp_and_moe,
)

# Short enough to keep the file small, long enough that queries lose keys: a query of "a" sees at
# most 8 + 3 keys, one of "b" at most 6 + 1.
DOC_LENS = {"a": [6, 13, 21], "b": [4, 9, 17]}
SEEDS = {"a": 2468, "b": 1357}
LM = dict(vocab=40, hidden=16, tokens=14, pad_id=3, seed=97531)
# Stands in for a global token count larger than this pack's own.
LM_NUM_ITEMS = 17


def grads_of(module, prefix, tensors, names):
    """Stores every parameter gradient; records which parameters got one."""
    for k, p in module.named_parameters():
        if p.grad is not None:
            tensors[f"{prefix}{k}"] = p.grad.clone()
            names.append(k)


def attention(name, config, cfg, gen, tensors, meta):
    lens = DOC_LENS[name]
    attn = random_attention(config, gen)

    xs, dxs, dys, outs, indices = [], [], [], [], []
    start, drops = 0, False
    for length in lens:
        x, q_resid = clear_document_input(name, attn, cfg, length, gen)
        x = x.clone().requires_grad_(True)
        mask = torch.ones(1, length, dtype=torch.bool)
        out, _, _ = attn(hidden_states=x, attention_mask=mask, past_key_values=None)
        dy = torch.randn(out.shape, generator=gen)
        # Parameter gradients accumulate over the documents of the pack: the sum glmtune computes.
        out.backward(dy)
        with torch.no_grad():
            idx = attn.indexer(x, q_resid, mask, None)[0]
        drops |= bool(((idx >= 0).sum(-1) < torch.arange(1, length + 1)).any())
        xs.append(x.detach()[0])
        dxs.append(x.grad[0])
        dys.append(dy[0])
        outs.append(out.detach()[0])
        indices.append(torch.where(idx >= 0, idx + start, idx))
        start += length
    assert drops, f"config {name}: the sparse selection never drops a key; make a document longer"
    for k, p in attn.indexer.named_parameters():
        assert p.grad is None, f"indexer parameter {k} received a gradient"

    tensors[f"{name}.x"] = torch.cat(xs)
    tensors[f"{name}.cu_seqlens"] = cu_seqlens(lens)
    tensors[f"{name}.indices"] = torch.cat(indices).to(torch.int32)
    tensors[f"{name}.attn_dy"] = torch.cat(dys)
    tensors[f"{name}.attn_out"] = torch.cat(outs)
    tensors[f"{name}.attn_dx"] = torch.cat(dxs)
    for k, v in attn.state_dict().items():
        tensors[f"{name}.attn.{k}"] = v
    names = []
    grads_of(attn, f"{name}.attn_grad.", tensors, names)
    meta[f"{name}.attn_grads"] = sorted(names)


def ffn(name, config, cfg, gen, tensors, meta):
    d, total = cfg["hidden_size"], sum(DOC_LENS[name])
    mlp, moe = random_mlp_and_moe(config, gen)
    x = clear_moe_input(name, moe, total, d, gen)
    lim = cfg["swiglu_limit"]
    with torch.no_grad():
        gate = F.linear(x, mlp.gate_proj.weight)
        up = F.linear(x, mlp.up_proj.weight)
        assert (gate > lim).any() and (up > lim).any() and (up < -lim).any(), "MLP clamp inactive"
        gu = torch.einsum("td,emd->tem", x[0], moe.experts.gate_up_proj)
        g, u = gu.chunk(2, dim=-1)
        assert (g > lim).any() and (u.abs() > lim).any(), "expert clamp inactive"
    tensors[f"{name}.ffn_x"] = x[0]

    for tag, module in (("mlp", mlp), ("moe", moe)):
        xi = x.clone().requires_grad_(True)
        out = module(xi)
        dy = torch.randn(out.shape, generator=gen)
        out.backward(dy)
        tensors[f"{name}.{tag}_dy"] = dy[0]
        tensors[f"{name}.{tag}_out"] = out.detach()[0]
        tensors[f"{name}.{tag}_dx"] = xi.grad[0]
        for k, v in module.state_dict().items():
            tensors[f"{name}.{tag}.{k}"] = v
        names = []
        grads_of(module, f"{name}.{tag}_grad.", tensors, names)
        meta[f"{name}.{tag}_grads"] = sorted(names)
    assert moe.gate.e_score_correction_bias.grad is None
    assert "gate.e_score_correction_bias" not in meta[f"{name}.moe_grads"]


def embedding_and_loss(tensors, meta):
    gen = torch.Generator().manual_seed(LM["seed"])
    v, d, t, pad = LM["vocab"], LM["hidden"], LM["tokens"], LM["pad_id"]

    emb = torch.nn.Embedding(v, d, padding_idx=pad)
    with torch.no_grad():
        # A non-zero pad row: the forward must still return it, and it must get no gradient.
        emb.weight.copy_(torch.randn(v, d, generator=gen))
    ids = torch.randint(0, v, (t,), generator=gen)
    ids[2] = ids[9] = pad
    ids[5] = ids[11] = ids[4]  # repeated ids accumulate
    out = emb(ids)
    dy = torch.randn(out.shape, generator=gen)
    out.backward(dy)
    assert emb.weight.grad[pad].abs().max() == 0
    tensors["emb.weight"] = emb.weight.detach().clone()
    tensors["emb.ids"] = ids
    tensors["emb.dy"] = dy
    tensors["emb.out"] = out.detach()
    tensors["emb.grad"] = emb.weight.grad

    hidden = torch.randn(1, t, d, generator=gen)
    weight = torch.randn(v, d, generator=gen) / d**0.25
    labels = torch.randint(0, v, (1, t), generator=gen)
    labels[0, [0, 3, 4, 10]] = -100
    tensors["lm.hidden"] = hidden[0]
    tensors["lm.weight"] = weight
    tensors["lm.labels"] = labels[0]
    for tag, items in (("mean", None), ("sum", LM_NUM_ITEMS)):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        logits = F.linear(h, w)
        loss = ForCausalLMLoss(logits, labels, v, num_items_in_batch=items)
        loss.backward()
        tensors[f"lm.{tag}.loss"] = loss.detach().reshape(1)
        tensors[f"lm.{tag}.dhidden"] = h.grad[0]
        tensors[f"lm.{tag}.dweight"] = w.grad
    meta["lm"] = {**LM, "num_items_in_batch": LM_NUM_ITEMS}


def main():
    out_path = parse_out_arg(__doc__, "grads_dsa_moe.safetensors")
    torch.set_num_threads(1)
    tensors, meta = {}, {}
    for name, cfg in CONFIGS.items():
        config = eager_config(cfg)
        gen = torch.Generator().manual_seed(SEEDS[name])
        attention(name, config, cfg, gen, tensors, meta)
        ffn(name, config, cfg, gen, tensors, meta)
    embedding_and_loss(tensors, meta)
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    for k, v in tensors.items():
        assert v.dtype in (torch.float32, torch.int32, torch.int64), (k, v.dtype)
        if v.is_floating_point() and v.numel() > 1:
            assert v.abs().max() > 0, f"{k} is all zeros"
    meta.update(configs=CONFIGS, doc_lens=DOC_LENS)
    save_fixture(tensors, out_path, "fixture", meta, max_bytes=1_500_000)


if __name__ == "__main__":
    main()
