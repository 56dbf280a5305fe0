#!/usr/bin/env python3
"""Golden fixtures for the DSA indexer, sparse NoPE MLA attention, dense MLP and MoE ops.

Builds two tiny `Glm5NextTextConfig`s, instantiates the transformers 5.17.0 reference modules
(`Glm5NextTextAttention` with its `Glm5NextTextIndexer`, `Glm5NextTextMLP`, `Glm5NextTextMoE`)
with seeded random weights, and runs them on CPU in float32 with eager attention. Every document of
a pack is run on its own (batch of one, no padding), which is exactly what glmtune's packed ops
must reproduce. The result is written to tests/golden/ops/dsa_moe.safetensors and read by
tests/unit/test_ops_{indexer,mla,mlp,moe}.cpp.

Config "a" follows the shapes most likely to expose index mistakes (attention biases on, pool 4,
top-k 8 so that documents longer than 11 tokens lose keys, no expert groups); config "b" changes
every dimension that could be confused with another (v_head_dim != qk_nope_head_dim, three heads,
pool 2, expert groups 2/1, no top-k normalisation, two shared experts, no attention biases) and
also records the indexer with `index_kpool_always_select_tail = False`.

Weights are drawn away from their init values (norm weights near 1 but not 1, random LayerNorm
bias, pool ape and gate, random router correction bias) so that every parameter matters. The
SwiGLU limit is small enough that both clamps are active on some entries.

Top-k selections must be compared as sets, and near-ties could flip between two correct
implementations. For every query the indexer's pool scores are recomputed here and the input of
a document is redrawn until the gap between the last selected and the first rejected candidate is
clear; the MoE input is redrawn the same way for the group and expert choices.

Tensor names (prefix = config name): `<c>.x`, `<c>.cu_seqlens` (int32), `<c>.attn.<param>` (the
module's state-dict names, indexer under `attn.indexer.`), `<c>.q_resid`, `<c>.indices` (int32,
GLOBAL token indices into the pack, -1 = empty), `<c>.attn_out`, `<c>.moe_x`, `<c>.mlp.<param>`,
`<c>.mlp_out`, `<c>.moe.<param>`, `<c>.moe_out`, `<c>.router_logits`, `<c>.router_weights`,
`<c>.router_indices` (int32), `<c>.expert_counts` (int64); `b.indices_notail`. The configs and
document lengths are repeated in the file's metadata (key "fixture", JSON).

Usage: python tools/golden/ops_dsa_moe.py [--out PATH]
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.models.glm5_next import modeling_glm5_next as ref
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cu_seqlens, parse_out_arg, save_fixture  # noqa: E402

# Only the fields that differ from the released defaults; num_hidden_layers = 4 puts a DSA layer
# (with its own indexer) at index 3.
CONFIGS = {
    "a": dict(
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=0,
        v_head_dim=16,
        index_n_heads=4,
        index_head_dim=16,
        index_kpool=4,
        index_topk=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        swiglu_limit=1.0,
        attention_bias=True,
        rms_norm_eps=1e-5,
    ),
    "b": dict(
        hidden_size=48,
        intermediate_size=40,
        num_hidden_layers=4,
        num_attention_heads=3,
        num_key_value_heads=3,
        q_lora_rank=24,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=0,
        v_head_dim=12,
        index_n_heads=3,
        index_head_dim=8,
        index_kpool=2,
        index_topk=6,
        n_routed_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=16,
        n_shared_experts=2,
        n_group=2,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.7,
        swiglu_limit=1.5,
        attention_bias=False,
        rms_norm_eps=1e-5,
    ),
}
DOC_LENS = {"a": [7, 13, 29], "b": [3, 11, 22]}
SEEDS = {"a": 1234, "b": 5678}
# A selection is accepted when the last chosen score beats the first rejected one by this much
# (relative to the row's largest magnitude); fp32 reorderings differ by ~1e-6 relative.
INDEXER_GAP = 1e-3
ROUTER_GAP = 1e-3


def randomise(module, gen, name_prefix=""):
    """Draws every parameter and buffer of `module` away from its init value."""
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if t.dim() >= 2:
                # Fan-in scaling keeps every projection output O(1), so softmaxes, clamps and
                # relus all see a useful spread.
                t.copy_(torch.randn(t.shape, generator=gen) / t.shape[-1] ** 0.5)
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=gen))
            elif "norm" in name and name.endswith("weight"):
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=gen))
            elif name.endswith("bias"):
                t.copy_(0.2 * torch.randn(t.shape, generator=gen))
            else:
                raise RuntimeError(f"no draw rule for {name_prefix}{name} {tuple(t.shape)}")
        if hasattr(module, "indexer") and module.indexer is not None:
            # The ape is 2-D but not a projection: give it O(1) entries so slots differ.
            module.indexer.index_kpool_compress_ape.copy_(
                0.5 * torch.randn(module.indexer.index_kpool_compress_ape.shape, generator=gen)
            )


def pool_scores(indexer, x, q_resid):
    """Recomputes the indexer's per-pool scores [S, NP] for one document (batch of one)."""
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


