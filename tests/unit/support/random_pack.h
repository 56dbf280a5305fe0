#pragma once
// A pack of random tokens for the training-step tests: documents at `cu_seqlens` (the last one the
// padding document of `padding` tokens, unlabelled), each real document's next-token labels.

#include <cstdint>
#include <random>
#include <vector>

#include "glmtune/model/config.h"
#include "glmtune/model/text/model.h"
#include "glmtune/tensor/tensor.h"

namespace glmtune::test {

inline model::text::PackInput random_pack(const model::ModelConfig& config, uint64_t seed,
                                          const std::vector<int32_t>& cu_seqlens, int64_t padding) {
  const int64_t tokens = cu_seqlens.back();
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> token(1, int32_t(config.text().vocab_size) - 1);
  std::vector<int32_t> ids(static_cast<size_t>(tokens)), labels(static_cast<size_t>(tokens), -100);
  for (int32_t& id : ids) id = token(rng);
  for (size_t d = 0; d + 2 < cu_seqlens.size(); ++d)
    for (int32_t i = cu_seqlens[d]; i + 1 < cu_seqlens[d + 1]; ++i)
      labels[size_t(i)] = ids[size_t(i + 1)];
  model::text::PackInput in;
  in.input_ids = Tensor::from_vector(ids, {tokens});
  in.cu_seqlens = Tensor::from_vector(cu_seqlens, {int64_t(cu_seqlens.size())});
  in.labels = Tensor::from_vector(labels, {tokens});
  in.padding_tokens = padding;
  return in;
}

}  // namespace glmtune::test
