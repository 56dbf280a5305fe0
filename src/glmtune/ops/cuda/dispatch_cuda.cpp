// The CUDA paths of the dense ops (ops/cuda/dispatch.h), composed from the kernels in ops/cuda/.

#include <cuda_runtime.h>

#include <cmath>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/ops/cuda/cross_entropy.h"
#include "glmtune/ops/cuda/dispatch.h"
#include "glmtune/ops/cuda/embedding.h"
#include "glmtune/ops/cuda/gemm.h"
#include "glmtune/ops/cuda/indexer.h"
#include "glmtune/ops/cuda/kda.h"
#include "glmtune/ops/cuda/mhc.h"
#include "glmtune/ops/cuda/mla.h"
#include "glmtune/ops/cuda/moe.h"
#include "glmtune/ops/cuda/norm.h"
#include "glmtune/ops/cuda/streams.h"
#include "glmtune/ops/cuda/swiglu.h"
#include "glmtune/ops/grad.h"
#include "glmtune/tensor/cuda_check.h"

namespace glmtune::ops::cuda_path {
namespace {

// The gradient buffer of a parameter: an undefined slot becomes f32 zeros shaped like it, on its
// device; a defined one must match the parameter's shape and device.
Tensor& grad_slot(Tensor* slot, const Tensor& param, const char* op, const char* what) {
  if (!slot->defined()) *slot = Tensor::zeros(param.shape(), DType::f32, param.device());
  GLMTUNE_ASSERT(
      slot->shape() == param.shape() && slot->device() == param.device() && slot->is_contiguous(),
      "{}: the {} gradient {} must be contiguous and shaped like {} on {}", op, what, slot->str(),
      param.str(), param.device().str());
  return *slot;
}

// grad_slot for a trained parameter; nullptr (no buffer, no gradient) for a null slot or a
// frozen parameter.
Tensor* trained_slot(Tensor* slot, const Tensor& param, const char* op, const char* what) {
  return grad_if_trained(slot, param) ? &grad_slot(slot, param, op, what) : nullptr;
}

// The f32 form the kernels take for small parameters (mHC mixing, KDA gate and norm weights)
// whatever dtype the model stores them in; free when they already are f32. Frozen like `t`.
Tensor as_f32(const Tensor& t) {
  if (!t.defined() || t.dtype() == DType::f32) return t;
  Tensor f = t.to(DType::f32);
  f.set_frozen(t.frozen());
  return f;
}

// cu_seqlens as the kernels take them: int32 on the device.
Tensor device_cu_seqlens(const Tensor& cu, Device device) {
  GLMTUNE_ASSERT(cu.defined() && cu.dim() == 1 && cu.size(0) >= 2,
                 "cu_seqlens must be [ndoc + 1], got {}", cu.defined() ? cu.str() : "undefined");
  if (cu.dtype() == DType::i32 && cu.device() == device) return cu;
  return cu.to(Device::cpu()).to(DType::i32).to(device);
}

// Backward of y = x Wᵀ into an f32 dx: dW += dyᵀ x, then dx = dy W (added to dx with
// `accumulate`). Summing the mixer's several input-gradient products in f32 and rounding once
// keeps dx as close to the reference as one bf16 rounding allows.
void linear_backward_into(Tensor& dx32, bool accumulate, const Tensor& dy, const Tensor& x,
                          const Tensor& weight, Tensor* grad_weight, const char* op) {
  if (Tensor* g = trained_slot(grad_weight, weight, op, "projection"))
    cuda::linear_backward_weight(*g, dy, x);
  cuda::linear_backward_input_out(dx32, dy, weight, accumulate);
}

// ---- Op timing -----------------------------------------------------------------------------

struct TimedOp {
  const char* name;
  cudaEvent_t start, stop;
};
bool g_timing = false;
std::vector<TimedOp> g_timed;
thread_local int g_depth = 0;

// Times the enclosing function when timing is on and no other timed op is running.
class OpTimer {
 public:
  explicit OpTimer(const char* name) : outermost_(g_timing && g_depth == 0) {
    ++g_depth;
    if (!outermost_) return;
    op_.name = name;
    GLMTUNE_CUDA_CHECK(cudaEventCreate(&op_.start));
    GLMTUNE_CUDA_CHECK(cudaEventCreate(&op_.stop));
    GLMTUNE_CUDA_CHECK(cudaEventRecord(op_.start));
  }
  ~OpTimer() {
    --g_depth;
    if (!outermost_) return;
    cudaEventRecord(op_.stop);
    g_timed.push_back(op_);
  }
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

