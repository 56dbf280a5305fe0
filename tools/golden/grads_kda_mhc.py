"""Regenerate tests/golden/ops/grads_kda_mhc.safetensors: golden gradients for glmtune's CPU
backward passes of the norms, the mHC hyper-connection and the KDA mixer, from the autograd of
the transformers 5.17.0 `glm5_next` reference modules.

Run with the reference environment's Python (CPU, float32, eager):

    python tools/golden/grads_kda_mhc.py [--out tests/golden/ops/grads_kda_mhc.safetensors]

Like tools/golden/ops_kda_mhc.py (whose config and parameter draws this script imports), it
refuses to run when FLA, `causal_conv1d` or the `kernels` hub package is importable, so autograd
differentiates the reference's PyTorch fallback: the F.conv1d short conv and the chunked (chunk
64) delta rule.

Packs: every document runs through the module on its own (batch of one, no padding, no mask) with
a fixed random upstream gradient for its rows; the parameter gradient of a pack is therefore the
sum over its documents (autograd accumulates `.grad` across the backward calls), the input
gradient the concatenation of the per-document ones. mHC is per token, but runs per document too.

Tensor names:
- `norm.*`: inputs as in ops_kda_mhc.py plus upstream `*_dy`; gradients `rms_dx`, `rms_dw`,
  `unweighted_dx`, `gated_dx`, `gated_dgate`, `gated_dw`, `ln_dx`, `ln_dw`, `ln_db`, `l2_dx`.
- `mhc.*`: `streams`, `fn`, `base`, `scale`, `cu_seqlens`; upstream `d_post`, `d_comb`,
  `d_collapsed`; gradients `d_streams`, `d_fn`, `d_base`, `d_scale`. The stream update
  X'_i = post_i·y + Σ_j comb[j][i]·X_j on `mhc.streams`: inputs `post_in.{y,post,comb}` (post and
  comb are the hyper-connection's outputs), upstream `post_in.dy_out`, gradients
  `post_in.d_{streams,y,post,comb}`.
  Hyper head (mean over streams): `head.dy`, `head.d_streams`.
- `kda.*`: `param.<name>` (KdaParams names), `x`, `cu_seqlens`, `dy`, `dx`, `grad.<name>`.
  `kda_softplus.*`: the softplus forget gate (no lower bound) with its own `param.A_log`,
  `param.dt_bias` (the other parameters are kda's), `dy`, `dx`, `grad.<name>`.
- `layer.*`: decoder layer 0 (KDA, with kda's parameters) with its FFN replaced by the identity:
  `streams`, `cu_seqlens`, `dy`, `d_streams`, parameters `attn_hc.{fn,base,scale}`,
  `ffn_hc.{fn,base,scale}`, `input_layernorm`, `post_attention_layernorm`, and `grad.<same>` plus
  `grad.self_attn.<name>` for the KDA parameters.
"""

import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers.models.glm5_next import modeling_glm5_next as ref

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ops_kda_mhc import (  # noqa: E402
    HC_MULT,
    HEAD_DIM,
    HIDDEN,
    NUM_HEADS,
    cu_seqlens,
    make_config,
    randomise_hc,
    randomise_kda,
    require_torch_fallback,
)

SEED = 20260611
KDA_DOCS = [130, 1, 63, 65]  # chunk boundaries at 64 and 128, a single token, one short of a chunk
MHC_DOCS = [13, 11]
LAYER_DOCS = [70, 3]
NORM_ROWS = 12

# Module attribute paths of the KDA parameters, in KdaParams order and naming.
KDA_PARAMS = {
    "q_proj": "q_proj.weight",
    "k_proj": "k_proj.weight",
    "v_proj": "v_proj.weight",
    "conv1d": "conv1d.weight",
    "f_a_proj": "forget_gate.f_a_proj.weight",
    "f_b_proj": "forget_gate.f_b_proj.weight",
    "dt_bias": "forget_gate.dt_bias",
    "A_log": "forget_gate.A_log",
    "b_proj": "b_proj.weight",
    "g_a_proj": "g_a_proj.weight",
    "g_b_proj": "g_b_proj.weight",
    "o_norm": "o_norm.weight",
    "o_proj": "o_proj.weight",
}


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def backward_per_doc(run, x, dy, docs):
    """run(x_doc) -> y_doc for one document (batch dim added by the caller's closure); returns the
    concatenated input gradient. Parameter gradients accumulate in the modules' .grad."""
    grads, start = [], 0
    for n in docs:
        xd = leaf(x[start:start + n])
        y = run(xd)
        y.backward(dy[start:start + n])
        grads.append(xd.grad)
        start += n
    return torch.cat(grads)


