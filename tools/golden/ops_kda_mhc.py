"""Regenerate tests/golden/ops/kda_mhc.safetensors: golden values for glmtune's CPU norm, mHC and
KDA ops, computed by the transformers 5.17.0 `glm5_next` reference modules.

Run with the reference environment's Python (CPU, float32, eager):

    python tools/golden/ops_kda_mhc.py [--out tests/golden/ops/kda_mhc.safetensors]

Reference path: the KDA module calls `causal_conv1d_fn` and `chunk_kimi_delta_attention`, which
resolve to an optimised kernel only when the `kernels` hub package, FLA (`fla`) or
`causal_conv1d` is importable. This script refuses to run if any of them is installed, so what it
records is the plain PyTorch fallback: the reference `F.conv1d` short conv and the chunked
(chunk 64) delta rule, the path the reference runs for every prefill / training forward without a
cache. The token-by-token
`recurrent_kimi_delta_attention` is also evaluated on the same inputs for comparison.

Every document is run through the reference on its own (batch of one, no padding, no mask) and the
results are concatenated in pack order; `*.cu_seqlens` gives the document offsets.
"""

import importlib.util
import os
import sys

import torch
from transformers.models.glm5_next import modeling_glm5_next as ref
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    assert_finite_and_nonzero,
    cu_seqlens,
    parse_out_arg,
    save_fixture,
)

SEED = 20260517
HIDDEN = 64
NUM_HEADS = 2  # KDA heads NL
HEAD_DIM = 16  # KDA head dim HL
HC_MULT = 4
KDA_DOCS = [130, 1, 63, 65]  # crosses chunk boundaries (64, 128), a single token, one short of a chunk
LAYER_DOCS = [70, 3]
MHC_TOKENS = 24
NORM_ROWS = 12


# The configuration of make_config() (and of the softplus variant) that both kda_mhc fixtures
# record in their metadata.
FIXTURE_CONFIG = {
    "hidden_size": HIDDEN,
    "linear_num_heads": NUM_HEADS,
    "linear_head_dim": HEAD_DIM,
    "hc_mult": HC_MULT,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-5,
    "hc_eps": 1e-6,
    "hc_sinkhorn_iters": 20,
    "linear_lower_bound": -5.0,
    "kda_softplus.linear_lower_bound": None,
}


def require_torch_fallback():
    for pkg in ("fla", "kernels", "causal_conv1d"):
        if importlib.util.find_spec(pkg) is not None:
            raise SystemExit(
                f"'{pkg}' is installed: the reference would run its kernels instead of the PyTorch "
                "fallback these goldens must record. Use an environment without it."
            )


def seeded_reference_run(seed):
    """Checks that the reference runs its PyTorch fallback, seeds torch's global generator (the
    modules' own inits) and returns the generator every value of the fixture is drawn from."""
    require_torch_fallback()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    torch.set_default_dtype(torch.float32)
    return gen


def make_config(**overrides):
    kwargs = dict(
        vocab_size=256,
        pad_token_id=0,
        hidden_size=HIDDEN,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        linear_num_heads=NUM_HEADS,
        linear_head_dim=HEAD_DIM,
        linear_conv_kernel_dim=4,
        hc_mult=HC_MULT,
        hc_sinkhorn_iters=20,
        rms_norm_eps=1e-5,
        hc_eps=1e-6,
    )
    kwargs.update(overrides)
    return Glm5NextTextConfig(**kwargs)


def randomise_kda(attn, gen):
    """Seeded values far from init (A_log = 0, o_norm = 1) so no parameter is trivially neutral."""
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-1.5, 1.0, generator=gen))
            elif name.endswith("dt_bias"):
                # Mostly slow decay (g near 0) so state carried across chunks and documents
                # matters, with a spread of fast channels.
                p.copy_(torch.randn(p.shape, generator=gen) - 2.5)
            elif name.startswith("o_norm"):
                p.copy_(1.0 + 0.4 * torch.randn(p.shape, generator=gen))
            elif name.startswith("conv1d"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.6)
            else:  # projections [out, in]: unit-scale outputs for unit-scale inputs
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def randomise_hc(hc, gen):
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=gen) * 0.3)
        hc.base.copy_(torch.randn(hc.base.shape, generator=gen) * 0.5)
        hc.scale.copy_(torch.empty(3).uniform_(0.5, 1.5, generator=gen))


def make_norms(cfg, gen):
    """The normalisations with seeded weights, and their inputs: x [NORM_ROWS, HIDDEN] for the
    RMS, un-weighted RMS, LayerNorm and L2 norms, gx and the gate gz [NORM_ROWS, NL, HL] for the
    gated RMSNorm. Returns (x, rms, unweighted, gated, ln, gx, gz)."""
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
    return x, rms, unweighted, gated, ln, gx, gz


