#pragma once
// Label bookkeeping of packed sequences for the text model's losses (docs/model/text_model.md,
// "Losses" and "MTP"). The cross-entropy itself is ops/cross_entropy.h.
//
// Labels are always pre-aligned: label[i] is the token position i must predict, or kIgnoreLabel.
// In a pack the alignment is per document: label[i] = input_ids[i + 1] when i + 1 is in the same
// document and trained, so a document's last token never predicts the next document's first. The
// reference shifts inside its loss (`labels[..., 1:]` against `logits[..., :-1]`); for a document
// alone both give the same targets.

#include <cstdint>

#include "glmtune/tensor/tensor.h"

namespace glmtune::model {

// PyTorch's cross-entropy ignore index.
inline constexpr int32_t kIgnoreLabel = -100;

// Next-token labels of a pack: int32 [T] with label[i] = input_ids[i + 1] if position i + 1 lies in
// the same document and is trained, else kIgnoreLabel. `trained` (optional, int32, int64 or
// bool [T]) marks the tokens that carry a loss; undefined means every token does. input_ids and
// cu_seqlens are int32 or int64; a malformed cu_seqlens is a glmtune::Error.
Tensor next_token_labels(const Tensor& input_ids, const Tensor& cu_seqlens,
                         const Tensor& trained = Tensor());

// Labels moved `depth` positions further within each document: out[i] = labels[i + depth] when
// i + depth lies in the same document, else kIgnoreLabel. With next-token labels, depth k gives
// the target of MTP depth k (token t_{i+k+1}); depth 0 is a copy.
Tensor shift_labels(const Tensor& labels, const Tensor& cu_seqlens, int64_t depth);

}  // namespace glmtune::model
