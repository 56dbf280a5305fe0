// The CUDA bodies of the leaf ops (ops/cuda/dispatch.h), on the kernels in ops/cuda/.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/ops/cuda/cross_entropy.h"
#include "glmtune/ops/cuda/dispatch.h"
#include "glmtune/ops/cuda/embedding.h"
#include "glmtune/ops/cuda/fp8.h"
#include "glmtune/ops/cuda/gemm.h"
#include "glmtune/ops/cuda/indexer.h"
#include "glmtune/ops/cuda/kda.h"
#include "glmtune/ops/cuda/mhc.h"
#include "glmtune/ops/cuda/mla.h"
#include "glmtune/ops/cuda/moe.h"
#include "glmtune/ops/cuda/norm.h"
#include "glmtune/ops/cuda/streams.h"
#include "glmtune/ops/cuda/swiglu.h"
#include "glmtune/ops/cuda/vision.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/grad.h"
#include "glmtune/ops/mlp.h"
#include "glmtune/tensor/cuda_check.h"

namespace glmtune::ops::cuda_path {
namespace {

// grad_slot for a trained parameter; nullptr (no buffer, no gradient) for a null slot or a
// frozen parameter.
Tensor* trained_slot(Tensor* slot, const Tensor& param, const char* op, const char* what) {
  return grad_if_trained(slot, param) ? &grad_buffer(*slot, param, op, what) : nullptr;
}

// The f32 form the kernels take for small parameters (mHC mixing, KDA gate and norm weights)
// whatever dtype the model stores them in; free when they already are f32. Frozen like `t`.
Tensor as_f32(const Tensor& t) {
  if (!t.defined() || t.dtype() == DType::f32) return t;
  Tensor f = t.to(DType::f32);
  f.set_frozen(t.frozen());
  return f;
}

// A norm's weight or bias in the dtype of the rows it scales (the kernels read both alike).
Tensor like_rows(const Tensor& v, const Tensor& x) { return v.defined() ? v.to(x.dtype()) : v; }

// The chunked delta rule's kernels run chunks of this many tokens.
constexpr int64_t kKdaChunk = 64;

}  // namespace

// ---- Op timing -----------------------------------------------------------------------------

namespace {

struct TimedOp {
  std::string path;     // "outer > inner" (the name alone for an outermost op)
  int64_t parent = -1;  // the op that called it, when timed
  cudaEvent_t start = nullptr, stop = nullptr;
};

bool g_timing = false, g_nested = false, g_sync = false;
std::vector<TimedOp> g_timed;
thread_local int g_depth = 0;
thread_local std::vector<int64_t> g_open;  // the timed ops open now, innermost last

}  // namespace

OpTimer::OpTimer(const char* name, bool on_device) {
  if (!on_device) return;
  counted_ = true;
  ++g_depth;
  if (!g_timing || (g_depth > 1 && !g_nested)) return;
  TimedOp op;
  op.parent = g_open.empty() ? -1 : g_open.back();
  op.path = op.parent < 0 ? std::string(name) : g_timed[size_t(op.parent)].path + " > " + name;
  GLMTUNE_CUDA_CHECK(cudaEventCreate(&op.start));
  GLMTUNE_CUDA_CHECK(cudaEventCreate(&op.stop));
  if (g_sync) GLMTUNE_CUDA_CHECK(cudaDeviceSynchronize());
  GLMTUNE_CUDA_CHECK(cudaEventRecord(op.start));
  index_ = int64_t(g_timed.size());
  g_timed.push_back(std::move(op));
  g_open.push_back(index_);
}

OpTimer::~OpTimer() {
  if (!counted_) return;
  --g_depth;
  if (index_ < 0) return;
  cudaEventRecord(g_timed[size_t(index_)].stop);
  g_open.pop_back();
}

void enable_op_timing(bool on, bool nested, bool sync) {
  g_timing = on;
  g_nested = nested;
  g_sync = sync;
}

std::map<std::string, OpTime> take_op_times() {
  std::vector<double> own(g_timed.size()), inner(g_timed.size(), 0.0);
  for (size_t i = 0; i < g_timed.size(); ++i) {
    const TimedOp& op = g_timed[i];
    GLMTUNE_CUDA_CHECK(cudaEventSynchronize(op.stop));
    float t = 0;
    GLMTUNE_CUDA_CHECK(cudaEventElapsedTime(&t, op.start, op.stop));
    own[i] = double(t);
    if (op.parent >= 0) inner[size_t(op.parent)] += own[i];
  }
  std::map<std::string, OpTime> times;
  for (size_t i = 0; i < g_timed.size(); ++i) {
    OpTime& t = times[g_timed[i].path];
    t.ms += own[i] - inner[i];
    ++t.calls;
    cudaEventDestroy(g_timed[i].start);
    cudaEventDestroy(g_timed[i].stop);
  }
  g_timed.clear();
  return times;
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
    cuda::linear_backward_weight(grad_buffer(*grad_weight, weight, "linear_backward", "weight"), dy,
                                 x);
  if (grad_bias) {
    const Tensor bias_shape = Tensor::empty({weight.size(0)}, DType::f32, weight.device());
    cuda::linear_backward_bias(grad_buffer(*grad_bias, bias_shape, "linear_backward", "bias"), dy);
  }
  if (!need_input_grad) return Tensor();
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
  cuda::linear_backward_input_out(dx, dy, weight);
  return dx;
}

void linear_backward_add(Tensor& dx_sum, const Tensor& dy, const Tensor& x, const Tensor& weight,
                         Tensor* grad_weight, Tensor* grad_bias) {
  OpTimer timer("linear_backward");
  const char* op = "linear_backward_add";
  if (Tensor* g = trained_slot(grad_weight, weight, op, "weight"))
    cuda::linear_backward_weight(*g, dy, x);
  if (grad_bias) {
    const Tensor bias_shape = Tensor::empty({weight.size(0)}, DType::f32, weight.device());
    cuda::linear_backward_bias(grad_buffer(*grad_bias, bias_shape, op, "bias"), dy);
  }
  const bool accumulate = dx_sum.defined();
  if (!accumulate) dx_sum = Tensor::empty(x.shape(), DType::f32, x.device());
  GLMTUNE_ASSERT(dx_sum.shape() == x.shape() && dx_sum.dtype() == DType::f32 &&
                     dx_sum.device() == x.device() && dx_sum.is_contiguous(),
                 "{}: the running input gradient {} must be a contiguous f32 {}", op, dx_sum.str(),
                 x.str());
  cuda::linear_backward_input_out(dx_sum, dy, weight, accumulate);
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps, Tensor* rstd) {
  OpTimer timer("rms_norm");
  return cuda::rms_norm(x, weight, eps, rstd);
}

Tensor rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, double eps,
                         const Tensor& rstd, Tensor* grad_weight) {
  OpTimer timer("rms_norm_backward");
  grad_weight = grad_if_trained(grad_weight, weight);
  if (grad_weight) grad_buffer(*grad_weight, weight, "rms_norm_backward", "weight");
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

void add_into(Tensor& a, const Tensor& b) {
  OpTimer timer("add_into");
  cuda::add_inplace(a, b.contiguous());
}

void dropout_into(Tensor& a, double p, uint64_t key) {
  OpTimer timer("dropout_into");
  cuda::dropout_inplace(a, p, key);
}

void scale_into(Tensor& a, double s) {
  OpTimer timer("scale_into");
  cuda::scale_inplace(a, s);
}

Tensor gather_rows(const Tensor& x, const std::vector<int64_t>& rows) {
  OpTimer timer("gather_rows");
  return cuda::gather_rows(x, rows);
}

void scatter_rows_(Tensor& dst, const std::vector<int64_t>& rows, const Tensor& src) {
  OpTimer timer("scatter_rows");
  cuda::scatter_rows(dst, rows, src);
}

Fp8Blocks quantize_fp8_blocks(const Tensor& x, int64_t block_rows, int64_t block_cols) {
  OpTimer timer("quantize_fp8_blocks");
  return cuda::quantize_fp8_blocks(x, block_rows, block_cols);
}

Tensor dequantize_fp8_pieces(const Tensor& codes, const Tensor& scales, int64_t piece_rows,
                             const Shape& shape, DType out) {
  OpTimer timer("dequantize_fp8_pieces");
  GLMTUNE_ASSERT(out == DType::bf16 || out == DType::f32,
                 "dequantize_fp8_pieces: a CUDA output is bf16 or f32, not {}",
                 std::string(dtype_name(out)));
  Tensor values = Tensor::empty(shape, out, codes.device());
  cuda::dequantize_fp8_pieces(values, codes, scales, piece_rows);
  return values;
}

Fp8Blocks fp8_weight_from_codes(const Tensor& codes, const Tensor& scales) {
  return cuda::fp8_weight_from_codes(codes, scales);
}

namespace {

// [rows, n] of a [..., n] tensor, contiguous.
Tensor as_rows(const Tensor& a) {
  return a.contiguous().view({a.numel() / a.size(-1), a.size(-1)});
}

// model::text::use_fp8_gemms refuses such a model at start where it sees the shapes; under fsdp
// it sees placeholders, and this is where the run stops.
void check_fp8_gemm_shape(const Tensor& weight, const char* op) {
  if (weight.size(0) % 16 == 0 && weight.size(1) % 16 == 0) return;
  throw Error(fmt::format("{}: the GPU's FP8 GEMMs take weights whose two dimensions are "
                          "multiples of 16, got {}",
                          op, weight.str()),
              "train.fp8", "write train.fp8 = \"none\" for this model, or train it on the CPU");
}

}  // namespace

Tensor linear_fp8(const Tensor& x, const Tensor& weight) {
  OpTimer timer("linear_fp8");
  check_fp8_gemm_shape(weight, "linear_fp8");
  Shape out_shape = x.shape();
  out_shape.back() = weight.size(0);
  Tensor y = Tensor::empty(out_shape, x.dtype(), x.device());
  Tensor y2 = y.view({y.numel() / weight.size(0), weight.size(0)});
  cuda::fp8_linear_out(y2, fp8_input_tiles(x, 1, 128), fp8_weight_blocks(weight));
  return y;
}

namespace {

// Q(W)ᵀ for the input gradient, timed on its own ("transpose_fp8_weight" in the op table).
Fp8Blocks transposed_weight_blocks(const Tensor& weight) {
  const Fp8Blocks blocks = fp8_weight_blocks(weight);
  OpTimer timer("transpose_fp8_weight");
  return cuda::transpose_fp8_weight(blocks);
}

// dW += Q(dy; 128 × 1)ᵀ · Q(x; 128 × 1) unless the weight is frozen or no slot was given. The
// quantisations go through the timed op (and x through its share, when one is open).
void fp8_weight_grad(const Tensor& dy2, const Tensor& x, const Tensor& weight, Tensor* grad_weight,
                     const char* op) {
  if (Tensor* g = trained_slot(grad_weight, weight, op, "weight"))
    cuda::fp8_linear_backward_weight(*g, quantize_fp8_blocks(dy2, 128, 1),
                                     fp8_input_tiles(x, 128, 1));
}

}  // namespace

void linear_fp8_backward_add(Tensor* dx_sum, const Tensor& dy, const Tensor& x,
                             const Tensor& weight, Tensor* grad_weight) {
  OpTimer timer("linear_fp8_backward");
  const char* op = "linear_fp8_backward_add";
  check_fp8_gemm_shape(weight, op);
  const Tensor dy2 = as_rows(dy);
  fp8_weight_grad(dy2, x, weight, grad_weight, op);
  if (!dx_sum) return;
  const bool accumulate = dx_sum->defined();
  if (!accumulate) *dx_sum = Tensor::empty(x.shape(), DType::f32, x.device());
  GLMTUNE_ASSERT(dx_sum->shape() == x.shape() && dx_sum->dtype() == DType::f32 &&
                     dx_sum->device() == x.device() && dx_sum->is_contiguous(),
                 "{}: the running input gradient {} must be a contiguous f32 {}", op, dx_sum->str(),
                 x.str());
  Tensor dx2 = dx_sum->view({x.numel() / x.size(-1), x.size(-1)});
  cuda::fp8_linear_backward_input_out(dx2, quantize_fp8_blocks(dy2, 1, 128),
                                      transposed_weight_blocks(weight), accumulate);
}

Tensor linear_fp8_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                           Tensor* grad_weight) {
  OpTimer timer("linear_fp8_backward");
  const char* op = "linear_fp8_backward";
  check_fp8_gemm_shape(weight, op);
  const Tensor dy2 = as_rows(dy);
  fp8_weight_grad(dy2, x, weight, grad_weight, op);
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
  Tensor dx2 = dx.view({x.numel() / x.size(-1), x.size(-1)});
  cuda::fp8_linear_backward_input_out(dx2, quantize_fp8_blocks(dy2, 1, 128),
                                      transposed_weight_blocks(weight));
  return dx;
}