def softplus_kda(attn, gen):
    """The KDA mixer with the softplus forget gate (linear_lower_bound = None, no
    linear_attn_config): `attn`'s weights except A_log and dt_bias; every 7th dt_bias pushes the
    gate input past softplus' z > 20 (identity) branch."""
    cfg_sp = make_config(linear_lower_bound=None)
    assert cfg_sp.linear_lower_bound is None
    attn_sp = ref.Glm5NextTextLinearAttention(cfg_sp, layer_idx=0).eval()
    attn_sp.load_state_dict(attn.state_dict())
    with torch.no_grad():
        attn_sp.forget_gate.A_log.copy_(torch.empty(NUM_HEADS).uniform_(-2.0, 0.5, generator=gen))
        dt = torch.randn(NUM_HEADS * HEAD_DIM, generator=gen) * 0.7 - 2.0
        dt[::7] = 24.0
        attn_sp.forget_gate.dt_bias.copy_(dt)
    return attn_sp


def kda_decoder_layer(cfg, attn, gen):
    """Decoder layer 0 (a KDA layer) with `attn`'s weights and its FFN replaced by the identity,
    so that a fixture covers exactly hc_pre -> RMSNorm -> KDA -> hc_post -> hc_pre -> RMSNorm ->
    hc_post; seeded hyper-connections and norm weights."""
    layer = ref.Glm5NextTextDecoderLayer(cfg, layer_idx=0).eval()
    assert layer.block_type == "linear_attention"
    layer.self_attn.load_state_dict(attn.state_dict())
    layer.mlp = torch.nn.Identity()
    randomise_hc(layer.attn_hc, gen)
    randomise_hc(layer.ffn_hc, gen)
    with torch.no_grad():
        layer.input_layernorm.weight.copy_(1.0 + 0.3 * torch.randn(HIDDEN, generator=gen))
        layer.post_attention_layernorm.weight.copy_(1.0 + 0.3 * torch.randn(HIDDEN, generator=gen))
    return layer


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


def kda_params(attn, prefix, out):
    """Stores the KDA parameters of `attn` as `<prefix>.<KdaParams name>`."""
    for name, path in KDA_PARAMS.items():
        out[f"{prefix}.{name}"] = attn.get_parameter(path).detach().clone()


def run_kda_docs(attn, x, docs, record):
    """Runs each document alone; `record` collects intermediates from the reference calls."""
    captured = {}
    orig_conv, orig_chunk = ref.causal_conv1d_fn, ref.chunk_kimi_delta_attention

    def conv_spy(*args, **kwargs):
        y = orig_conv(*args, **kwargs)
        captured["conv_out"] = y[0].transpose(0, 1).clone()  # [S, 3QL]
        return y

    def chunk_spy(query, key, value, g, beta, **kwargs):
        o, s = orig_chunk(query, key, value, g=g, beta=beta, **kwargs)
        captured["g"] = g[0].clone()
        captured["beta"] = beta[0].clone()
        captured["core"] = o[0].clone()
        r, _ = ref.recurrent_kimi_delta_attention(
            query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=True)
        captured["recurrent"] = r[0].clone()
        return o, s

    hook = attn.o_norm.register_forward_hook(
        lambda m, inp, out: captured.__setitem__("normed", out[0].clone()))
    ref.causal_conv1d_fn, ref.chunk_kimi_delta_attention = conv_spy, chunk_spy
    try:
        ys, parts = [], {k: [] for k in record}
        start = 0
        for n in docs:
            with torch.no_grad():
                y = attn(hidden_states=x[None, start:start + n], cache_params=None,
                         attention_mask=None)
            ys.append(y[0])
            for k in record:
                parts[k].append(captured[k])
            start += n
    finally:
        ref.causal_conv1d_fn, ref.chunk_kimi_delta_attention = orig_conv, orig_chunk
        hook.remove()
    return torch.cat(ys), {k: torch.cat(v) for k, v in parts.items()}


