#pragma once
// The model FLOPs of a training step of the text model (docs/PERF.md, "Step benchmark: the FLOP
// count"): every matrix product as 2 × its weight's elements per token, sparse MLA attention over
// the keys each query attends, KDA's chunked delta rule, the indexer forward-only; the backward as
// twice the forward. Behind `glmtune bench step`'s and `glmtune train`'s model TFLOP/s and MFU.

#include <cstdint>
#include <vector>

#include "glmtune/model/config.h"

namespace glmtune::train {

// The H200's dense bf16 tensor-core peak (datasheet, SXM): the MFU denominator.
inline constexpr double kH200Bf16PeakTflops = 989.4;

// Per-token forward FLOPs of one pack's documents.
struct FlopCount {
  double trained = 0;       // forward FLOPs per token of differentiated work (× 3 with backward)
  double forward_only = 0;  // FLOPs of the pack's work without gradient (the indexer), in all
  // Forward + backward FLOPs of the pack (`tokens`: the documents' total).
  double step(int64_t tokens) const { return double(tokens) * (3 * trained) + forward_only; }
};

// The pack made of documents of `doc_lengths` tokens (packed, each attending within itself), with
// the MTP layer when `mtp`.
FlopCount count_flops(const model::TextConfig& config, const std::vector<int64_t>& doc_lengths,
                      bool mtp);

}  // namespace glmtune::train