def norms(gen, out):
    cfg = make_config()
    x = torch.randn(NORM_ROWS, HIDDEN, generator=gen) * 1.7 + 0.3
    rms = ref.Glm5NextTextRMSNorm(HIDDEN, eps=cfg.rms_norm_eps)
    unweighted = ref.Glm5NextTextUnweightedRMSNorm(eps=cfg.rms_norm_eps)
    gated = ref.Glm5NextTextRMSNormGated(HEAD_DIM, eps=cfg.rms_norm_eps)
    ln = torch.nn.LayerNorm(HIDDEN, eps=1e-6)  # the indexer's k_norm module
    with torch.no_grad():
        rms.weight.copy_(1.0 + 0.5 * torch.randn(HIDDEN, generator=gen))
        gated.weight.copy_(1.0 + 0.5 * torch.randn(HEAD_DIM, generator=gen))
        ln.weight.copy_(1.0 + 0.5 * torch.randn(HIDDEN, generator=gen))
        ln.bias.copy_(0.5 * torch.randn(HIDDEN, generator=gen))
    gx = torch.randn(NORM_ROWS, NUM_HEADS, HEAD_DIM, generator=gen)
    gz = torch.randn(NORM_ROWS, NUM_HEADS, HEAD_DIM, generator=gen) * 2.0
    dy = torch.randn(NORM_ROWS, HIDDEN, generator=gen)
    gdy = torch.randn(NORM_ROWS, NUM_HEADS, HEAD_DIM, generator=gen)

    def grad_of(fn, upstream, *inputs):
        leaves = [leaf(t) for t in inputs]
        fn(*leaves).backward(upstream)
        return [t.grad for t in leaves]

    out.update({
        "norm.x": x, "norm.dy": dy, "norm.gated_x": gx, "norm.gated_gate": gz, "norm.gated_dy": gdy,
        "norm.rms_weight": rms.weight.detach().clone(),
        "norm.gated_weight": gated.weight.detach().clone(),
        "norm.ln_weight": ln.weight.detach().clone(), "norm.ln_bias": ln.bias.detach().clone(),
    })
    out["norm.rms_dx"], = grad_of(rms, dy, x)
    out["norm.rms_dw"] = rms.weight.grad.clone()
    out["norm.unweighted_dx"], = grad_of(unweighted, dy, x)
    out["norm.gated_dx"], out["norm.gated_dgate"] = grad_of(gated, gdy, gx, gz)
    out["norm.gated_dw"] = gated.weight.grad.clone()
    out["norm.ln_dx"], = grad_of(ln, dy, x)
    out["norm.ln_dw"] = ln.weight.grad.clone()
    out["norm.ln_db"] = ln.bias.grad.clone()
    out["norm.l2_dx"], = grad_of(lambda t: ref.l2norm(t, dim=-1, eps=1e-6), dy, x)


