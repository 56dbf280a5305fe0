// The KDA mixer (ops/kda.h), composed from the leaf ops once for every device: f32 / f64 on the
// CPU, bf16 with f32 gates, norms and core inputs on a GPU (ops/dispatch.h).

#include <cmath>
#include <utility>

#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/fp8.h"
#include "glmtune/ops/grad.h"
#include "glmtune/ops/kda.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/norm.h"

namespace glmtune::ops {
namespace {

void expect_param(const Tensor& t, const Shape& shape, const Tensor& x, const char* name) {
  GLMTUNE_ASSERT(t.defined(), "kda_forward: parameter {} is missing", name);
  GLMTUNE_ASSERT(t.shape() == shape, "kda_forward: parameter {} is {}, expected {}", name, t.str(),
                 shape_str(shape));
  GLMTUNE_ASSERT(t.device() == x.device(), "kda_forward: parameter {} {} is not on x's device {}",
                 name, t.str(), x.device().str());
}

void check_params(const KdaParams& p, const Tensor& x, const KdaOptions& o) {
  GLMTUNE_ASSERT(x.defined() && x.dim() == 2, "kda_forward: x {} must be [T, D]",
                 x.defined() ? x.str() : "undefined");
  const int64_t d = x.size(1), nl = o.num_heads, hl = o.head_dim, ql = nl * hl;
  GLMTUNE_ASSERT(nl >= 1 && hl >= 1, "kda_forward: heads {} × head_dim {}", nl, hl);
  expect_param(p.q_proj.weight, {ql, d}, x, "q_proj.weight");
  expect_param(p.k_proj.weight, {ql, d}, x, "k_proj.weight");
  expect_param(p.v_proj.weight, {ql, d}, x, "v_proj.weight");
  GLMTUNE_ASSERT(p.conv1d.defined() && p.conv1d.size(0) == 3 * ql &&
                     (p.conv1d.dim() == 2 || (p.conv1d.dim() == 3 && p.conv1d.size(1) == 1)),
                 "kda_forward: conv1d.weight {} must be [{}, 1, Kc]",
                 p.conv1d.defined() ? p.conv1d.str() : "-", 3 * ql);
  expect_param(p.f_a_proj.weight, {hl, d}, x, "forget_gate.f_a_proj.weight");
  expect_param(p.f_b_proj.weight, {ql, hl}, x, "forget_gate.f_b_proj.weight");
  expect_param(p.dt_bias, {ql}, x, "forget_gate.dt_bias");
  expect_param(p.A_log, {nl}, x, "forget_gate.A_log");
  expect_param(p.b_proj.weight, {nl, d}, x, "b_proj.weight");
  expect_param(p.g_a_proj.weight, {hl, d}, x, "g_a_proj.weight");
  expect_param(p.g_b_proj.weight, {ql, hl}, x, "g_b_proj.weight");
  expect_param(p.o_norm, {hl}, x, "o_norm.weight");
  expect_param(p.o_proj.weight, {d, ql}, x, "o_proj.weight");
}

void expect_saved(const Tensor& t, const Shape& shape, const char* name) {
  GLMTUNE_ASSERT(t.defined() && t.shape() == shape,
                 "kda_backward: saved {} is {}, expected {} (run kda_forward with `saved` on the "
                 "same inputs)",
                 name, t.defined() ? t.str() : "missing", shape_str(shape));
}

void check_saved(const KdaSaved& s, const Tensor& x, const KdaOptions& o) {
  const int64_t t = x.size(0), nl = o.num_heads, hl = o.head_dim, ql = nl * hl;
  const Shape proj{t, ql}, heads{t, nl, hl}, per_head{t, nl};
  for (auto [tensor, name] : {std::pair{&s.q_conv_in, "q_conv_in"},
                              {&s.k_conv_in, "k_conv_in"},
                              {&s.v_conv_in, "v_conv_in"}})
    expect_saved(*tensor, proj, name);
  for (auto [tensor, name] : {std::pair{&s.q, "q"},
                              {&s.k, "k"},
                              {&s.v, "v"},
                              {&s.g, "g"},
                              {&s.core, "core"},
                              {&s.gate, "gate"},
                              {&s.normed, "normed"}})
    expect_saved(*tensor, heads, name);
  for (auto [tensor, name] :
       {std::pair{&s.q_norm, "q_norm"}, {&s.k_norm, "k_norm"}, {&s.beta, "beta"}})
    expect_saved(*tensor, per_head, name);
  if (x.device().is_cpu()) expect_saved(s.o_rstd, per_head, "o_rstd");
}

// The fused [3QL, Kc] conv weight in the activation dtype (the conv kernels read it so; a GPU
// keeps it in f32, model::is_fp32_kept). Depthwise channels are independent, so q, k and v use
// row slices of it rather than one concatenated projection.
Tensor conv_weight(const KdaParams& p, const Tensor& x, int64_t ql) {
  return p.conv1d.to(x.dtype()).reshape({3 * ql, p.conv1d.size(-1)});
}

}  // namespace

Tensor kda_forward(const KdaParams& p, const Tensor& x, const Tensor& cu_seqlens,
                   const KdaOptions& o, KdaSaved* saved) {
  GLMTUNE_TIME_OP("kda_forward", x);
  check_params(p, x, o);
  const int64_t t = x.size(0), nl = o.num_heads, hl = o.head_dim, ql = nl * hl;
  const Tensor cu = cu_seqlens_for(cu_seqlens, x);

  const Tensor conv_w = conv_weight(p, x, ql);
  const Fp8InputShare share(x);  // six projections read x
  Tensor q_in = linear(x, p.q_proj), k_in = linear(x, p.k_proj), v_in = linear(x, p.v_proj);
  // The reference normalises q and k inside its kernel, in fp32, after the conv output was
  // rounded to the activation dtype (kda_qk_conv does the same); the core scales q by HL^-1/2.
  Tensor q_norm, k_norm;
  Tensor q = kda_qk_conv(q_in, conv_w.slice(0, 0, ql), cu, hl, o.l2_eps, &q_norm);
  Tensor k = kda_qk_conv(k_in, conv_w.slice(0, ql, 2 * ql), cu, hl, o.l2_eps, &k_norm);
  Tensor v = causal_conv1d(v_in, conv_w.slice(0, 2 * ql, 3 * ql), cu, true).view({t, nl, hl});

  Tensor g = kda_gate(linear(linear(x, p.f_a_proj), p.f_b_proj), p.dt_bias, p.A_log, o.lower_bound);
  Tensor beta = kda_beta(linear(x, p.b_proj));

  const double scale = 1.0 / std::sqrt(double(hl));
  Tensor core = o.core == KdaCore::chunked ? kda_chunked(q, k, v, g, beta, cu, scale, o.chunk_size)
                                           : kda_recurrent(q, k, v, g, beta, cu, scale);

  Tensor gate = linear(linear(x, p.g_a_proj), p.g_b_proj).view({t, nl, hl});
  Tensor o_rstd;
  Tensor normed = rms_norm_gated(core, p.o_norm, gate, o.rms_eps, GateActivation::sigmoid, &o_rstd);
  Tensor y = linear(normed.view({t, ql}), p.o_proj);

  if (saved) {
    *saved = KdaSaved{};
    saved->q_conv_in = std::move(q_in);
    saved->k_conv_in = std::move(k_in);
    saved->v_conv_in = std::move(v_in);
    saved->q = std::move(q);
    saved->k = std::move(k);
    saved->v = std::move(v);
    saved->q_norm = std::move(q_norm);
    saved->k_norm = std::move(k_norm);
    saved->g = std::move(g);
    saved->beta = std::move(beta);
    saved->core = std::move(core);
    saved->gate = std::move(gate);
    saved->normed = std::move(normed);
    saved->o_rstd = std::move(o_rstd);
  }
  return y;
}

Tensor kda_backward(const KdaParams& p, const Tensor& x, const Tensor& cu_seqlens,
                    const KdaOptions& o, const KdaSaved* saved, const Tensor& dy, KdaGrads& grads) {
  GLMTUNE_TIME_OP("kda_backward", x);
  const char* op = "kda_backward";
  GLMTUNE_ASSERT(x.defined() && x.dim() == 2 && dy.defined() && dy.shape() == x.shape() &&
                     dy.dtype() == x.dtype() && dy.device() == x.device(),
                 "{}: dy {} must match x {} ([T, D])", op, dy.defined() ? dy.str() : "undefined",
                 x.defined() ? x.str() : "undefined");
  // Without saved intermediates the forward is rerun; it also validates every parameter.
  KdaSaved fresh;
  if (!saved) {
    kda_forward(p, x, cu_seqlens, o, &fresh);
    saved = &fresh;
  } else {
    check_params(p, x, o);
    check_saved(*saved, x, o);
  }
  const KdaSaved& s = *saved;
  const int64_t t = x.size(0), nl = o.num_heads, hl = o.head_dim, ql = nl * hl;
  const Tensor cu = cu_seqlens_for(cu_seqlens, x);

  // y = normed · Wo^T, then the gated o_norm per head.
  const Tensor d_normed =
      linear_backward(dy, s.normed.reshape({t, ql}), p.o_proj, &grads.o_proj).view({t, nl, hl});
  const RmsNormGatedGrads dn =
      rms_norm_gated_backward(d_normed, s.core, p.o_norm, s.gate, o.rms_eps,
                              GateActivation::sigmoid, s.o_rstd, &grads.o_norm);
  // gate = g_b(g_a(x)); g_a(x) is HL wide and recomputed. Every projection of x adds its term to
  // dx, summed in gradient_sum_dtype and rounded once at the end.
  const Fp8InputShare share(x);
  Tensor dx;
  const Tensor ga = linear(x, p.g_a_proj);
  const Tensor d_ga = linear_backward(dn.dgate.reshape({t, ql}), ga, p.g_b_proj, &grads.g_b_proj);
  linear_backward_add(dx, d_ga, x, p.g_a_proj, &grads.g_a_proj);

  const double scale = 1.0 / std::sqrt(double(hl));
  const KdaCoreGrads dc =
      kda_chunked_backward(s.q, s.k, s.v, s.g, s.beta, cu, scale, dn.dx, o.chunk_size);

  // β = σ(x Wb^T); the logit gradient is rounded to the activation dtype for the GEMMs, as
  // autograd in bf16 does.
  linear_backward_add(dx, kda_beta_backward(s.beta, dc.dbeta).to(x.dtype()), x, p.b_proj,
                      &grads.b_proj);

  // g = gate(f_b(f_a(x)) + dt_bias, A_log); the two narrow projections are recomputed.
  {
    const Tensor fa = linear(x, p.f_a_proj);
    const Tensor graw = linear(fa, p.f_b_proj);
    const Tensor dz = kda_gate_backward(graw, p.dt_bias, p.A_log, o.lower_bound, dc.dg,
                                        &grads.dt_bias, &grads.A_log);
    const Tensor d_fa = linear_backward(dz, fa, p.f_b_proj, &grads.f_b_proj);
    linear_backward_add(dx, d_fa, x, p.f_a_proj, &grads.f_a_proj);
  }

  // q and k through their L2 norm, SiLU and conv, v through SiLU and conv, then the projections;
  // the fused conv weight's gradient is written through row slices of one [3QL, Kc] view.
  Tensor* gconv = grad_if_trained(grads.conv1d, p.conv1d);
  const Tensor conv_w = conv_weight(p, x, ql);
  const Tensor gconv2 =
      gconv ? grad_buffer(*gconv, p.conv1d, op, "conv1d").view({3 * ql, conv_w.size(1)}) : Tensor();
  const Linear* projs[3] = {&p.q_proj, &p.k_proj, &p.v_proj};
  Linear* grad_projs[3] = {&grads.q_proj, &grads.k_proj, &grads.v_proj};
  const Tensor* conv_ins[3] = {&s.q_conv_in, &s.k_conv_in, &s.v_conv_in};
  for (int64_t i = 0; i < 3; ++i) {
    Tensor gslice = gconv ? gconv2.slice(0, i * ql, (i + 1) * ql) : Tensor();
    Tensor* gw = gconv ? &gslice : nullptr;
    const Tensor w = conv_w.slice(0, i * ql, (i + 1) * ql);
    const Tensor d_in =
        i == 2 ? causal_conv1d_backward(*conv_ins[i], w, cu, true, dc.dv.reshape({t, ql}), gw)
               : kda_qk_conv_backward(*conv_ins[i], w, cu, hl, o.l2_eps,
                                      i == 0 ? s.q_norm : s.k_norm, i == 0 ? dc.dq : dc.dk, gw);
    linear_backward_add(dx, d_in, x, *projs[i], grad_projs[i]);
  }
  return dx.to(x.dtype());
}

}  // namespace glmtune::ops