 private:
  bool outermost_;
  TimedOp op_{};
};

}  // namespace

void enable_op_timing(bool on) { g_timing = on; }

std::map<std::string, double> take_op_times() {
  std::map<std::string, double> ms;
  for (const TimedOp& op : g_timed) {
    GLMTUNE_CUDA_CHECK(cudaEventSynchronize(op.stop));
    float t = 0;
    GLMTUNE_CUDA_CHECK(cudaEventElapsedTime(&t, op.start, op.stop));
    ms[op.name] += double(t);
    cudaEventDestroy(op.start);
    cudaEventDestroy(op.stop);
  }
  g_timed.clear();
  return ms;
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  OpTimer timer("linear");
  return cuda::linear(x, weight, bias);
}

void linear_out(Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias,
                bool accumulate) {
  OpTimer timer("linear_out");
  cuda::linear_out(out, x, weight, bias, accumulate);
}

Tensor linear_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, Tensor* grad_weight,
                       Tensor* grad_bias, bool need_input_grad) {
  OpTimer timer("linear_backward");
  grad_weight = grad_if_trained(grad_weight, weight);
  if (grad_weight)
    cuda::linear_backward_weight(grad_slot(grad_weight, weight, "linear_backward", "weight"), dy,
                                 x);
  if (grad_bias) {
    const Tensor bias_shape = Tensor::empty({weight.size(0)}, DType::f32, weight.device());
    cuda::linear_backward_bias(grad_slot(grad_bias, bias_shape, "linear_backward", "bias"), dy);
  }
  if (!need_input_grad) return Tensor();
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
  cuda::linear_backward_input_out(dx, dy, weight);
  return dx;
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps, Tensor* rstd) {
  OpTimer timer("rms_norm");
  return cuda::rms_norm(x, weight, eps, rstd);
}

Tensor rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, double eps,
                         const Tensor& rstd, Tensor* grad_weight) {
  OpTimer timer("rms_norm_backward");
  grad_weight = grad_if_trained(grad_weight, weight);
  if (grad_weight) grad_slot(grad_weight, weight, "rms_norm_backward", "weight");
  return cuda::rms_norm_backward(dy, x, weight, eps, rstd, grad_weight);
}

Tensor swiglu_clamped(const Tensor& gate, const Tensor& up, double limit) {
  OpTimer timer("swiglu_clamped");
  return cuda::swiglu_clamped(gate, up, limit);
}

void swiglu_clamped_backward(const Tensor& gate, const Tensor& up, const Tensor& dout, double limit,
                             Tensor& dgate, Tensor& dup) {
  OpTimer timer("swiglu_clamped_backward");
  if (!dgate.defined()) dgate = Tensor::empty(gate.shape(), gate.dtype(), gate.device());
  if (!dup.defined()) dup = Tensor::empty(gate.shape(), gate.dtype(), gate.device());
  cuda::swiglu_clamped_backward(gate, up, dout, limit, dgate, dup);
}

Tensor mlp_forward(const MlpParams& params, const Tensor& x, double swiglu_limit, MlpContext* ctx) {
  OpTimer timer("mlp_forward");
  Tensor gate = cuda::linear(x, params.gate_proj);
  Tensor up = cuda::linear(x, params.up_proj);
  Tensor y = cuda::linear(cuda::swiglu_clamped(gate, up, swiglu_limit), params.down_proj);
  if (ctx) *ctx = {x, std::move(gate), std::move(up)};
  return y;
}

Tensor mlp_backward(const MlpParams& params, const MlpContext& ctx, const Tensor& dy,
                    double swiglu_limit, MlpParams& grads) {
  OpTimer timer("mlp_backward");
  // The activation is recomputed from the saved projections, as on the CPU.
  const Tensor act = cuda::swiglu_clamped(ctx.gate, ctx.up, swiglu_limit);
  if (Tensor* g = trained_slot(&grads.down_proj, params.down_proj, "mlp_backward", "down"))
    cuda::linear_backward_weight(*g, dy, act);
  const Tensor d_act = cuda::linear_backward_input(dy, params.down_proj);
  Tensor d_gate = Tensor::empty(ctx.gate.shape(), ctx.gate.dtype(), dy.device());
  Tensor d_up = Tensor::empty(ctx.up.shape(), ctx.up.dtype(), dy.device());
  cuda::swiglu_clamped_backward(ctx.gate, ctx.up, d_act, swiglu_limit, d_gate, d_up);
  if (Tensor* g = trained_slot(&grads.gate_proj, params.gate_proj, "mlp_backward", "gate"))
    cuda::linear_backward_weight(*g, d_gate, ctx.x);
  if (Tensor* g = trained_slot(&grads.up_proj, params.up_proj, "mlp_backward", "up"))
    cuda::linear_backward_weight(*g, d_up, ctx.x);
  // dx = d_gate Wg + d_up Wu, the second product accumulated in f32 inside the GEMM and rounded
  // once: a bf16 dx of the first would round twice.
  Tensor dx32 = Tensor::empty(ctx.x.shape(), DType::f32, dy.device());
  cuda::linear_backward_input_out(dx32, d_gate, params.gate_proj);
  cuda::linear_backward_input_out(dx32, d_up, params.up_proj, /*accumulate=*/true);
  return dx32.to(ctx.x.dtype());
}

Tensor embedding_forward(const Tensor& table, const Tensor& ids) {
  OpTimer timer("embedding_forward");
  return cuda::embedding_forward(table, ids);
}