def indexer_selection_is_clear(indexer, x, q_resid, cfg):
    """True when no query of the document has a near-tie at the top-k boundary."""
    scores = pool_scores(indexer, x, q_resid)
    pool, topk = cfg["index_kpool"], cfg["index_topk"]
    n_pools = scores.shape[1]
    select_k = min(topk // pool, n_pools)
    for s in range(scores.shape[0]):
        n_cand = (s + 1) // pool  # complete pools whose last token is <= s
        if n_cand <= select_k:
            continue  # every candidate is selected: nothing can flip
        row = scores[s, :n_cand].sort(descending=True).values
        gap = (row[select_k - 1] - row[select_k]).item()
        if gap <= INDEXER_GAP * max(row.abs().max().item(), 1e-6):
            return False
    return True


def router_choice(gate, x, use_bias=True):
    """Group-limited top-k as the reference router does it, plus the boundary gaps."""
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
    srt = choice.sort(dim=-1, descending=True).values
    if gate.topk_group * (e // g) > gate.top_k:
        gaps.append(srt[:, gate.top_k - 1] - srt[:, gate.top_k])
    sel = choice.topk(gate.top_k, dim=-1)[1].sort(dim=-1).values
    min_gap = min(gap.min().item() for gap in gaps) if gaps else float("inf")
    return sel, min_gap


def eager_config(cfg):
    """The reference config of one of CONFIGS, with eager attention and experts."""
    config = Glm5NextTextConfig(**cfg)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def random_attention(config, gen):
    """A DSA attention layer (index 3, with its own indexer) with seeded weights."""
    attn = ref.Glm5NextTextAttention(config, layer_idx=3).eval()
    assert attn.indexer is not None
    randomise(attn, gen, "attn.")
    return attn


def random_mlp_and_moe(config, gen):
    """The dense MLP and the MoE block with seeded weights (drawn in that order)."""
    mlp = ref.Glm5NextTextMLP(config).eval()
    randomise(mlp, gen, "mlp.")
    moe = ref.Glm5NextTextMoE(config).eval()
    randomise(moe, gen, "moe.")
    return mlp, moe


def clear_document_input(name, attn, cfg, length, gen):
    """Draws one document's input [1, length, D] until no query of it has a near-tie at the
    indexer's top-k boundary; returns it with its q_resid."""
    with torch.no_grad():
        for _ in range(10000):
            x = torch.randn(1, length, cfg["hidden_size"], generator=gen)
            q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
            if indexer_selection_is_clear(attn.indexer, x, q_resid, cfg):
                return x, q_resid
    raise RuntimeError(f"config {name}: no tie-free draw for a document of {length}")


def clear_moe_input(name, moe, total, d, gen):
    """Draws the position-wise input [1, total, D] until no router top-k boundary is near a tie
    and the correction bias changes at least one choice (so a port that ignores the bias, or lets
    it into the combine weights, fails)."""
    with torch.no_grad():
        for _ in range(10000):
            x = torch.randn(1, total, d, generator=gen)
            sel_bias, gap = router_choice(moe.gate, x[0])
            sel_plain, _ = router_choice(moe.gate, x[0], use_bias=False)
            if gap > ROUTER_GAP and not torch.equal(sel_bias, sel_plain):
                return x
    raise RuntimeError(f"config {name}: no tie-free MoE input")


def build(name, gen, tensors):
    cfg = CONFIGS[name]
    config = eager_config(cfg)
    lens = DOC_LENS[name]
    d = cfg["hidden_size"]

    attn = random_attention(config, gen)
    mlp, moe = random_mlp_and_moe(config, gen)

    xs, q_resids, indices, outs = [], [], [], []
    start = 0
    drops = False
    with torch.no_grad():
        for length in lens:
            x, q_resid = clear_document_input(name, attn, cfg, length, gen)
            mask = torch.ones(1, length, dtype=torch.bool)
            out, _, _ = attn(hidden_states=x, attention_mask=mask, past_key_values=None)
            idx = attn.indexer(x, q_resid, mask, None)[0]
            n_visible = (idx >= 0).sum(-1)
            drops |= bool((n_visible < torch.arange(1, length + 1)).any())
            xs.append(x[0])
            q_resids.append(q_resid[0])
            indices.append(torch.where(idx >= 0, idx + start, idx))
            outs.append(out[0])
            start += length
    assert drops, f"config {name}: the sparse selection never drops a key; make a document longer"

    tensors[f"{name}.x"] = torch.cat(xs)
    tensors[f"{name}.cu_seqlens"] = cu_seqlens(lens)
    tensors[f"{name}.q_resid"] = torch.cat(q_resids)
    tensors[f"{name}.indices"] = torch.cat(indices).to(torch.int32)
    tensors[f"{name}.attn_out"] = torch.cat(outs)
    for k, v in attn.state_dict().items():
        tensors[f"{name}.attn.{k}"] = v

    if name == "b":
        # Same weights, tail off: the output width shrinks to index_topk and the last tokens of an
        # unfinished pool become invisible.
        config_nt = Glm5NextTextConfig(**{**cfg, "index_kpool_always_select_tail": False})
        indexer_nt = ref.Glm5NextTextIndexer(config_nt, layer_idx=3).eval()
        indexer_nt.load_state_dict(attn.indexer.state_dict())
        rows, start = [], 0
        with torch.no_grad():
            for x, q_resid in zip(xs, q_resids):
                length = x.shape[0]
                mask = torch.ones(1, length, dtype=torch.bool)
                idx = indexer_nt(x[None], q_resid[None], mask, None)[0]
                rows.append(torch.where(idx >= 0, idx + start, idx))
                start += length
        tensors[f"{name}.indices_notail"] = torch.cat(rows).to(torch.int32)

    # MLP and MoE are position-wise, so the whole pack runs as one batch-of-one sequence.
    total = sum(lens)
    moe_x = clear_moe_input(name, moe, total, d, gen)
    with torch.no_grad():
        logits, weights, sel = moe.gate(moe_x)
        moe_out = moe(moe_x)
        mlp_out = mlp(moe_x)
        gate = F.linear(moe_x, mlp.gate_proj.weight)
        lim = cfg["swiglu_limit"]
        up = F.linear(moe_x, mlp.up_proj.weight)
        assert (gate > lim).any() and (up > lim).any() and (up < -lim).any(), "clamp inactive"
    tensors[f"{name}.moe_x"] = moe_x[0]
    tensors[f"{name}.mlp_out"] = mlp_out[0]
    tensors[f"{name}.moe_out"] = moe_out[0]
    tensors[f"{name}.router_logits"] = logits
    tensors[f"{name}.router_weights"] = weights
    tensors[f"{name}.router_indices"] = sel.to(torch.int32)
    tensors[f"{name}.expert_counts"] = torch.bincount(
        sel.flatten(), minlength=cfg["n_routed_experts"]
    ).to(torch.int64)
    for k, v in mlp.state_dict().items():
        tensors[f"{name}.mlp.{k}"] = v
    for k, v in moe.state_dict().items():
        tensors[f"{name}.moe.{k}"] = v


def main():
    out_path = parse_out_arg(__doc__, "dsa_moe.safetensors")
    torch.set_num_threads(1)
    tensors = {}
    for name in CONFIGS:
        build(name, torch.Generator().manual_seed(SEEDS[name]), tensors)
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    for k, v in tensors.items():
        assert v.dtype in (torch.float32, torch.int32, torch.int64), (k, v.dtype)
    save_fixture(tensors, out_path, "fixture", {"configs": CONFIGS, "doc_lens": DOC_LENS},
                 max_bytes=1 << 20)


if __name__ == "__main__":
    main()