Tensor embedding_forward(const Tensor& table, const Tensor& ids) {
  OpTimer timer("embedding_forward");
  return cuda::embedding_forward(table, ids);
}

void embedding_backward(const Tensor& table, const Tensor& ids, const Tensor& dout,
                        std::optional<int64_t> padding_idx, Tensor& dtable) {
  OpTimer timer("embedding_backward");
  if (table.frozen()) return;
  grad_buffer(dtable, table, "embedding_backward", "table");
  const cuda::EmbeddingGradPlan plan =
      cuda::make_embedding_grad_plan(ids, table.size(0), padding_idx, table.device());
  cuda::embedding_backward(plan, dout.contiguous(), dtable);
}

CrossEntropyResult lm_head_cross_entropy(const Tensor& hidden, const Tensor& weight,
                                         const Tensor& labels, const CrossEntropyOptions& opts,
                                         Tensor* dhidden, Tensor* dweight) {
  OpTimer timer("lm_head_cross_entropy");
  dweight = grad_if_trained(dweight, weight);
  if (dweight && opts.weight_grad_col0 == 0)
    grad_buffer(*dweight, weight, "lm_head_cross_entropy", "head weight");
  // A gradient of the trailing columns only: the op creates and checks it.
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
                        MhcGrads& grads, const Tensor& residual) {
  OpTimer timer("mhc_pre_backward");
  return cuda::mhc_pre_backward(streams, as_f32(fn), as_f32(base), as_f32(scale), options, saved,
                                d_post, d_comb, d_collapsed, grads, residual);
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

Tensor rms_norm_gated(const Tensor& x, const Tensor& weight, const Tensor& gate, double eps,
                      GateActivation activation, Tensor* rstd) {
  OpTimer timer("rms_norm_gated");
  GLMTUNE_ASSERT(activation == GateActivation::sigmoid,
                 "rms_norm_gated: the GPU kernel gates with the sigmoid only");
  // The statistic is not kept: the backward recomputes it.
  if (rstd) *rstd = Tensor();
  return cuda::rms_norm_gated(x, as_f32(weight), gate, eps);
}

RmsNormGatedGrads rms_norm_gated_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                          const Tensor& gate, double eps, GateActivation activation,
                                          const Tensor& rstd, Tensor* grad_weight) {
  OpTimer timer("rms_norm_gated_backward");
  GLMTUNE_ASSERT(activation == GateActivation::sigmoid,
                 "rms_norm_gated_backward: the GPU kernel gates with the sigmoid only");
  return cuda::rms_norm_gated_backward(
      dy, x, as_f32(weight), gate, eps,
      trained_slot(grad_weight, weight, "rms_norm_gated_backward", "weight"));
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                  Tensor* mean, Tensor* rstd) {
  OpTimer timer("layer_norm");
  return cuda::layer_norm(x, like_rows(weight, x), like_rows(bias, x), eps, mean, rstd);
}