void embedding_backward(const Tensor& table, const Tensor& ids, const Tensor& dout,
                        std::optional<int64_t> padding_idx, Tensor& dtable) {
  OpTimer timer("embedding_backward");
  if (table.frozen()) return;
  grad_slot(&dtable, table, "embedding_backward", "table");
  const cuda::EmbeddingGradPlan plan =
      cuda::make_embedding_grad_plan(ids, table.size(0), padding_idx, table.device());
  cuda::embedding_backward(plan, dout.contiguous(), dtable);
}

CrossEntropyResult lm_head_cross_entropy(const Tensor& hidden, const Tensor& weight,
                                         const Tensor& labels, const CrossEntropyOptions& opts,
                                         Tensor* dhidden, Tensor* dweight) {
  OpTimer timer("lm_head_cross_entropy");
  dweight = grad_if_trained(dweight, weight);
  if (dweight) grad_slot(dweight, weight, "lm_head_cross_entropy", "head weight");
  return cuda::lm_head_cross_entropy(hidden, weight, labels, opts, dhidden, dweight);
}

MhcPreResult mhc_pre(const Tensor& streams, const Tensor& fn, const Tensor& base,
                     const Tensor& scale, const MhcOptions& options, MhcPreSaved* saved) {
  OpTimer timer("mhc_pre");
  return cuda::mhc_pre(streams, as_f32(fn), as_f32(base), as_f32(scale), options, saved);
}

Tensor mhc_pre_backward(const Tensor& streams, const Tensor& fn, const Tensor& base,
                        const Tensor& scale, const MhcOptions& options, const MhcPreSaved* saved,
                        const Tensor& d_post, const Tensor& d_comb, const Tensor& d_collapsed,
                        MhcGrads& grads) {
  OpTimer timer("mhc_pre_backward");
  return cuda::mhc_pre_backward(streams, as_f32(fn), as_f32(base), as_f32(scale), options, saved,
                                d_post, d_comb, d_collapsed, grads);
}

Tensor mhc_post(const Tensor& streams, const Tensor& y, const Tensor& post, const Tensor& comb) {
  OpTimer timer("mhc_post");
  return cuda::mhc_post(streams, y, post, comb);
}

MhcPostGrads mhc_post_backward(const Tensor& streams, const Tensor& y, const Tensor& post,
                               const Tensor& comb, const Tensor& d_out) {
  OpTimer timer("mhc_post_backward");
  return cuda::mhc_post_backward(streams, y, post, comb, d_out);
}

Tensor mhc_expand(const Tensor& x, int64_t hc_mult) {
  OpTimer timer("mhc_expand");
  return cuda::broadcast_streams(x.contiguous(), hc_mult, 1.0f);
}

Tensor mhc_head(const Tensor& streams) {
  OpTimer timer("mhc_head");
  return cuda::reduce_streams(streams.contiguous(), 1.0f / float(streams.size(-2)));
}

Tensor mhc_expand_backward(const Tensor& d_streams) {
  OpTimer timer("mhc_expand_backward");
  return cuda::reduce_streams(d_streams.contiguous(), 1.0f);
}

Tensor mhc_head_backward(const Tensor& d_out, int64_t hc_mult) {
  OpTimer timer("mhc_head_backward");
  return cuda::broadcast_streams(d_out.contiguous(), hc_mult, 1.0f / float(hc_mult));
}

Tensor kda_forward(const KdaParams& p, const Tensor& x, const Tensor& cu_seqlens,
                   const KdaOptions& o, KdaSaved* saved) {
  OpTimer timer("kda_forward");
  GLMTUNE_ASSERT(x.dim() == 2, "kda_forward: x {} must be [T, D]", x.str());
  GLMTUNE_ASSERT(o.core == KdaCore::chunked,
                 "kda_forward: the GPU runs the chunked delta rule only (KdaOptions::core)");
  const int64_t t = x.size(0), nl = o.num_heads, hl = o.head_dim, ql = nl * hl;
  const Tensor cu = device_cu_seqlens(cu_seqlens, x.device());
  // The depthwise conv channels are independent: the fused [3QL, Kc] weight is used in slices.
  // The conv weight is kept in f32 (model::is_fp32_kept); the conv kernel reads it in the
  // activation dtype.
  const int64_t kc = p.conv1d.size(-1);
  const Tensor conv_w = p.conv1d.to(x.dtype()).reshape({3 * ql, kc});
  Tensor q_in = cuda::linear(x, p.q_proj), k_in = cuda::linear(x, p.k_proj),
         v_in = cuda::linear(x, p.v_proj);
  Tensor q = cuda::causal_conv1d(q_in, conv_w.slice(0, 0, ql), cu, true).view({t, nl, hl});
  Tensor k = cuda::causal_conv1d(k_in, conv_w.slice(0, ql, 2 * ql), cu, true).view({t, nl, hl});
  Tensor v = cuda::causal_conv1d(v_in, conv_w.slice(0, 2 * ql, 3 * ql), cu, true).view({t, nl, hl});
  Tensor g = cuda::kda_gate(cuda::linear(cuda::linear(x, p.f_a_proj), p.f_b_proj),
                            as_f32(p.dt_bias), as_f32(p.A_log), o.lower_bound);
  Tensor beta = cuda::kda_beta(cuda::linear(x, p.b_proj));
  Tensor q_norm, k_norm;
  const Tensor qn = cuda::l2_norm(q, o.l2_eps, &q_norm), kn = cuda::l2_norm(k, o.l2_eps, &k_norm);
  const double scale = 1.0 / std::sqrt(double(hl));
  Tensor core = cuda::kda_chunked(qn, kn, v, g, beta, cu, scale);
  Tensor gate = cuda::linear(cuda::linear(x, p.g_a_proj), p.g_b_proj).view({t, nl, hl});
  Tensor normed = cuda::rms_norm_gated(core, as_f32(p.o_norm), gate, o.rms_eps);
  Tensor y = cuda::linear(normed.view({t, ql}), p.o_proj);
  if (saved) {
    *saved = KdaSaved{};
    saved->q_conv_in = q_in;
    saved->k_conv_in = k_in;
    saved->v_conv_in = v_in;
    saved->q = q;
    saved->k = k;
    saved->v = v;
    saved->q_norm = q_norm;
    saved->k_norm = k_norm;
    saved->g = g;
    saved->beta = beta;
    saved->core = core;
    saved->gate = gate;
    saved->normed = normed;
  }
  return y;
}

