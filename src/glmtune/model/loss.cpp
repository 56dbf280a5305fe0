#include "glmtune/model/loss.h"

#include <algorithm>

#include "glmtune/ops/indexer.h"

namespace glmtune::model {
namespace {

// Integer-valued 1-D tensor as int64 values (ids, labels, masks come as int32, int64 or bool).
std::vector<int64_t> integer_values(const Tensor& t, const char* what) {
  GLMTUNE_ASSERT(t.defined() && t.dim() == 1 && t.device().is_cpu(), "{} must be a CPU [T] tensor",
                 what);
  const Tensor c = t.contiguous();
  std::vector<int64_t> out(size_t(c.numel()));
  switch (c.dtype()) {
    case DType::i32:
      std::copy_n(c.data<int32_t>(), out.size(), out.begin());
      break;
    case DType::i64:
      std::copy_n(c.data<int64_t>(), out.size(), out.begin());
      break;
    case DType::boolean: {
      const auto* p = static_cast<const uint8_t*>(c.data_ptr());
      for (size_t i = 0; i < out.size(); ++i) out[i] = p[i] != 0;
      break;
    }
    default:
      GLMTUNE_ASSERT(false, "{} must be int32, int64 or bool, got {}", what, c.str());
  }
  return out;
}

}  // namespace

Tensor next_token_labels(const Tensor& input_ids, const Tensor& cu_seqlens, const Tensor& trained) {
  const std::vector<int64_t> ids = integer_values(input_ids, "input_ids");
  const int64_t tokens = int64_t(ids.size());
  const std::vector<int64_t> cu = ops::read_cu_seqlens(cu_seqlens, tokens, "next_token_labels");
  std::vector<int64_t> mask;
  if (trained.defined()) {
    mask = integer_values(trained, "trained mask");
    GLMTUNE_ASSERT(int64_t(mask.size()) == tokens, "trained mask has {} entries for {} tokens",
                   mask.size(), tokens);
  }
  Tensor out = Tensor::full({tokens}, kIgnoreLabel, DType::i32);
  int32_t* lab = out.data<int32_t>();
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int64_t i = cu[d]; i + 1 < cu[d + 1]; ++i)
      if (mask.empty() || mask[i + 1] != 0) lab[i] = int32_t(ids[i + 1]);
  return out;
}

Tensor shift_labels(const Tensor& labels, const Tensor& cu_seqlens, int64_t depth) {
  GLMTUNE_ASSERT(depth >= 0, "label shift must be non-negative, got {}", depth);
  GLMTUNE_ASSERT(labels.defined() && labels.dim() == 1 && labels.dtype() == DType::i32,
                 "labels must be int32 [T], got {}",
                 labels.defined() ? labels.str() : std::string("undefined"));
  const int64_t tokens = labels.size(0);
  const std::vector<int64_t> cu = ops::read_cu_seqlens(cu_seqlens, tokens, "shift_labels");
  const Tensor in = labels.contiguous();
  const int32_t* src = in.data<int32_t>();
  Tensor out = Tensor::full({tokens}, kIgnoreLabel, DType::i32);
  int32_t* dst = out.data<int32_t>();
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int64_t i = cu[d]; i + depth < cu[d + 1]; ++i) dst[i] = src[i + depth];
  return out;
}

}  // namespace glmtune::model
