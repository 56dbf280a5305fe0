#include "glmtune/dist/sequence_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/base/overloaded.h"
#include "glmtune/model/text/weights.h"
#include "glmtune/ops/elementwise.h"
#include "glmtune/ops/linear.h"

namespace glmtune::dist {
namespace {

// Rows of the whole pack: the last entry of its cu_seqlens.
int64_t pack_tokens(const Tensor& cu_seqlens) {
  const Tensor c = cu_seqlens.contiguous();
  GLMTUNE_ASSERT(c.dim() == 1 && c.numel() >= 1, "cu_seqlens must be a non-empty vector, got {}",
                 c.str());
  const int64_t n = c.numel();
  return c.dtype() == DType::i32 ? int64_t(c.data<int32_t>()[n - 1]) : c.data<int64_t>()[n - 1];
}

// A backward's input and output gradient, each gathered over the whole pack. The braces order the
// two collectives alike on every rank.
std::pair<Tensor, Tensor> gather_pack(const UlyssesParallel& sp, const Tensor& x, const Tensor& dy,
                                      const Tensor& cu_seqlens) {
  const int64_t tokens = pack_tokens(cu_seqlens);
  return {sp.all_gather_rows(x, tokens), sp.all_gather_rows(dy, tokens)};
}

// The slices are frozen like the parameter, so a frozen one gets no gradient on any rank.
Tensor rows_of(const Tensor& t, int64_t begin, int64_t n) {
  return t.narrow(0, begin, n).contiguous().set_frozen(t.frozen());
}
Tensor cols_of(const Tensor& t, int64_t begin, int64_t n) {
  return t.narrow(1, begin, n).contiguous().set_frozen(t.frozen());
}

// grad[row0 + i, col0 + j] += part[i, j], both seen as [size(0), numel / size(0)]; `grad` is
// created as zeros shaped like `param` (in the part's dtype: f32 on a GPU) when the caller left it
// undefined. On either device: a block of whole rows is added in place, a block of columns through
// a contiguous copy (the same sum per element).
void add_block(Tensor& grad, const Tensor& param, const Tensor& part_in, int64_t row0 = 0,
               int64_t col0 = 0) {
  if (!part_in.defined()) return;
  if (!grad.defined()) grad = Tensor::zeros(param.shape(), part_in.dtype(), param.device());
  GLMTUNE_ASSERT(
      grad.is_contiguous() && grad.dtype() == part_in.dtype() && grad.device() == part_in.device(),
      "gradient buffer {} cannot take {}", grad.str(), part_in.str());
  const int64_t rows = part_in.size(0), cols = part_in.numel() / std::max<int64_t>(rows, 1);
  const int64_t stride = grad.numel() / grad.size(0);
  GLMTUNE_ASSERT(row0 + rows <= grad.size(0) && col0 + cols <= stride,
                 "a gradient block {} at ({}, {}) does not fit {}", part_in.str(), row0, col0,
                 grad.str());
  const Tensor part = part_in.contiguous().view({rows, cols});
  Tensor block = grad.view({grad.size(0), stride}).narrow(0, row0, rows).narrow(1, col0, cols);
  if (block.is_contiguous()) {
    ops::add_into(block, part);
    return;
  }
  Tensor sum = block.contiguous();
  ops::add_into(sum, part);
  block.copy_(sum);
}

// Rows [begin, begin + n) of each of `blocks` consecutive row blocks of `t` (each `stride` rows),
// stacked: the heads' slice of KDA's fused q/k/v conv weight.
Tensor stacked_rows(const Tensor& t, int64_t blocks, int64_t stride, int64_t begin, int64_t n) {
  Shape shape = t.shape();
  shape[0] = blocks * n;
  Tensor out = Tensor::empty(shape, t.dtype(), t.device());
  for (int64_t b = 0; b < blocks; ++b)
    out.narrow(0, b * n, n).copy_(t.narrow(0, b * stride + begin, n));
  return out.set_frozen(t.frozen());
}

// How a mixer parameter is split over the heads: the block [first·unit, (first + count)·unit)
// of dim 0 (`rows`) or dim 1 (`cols`), that block in each third of dim 0 (`rows_of_3`: the fused
// q/k/v conv), held whole by every rank (`whole`: the narrow projections and norms the heads
// share), or by rank 0 only (`first_rank`: an output bias, which the ranks' partial outputs must
// count once). The parameters themselves come from the one parameter list (zip_kda_params,
// zip_mla_params); only the split is named here.
enum class HeadSplit { whole, rows, cols, rows_of_3, first_rank };
struct Slicing {
  HeadSplit split = HeadSplit::whole;
  int64_t unit = 0;  // rows or columns per head
};

// A LoRA adapter follows its projection (ops/linear.h): y = W x + s·B(A x). With the output rows
// split over the heads, B's rows split alike and A (reading all of x) is whole; with the input
// columns split (the output projections, whose partial products the ranks sum), A's columns split
// alike and B is whole (B applied to each rank's partial A x sums to B A x). `weight`: the
// projection's own slicing.
std::optional<Slicing> adapter_slicing(const std::string& n,
                                       const std::function<Slicing(const std::string&)>& of) {
  for (const auto& [suffix, is_a] :
       {std::pair{".lora_A.weight", true}, {".lora_B.weight", false}}) {
    if (!n.ends_with(suffix)) continue;
    const Slicing w = of(n.substr(0, n.size() - std::strlen(suffix)) + ".weight");
    if (w.split == (is_a ? HeadSplit::cols : HeadSplit::rows)) return w;
    return Slicing{};
  }
  return std::nullopt;
}

// `n`: the name in the ops' list (ops/kda.h, ops/mla.h), relative to `self_attn.`.
Slicing kda_slicing(const std::string& n, int64_t head_dim) {
  if (auto a = adapter_slicing(n, [&](const std::string& w) { return kda_slicing(w, head_dim); }))
    return *a;
  if (n == "q_proj.weight" || n == "k_proj.weight" || n == "v_proj.weight" ||
      n == "f_b_proj.weight" || n == "dt_bias" || n == "g_b_proj.weight")
    return {HeadSplit::rows, head_dim};
  if (n == "conv1d.weight") return {HeadSplit::rows_of_3, head_dim};
  if (n == "A_log" || n == "b_proj.weight") return {HeadSplit::rows, 1};
  if (n == "o_proj.weight") return {HeadSplit::cols, head_dim};
  return {};
}

Slicing mla_slicing(const std::string& n, const ops::MlaConfig& c) {
  if (auto a = adapter_slicing(n, [&](const std::string& w) { return mla_slicing(w, c); }))
    return *a;
  if (n == "q_b_proj.weight") return {HeadSplit::rows, c.qk_nope_head_dim};
  if (n == "kv_b_proj.weight") return {HeadSplit::rows, c.qk_nope_head_dim + c.v_head_dim};
  if (n == "o_proj.weight") return {HeadSplit::cols, c.v_head_dim};
  if (n == "o_proj.bias") return {HeadSplit::first_rank, 0};
  return {};
}

// Heads [first, first + count) of a parameter, on this rank.
Tensor slice_heads(const Tensor& t, Slicing s, int64_t first, int64_t count, int rank) {
  if (!t.defined()) return t;
  const int64_t begin = first * s.unit, n = count * s.unit;
  switch (s.split) {
    case HeadSplit::whole:
      return t;
    case HeadSplit::rows:
      return rows_of(t, begin, n);
    case HeadSplit::cols:
      return cols_of(t, begin, n);
    case HeadSplit::rows_of_3:
      return stacked_rows(t, 3, t.size(0) / 3, begin, n);
    case HeadSplit::first_rank:
      return rank == 0 ? t : Tensor();
  }
  return t;
}

// Adds the gradient of this rank's heads of a parameter (`part`, shaped like slice_heads' result)
// into its full-sized buffer.
void add_head_grad(Tensor& grad, const Tensor& param, const Tensor& part, Slicing s, int64_t first,
                   int64_t count) {
  const int64_t begin = first * s.unit, n = count * s.unit;
  switch (s.split) {
    case HeadSplit::whole:
    case HeadSplit::first_rank:
      add_block(grad, param, part);
      return;
    case HeadSplit::rows:
      add_block(grad, param, part, begin);
      return;
    case HeadSplit::cols:
      add_block(grad, param, part, 0, begin);
      return;
    case HeadSplit::rows_of_3:
      if (part.defined())
        for (int64_t b = 0; b < 3; ++b)
          add_block(grad, param, part.narrow(0, b * n, n), b * (param.size(0) / 3) + begin);
      return;
  }
}

// The fields of `p` in the parameter list's order.
template <typename Params, typename Zip>
std::vector<const Tensor*> fields_of(const Params& p, Zip zip) {
  std::vector<const Tensor*> fields;
  zip(p, p, [&](const std::string&, const Tensor& t, const Tensor&) { fields.push_back(&t); });
  return fields;
}

// This rank's share of a mixer's heads, split evenly over the ranks: [first, first + count).
struct HeadShare {
  int64_t first = 0;  // first head
  int64_t count = 0;  // heads here
};

HeadShare head_share(int64_t heads, int rank, int ranks) {
  const int64_t count = heads / ranks;
  return {int64_t(rank) * count, count};
}

// This rank's heads of one KDA layer: the parameters restricted to them and the options that
// describe them.
struct KdaHeads {
  ops::KdaParams params;
  ops::KdaOptions options;
  HeadShare share;
};

// This rank's MLA heads. The o_proj bias stays with rank 0 only (mla_slicing).
struct MlaHeads {
  ops::DsaParams params;
  ops::MlaConfig config;
  HeadShare share;
};

const auto zip_kda = [](auto& a, auto& b, auto&& f) { ops::zip_kda_params(a, b, f); };
const auto zip_mla = [](auto& a, auto& b, auto&& f) { ops::zip_mla_params(a, b, f); };

// The output projection of the forward, on this rank's rows of the pack from `row0` on (all
// columns): its dropout masks at those rows.
ops::Linear on_shard_rows(const ops::Linear& l, int64_t row0) {
  ops::Linear shard = l;
  shard.lora.dropout_block.row0 = row0;
  return shard;
}

// A projection's slice keeps its adapter's scale and dropout and its FP8 mark (train.fp8: the
// slice's blocks are the whole weight's where the heads' rows or columns split at multiples of
// 128, which check_fp8_head_slices makes sure of). Where its input is this rank's slice of the
// heads' columns (the output projections), the dropout masks are drawn at those columns of the
// whole input.
template <typename SlicingOf>
auto keep_projection_settings(SlicingOf slicing_of, int64_t first) {
  return [slicing_of, first](const std::string& name, const ops::Linear& full, ops::Linear& mine,
                             ops::WholeProjection) {
    mine.lora.scale = full.lora.scale;
    mine.lora.dropout = full.lora.dropout;
    mine.lora.dropout_key = full.lora.dropout_key;
    mine.lora.dropout_block = full.lora.dropout_block;
    const Slicing s = slicing_of(name + ".weight");
    if (s.split == HeadSplit::cols && full.weight.defined()) {
      mine.lora.dropout_block.col0 = first * s.unit;
      mine.lora.dropout_block.width = full.weight.size(1);
    }
    mine.fp8 = full.fp8;
  };
}

auto kda_slicing_of(int64_t head_dim) {
  return [head_dim](const std::string& n) { return kda_slicing(n, head_dim); };
}
auto mla_slicing_of(const ops::MlaConfig& c) {
  return [c](const std::string& n) { return mla_slicing(n, c); };
}

// A mixer's parameters `full` restricted to the heads of `share` into `mine`: `zip` walks the
// mixer's parameter list, `slicing_of` names how each parameter splits.
template <typename Params, typename Zip, typename SlicingOf>
void slice_params(Zip zip, SlicingOf slicing_of, const Params& full, Params& mine, HeadShare share,
                  int rank) {
  zip(full, mine,
      Overloaded{[&](const std::string& name, const Tensor& f, Tensor& m) {
                   m = slice_heads(f, slicing_of(name), share.first, share.count, rank);
                 },
                 keep_projection_settings(slicing_of, share.first)});
}

// Adds the gradients of this rank's heads (`part`, shaped like slice_params' result) into the
// full-sized buffers `g` of the parameters `p`.
template <typename Params, typename Grads, typename Zip, typename SlicingOf>
void add_head_grads(Zip zip, SlicingOf slicing_of, const Params& p, HeadShare share,
                    const Grads& part, Grads& g) {
  const std::vector<const Tensor*> parts = fields_of(part, zip);
  size_t i = 0;
  zip(p, g, [&](const std::string& name, const Tensor& param, Tensor& grad) {
    add_head_grad(grad, param, *parts[i++], slicing_of(name), share.first, share.count);
  });
}

KdaHeads kda_heads(const ops::KdaParams& p, const ops::KdaOptions& o, int rank, int ranks) {
  KdaHeads h{.params = {}, .options = o, .share = head_share(o.num_heads, rank, ranks)};
  h.options.num_heads = h.share.count;
  slice_params(zip_kda, kda_slicing_of(o.head_dim), p, h.params, h.share, rank);
  return h;
}

MlaHeads mla_heads(const ops::MlaConfig& c, const ops::DsaParams& p, int rank, int ranks) {
  MlaHeads h{.params = {.mla = {}, .indexer = p.indexer},
             .config = c,
             .share = head_share(c.n_heads, rank, ranks)};
  h.config.n_heads = h.share.count;
  slice_params(zip_mla, mla_slicing_of(c), p.mla, h.params.mla, h.share, rank);
  return h;
}

}  // namespace

void check_fp8_head_slices(const model::TextConfig& c, int64_t sp_size, const std::string& where) {
  if (sp_size <= 1) return;
  const int64_t kda_heads = c.linear_num_heads / sp_size,
                mla_heads = c.num_attention_heads / sp_size;
  const struct {
    const char* what;
    int64_t per_head, heads;
  } slices[] = {{"KDA q/k/v/f_b/g_b rows and o_proj columns (linear_attn_config.head_dim)",
                 c.linear_head_dim, kda_heads},
                {"MLA q_b_proj rows (qk_head_dim)", c.qk_head_dim(), mla_heads},
                {"MLA o_proj columns (v_head_dim)", c.v_head_dim, mla_heads}};
  for (const auto& s : slices)
    if (s.per_head * s.heads % 128 != 0)
      throw Error(fmt::format("train.fp8 = \"tilewise\" with sp_size {}: each rank's share of the "
                              "{} is {} heads x {} = {}, not a multiple of the FP8 blocks' 128, "
                              "so its blocks would differ from one process's",
                              sp_size, s.what, s.heads, s.per_head, s.per_head * s.heads),
                  where,
                  "choose a train.sp_size that leaves each rank a multiple of 128 rows (the "
                  "released model's head dims do), or write train.fp8 = \"none\"");
}

UlyssesParallel::UlyssesParallel(Communicator& sp, int64_t kda_heads, int64_t mla_heads,
                                 const std::string& where, Communicator* device_sp)
    : sp_(sp), device_sp_(device_sp), kda_heads_(kda_heads), mla_heads_(mla_heads) {
  if (device_sp && (device_sp->size() != sp.size() || device_sp->rank() != sp.rank()))
    throw InternalError(
        fmt::format("device group '{}' is rank {} of {}, the sp group rank {} of {}",
                    device_sp->name(), device_sp->rank(), device_sp->size(), sp.rank(), sp.size()));
  const int64_t s = sp.size();
  if (kda_heads % s != 0 || mla_heads % s != 0)
    throw Error(fmt::format("the attention heads ({} KDA, {} MLA) do not split over {} sequence "
                            "parallel ranks",
                            kda_heads, mla_heads, s),
                where, "choose a train.sp_size that divides both head counts");
}

int64_t UlyssesParallel::shard_begin(int64_t tokens) const {
  if (tokens < sp_.size())
    throw Error(fmt::format("a pack of {} tokens cannot be split over {} sequence parallel ranks",
                            tokens, sp_.size()),
                "train.sp_size", "use packs of at least train.sp_size tokens");
  return tokens * sp_.rank() / sp_.size();
}

int64_t UlyssesParallel::shard_rows(int64_t tokens) const {
  return tokens * (sp_.rank() + 1) / sp_.size() - shard_begin(tokens);
}

void UlyssesParallel::sum(std::vector<int64_t>& values) const { sp_.all_reduce_sum(values); }

std::vector<int64_t> UlyssesParallel::shard_counts(int64_t tokens) const {
  const int ranks = sp_.size();
  std::vector<int64_t> counts(static_cast<size_t>(ranks));
  for (int q = 0; q < ranks; ++q) counts[size_t(q)] = tokens * (q + 1) / ranks - tokens * q / ranks;
  return counts;
}

Tensor UlyssesParallel::gather_rows(const Tensor& local_in, std::span<const int64_t> counts) const {
  const int ranks = sp_.size();
  GLMTUNE_ASSERT(int64_t(counts.size()) == ranks, "{} row counts for {} ranks", counts.size(),
                 ranks);
  const Tensor local = local_in.contiguous();
  GLMTUNE_ASSERT(local.size(0) == counts[size_t(sp_.rank())], "a shard of {} rows, expected {}",
                 local.size(0), counts[size_t(sp_.rank())]);
  Shape out_shape = local.shape();
  out_shape[0] = 0;
  for (int64_t c : counts) out_shape[0] += c;
  int64_t width = 1;
  for (size_t i = 1; i < out_shape.size(); ++i) width *= out_shape[i];
  // The shard goes to every rank: its copies are the consecutive send blocks.
  Shape send_shape = local.shape();
  send_shape[0] *= ranks;
  Tensor send = Tensor::empty(send_shape, local.dtype(), local.device());
  for (int q = 0; q < ranks; ++q) send.narrow(0, q * local.size(0), local.size(0)).copy_(local);
  Tensor out = Tensor::empty(out_shape, local.dtype(), local.device());
  std::vector<int64_t> send_counts(size_t(ranks), local.numel()),
      recv_counts(static_cast<size_t>(ranks));
  for (int q = 0; q < ranks; ++q) recv_counts[size_t(q)] = counts[size_t(q)] * width;
  movers(local).all_to_all(send, send_counts, out, recv_counts);
  return out;
}

Tensor UlyssesParallel::sum_scatter_rows(const Tensor& full_in,
                                         std::span<const int64_t> counts) const {
  const int ranks = sp_.size();
  GLMTUNE_ASSERT(int64_t(counts.size()) == ranks, "{} row counts for {} ranks", counts.size(),
                 ranks);
  const Tensor full = full_in.contiguous();
  const int64_t tokens = full.size(0), rows = counts[size_t(sp_.rank())];
  const int64_t width = full.numel() / std::max<int64_t>(tokens, 1);
  std::vector<int64_t> send_counts(static_cast<size_t>(ranks)),
      recv_counts(size_t(ranks), rows * width);
  int64_t total = 0;
  for (int q = 0; q < ranks; ++q) {
    send_counts[size_t(q)] = counts[size_t(q)] * width;
    total += counts[size_t(q)];
  }
  GLMTUNE_ASSERT(total == tokens, "row counts add up to {}, the tensor has {} rows", total, tokens);
  GLMTUNE_ASSERT(full.dtype() == DType::f32 || full.dtype() == DType::f64 ||
                     (full.dtype() == DType::bf16 && full.device().is_cuda()),
                 "sum_scatter_rows sums f32 or f64 (or bf16 on a GPU), got {}", full.str());
  Tensor parts = Tensor::empty({int64_t(ranks), rows * width}, full.dtype(), full.device());
  movers(full).all_to_all(full, send_counts, parts, recv_counts);
  // Summed in rank order, so every run adds in the same order; the GPU's bf16 partial gradients
  // are added in f32 and rounded once.
  Shape shape = full.shape();
  shape[0] = rows;
  const DType sum_dtype = full.dtype() == DType::bf16 ? DType::f32 : full.dtype();
  Tensor out = parts.select(0, 0).to(sum_dtype).contiguous().clone().view(shape);
  for (int q = 1; q < ranks; ++q)
    ops::add_into(out, parts.select(0, q).to(sum_dtype).contiguous().view(shape));
  return out.to(full.dtype());
}

Communicator& UlyssesParallel::movers(const Tensor& t) const {
  if (!t.device().is_cuda()) return sp_;
  GLMTUNE_ASSERT(device_sp_ != nullptr || sp_.size() == 1,
                 "a GPU tensor {} to exchange over sp without a device group", t.str());
  return device_sp_ ? *device_sp_ : sp_;
}

Tensor UlyssesParallel::all_gather_rows(const Tensor& shard, int64_t tokens) const {
  return gather_rows(shard, shard_counts(tokens));
}

Tensor UlyssesParallel::reduce_scatter_rows(const Tensor& full) const {
  return sum_scatter_rows(full, shard_counts(full.size(0)));
}

Tensor UlyssesParallel::columns_to_rows(const Tensor& full_in) const {
  const int ranks = sp_.size();
  const Tensor full = full_in.contiguous();
  GLMTUNE_ASSERT(full.dim() == 2, "columns_to_rows takes [T, W], got {}", full.str());
  const int64_t tokens = full.size(0), width = full.size(1), rows = shard_rows(tokens);
  // Rank q's rows of my columns are one consecutive block of `full`.
  std::vector<int64_t> send_counts(static_cast<size_t>(ranks)),
      recv_counts(size_t(ranks), rows * width);
  for (int q = 0; q < ranks; ++q)
    send_counts[size_t(q)] = (tokens * (q + 1) / ranks - tokens * q / ranks) * width;
  Tensor parts = Tensor::empty({int64_t(ranks), rows, width}, full.dtype(), full.device());
  movers(full).all_to_all(full, send_counts, parts, recv_counts);
  // [S, rows, W] -> [rows, S·W]: rank q's columns (heads) sit at q·W, as in the unsplit layout.
  Tensor out = Tensor::empty({rows, int64_t(ranks) * width}, full.dtype(), full.device());
  for (int q = 0; q < ranks; ++q) out.narrow(1, q * width, width).copy_(parts.select(0, q));
  return out;
}

Tensor UlyssesParallel::kda_forward(const ops::KdaParams& params, const Tensor& x,
                                    const Tensor& cu_seqlens, const ops::KdaOptions& options,
                                    ops::KdaSaved* saved) const {
  GLMTUNE_ASSERT(options.num_heads == kda_heads_, "KDA with {} heads, the split was made for {}",
                 options.num_heads, kda_heads_);
  const int64_t tokens = pack_tokens(cu_seqlens);
  const Tensor x_full = all_gather_rows(x, tokens);
  const KdaHeads h = kda_heads(params, options, sp_.rank(), sp_.size());
  ops::KdaSaved own;
  ops::KdaSaved* s = saved ? saved : &own;
  // The op's own output is this rank's heads through their o_proj columns; the gated-norm output
  // before it is what travels, so that o_proj runs once per token on its owner, as unsplit.
  ops::kda_forward(h.params, x_full, cu_seqlens, h.options, s);
  const Tensor normed = columns_to_rows(s->normed.view({tokens, h.share.count * options.head_dim}));
  return ops::linear(normed, on_shard_rows(params.o_proj, shard_begin(tokens)));
}

Tensor UlyssesParallel::kda_backward(const ops::KdaParams& params, const Tensor& x,
                                     const Tensor& cu_seqlens, const ops::KdaOptions& options,
                                     const ops::KdaSaved* saved, const Tensor& dy,
                                     ops::KdaGrads& grads) const {
  const auto [x_full, dy_full] = gather_pack(*this, x, dy, cu_seqlens);
  const KdaHeads h = kda_heads(params, options, sp_.rank(), sp_.size());
  ops::KdaGrads part;
  const Tensor dx =
      ops::kda_backward(h.params, x_full, cu_seqlens, h.options,
                        saved && saved->normed.defined() ? saved : nullptr, dy_full, part);
  add_head_grads(zip_kda, kda_slicing_of(options.head_dim), params, h.share, part, grads);
  return reduce_scatter_rows(dx);
}

Tensor UlyssesParallel::dsa_forward(const ops::MlaConfig& mla, const ops::IndexerConfig& indexer,
                                    const ops::DsaParams& params, const Tensor& x,
                                    const Tensor& cu_seqlens, const Tensor& carried_indices,
                                    Tensor* indices_out) const {
  GLMTUNE_ASSERT(mla.n_heads == mla_heads_, "MLA with {} heads, the split was made for {}",
                 mla.n_heads, mla_heads_);
  const int64_t tokens = pack_tokens(cu_seqlens);
  const Tensor x_full = all_gather_rows(x, tokens);
  const MlaHeads h = mla_heads(mla, params, sp_.rank(), sp_.size());
  // q_resid and the latent do not depend on the heads: every rank has them for the whole pack,
  // so the indexer pools and selects exactly as unsplit.
  const ops::MlaProjections proj = ops::mla_project(h.config, h.params.mla, x_full);
  const Tensor indices =
      params.indexer.defined()
          ? ops::indexer_forward(indexer, params.indexer, x_full, proj.q_resid, cu_seqlens)
          : carried_indices;
  const Tensor core =
      ops::sparse_attention(proj.q, proj.k, proj.v, indices, cu_seqlens, mla.softmax_scale())
          .view({tokens, h.share.count * mla.v_head_dim});
  if (indices_out) *indices_out = indices;
  return ops::linear(columns_to_rows(core), on_shard_rows(params.mla.o_proj, shard_begin(tokens)));
}

Tensor UlyssesParallel::dsa_backward(const ops::MlaConfig& mla, const ops::DsaParams& params,
                                     const Tensor& x, const Tensor& indices,
                                     const Tensor& cu_seqlens, const Tensor& dy,
                                     ops::DsaParams& grads) const {
  const auto [x_full, dy_full] = gather_pack(*this, x, dy, cu_seqlens);
  const MlaHeads h = mla_heads(mla, params, sp_.rank(), sp_.size());
  // As unsplit (model backward): the MLA context is rebuilt from the input and the selection.
  ops::MlaContext ctx;
  ops::mla_forward(h.config, h.params.mla, x_full, indices, cu_seqlens, ctx);
  ops::DsaParams part;
  const Tensor dx = ops::dsa_backward(h.config, h.params, ctx, dy_full, part);
  add_head_grads(zip_mla, mla_slicing_of(mla), params.mla, h.share, part.mla, grads.mla);
  return reduce_scatter_rows(dx);
}

}  // namespace glmtune::dist