Tensor kda_backward(const KdaParams& p, const Tensor& x, const Tensor& cu_seqlens,
                    const KdaOptions& o, const KdaSaved* saved, const Tensor& dy, KdaGrads& grads) {
  OpTimer timer("kda_backward");
  const char* op = "kda_backward";
  GLMTUNE_ASSERT(x.dim() == 2 && dy.shape() == x.shape(), "{}: dy {} must match x {} ([T, D])", op,
                 dy.str(), x.str());
  const int64_t t = x.size(0), nl = o.num_heads, hl = o.head_dim, ql = nl * hl;
  KdaSaved fresh;
  if (!saved) {
    cuda_path::kda_forward(p, x, cu_seqlens, o, &fresh);
    saved = &fresh;
  }
  const KdaSaved& s = *saved;
  const Tensor cu = device_cu_seqlens(cu_seqlens, x.device());

  // y = normed · Wo^T, then the gated o_norm per head.
  const Tensor d_normed = cuda_path::linear_backward(dy, s.normed.reshape({t, ql}), p.o_proj,
                                                     &grads.o_proj, nullptr, true)
                              .view({t, nl, hl});
  const RmsNormGatedGrads dn =
      cuda::rms_norm_gated_backward(d_normed, s.core, as_f32(p.o_norm), s.gate, o.rms_eps,
                                    trained_slot(&grads.o_norm, p.o_norm, op, "o_norm"));
  // gate = g_b(g_a(x)); g_a(x) is HL wide and recomputed.
  Tensor dx32 = Tensor::empty(x.shape(), DType::f32, x.device());
  const Tensor ga = cuda::linear(x, p.g_a_proj);
  const Tensor d_ga = cuda_path::linear_backward(dn.dgate.reshape({t, ql}), ga, p.g_b_proj,
                                                 &grads.g_b_proj, nullptr, true);
  linear_backward_into(dx32, false, d_ga, x, p.g_a_proj, &grads.g_a_proj, op);

  // The core on q, k normalised again by the same kernel the forward ran.
  const Tensor qn = cuda::l2_norm(s.q, o.l2_eps), kn = cuda::l2_norm(s.k, o.l2_eps);
  const double scale = 1.0 / std::sqrt(double(hl));
  const KdaCoreGrads dc = cuda::kda_chunked_backward(qn, kn, s.v, s.g, s.beta, cu, scale, dn.dx);

  // β = σ(x Wb^T); the logit gradient is rounded to bf16 for the GEMMs, as autograd in bf16 does.
  const Tensor d_logit = cuda::kda_beta_backward(s.beta, dc.dbeta).to(x.dtype());
  linear_backward_into(dx32, true, d_logit, x, p.b_proj, &grads.b_proj, op);

  // g = gate(f_b(f_a(x)) + dt_bias, A_log); the two narrow projections are recomputed.
  {
    const Tensor fa = cuda::linear(x, p.f_a_proj);
    const Tensor graw = cuda::linear(fa, p.f_b_proj);
    const Tensor dz =
        cuda::kda_gate_backward(graw, as_f32(p.dt_bias), as_f32(p.A_log), o.lower_bound, dc.dg,
                                trained_slot(&grads.dt_bias, p.dt_bias, op, "dt_bias"),
                                trained_slot(&grads.A_log, p.A_log, op, "A_log"));
    const Tensor d_fa =
        cuda_path::linear_backward(dz, fa, p.f_b_proj, &grads.f_b_proj, nullptr, true);
    linear_backward_into(dx32, true, d_fa, x, p.f_a_proj, &grads.f_a_proj, op);
  }

  // q, k through their L2 norm, then q, k, v through SiLU + conv and the projections; the fused
  // conv weight's gradient is written through row slices of one [3QL, Kc] view.
  Tensor* gconv = trained_slot(&grads.conv1d, p.conv1d, op, "conv1d");
  const int64_t kc = p.conv1d.size(-1);
  const Tensor conv_w = p.conv1d.to(x.dtype()).reshape({3 * ql, kc});
  Tensor gconv2 = gconv ? gconv->view({3 * ql, kc}) : Tensor();
  const Tensor dq = cuda::l2_norm_backward(dc.dq, s.q, o.l2_eps);
  const Tensor dk = cuda::l2_norm_backward(dc.dk, s.k, o.l2_eps);
  const Tensor* conv_in[3] = {&s.q_conv_in, &s.k_conv_in, &s.v_conv_in};
  const Tensor d_out[3] = {dq.reshape({t, ql}), dk.reshape({t, ql}), dc.dv.reshape({t, ql})};
  const Tensor* proj[3] = {&p.q_proj, &p.k_proj, &p.v_proj};
  Tensor* grad_proj[3] = {&grads.q_proj, &grads.k_proj, &grads.v_proj};
  for (int64_t i = 0; i < 3; ++i) {
    Tensor gslice = gconv ? gconv2.slice(0, i * ql, (i + 1) * ql) : Tensor();
    const Tensor d_in =
        cuda::causal_conv1d_backward(*conv_in[i], conv_w.slice(0, i * ql, (i + 1) * ql), cu, true,
                                     d_out[i], gconv ? &gslice : nullptr);
    linear_backward_into(dx32, true, d_in, x, *proj[i], grad_proj[i], op);
  }
  return dx32.to(x.dtype());
}