def main():
    out_path = parse_out_arg(__doc__, "kda_mhc.safetensors")
    gen = seeded_reference_run(SEED)
    out = {}

    # --- norms -------------------------------------------------------------------------------
    cfg = make_config()
    x, rms, unweighted, gated, ln, gx, gz = make_norms(cfg, gen)
    with torch.no_grad():
        out.update({
            "norm.x": x,
            "norm.rms_weight": rms.weight.detach().clone(),
            "norm.rms_out": rms(x),
            "norm.unweighted_out": unweighted(x),
            "norm.gated_x": gx,
            "norm.gated_gate": gz,
            "norm.gated_weight": gated.weight.detach().clone(),
            "norm.gated_out": gated(gx, gz),
            "norm.ln_weight": ln.weight.detach().clone(),
            "norm.ln_bias": ln.bias.detach().clone(),
            "norm.ln_out": ln(x),
            "norm.l2_out": ref.l2norm(x, dim=-1, eps=1e-6),
        })

    # --- mHC ---------------------------------------------------------------------------------
    hc = ref.Glm5NextTextHyperConnection(cfg)
    randomise_hc(hc, gen)
    head = ref.Glm5NextTextHyperHead()
    streams = torch.randn(MHC_TOKENS, HC_MULT, HIDDEN, generator=gen)
    sub_out = torch.randn(MHC_TOKENS, HIDDEN, generator=gen)
    with torch.no_grad():
        post, comb, collapsed = hc(streams[None])
        post, comb, collapsed = post[0], comb[0], collapsed[0]
        # The stream update as Glm5NextTextDecoderLayer.forward writes it after each sub-layer.
        updated = post.unsqueeze(-1) * sub_out.unsqueeze(-2) + torch.matmul(
            comb.transpose(-1, -2), streams)
        out.update({
            "mhc.streams": streams,
            "mhc.fn": hc.fn.detach().clone(),
            "mhc.base": hc.base.detach().clone(),
            "mhc.scale": hc.scale.detach().clone(),
            "mhc.post": post,
            "mhc.comb": comb,
            "mhc.collapsed": collapsed,
            "mhc.sub_out": sub_out,
            "mhc.updated": updated,
            "mhc.head": head(streams[None])[0],
        })

    # --- KDA mixer ---------------------------------------------------------------------------
    attn = ref.Glm5NextTextLinearAttention(cfg, layer_idx=0).eval()
    randomise_kda(attn, gen)
    t = sum(KDA_DOCS)
    kx = torch.randn(t, HIDDEN, generator=gen)
    y, parts = run_kda_docs(attn, kx, KDA_DOCS,
                            ["conv_out", "g", "beta", "core", "recurrent", "normed"])
    kda_params(attn, "kda", out)
    out["kda.x"] = kx
    out["kda.cu_seqlens"] = cu_seqlens(KDA_DOCS)
    out["kda.y"] = y
    for k, v in parts.items():
        out[f"kda.{k}"] = v

    attn_sp = softplus_kda(attn, gen)
    y_sp, parts_sp = run_kda_docs(attn_sp, kx, KDA_DOCS, ["g"])
    out["kda_softplus.A_log"] = attn_sp.forget_gate.A_log.detach().clone()
    out["kda_softplus.dt_bias"] = attn_sp.forget_gate.dt_bias.detach().clone()
    out["kda_softplus.y"] = y_sp
    out["kda_softplus.g"] = parts_sp["g"]

    # --- one decoder layer: mHC around KDA and around an identity FFN --------------------------
    # The KDA weights are the ones stored under "kda.".
    layer = kda_decoder_layer(cfg, attn, gen)
    tl = sum(LAYER_DOCS)
    lx = torch.randn(tl, HC_MULT, HIDDEN, generator=gen)
    outs, start = [], 0
    for n in LAYER_DOCS:
        with torch.no_grad():
            h, _ = layer(lx[None, start:start + n], attention_mask=None)
        outs.append(h[0])
        start += n
    out["layer.streams"] = lx
    out["layer.cu_seqlens"] = cu_seqlens(LAYER_DOCS)
    out["layer.out"] = torch.cat(outs)
    for site in ("attn_hc", "ffn_hc"):
        hcm = getattr(layer, site)
        out[f"layer.{site}.fn"] = hcm.fn.detach().clone()
        out[f"layer.{site}.base"] = hcm.base.detach().clone()
        out[f"layer.{site}.scale"] = hcm.scale.detach().clone()
    out["layer.input_layernorm"] = layer.input_layernorm.weight.detach().clone()
    out["layer.post_attention_layernorm"] = layer.post_attention_layernorm.weight.detach().clone()

    assert_finite_and_nonzero(out)
    out = {k: v.contiguous() for k, v in out.items()}
    save_fixture(out, out_path, "glmtune_golden", {
        "generator": "tools/golden/ops_kda_mhc.py",
        "reference": "transformers 5.17.0 glm5_next, torch fallback (chunk_kimi_delta_attention)",
        "seed": SEED,
        "config": FIXTURE_CONFIG,
        "kda_docs": KDA_DOCS,
        "layer_docs": LAYER_DOCS,
    }, max_bytes=1_000_000)


if __name__ == "__main__":
    main()
