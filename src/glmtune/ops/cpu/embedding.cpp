#include "glmtune/ops/embedding.h"

#include <algorithm>
#include <vector>

#include "glmtune/ops/cpu/common.h"
#include "glmtune/ops/dispatch.h"

namespace glmtune::ops {
using namespace cpu_detail;
namespace {

// The checks made before dispatch (ops/checks.h): a [V, D] table and integer ids (on any device:
// the GPU bodies copy host ids over).
void check_lookup_args(const Tensor& table, const Tensor& ids, const char* op) {
  GLMTUNE_ASSERT(table.defined() && table.dim() == 2, "{}: the table {} must be [V, D]", op,
                 describe(table));
  GLMTUNE_ASSERT(ids.defined() && (ids.dtype() == DType::i32 || ids.dtype() == DType::i64),
                 "{}: ids {} must be int32 or int64", op, describe(ids));
}

void check_table(const Tensor& table) {
  GLMTUNE_ASSERT(table.defined() && table.dim() == 2 && table.device().is_cpu() &&
                     (table.dtype() == DType::f32 || table.dtype() == DType::f64),
                 "embedding table must be a CPU [V, D] tensor in f32 or f64, got {}",
                 describe(table));
}

// The ids widened to int64, each checked against the vocabulary. A bad id is user-visible (a
// tokenizer / vocabulary mismatch), so it is a glmtune::Error rather than an internal assertion.
std::vector<int64_t> read_ids(const Tensor& ids, int64_t vocab) {
  GLMTUNE_ASSERT(ids.defined() && ids.device().is_cpu() &&
                     (ids.dtype() == DType::i32 || ids.dtype() == DType::i64),
                 "embedding ids must be a CPU int32/int64 tensor, got {}", describe(ids));
  const Tensor c = ids.contiguous();
  std::vector<int64_t> out(size_t(c.numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = c.dtype() == DType::i32 ? int64_t(c.data<int32_t>()[i]) : c.data<int64_t>()[i];
    if (out[i] < 0 || out[i] >= vocab)
      throw Error(fmt::format("token id {} at position {} is outside the vocabulary [0, {})",
                              out[i], i, vocab),
                  "embedding",
                  "the data was tokenized for another vocabulary, or the model config's "
                  "vocab_size is wrong");
  }
  return out;
}

template <typename T>
void gather(const T* table, const std::vector<int64_t>& ids, int64_t dim, T* out) {
  const int64_t n = int64_t(ids.size());
#pragma omp parallel for schedule(static) if (n * dim > 65536)
  for (int64_t t = 0; t < n; ++t) std::copy_n(table + ids[size_t(t)] * dim, dim, out + t * dim);
}

template <typename T>
void scatter_add(const std::vector<int64_t>& ids, const T* dout, int64_t dim, int64_t vocab,
                 int64_t skip, T* dtable) {
  const int64_t n = int64_t(ids.size());
  // The positions of every id, in token order (a counting sort): one row's gradient is the sum
  // over the tokens of that id, which for a frequent token is thousands of terms. It is summed in
  // double, in token order, and rounded once into the row; one thread owns a row, so neither the
  // order nor the result depends on the threads.
  std::vector<int64_t> first(size_t(vocab) + 1, 0), pos(static_cast<size_t>(n));
  for (int64_t id : ids) ++first[size_t(id) + 1];
  for (int64_t v = 0; v < vocab; ++v) first[size_t(v) + 1] += first[size_t(v)];
  {
    std::vector<int64_t> next(first.begin(), first.end() - 1);
    for (int64_t t = 0; t < n; ++t) pos[size_t(next[size_t(ids[size_t(t)])]++)] = t;
  }
  std::vector<int64_t> rows;
  for (int64_t v = 0; v < vocab; ++v)
    if (v != skip && first[size_t(v) + 1] > first[size_t(v)]) rows.push_back(v);
  const int64_t nrows = int64_t(rows.size());
#pragma omp parallel if (n * dim > 65536)
  {
    std::vector<double> acc(static_cast<size_t>(dim));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < nrows; ++r) {
      const int64_t v = rows[size_t(r)];
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t i = first[size_t(v)]; i < first[size_t(v) + 1]; ++i) {
        const T* src = dout + pos[size_t(i)] * dim;
        for (int64_t c = 0; c < dim; ++c) acc[size_t(c)] += double(src[c]);
      }
      T* dst = dtable + v * dim;
      for (int64_t c = 0; c < dim; ++c) dst[c] += T(acc[size_t(c)]);
    }
  }
}

}  // namespace

Tensor embedding_forward(const Tensor& table, const Tensor& ids) {
  check_lookup_args(table, ids, "embedding_forward");
  GLMTUNE_DISPATCH_CUDA(table, cuda_path::embedding_forward(table, ids));
  check_table(table);
  const int64_t vocab = table.size(0), dim = table.size(1);
  const std::vector<int64_t> id = read_ids(ids, vocab);
  Shape shape = ids.shape();
  shape.push_back(dim);
  Tensor out = Tensor::empty(shape, table.dtype());
  if (out.numel() == 0) return out;
  const Tensor t = table.contiguous();
  if (t.dtype() == DType::f32)
    gather<float>(t.data<float>(), id, dim, out.data<float>());
  else
    gather<double>(t.data<double>(), id, dim, out.data<double>());
  return out;
}

void embedding_backward(const Tensor& table, const Tensor& ids, const Tensor& dout,
                        std::optional<int64_t> padding_idx, Tensor& dtable) {
  if (table.frozen()) return;  // a frozen table gets no gradient
  const char* op = "embedding_backward";
  check_lookup_args(table, ids, op);
  const int64_t vocab = table.size(0), dim = table.size(1);
  GLMTUNE_ASSERT(!padding_idx || (*padding_idx >= 0 && *padding_idx < vocab),
                 "{}: padding_idx {} must be a row of the [{}, {}] table", op,
                 padding_idx.value_or(-1), vocab, dim);
  Shape shape = ids.shape();
  shape.push_back(dim);
  GLMTUNE_ASSERT(dout.defined() && dout.shape() == shape && dout.device() == table.device(),
                 "{}: dout {} must be {} on the table's device", op, describe(dout),
                 shape_str(shape));
  GLMTUNE_DISPATCH_CUDA(table,
                        cuda_path::embedding_backward(table, ids, dout, padding_idx, dtable));
  check_table(table);
  GLMTUNE_ASSERT(dout.dtype() == table.dtype(), "{}: dout {} must be in the table's {}", op,
                 describe(dout), dtype_name(table.dtype()));
  const std::vector<int64_t> id = read_ids(ids, vocab);
  if (!dtable.defined()) dtable = Tensor::zeros(table.shape(), table.dtype());
  GLMTUNE_ASSERT(dtable.shape() == table.shape() && dtable.dtype() == table.dtype() &&
                     dtable.is_contiguous() && dtable.device().is_cpu(),
                 "embedding gradient {} must be a contiguous CPU tensor like the table {}",
                 dtable.str(), table.str());
  const int64_t skip = padding_idx ? *padding_idx : -1;
  const Tensor d = dout.contiguous();
  if (table.dtype() == DType::f32)
    scatter_add<float>(id, d.data<float>(), dim, vocab, skip, dtable.data<float>());
  else
    scatter_add<double>(id, d.data<double>(), dim, vocab, skip, dtable.data<double>());
}

}  // namespace glmtune::ops