Tensor indexer_forward(const IndexerConfig& cfg, const IndexerParams& params, const Tensor& x,
                       const Tensor& q_resid, const Tensor& cu_seqlens) {
  OpTimer timer("indexer_forward");
  return cuda::indexer_forward(cfg, params, x, q_resid, cu_seqlens.to(Device::cpu()));
}

namespace {

// [T, NH, Dn + Dv] → k [T, NH, Dn], v [T, NH, Dv], each contiguous (the attention kernels read
// whole head rows).
void split_kv(const Tensor& kv, int64_t dn, int64_t dv, MlaProjections& p) {
  p.k = kv.narrow(2, 0, dn).contiguous();
  p.v = kv.narrow(2, dn, dv).contiguous();
}

Tensor* bias_grad(const Tensor& bias, Tensor& grad) {
  return bias.defined() ? grad_if_trained(grad, bias) : nullptr;
}

// The absorbed-latent attention (ops/cuda/mla.h) covers the released shape in bf16: Rkv = 512 and
// at most 64 heads. Anything else keeps the per-head path, and so does the fp32 mode: the absorbed
// kernels are bf16 tensor-core MMAs, while the per-head path is exact fp32 like the CPU op (and
// equal to the absorbed form in real arithmetic).
bool use_absorbed(const MlaConfig& cfg, DType dtype) {
  return dtype == DType::bf16 && cfg.kv_lora_rank == 512 && cfg.n_heads <= 64;
}

// Per-head products with kv_b_proj's factors, W_kb[h] = rows h·(Dn+Dv) .. +Dn and W_vb[h] = the
// Dv rows after them, each [D, Rkv]; `a` and `c` are head-interleaved [T, NH, ·] buffers.
//   absorb:   c[:, h] = a[:, h] · W[h]          ([T, D] → [T, Rkv])
//   expand:   c[:, h] = a[:, h] · W[h]ᵀ         ([T, Rkv] → [T, D])
//   grad:     g[h] += a[:, h]ᵀ · b[:, h]        (f32 [D, Rkv] rows of kv_b_proj's gradient)
struct KvbHeads {
  const MlaConfig& cfg;
  const Tensor& kvb;  // bf16 [NH·(Dn+Dv), Rkv]
  int64_t tokens;

  const char* row(bool value_rows, int64_t h) const {
    const int64_t r =
        h * (cfg.qk_nope_head_dim + cfg.v_head_dim) + (value_rows ? cfg.qk_nope_head_dim : 0);
    return static_cast<const char*>(kvb.data_ptr()) + r * cfg.kv_lora_rank * 2;
  }
  int64_t dim(bool value_rows) const { return value_rows ? cfg.v_head_dim : cfg.qk_nope_head_dim; }
  void absorb(bool value_rows, const Tensor& a, Tensor& c) const {
    if (tokens == 0) return;
    const int64_t nh = cfg.n_heads, d = dim(value_rows), r = cfg.kv_lora_rank;
    for (int64_t h = 0; h < nh; ++h)
      cuda::gemm({a.device().index, false, false, tokens, r, d,
                  static_cast<const char*>(a.data_ptr()) + h * d * 2, nh * d, row(value_rows, h), r,
                  static_cast<char*>(c.data_ptr()) + h * r * 2, nh * r, DType::bf16});
  }
  void expand(bool value_rows, const Tensor& a, Tensor& c) const {
    if (tokens == 0) return;
    const int64_t nh = cfg.n_heads, d = dim(value_rows), r = cfg.kv_lora_rank;
    for (int64_t h = 0; h < nh; ++h)
      cuda::gemm({a.device().index, false, true, tokens, d, r,
                  static_cast<const char*>(a.data_ptr()) + h * r * 2, nh * r, row(value_rows, h), r,
                  static_cast<char*>(c.data_ptr()) + h * d * 2, nh * d, DType::bf16});
  }
  void grad(bool value_rows, const Tensor& a, const Tensor& b, Tensor& g) const {
    if (tokens == 0) return;
    const int64_t nh = cfg.n_heads, d = dim(value_rows), r = cfg.kv_lora_rank;
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t grow =
          h * (cfg.qk_nope_head_dim + cfg.v_head_dim) + (value_rows ? cfg.qk_nope_head_dim : 0);
      cuda::gemm({a.device().index, true, false, d, r, tokens,
                  static_cast<const char*>(a.data_ptr()) + h * d * 2, nh * d,
                  static_cast<const char*>(b.data_ptr()) + h * r * 2, nh * r,
                  g.data<float>() + grow * r, r, DType::f32, 1.0f, 1.0f});
    }
  }
};

}  // namespace