Tensor layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, double eps,
                           const Tensor& mean, const Tensor& rstd, Tensor* grad_weight,
                           Tensor* grad_bias) {
  OpTimer timer("layer_norm_backward");
  return cuda::layer_norm_backward(dy, x, like_rows(weight, x), eps, mean, rstd, grad_weight,
                                   grad_bias);
}

Tensor l2_norm(const Tensor& x, double eps, Tensor* norm) {
  OpTimer timer("l2_norm");
  return cuda::l2_norm(x, eps, norm);
}

Tensor l2_norm_backward(const Tensor& dy, const Tensor& x, double eps, const Tensor& norm) {
  OpTimer timer("l2_norm_backward");
  // The kernel recomputes the norm from x; a saved one is not needed.
  return cuda::l2_norm_backward(dy, x, eps);
}

Tensor causal_conv1d(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens, bool silu,
                     Tensor* pre_activation) {
  OpTimer timer("causal_conv1d");
  GLMTUNE_ASSERT(pre_activation == nullptr,
                 "causal_conv1d: the GPU kernel does not keep the pre-activation (its backward "
                 "recomputes it); pass none");
  return cuda::causal_conv1d(x, weight, cu_seqlens_for(cu_seqlens, x), silu);
}

Tensor causal_conv1d_backward(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                              bool silu, const Tensor& dy, Tensor* grad_weight,
                              const Tensor& pre_activation) {
  OpTimer timer("causal_conv1d_backward");
  return cuda::causal_conv1d_backward(
      x, weight, cu_seqlens_for(cu_seqlens, x), silu, dy,
      trained_slot(grad_weight, weight, "causal_conv1d_backward", "weight"));
}