def mhc(gen, out):
    cfg = make_config()
    hc = ref.Glm5NextTextHyperConnection(cfg)
    randomise_hc(hc, gen)
    t = sum(MHC_DOCS)
    streams = torch.randn(t, HC_MULT, HIDDEN, generator=gen)
    d_post = torch.randn(t, HC_MULT, generator=gen)
    d_comb = torch.randn(t, HC_MULT, HC_MULT, generator=gen)
    d_coll = torch.randn(t, HIDDEN, generator=gen)
    grads, posts, combs, start = [], [], [], 0
    for n in MHC_DOCS:
        xd = leaf(streams[start:start + n])
        post, comb, coll = hc(xd[None])
        sl = slice(start, start + n)
        torch.autograd.backward([post[0], comb[0], coll[0]], [d_post[sl], d_comb[sl], d_coll[sl]])
        grads.append(xd.grad)
        posts.append(post[0].detach())
        combs.append(comb[0].detach())
        start += n
    out.update({
        "mhc.streams": streams, "mhc.cu_seqlens": cu_seqlens(MHC_DOCS),
        "mhc.fn": hc.fn.detach().clone(), "mhc.base": hc.base.detach().clone(),
        "mhc.scale": hc.scale.detach().clone(),
        "mhc.d_post": d_post, "mhc.d_comb": d_comb, "mhc.d_collapsed": d_coll,
        "mhc.d_streams": torch.cat(grads), "mhc.d_fn": hc.fn.grad.clone(),
        "mhc.d_base": hc.base.grad.clone(), "mhc.d_scale": hc.scale.grad.clone(),
    })

    # The stream update, written as Glm5NextTextDecoderLayer.forward writes it.
    post, comb = torch.cat(posts), torch.cat(combs)
    y = torch.randn(t, HIDDEN, generator=gen)
    dy_out = torch.randn(t, HC_MULT, HIDDEN, generator=gen)
    ls, ly, lp, lc = leaf(streams), leaf(y), leaf(post), leaf(comb)
    updated = lp.unsqueeze(-1) * ly.unsqueeze(-2) + torch.matmul(lc.transpose(-1, -2), ls)
    updated.backward(dy_out)
    out.update({
        "post_in.y": y, "post_in.post": post, "post_in.comb": comb,
        "post_in.dy_out": dy_out, "post_in.d_streams": ls.grad, "post_in.d_y": ly.grad,
        "post_in.d_post": lp.grad, "post_in.d_comb": lc.grad,
    })

    head_dy = torch.randn(t, HIDDEN, generator=gen)
    ls = leaf(streams)
    ref.Glm5NextTextHyperHead()(ls[None])[0].backward(head_dy)
    out["head.dy"] = head_dy
    out["head.d_streams"] = ls.grad


def kda_grads(attn, prefix, out):
    for name, path in KDA_PARAMS.items():
        out[f"{prefix}.{name}"] = attn.get_parameter(path).grad.clone()


def kda(gen, out):
    cfg = make_config()
    attn = ref.Glm5NextTextLinearAttention(cfg, layer_idx=0).eval()
    randomise_kda(attn, gen)
    t = sum(KDA_DOCS)
    x = torch.randn(t, HIDDEN, generator=gen)
    dy = torch.randn(t, HIDDEN, generator=gen)

    def run(module):
        return lambda xd: module(hidden_states=xd[None], cache_params=None, attention_mask=None)[0]

    dx = backward_per_doc(run(attn), x, dy, KDA_DOCS)
    for name, path in KDA_PARAMS.items():
        out[f"kda.param.{name}"] = attn.get_parameter(path).detach().clone()
    out.update({"kda.x": x, "kda.cu_seqlens": cu_seqlens(KDA_DOCS), "kda.dy": dy, "kda.dx": dx})
    kda_grads(attn, "kda.grad", out)

    # Softplus forget gate (linear_lower_bound = None): kda's weights except A_log and dt_bias;
    # every 7th dt_bias is large enough that z > 20 takes softplus' identity branch.
    cfg_sp = make_config(linear_lower_bound=None)
    assert cfg_sp.linear_lower_bound is None
    attn_sp = ref.Glm5NextTextLinearAttention(cfg_sp, layer_idx=0).eval()
    attn_sp.load_state_dict(attn.state_dict())
    with torch.no_grad():
        attn_sp.forget_gate.A_log.copy_(torch.empty(NUM_HEADS).uniform_(-2.0, 0.5, generator=gen))
        dt = torch.randn(NUM_HEADS * HEAD_DIM, generator=gen) * 0.7 - 2.0
        dt[::7] = 24.0
        attn_sp.forget_gate.dt_bias.copy_(dt)
    dy_sp = torch.randn(t, HIDDEN, generator=gen)
    dx_sp = backward_per_doc(run(attn_sp), x, dy_sp, KDA_DOCS)
    out["kda_softplus.param.A_log"] = attn_sp.forget_gate.A_log.detach().clone()
    out["kda_softplus.param.dt_bias"] = attn_sp.forget_gate.dt_bias.detach().clone()
    out.update({"kda_softplus.dy": dy_sp, "kda_softplus.dx": dx_sp})
    kda_grads(attn_sp, "kda_softplus.grad", out)
    return attn