MlaProjections mla_project(const MlaConfig& cfg, const MlaParams& params, const Tensor& x) {
  OpTimer timer("mla_project");
  const int64_t tokens = x.size(0), nh = cfg.n_heads, dn = cfg.qk_nope_head_dim,
                dv = cfg.v_head_dim;
  MlaProjections p;
  p.q_resid = cuda::rms_norm(cuda::linear(x, params.q_a_proj, params.q_a_proj_bias),
                             params.q_a_layernorm, cfg.rms_norm_eps);
  p.q = cuda::linear(p.q_resid, params.q_b_proj).view({tokens, nh, dn});
  const Tensor latent =
      cuda::rms_norm(cuda::linear(x, params.kv_a_proj_with_mqa, params.kv_a_proj_with_mqa_bias),
                     params.kv_a_layernorm, cfg.rms_norm_eps);
  split_kv(cuda::linear(latent, params.kv_b_proj).view({tokens, nh, dn + dv}), dn, dv, p);
  return p;
}

Tensor sparse_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& indices,
                        const Tensor& cu_seqlens, double scale) {
  OpTimer timer("sparse_attention");
  const cuda::SparseKeySets sets =
      cuda::sparse_key_sets(indices, cu_seqlens.to(Device::cpu()), /*key_major=*/false);
  return cuda::sparse_attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), sets, scale)
      .out;
}

AttentionGrads sparse_attention_backward(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                         const Tensor& indices, const Tensor& cu_seqlens,
                                         double scale, const Tensor& dout) {
  OpTimer timer("sparse_attention_backward");
  const Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const cuda::SparseKeySets sets =
      cuda::sparse_key_sets(indices, cu_seqlens.to(Device::cpu()), /*key_major=*/true);
  const cuda::SparseAttentionOutput fwd = cuda::sparse_attention_forward(q, k, v, sets, scale);
  return cuda::sparse_attention_backward(q, k, v, fwd.out, fwd.lse, sets, scale, dout.contiguous());
}

MlaOutput mla_forward(const MlaConfig& cfg, const MlaParams& params, const Tensor& x,
                      const Tensor& indices, const Tensor& cu_seqlens, MlaContext* ctx) {
  OpTimer timer("mla_forward");
  const int64_t tokens = x.size(0), nh = cfg.n_heads, dn = cfg.qk_nope_head_dim,
                dv = cfg.v_head_dim;
  MlaContext local;
  MlaContext& c = ctx ? *ctx : local;
  c.x = x;
  MlaOutput out;
  c.q_a = cuda::linear(x, params.q_a_proj, params.q_a_proj_bias);
  out.proj.q_resid = cuda::rms_norm(c.q_a, params.q_a_layernorm, cfg.rms_norm_eps, &c.q_rstd);
  out.proj.q = cuda::linear(out.proj.q_resid, params.q_b_proj).view({tokens, nh, dn});
  c.kv_a = cuda::linear(x, params.kv_a_proj_with_mqa, params.kv_a_proj_with_mqa_bias);
  c.latent = cuda::rms_norm(c.kv_a, params.kv_a_layernorm, cfg.rms_norm_eps, &c.kv_rstd);
  c.attn_latent = Tensor();
  c.attn_lse2 = Tensor();
  if (use_absorbed(cfg, x.dtype())) {
    // Attention on the latent: q_abs = W_kbᵀ q per head, then o = W_vb o_lat.
    GLMTUNE_ASSERT(params.kv_b_proj.dtype() == DType::bf16 && params.kv_b_proj.is_contiguous(),
                   "mla_forward: kv_b_proj must be contiguous bf16 on the GPU, got {}",
                   params.kv_b_proj.str());
    const KvbHeads kvb{cfg, params.kv_b_proj, tokens};
    Tensor q_abs = Tensor::empty({tokens, nh, cfg.kv_lora_rank}, DType::bf16, x.device());
    kvb.absorb(false, out.proj.q, q_abs);
    const cuda::SparseKeySets sets =
        cuda::sparse_key_sets(indices, cu_seqlens.to(Device::cpu()), /*key_major=*/false);
    const cuda::AbsorbedAttentionOutput att =
        cuda::absorbed_attention_forward(q_abs, c.latent, sets, cfg.softmax_scale());
    out.attn = Tensor::empty({tokens, nh * dv}, DType::bf16, x.device());
    kvb.expand(true, att.out, out.attn);
    c.attn_latent = att.out;
    c.attn_lse2 = att.lse2;
  } else {
    split_kv(cuda::linear(c.latent, params.kv_b_proj).view({tokens, nh, dn + dv}), dn, dv,
             out.proj);
    out.attn = cuda_path::sparse_attention(out.proj.q, out.proj.k, out.proj.v, indices, cu_seqlens,
                                           cfg.softmax_scale())
                   .view({tokens, nh * dv});
  }
  out.y = cuda::linear(out.attn, params.o_proj, params.o_proj_bias);
  c.indices = indices;
  c.cu_seqlens = cu_seqlens;
  c.proj = out.proj;
  c.attn = out.attn;
  return out;
}