Tensor kda_qk_conv(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                   int64_t head_dim, double eps, Tensor* norm) {
  OpTimer timer("kda_qk_conv");
  return cuda::kda_qk_conv(x, weight, cu_seqlens_for(cu_seqlens, x), head_dim, eps, norm);
}

Tensor kda_qk_conv_backward(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                            int64_t head_dim, double eps, const Tensor& norm, const Tensor& dy,
                            Tensor* grad_weight) {
  OpTimer timer("kda_qk_conv_backward");
  return cuda::kda_qk_conv_backward(
      x, weight, cu_seqlens_for(cu_seqlens, x), head_dim, eps, norm, dy,
      trained_slot(grad_weight, weight, "kda_qk_conv_backward", "weight"));
}

Tensor kda_gate(const Tensor& graw, const Tensor& dt_bias, const Tensor& A_log,
                std::optional<double> lower_bound) {
  OpTimer timer("kda_gate");
  return cuda::kda_gate(graw, as_f32(dt_bias), as_f32(A_log), lower_bound);
}

Tensor kda_gate_backward(const Tensor& graw, const Tensor& dt_bias, const Tensor& A_log,
                         std::optional<double> lower_bound, const Tensor& dg, Tensor* grad_dt_bias,
                         Tensor* grad_A_log) {
  OpTimer timer("kda_gate_backward");
  const char* op = "kda_gate_backward";
  return cuda::kda_gate_backward(graw, as_f32(dt_bias), as_f32(A_log), lower_bound, dg,
                                 trained_slot(grad_dt_bias, dt_bias, op, "dt_bias"),
                                 trained_slot(grad_A_log, A_log, op, "A_log"));
}

Tensor kda_beta(const Tensor& logits) {
  OpTimer timer("kda_beta");
  return cuda::kda_beta(logits);
}

Tensor kda_beta_backward(const Tensor& beta, const Tensor& d_beta) {
  OpTimer timer("kda_beta_backward");
  return cuda::kda_beta_backward(beta, d_beta);
}

Tensor kda_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                   const Tensor& beta, const Tensor& cu_seqlens, double scale, int64_t chunk_size,
                   Tensor* final_state) {
  OpTimer timer("kda_chunked");
  GLMTUNE_ASSERT(chunk_size == kKdaChunk && final_state == nullptr,
                 "kda_chunked: the GPU kernels run chunks of {} and return no final state (got "
                 "chunk_size {}{})",
                 kKdaChunk, chunk_size, final_state ? ", a final-state request" : "");
  return cuda::kda_chunked(q, k, v, g, beta, cu_seqlens_for(cu_seqlens, q), scale);
}

KdaCoreGrads kda_chunked_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens,
                                  double scale, const Tensor& d_out, int64_t chunk_size) {
  OpTimer timer("kda_chunked_backward");
  GLMTUNE_ASSERT(chunk_size == kKdaChunk,
                 "kda_chunked_backward: the GPU kernels run chunks of {}, got {}", kKdaChunk,
                 chunk_size);
  return cuda::kda_chunked_backward(q, k, v, g, beta, cu_seqlens_for(cu_seqlens, q), scale, d_out);
}

Tensor indexer_forward(const IndexerConfig& cfg, const IndexerParams& params, const Tensor& x,
                       const Tensor& q_resid, const Tensor& cu_seqlens) {
  OpTimer timer("indexer_forward");
  return cuda::indexer_forward(cfg, params, x, q_resid, cu_seqlens.to(Device::cpu()));
}