def layer(gen, out, attn):
    cfg = make_config()
    lay = ref.Glm5NextTextDecoderLayer(cfg, layer_idx=0).eval()
    assert lay.block_type == "linear_attention"
    lay.self_attn.load_state_dict(attn.state_dict())
    lay.mlp = torch.nn.Identity()
    randomise_hc(lay.attn_hc, gen)
    randomise_hc(lay.ffn_hc, gen)
    with torch.no_grad():
        lay.input_layernorm.weight.copy_(1.0 + 0.3 * torch.randn(HIDDEN, generator=gen))
        lay.post_attention_layernorm.weight.copy_(1.0 + 0.3 * torch.randn(HIDDEN, generator=gen))
    t = sum(LAYER_DOCS)
    streams = torch.randn(t, HC_MULT, HIDDEN, generator=gen)
    dy = torch.randn(t, HC_MULT, HIDDEN, generator=gen)
    d_streams = backward_per_doc(lambda xd: lay(xd[None], attention_mask=None)[0][0], streams, dy,
                                 LAYER_DOCS)
    out.update({"layer.streams": streams, "layer.cu_seqlens": cu_seqlens(LAYER_DOCS),
                "layer.dy": dy, "layer.d_streams": d_streams})
    for site in ("attn_hc", "ffn_hc"):
        for p in ("fn", "base", "scale"):
            param = getattr(getattr(lay, site), p)
            out[f"layer.{site}.{p}"] = param.detach().clone()
            out[f"layer.grad.{site}.{p}"] = param.grad.clone()
    for norm in ("input_layernorm", "post_attention_layernorm"):
        w = getattr(lay, norm).weight
        out[f"layer.{norm}"] = w.detach().clone()
        out[f"layer.grad.{norm}"] = w.grad.clone()
    kda_grads(lay.self_attn, "layer.grad.self_attn", out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--out", default=os.path.join(here, "..", "..", "tests", "golden", "ops",
                                                      "grads_kda_mhc.safetensors"))
    args = parser.parse_args()
    require_torch_fallback()
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    torch.set_default_dtype(torch.float32)
    out = {}
    norms(gen, out)
    mhc(gen, out)
    attn = kda(gen, out)
    layer(gen, out, attn)

    for k, v in out.items():
        assert torch.isfinite(v.float()).all(), k
        if v.dtype.is_floating_point:
            assert v.abs().max() > 0, f"{k} is all zero"
    out = {k: v.detach().contiguous() for k, v in out.items()}
    # One metadata key: safetensors writes several in hash order, which would make the file's bytes
    # differ between runs with identical tensors.
    meta = {"glmtune_golden": json.dumps({
        "generator": "tools/golden/grads_kda_mhc.py",
        "reference": "transformers 5.17.0 glm5_next autograd, torch fallback "
                     "(chunk_kimi_delta_attention), float32 CPU",
        "seed": SEED,
        "config": {"hidden_size": HIDDEN, "linear_num_heads": NUM_HEADS,
                   "linear_head_dim": HEAD_DIM, "hc_mult": HC_MULT,
                   "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-5, "hc_eps": 1e-6,
                   "hc_sinkhorn_iters": 20, "linear_lower_bound": -5.0,
                   "kda_softplus.linear_lower_bound": None},
        "kda_docs": KDA_DOCS,
        "mhc_docs": MHC_DOCS,
        "layer_docs": LAYER_DOCS,
    }, sort_keys=True)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    save_file(out, args.out, metadata=meta)
    size = os.path.getsize(args.out)
    print(f"wrote {os.path.normpath(args.out)}: {len(out)} tensors, {size} bytes")
    assert size < 1_500_000, "fixture must stay below 1.5 MB"


if __name__ == "__main__":
    main()