Tensor mla_backward(const MlaConfig& cfg, const MlaParams& params, const MlaContext& ctx,
                    const Tensor& dy, MlaParams& grads) {
  OpTimer timer("mla_backward");
  const char* op = "mla_backward";
  const int64_t tokens = ctx.x.size(0), nh = cfg.n_heads, dn = cfg.qk_nope_head_dim,
                dv = cfg.v_head_dim;
  const Tensor d_attn =
      cuda_path::linear_backward(dy, ctx.attn, params.o_proj, &grads.o_proj,
                                 bias_grad(params.o_proj_bias, grads.o_proj_bias), true);
  Tensor d_latent, d_q;
  if (ctx.attn_latent.defined()) {
    // The absorbed form backwards: d o_lat = W_vbᵀ d o, the latent attention's backward, then
    // d q = W_kb d q_abs; kv_b_proj's gradient gets both factors' rows (d W_vb[h] = d o_hᵀ o_lat_h,
    // d W_kb[h] = q_hᵀ d q_abs_h). q_abs is recomputed rather than kept.
    const int64_t rkv = cfg.kv_lora_rank;
    const KvbHeads kvb{cfg, params.kv_b_proj, tokens};
    Tensor* g_kvb = trained_slot(&grads.kv_b_proj, params.kv_b_proj, op, "kv_b_proj");
    Tensor d_olat = Tensor::empty({tokens, nh, rkv}, DType::bf16, dy.device());
    kvb.absorb(true, d_attn, d_olat);
    if (g_kvb) kvb.grad(true, d_attn, ctx.attn_latent, *g_kvb);
    Tensor q_abs = Tensor::empty({tokens, nh, rkv}, DType::bf16, dy.device());
    kvb.absorb(false, ctx.proj.q, q_abs);
    const cuda::SparseKeySets sets =
        cuda::sparse_key_sets(ctx.indices, ctx.cu_seqlens.to(Device::cpu()), /*key_major=*/true);
    const cuda::AbsorbedAttentionGrads ga = cuda::absorbed_attention_backward(
        q_abs, ctx.latent, ctx.attn_latent, ctx.attn_lse2, sets, cfg.softmax_scale(), d_olat);
    d_q = Tensor::empty({tokens, nh * dn}, DType::bf16, dy.device());
    kvb.expand(false, ga.q_abs, d_q);
    if (g_kvb) kvb.grad(false, ctx.proj.q, ga.q_abs, *g_kvb);
    d_latent = ga.latent.to(DType::bf16);
  } else {
    const AttentionGrads ga = cuda_path::sparse_attention_backward(
        ctx.proj.q, ctx.proj.k, ctx.proj.v, ctx.indices, ctx.cu_seqlens, cfg.softmax_scale(),
        d_attn.view({tokens, nh, dv}));
    // [dk | dv] per head, in kv_b_proj's output layout.
    Tensor d_kv = Tensor::empty({tokens, nh, dn + dv}, ga.k.dtype(), dy.device());
    d_kv.narrow(2, 0, dn).copy_(ga.k);
    d_kv.narrow(2, dn, dv).copy_(ga.v);
    d_latent = cuda_path::linear_backward(d_kv.view({tokens, nh * (dn + dv)}), ctx.latent,
                                          params.kv_b_proj, &grads.kv_b_proj, nullptr, true);
    d_q = ga.q.view({tokens, nh * dn});
  }
  const Tensor d_kv_a =
      cuda_path::rms_norm_backward(d_latent, ctx.kv_a, params.kv_a_layernorm, cfg.rms_norm_eps,
                                   ctx.kv_rstd, &grads.kv_a_layernorm);
  const Tensor d_qresid = cuda_path::linear_backward(d_q, ctx.proj.q_resid, params.q_b_proj,
                                                     &grads.q_b_proj, nullptr, true);
  const Tensor d_q_a = cuda_path::rms_norm_backward(
      d_qresid, ctx.q_a, params.q_a_layernorm, cfg.rms_norm_eps, ctx.q_rstd, &grads.q_a_layernorm);
  // dx from both projections, summed in f32 and rounded once.
  Tensor dx32 = Tensor::empty(ctx.x.shape(), DType::f32, dy.device());
  linear_backward_into(dx32, false, d_kv_a, ctx.x, params.kv_a_proj_with_mqa,
                       &grads.kv_a_proj_with_mqa, op);
  if (Tensor* g = bias_grad(params.kv_a_proj_with_mqa_bias, grads.kv_a_proj_with_mqa_bias))
    cuda::linear_backward_bias(grad_slot(g, params.kv_a_proj_with_mqa_bias, op, "kv_a bias"),
                               d_kv_a);
  linear_backward_into(dx32, true, d_q_a, ctx.x, params.q_a_proj, &grads.q_a_proj, op);
  if (Tensor* g = bias_grad(params.q_a_proj_bias, grads.q_a_proj_bias))
    cuda::linear_backward_bias(grad_slot(g, params.q_a_proj_bias, op, "q_a bias"), d_q_a);
  return dx32.to(ctx.x.dtype());
}

