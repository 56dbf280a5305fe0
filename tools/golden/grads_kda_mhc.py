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

import os
import sys

import torch
from transformers.models.glm5_next import modeling_glm5_next as ref

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    assert_finite_and_nonzero,
    cu_seqlens,
    parse_out_arg,
    save_fixture,
)
from ops_kda_mhc import (  # noqa: E402
    FIXTURE_CONFIG,
    HC_MULT,
    HEAD_DIM,
    HIDDEN,
    KDA_PARAMS,
    NORM_ROWS,
    NUM_HEADS,
    kda_decoder_layer,
    kda_params,
    make_config,
    make_norms,
    randomise_hc,
    randomise_kda,
    seeded_reference_run,
    softplus_kda,
)

SEED = 20260611
KDA_DOCS = [130, 1, 63, 65]  # chunk boundaries at 64 and 128, a single token, one short of a chunk
MHC_DOCS = [13, 11]
LAYER_DOCS = [70, 3]

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
    x, rms, unweighted, gated, ln, gx, gz = make_norms(make_config(), gen)
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
    kda_params(attn, "kda.param", out)
    out.update({"kda.x": x, "kda.cu_seqlens": cu_seqlens(KDA_DOCS), "kda.dy": dy, "kda.dx": dx})
    kda_grads(attn, "kda.grad", out)

    # Softplus forget gate: kda's weights except A_log and dt_bias.
    attn_sp = softplus_kda(attn, gen)
    dy_sp = torch.randn(t, HIDDEN, generator=gen)
    dx_sp = backward_per_doc(run(attn_sp), x, dy_sp, KDA_DOCS)
    out["kda_softplus.param.A_log"] = attn_sp.forget_gate.A_log.detach().clone()
    out["kda_softplus.param.dt_bias"] = attn_sp.forget_gate.dt_bias.detach().clone()
    out.update({"kda_softplus.dy": dy_sp, "kda_softplus.dx": dx_sp})
    kda_grads(attn_sp, "kda_softplus.grad", out)
    return attn


def layer(gen, out, attn):
    lay = kda_decoder_layer(make_config(), attn, gen)
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
    out_path = parse_out_arg(__doc__, "grads_kda_mhc.safetensors")
    gen = seeded_reference_run(SEED)
    out = {}
    norms(gen, out)
    mhc(gen, out)
    attn = kda(gen, out)
    layer(gen, out, attn)

    assert_finite_and_nonzero(out)
    out = {k: v.detach().contiguous() for k, v in out.items()}
    save_fixture(out, out_path, "glmtune_golden", {
        "generator": "tools/golden/grads_kda_mhc.py",
        "reference": "transformers 5.17.0 glm5_next autograd, torch fallback "
                     "(chunk_kimi_delta_attention), float32 CPU",
        "seed": SEED,
        "config": FIXTURE_CONFIG,
        "kda_docs": KDA_DOCS,
        "mhc_docs": MHC_DOCS,
        "layer_docs": LAYER_DOCS,
    }, max_bytes=1_500_000)


if __name__ == "__main__":
    main()
