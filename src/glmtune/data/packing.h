#pragma once
// Packing: tokenized samples (documents) laid end to end into packs of exactly `pack_max_length`
// tokens, with `cu_seqlens` marking document boundaries and labels already aligned for the loss
// per document. Padding is one trailing document of `<|endoftext|>` ids with ignored labels.
//
// A sample is never split across packs (samples longer than a pack are the dataset's truncation
// rule's job). The sample order is a seeded shuffle per epoch, and `PackSampler`'s position can be
// saved and restored so that a resumed run sees the identical pack sequence.

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <vector>

#include "glmtune/data/dataset.h"

namespace glmtune::data {

struct Pack {
  std::vector<int32_t> input_ids;  // pack_max_length ids
  // Next-token targets: labels[i] = input_ids[i + 1] when that token is trained and belongs to the
  // same document, else kIgnoreIndex (always at a document's last token and in the padding).
  std::vector<int32_t> labels;
  // Document boundaries [0, end_0, end_1, ..., pack_max_length]; the padding, when there is any,
  // is the last document.
  std::vector<int32_t> cu_seqlens;
  int32_t max_seqlen = 0;               // longest document, padding included
  int32_t num_padding = 0;              // tokens of the padding document
  int64_t num_targets = 0;              // labels that are not kIgnoreIndex
  std::vector<int64_t> sample_indices;  // the documents' sample indices, in pack order

  // Documents in cu_seqlens, the padding document included.
  int64_t num_documents() const { return static_cast<int64_t>(cu_seqlens.size()) - 1; }
};

// Lays `docs` out into one pack. Throws glmtune::Error if they do not fit; `sample_indices` are
// recorded as given.
Pack build_pack(const std::vector<TokenizedSample>& docs,
                const std::vector<int64_t>& sample_indices, int64_t pack_max_length,
                int32_t pad_id);

// Groups samples into packs without splitting any. Samples are taken in `order`; a pack is filled
// greedily, and when the next sample does not fit, the following `lookahead` samples are scanned
// (longest first) for ones that fill the remaining space. Deterministic for a given input.
// Throws glmtune::Error for a sample longer than the pack.
std::vector<std::vector<int64_t>> plan_packs(const std::vector<int64_t>& order,
                                             const std::function<int64_t(int64_t)>& length,
                                             int64_t pack_max_length, int64_t lookahead);

// A seeded permutation of [0, n): the same (n, seed, epoch) gives the same order on every
// platform (own generator and Fisher-Yates; the standard library's distributions are not portable).
std::vector<int64_t> shuffled_order(int64_t n, uint64_t seed, int64_t epoch);

struct PackingConfig {
  int64_t pack_max_length = 16384;
  // Pending samples searched to fill a pack's tail (pack_extra_buffer_size in the reference
  // trainer).
  int64_t lookahead = 100;
  bool shuffle = true;
  uint64_t seed = 0;
  // Padding token: `tokenizer.require_id("<|endoftext|>")`. Required (the default is invalid)
  // because small test tokenizers number their added tokens differently from the release.
  int32_t pad_id = -1;
};

// Endless stream of packs, epoch after epoch (each epoch a fresh shuffle of all samples).
class PackSampler {
 public:
  // `source` must outlive the sampler. Throws glmtune::Error for an empty source, a sample longer
  // than the pack, or an invalid config.
  PackSampler(const SampleSource& source, PackingConfig config);

  // The next pack. After the last pack of an epoch the sampler moves on to (and shuffles) the
  // next epoch right away, so (epoch, index_in_epoch) always names the pack `next` returns.
  Pack next();

  int64_t epoch() const { return epoch_; }
  int64_t index_in_epoch() const { return index_; }
  int64_t packs_in_epoch() const { return static_cast<int64_t>(plan_.size()); }
  // Sample indices of the packs of the current epoch.
  const std::vector<std::vector<int64_t>>& plan() const { return plan_; }
  // Sample indices of the next `n` packs `next` will return, as far as the current epoch goes
  // (fewer, possibly none, at its end); the position does not move.
  std::vector<std::vector<int64_t>> peek(int64_t n) const;

  // Position (epoch, index in epoch, seed) plus what must match for a resume to reproduce the
  // same packs: the source's fingerprint and the packing settings.
  nlohmann::json save_state() const;
  // Continues from a saved position. Throws glmtune::Error if the data or settings differ.
  void restore_state(const nlohmann::json& state);

 private:
  void plan_epoch(int64_t epoch);

  const SampleSource& source_;
  PackingConfig config_;
  uint64_t fingerprint_;
  int64_t epoch_ = 0;
  int64_t index_ = 0;
  std::vector<std::vector<int64_t>> plan_;
};

}  // namespace glmtune::data