Routing moe_route(const MoeConfig& cfg, const Tensor& router_weight,
                  const Tensor& e_score_correction_bias, const Tensor& x) {
  OpTimer timer("moe_route");
  return cuda::moe_route(cfg, router_weight, as_f32(e_score_correction_bias), x);
}

Tensor moe_experts(const MoeConfig& cfg, const Tensor& gate_up_proj, const Tensor& down_proj,
                   const Tensor& x, const Routing& routing) {
  OpTimer timer("moe_experts");
  return cuda::moe_experts(cfg, gate_up_proj, down_proj, x, routing);
}

Tensor moe_expert_counts(const Routing& routing, int64_t n_experts, int64_t rows) {
  OpTimer timer("moe_expert_counts");
  return cuda::moe_expert_counts(routing, n_experts, rows).to(Device::cpu());
}

MoeOutput moe_forward(const MoeConfig& cfg, const MoeParams& params_in, const Tensor& x,
                      int64_t counted_rows, MoeContext* ctx) {
  OpTimer timer("moe_forward");
  MoeParams params = params_in;
  params.e_score_correction_bias = as_f32(params.e_score_correction_bias);
  cuda::MoeContext cc;
  MoeOutput out = cuda::moe_forward(cfg, params, x, counted_rows, ctx ? &cc : nullptr);
  out.expert_counts = out.expert_counts.to(Device::cpu());
  if (ctx) {
    ctx->x = x;
    ctx->routing = out.routing;
    ctx->shared = MlpContext{};
    if (cc.shared_gate_up.defined()) {
      const int64_t is = cc.shared_gate_up.size(1) / 2;
      ctx->shared = {x, cc.shared_gate_up.narrow(1, 0, is), cc.shared_gate_up.narrow(1, is, is)};
    }
  }
  return out;
}

Tensor moe_route_backward(const MoeConfig& cfg, const Routing& routing, const Tensor& d_weights) {
  OpTimer timer("moe_route_backward");
  return cuda::moe_route_backward(cfg, routing, d_weights);
}

Tensor moe_backward(const MoeConfig& cfg, const MoeParams& params_in, const MoeContext& ctx,
                    const Tensor& dy, MoeParams& grads, const Tensor& d_router_logits) {
  OpTimer timer("moe_backward");
  MoeParams params = params_in;
  params.e_score_correction_bias = as_f32(params.e_score_correction_bias);
  cuda::MoeContext cc;
  cc.x = ctx.x;
  cc.routing = ctx.routing;
  cc.permutation = cuda::moe_permute(ctx.routing.indices, cfg.n_experts);
  if (ctx.shared.gate.defined()) {
    // The shared expert's gate | up, as one [T, 2·Is] buffer.
    const int64_t is = ctx.shared.gate.size(1);
    cc.shared_gate_up =
        Tensor::empty({ctx.x.size(0), 2 * is}, ctx.shared.gate.dtype(), dy.device());
    cc.shared_gate_up.narrow(1, 0, is).copy_(ctx.shared.gate);
    cc.shared_gate_up.narrow(1, is, is).copy_(ctx.shared.up);
  }
  const Tensor d_logits =
      d_router_logits.defined() ? d_router_logits.to(dy.device()).to(DType::f32) : Tensor();
  return cuda::moe_backward(cfg, params, cc, dy, grads, d_logits);
}

Tensor moe_backward_routed_elsewhere(const MoeConfig& cfg, const MoeParams& params, const Tensor& x,
                                     const Routing& routing, const Tensor& dy,
                                     const Tensor& routed_dx, const Tensor& routed_d_weights,
                                     MoeParams& grads, const Tensor& d_router_logits) {
  OpTimer timer("moe_backward");
  const Tensor d_logits =
      d_router_logits.defined() ? d_router_logits.to(dy.device()).to(DType::f32) : Tensor();
  return cuda::moe_backward_routed_elsewhere(cfg, params, x, routing, dy, routed_dx,
                                             routed_d_weights, grads, d_logits);
}

}  // namespace glmtune::ops::cuda_path