namespace {

// Per-head products with kv_b_proj's factors, W_kb[h] = rows h·(Dn+Dv) .. +Dn and W_vb[h] = the
// Dv rows after them, each [D, Rkv]; `a` and `c` are head-interleaved [T, NH, ·] buffers.
//   absorb:   c[:, h] = a[:, h] · W[h]          ([T, D] → [T, Rkv])
//   expand:   c[:, h] = a[:, h] · W[h]ᵀ         ([T, Rkv] → [T, D])
//   grad:     g[h] += a[:, h]ᵀ · b[:, h]        (f32 [D, Rkv] rows of kv_b_proj's gradient)
struct KvbHeads {
  const MlaConfig& cfg;
  const Tensor& kvb;  // bf16 [NH·(Dn+Dv), Rkv]
  int64_t tokens;

  // Each is one batched GEMM of a product per head: head h's slice of a [T, NH·D] tensor starts
  // h·D elements in, its rows of kv_b_proj h·(Dn+Dv)·Rkv (+ Dn for the value rows).
  const char* rows(bool value_rows) const {
    return static_cast<const char*>(kvb.data_ptr()) +
           (value_rows ? cfg.qk_nope_head_dim : 0) * cfg.kv_lora_rank * 2;
  }
  int64_t head_stride() const { return (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank; }
  int64_t dim(bool value_rows) const { return value_rows ? cfg.v_head_dim : cfg.qk_nope_head_dim; }
  void absorb(bool value_rows, const Tensor& a, Tensor& c) const {
    if (tokens == 0) return;
    const int64_t nh = cfg.n_heads, d = dim(value_rows), r = cfg.kv_lora_rank;
    cuda::gemm({.device = a.device().index,
                .m = tokens,
                .n = r,
                .k = d,
                .a = a.data_ptr(),
                .lda = nh * d,
                .b = rows(value_rows),
                .ldb = r,
                .c = c.data_ptr(),
                .ldc = nh * r,
                .batch = nh,
                .stride_a = d,
                .stride_b = head_stride(),
                .stride_c = r});
  }
  void expand(bool value_rows, const Tensor& a, Tensor& c) const {
    if (tokens == 0) return;
    const int64_t nh = cfg.n_heads, d = dim(value_rows), r = cfg.kv_lora_rank;
    cuda::gemm({.device = a.device().index,
                .trans_b = true,
                .m = tokens,
                .n = d,
                .k = r,
                .a = a.data_ptr(),
                .lda = nh * r,
                .b = rows(value_rows),
                .ldb = r,
                .c = c.data_ptr(),
                .ldc = nh * d,
                .batch = nh,
                .stride_a = r,
                .stride_b = head_stride(),
                .stride_c = d});
  }
  void grad(bool value_rows, const Tensor& a, const Tensor& b, Tensor& g) const {
    if (tokens == 0) return;
    const int64_t nh = cfg.n_heads, d = dim(value_rows), r = cfg.kv_lora_rank;
    cuda::gemm({.device = a.device().index,
                .trans_a = true,
                .m = d,
                .n = r,
                .k = tokens,
                .a = a.data_ptr(),
                .lda = nh * d,
                .b = b.data_ptr(),
                .ldb = nh * r,
                .c = g.data<float>() + (value_rows ? cfg.qk_nope_head_dim : 0) * r,
                .ldc = r,
                .c_dtype = DType::f32,
                .beta = 1.0f,
                .batch = nh,
                .stride_a = d,
                .stride_b = r,
                .stride_c = head_stride()});
  }
};

}  // namespace

// The absorbed-latent attention (ops/cuda/mla.h) covers the released shape in bf16: Rkv = 512 and
// at most 64 heads. Anything else keeps the per-head path, and so does the fp32 mode: the absorbed
// kernels are bf16 tensor-core MMAs, while the per-head path is exact fp32 like the CPU op (and
// equal to the absorbed form in real arithmetic).
bool absorbed_attention_fits(const MlaConfig& cfg, DType dtype) {
  return dtype == DType::bf16 && cfg.kv_lora_rank == 512 && cfg.n_heads <= 64;
}

// The variable is read once: a step must not change kernels. The benchmarks compare the three
// choices in one binary.
cuda::AbsorbedKernel absorbed_kernel(int device, bool backward) {
  enum class Choice { wgmma, wgmma_forward, mma_sync };
  static const Choice choice = [] {
    const char* v = std::getenv("GLMTUNE_MLA_KERNEL");
    const std::string s = v ? v : "wgmma";
    if (s == "wgmma") return Choice::wgmma;
    if (s == "wgmma_forward") return Choice::wgmma_forward;
    if (s == "mma_sync") return Choice::mma_sync;
    throw Error("GLMTUNE_MLA_KERNEL=" + s + " is not a kernel choice", "GLMTUNE_MLA_KERNEL",
                "use wgmma (the default), wgmma_forward or mma_sync, or leave it unset");
  }();
  const bool wgmma = choice == Choice::wgmma || (choice == Choice::wgmma_forward && !backward);
  return wgmma && cuda::absorbed_wgmma_available(device) ? cuda::AbsorbedKernel::wgmma
                                                         : cuda::AbsorbedKernel::mma_sync;
}

Tensor mla_attention_absorbed(const MlaConfig& cfg, const Tensor& kv_b_proj, const Tensor& indices,
                              const Tensor& cu_seqlens, MlaContext& ctx) {
  OpTimer timer("mla_attention");
  // Attention on the latent: q_abs = W_kbᵀ q per head, then o = W_vb o_lat.
  GLMTUNE_ASSERT(kv_b_proj.dtype() == DType::bf16 && kv_b_proj.is_contiguous(),
                 "mla_attention: kv_b_proj must be contiguous bf16 on the GPU, got {}",
                 kv_b_proj.str());
  const int64_t tokens = ctx.latent.size(0), nh = cfg.n_heads;
  const KvbHeads kvb{cfg, kv_b_proj, tokens};
  const Device device = ctx.latent.device();
  // The pieces are timed apart (nested under this op in the step's op table): the per-head
  // products and the key sets are small next to the attention only when each is done well.
  Tensor q_abs = Tensor::empty({tokens, nh, cfg.kv_lora_rank}, DType::bf16, device);
  {
    OpTimer piece("mla_absorb_q");
    kvb.absorb(false, ctx.proj.q, q_abs);
  }
  cuda::SparseKeySets sets;
  {
    OpTimer piece("mla_key_sets");
    // Checked once the attention is queued behind them: the device does not wait for the host.
    sets = cuda::sparse_key_sets(indices, cu_seqlens.to(Device::cpu()), /*key_major=*/false,
                                 nullptr, cuda::IndexCheck::deferred);
  }
  cuda::AbsorbedAttentionOutput att;
  {
    OpTimer piece("mla_latent_attention");
    att = cuda::absorbed_attention_forward(q_abs, ctx.latent, sets, cfg.softmax_scale(), nullptr,
                                           absorbed_kernel(device.index, false));
  }
  cuda::require_valid_indices(sets);
  Tensor out = Tensor::empty({tokens, nh * cfg.v_head_dim}, DType::bf16, device);
  {
    OpTimer piece("mla_expand_o");
    kvb.expand(true, att.out, out);
  }
  ctx.attn_latent = std::move(att.out);
  ctx.attn_lse2 = std::move(att.lse2);
  return out;
}

MlaAttentionGrads mla_attention_absorbed_backward(const MlaConfig& cfg, const Tensor& kv_b_proj,
                                                  const MlaContext& ctx, const Tensor& d_attn,
                                                  Tensor* grad_kv_b_proj) {
  OpTimer timer("mla_attention_backward");
  // d o_lat = W_vbᵀ d o, the latent attention's backward, then d q = W_kb d q_abs; kv_b_proj's
  // gradient gets both factors' rows (d W_vb[h] = d o_hᵀ o_lat_h, d W_kb[h] = q_hᵀ d q_abs_h).
  // q_abs is recomputed rather than kept.
  const int64_t tokens = ctx.latent.size(0), nh = cfg.n_heads, rkv = cfg.kv_lora_rank;
  const Device device = ctx.latent.device();
  const KvbHeads kvb{cfg, kv_b_proj, tokens};
  Tensor* g_kvb = grad_kv_b_proj
                      ? &grad_buffer(*grad_kv_b_proj, kv_b_proj, "mla_attention", "kv_b_proj")
                      : nullptr;
  const Tensor d_out = d_attn.contiguous();
  Tensor d_olat = Tensor::empty({tokens, nh, rkv}, DType::bf16, device);
  Tensor q_abs = Tensor::empty({tokens, nh, rkv}, DType::bf16, device);
  {
    OpTimer piece("mla_absorb_do_q");
    kvb.absorb(true, d_out, d_olat);
    kvb.absorb(false, ctx.proj.q, q_abs);
  }
  if (g_kvb) {
    OpTimer piece("mla_kv_b_grad");
    kvb.grad(true, d_out, ctx.attn_latent, *g_kvb);
  }
  cuda::SparseKeySets sets;
  {
    OpTimer piece("mla_key_sets");
    sets = cuda::sparse_key_sets(ctx.indices, ctx.cu_seqlens.to(Device::cpu()), /*key_major=*/true,
                                 nullptr, cuda::IndexCheck::deferred);
  }
  cuda::AbsorbedAttentionGrads ga;
  {
    OpTimer piece("mla_latent_attention_backward");
    ga = cuda::absorbed_attention_backward(q_abs, ctx.latent, ctx.attn_latent, ctx.attn_lse2, sets,
                                           cfg.softmax_scale(), d_olat, nullptr, int64_t(1) << 31,
                                           absorbed_kernel(device.index, true));
  }
  cuda::require_valid_indices(sets);
  MlaAttentionGrads g;
  g.q = Tensor::empty({tokens, nh * cfg.qk_nope_head_dim}, DType::bf16, device);
  {
    OpTimer piece("mla_expand_dq");
    kvb.expand(false, ga.q_abs, g.q);
  }
  if (g_kvb) {
    OpTimer piece("mla_kv_b_grad");
    kvb.grad(false, ctx.proj.q, ga.q_abs, *g_kvb);
  }
  g.latent = ga.latent.to(DType::bf16);
  return g;
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

Routing moe_route(const MoeConfig& cfg, const Tensor& router_weight,
                  const Tensor& e_score_correction_bias, const Tensor& x) {
  OpTimer timer("moe_route");
  return cuda::moe_route(cfg, router_weight, as_f32(e_score_correction_bias), x);
}

Tensor moe_experts(const MoeConfig& cfg, const Linear& gate_up_proj, const Linear& down_proj,
                   const Tensor& x, const Routing& routing) {
  OpTimer timer("moe_experts");
  return cuda::moe_experts(cfg, gate_up_proj, down_proj, x, routing);
}

Tensor moe_expert_counts(const Routing& routing, int64_t n_experts, int64_t rows) {
  OpTimer timer("moe_expert_counts");
  return cuda::moe_expert_counts(routing, n_experts, rows);
}

Tensor moe_balancing_loss(const Tensor& logits, const Tensor& bias, const Tensor& loads,
                          int64_t counted_rows, int64_t top_k, double weight, Tensor& loss_sum) {
  OpTimer timer("moe_balancing_loss");
  return cuda::moe_balancing_loss(logits, as_f32(bias), loads, counted_rows, top_k, weight,
                                  loss_sum);
}

namespace {

// The fused MoE kernels run the shared expert on its bare weights in bf16. One with an adapter or
// FP8 GEMMs (ops/linear.h) runs beside them as the MLP composite instead, which applies them; its
// output is then added to the routed sum in bf16 rather than inside the combine's f32 sum.
bool shared_expert_composed(const MoeParams& params) {
  for (const Linear* l :
       {&params.shared.gate_proj, &params.shared.up_proj, &params.shared.down_proj})
    if (l->lora.defined() || l->fp8) return true;
  return false;
}

// The routed experts' grouped GEMMs: one cuBLASLt GEMM per expert with the offsets read on the
// host, or Hopper's kernels that read them on the device (the host never waits for them;
// ops/cuda/grouped_gemm.h). By default the device-offset kernels take the blocks whose experts get
// fewer than kDeviceOffsetsBelowRows rows on average (many small experts, where one cuBLASLt call
// per expert costs most: 144 experts of about 910 rows run 4-10% faster on them, 36 of about 3,641
// 2-5% slower, docs/PERF.md); the mean is known on the host (rows · top-k / experts), so choosing
// needs no synchronisation. GLMTUNE_GROUPED_GEMM=cublaslt or wgmma forces one for every block
// (read once: a step must not change kernels). Experts in FP8 GEMMs follow the same rule: the
// device-offset choice runs the grouped FP8 kernel of one launch (ops/cuda/fp8.h), the other one
// block-scaled cuBLASLt GEMM per expert. On an H100 the one launch ran 36 experts of 910 rows 6%
// (forward) and 12% (dX) faster and the weight gradient 40% slower, and the crop25b step with 8
// experts of 16,384 rows 2.7% slower than per expert (docs/PERF.md).
constexpr int64_t kDeviceOffsetsBelowRows = 2048;

cuda::GroupedGemmBackend moe_gemm_backend(const MoeConfig& cfg, int64_t rows) {
  enum class Choice { by_rows, cublaslt, wgmma };
  static const Choice choice = [] {
    const char* v = std::getenv("GLMTUNE_GROUPED_GEMM");
    const std::string s = v ? v : "auto";
    if (s == "auto") return Choice::by_rows;
    if (s == "cublaslt") return Choice::cublaslt;
    if (s == "wgmma") return Choice::wgmma;
    throw Error("GLMTUNE_GROUPED_GEMM=" + s + " is not a grouped GEMM choice",
                "GLMTUNE_GROUPED_GEMM",
                "use auto (the default: by the rows per expert), cublaslt or wgmma, or leave it "
                "unset");
  }();
  const bool device =
      choice == Choice::wgmma ||
      (choice == Choice::by_rows && rows * cfg.top_k < kDeviceOffsetsBelowRows * cfg.n_experts);
  return device ? cuda::GroupedGemmBackend::kWgmmaDeviceOffsets
                : cuda::GroupedGemmBackend::kLtPerGroup;
}

}  // namespace

MoeOutput moe_forward(const MoeConfig& cfg, const MoeParams& params_in, const Tensor& x,
                      int64_t counted_rows, MoeContext* ctx, bool keep_routed) {
  OpTimer timer("moe_forward");
  MoeParams params = params_in;
  params.e_score_correction_bias = as_f32(params.e_score_correction_bias);
  const bool composed = shared_expert_composed(params);
  if (composed) params.shared = MlpParams{};
  cuda::MoeContext cc;
  MoeOutput out = cuda::moe_forward(cfg, params, x, counted_rows, ctx ? &cc : nullptr,
                                    moe_gemm_backend(cfg, x.size(0)), nullptr, keep_routed);
  MlpContext shared;
  if (composed) add_into(out.y, ops::mlp_forward(params_in.shared, x, cfg.swiglu_limit, shared));
  if (ctx) {
    ctx->x = x;
    ctx->routing = out.routing;
    ctx->shared = shared;
    if (cc.shared_gate_up.defined()) {
      const int64_t is = cc.shared_gate_up.size(1) / 2;
      ctx->shared = {x, cc.shared_gate_up.narrow(1, 0, is), cc.shared_gate_up.narrow(1, is, is)};
    }
    cuda::ExpertActivations& a = cc.activations;
    ctx->routed = {std::move(a.x_perm), std::move(a.h),         std::move(a.act),
                   std::move(a.yp),     std::move(a.u_gate_up), std::move(a.u_down)};
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
  const MoeRoutedActivations& r = ctx.routed;
  cc.activations = {r.x_sorted, r.gate_up, r.act, r.out, r.u_gate_up, r.u_down};
  const cuda::GroupedGemmBackend backend = moe_gemm_backend(cfg, ctx.x.size(0));
  cc.permutation = cuda::moe_permute(ctx.routing.indices, cfg.n_experts, nullptr,
                                     backend != cuda::GroupedGemmBackend::kWgmmaDeviceOffsets);
  const Tensor d_logits =
      d_router_logits.defined() ? d_router_logits.to(dy.device()).to(DType::f32) : Tensor();
  if (shared_expert_composed(params)) {
    params.shared = MlpParams{};
    Tensor dx = cuda::moe_backward(cfg, params, cc, dy, grads, d_logits, backend);
    add_into(dx,
             ops::mlp_backward(params_in.shared, ctx.shared, dy, cfg.swiglu_limit, grads.shared));
    return dx;
  }
  if (ctx.shared.gate.defined()) {
    // The shared expert's gate | up, as one [T, 2·Is] buffer.
    const int64_t is = ctx.shared.gate.size(1);
    cc.shared_gate_up =
        Tensor::empty({ctx.x.size(0), 2 * is}, ctx.shared.gate.dtype(), dy.device());
    cc.shared_gate_up.narrow(1, 0, is).copy_(ctx.shared.gate);
    cc.shared_gate_up.narrow(1, is, is).copy_(ctx.shared.up);
  }
  return cuda::moe_backward(cfg, params, cc, dy, grads, d_logits, backend);
}

Tensor moe_backward_routed_elsewhere(const MoeConfig& cfg, const MoeParams& params, const Tensor& x,
                                     const Routing& routing, const Tensor& dy,
                                     const Tensor& routed_dx, const Tensor& routed_d_weights,
                                     MoeParams& grads, const Tensor& d_router_logits) {
  OpTimer timer("moe_backward");
  GLMTUNE_ASSERT(
      !shared_expert_composed(params),
      "expert parallelism on GPUs with an adapted or FP8 shared expert is not wired yet");
  const Tensor d_logits =
      d_router_logits.defined() ? d_router_logits.to(dy.device()).to(DType::f32) : Tensor();
  return cuda::moe_backward_routed_elsewhere(cfg, params, x, routing, dy, routed_dx,
                                             routed_d_weights, grads, d_logits);
}

// ---- vision tower ----

void rope_2d_(Tensor& x, const RopeTables& tables, bool transpose) {
  OpTimer timer(transpose ? "rope_2d_backward" : "rope_2d");
  cuda::rope_2d(x, tables.cos, tables.sin, transpose);
}

void gelu_erf_(Tensor& x) {
  OpTimer timer("gelu_erf");
  cuda::gelu_erf(x);
}

void gelu_erf_backward_(const Tensor& x, Tensor& dy) {
  OpTimer timer("gelu_erf_backward");
  cuda::gelu_erf_backward(x, dy);
}

Tensor varlen_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                        const std::vector<int64_t>& cu_seqlens, int64_t heads, double scale,
                        int64_t q_begin, Tensor* lse) {
  OpTimer timer("varlen_attention");
  GLMTUNE_ASSERT(heads >= 1 && q.dim() == 2 && q.size(1) % heads == 0,
                 "varlen_attention: q {} does not split into {} heads", q.str(), heads);
  Tensor out = Tensor::empty({q.size(0), q.size(1)}, q.dtype(), q.device());
  Tensor stats = Tensor::empty({q.size(0), heads}, DType::f32, q.device());
  cuda::varlen_attention(out, stats, q, k, v, cu_seqlens, heads, scale, q_begin);
  if (lse) *lse = std::move(stats);
  return out;
}

VarlenAttentionGrads varlen_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                               const Tensor& out, const Tensor& dout,
                                               const std::vector<int64_t>& cu_seqlens,
                                               int64_t heads, double scale, int64_t q_begin,
                                               Tensor lse) {
  if (!lse.defined()) varlen_attention(q, k, v, cu_seqlens, heads, scale, q_begin, &lse);
  OpTimer timer("varlen_attention_backward");
  GLMTUNE_ASSERT(k.dim() == 2, "varlen_attention_backward: k {} must be 2-D", k.str());
  const Shape key_shape{k.size(0), q.size(1)};
  VarlenAttentionGrads g{Tensor::empty(q.shape(), q.dtype(), q.device()),
                         Tensor::empty(key_shape, q.dtype(), q.device()),
                         Tensor::empty(key_shape, q.dtype(), q.device())};
  // The kernels read out and dout with one row stride.
  const Tensor out_c = out.contiguous(), dout_c = dout.contiguous();
  cuda::varlen_attention_backward(g.dq, g.dk, g.dv, q, k, v, out_c, dout_c, lse, cu_seqlens, heads,
                                  scale, q_begin);
  return g;
}

}  // namespace glmtune::ops::cuda_path
