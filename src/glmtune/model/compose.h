#pragma once
// The vision-language model: the vision tower's features spliced into the text model's token
// embeddings as transformers' `Glm5NextModel.forward` does (docs/vision.md, "The splice"), forward
// and backward over packed sequences.
//
//   e = embed_tokens[input_ids]                         [T, D]
//   F = tower+projector(image rows ++ video rows)       one call for the whole pack, every image
//                                                       and every video tubelet its own segment
//   e[mm_token_type_ids == 1] = image features          in order of appearance in the pack
//   e[mm_token_type_ids == 2] = video features          likewise
//   text model on e (TextModel, PackInput::inputs_embeds)
//
// The reference tells image from video slots by the video start/end markers around `<|image|>`;
// the data pipeline records that as mm_token_type_ids (data/media/processor.h), which is what the
// splice reads. Placeholders and features are counted per document: a mismatch is a
// glmtune::Error naming the document, never a silent shift of the features into other documents.
//
// The backward runs the text backward on the spliced embeddings, adds the token-embedding
// gradient of the text rows (a media row's lookup is overwritten, so its token row gets nothing,
// as with the reference's masked_scatter), and sends the media rows of d_embeddings into the
// projector and the tower. Frozen parts (freeze_vision: patch embed, blocks, post norm;
// freeze_projector: downsample and merger) get no gradient and, when both are frozen, the vision
// backward does not run at all.
//
// Sequence parallel (TrainOptions::sequence_parallel): every rank of the group holds the whole
// pack and its media. The tower runs sharded (vision::VisionShard: contiguous whole merge blocks
// per rank), the ranks' merged tokens are all-gathered into the whole pack's embeddings on every
// rank, and the text model takes its shard of them. In the backward each rank's partial gradient
// of the pack's embeddings (its rows and the MTP future rows its rows read) is summed back to the
// ranks that produced each merged token, whose tower backward then runs on its own patches.

#include <cstdint>
#include <string>
#include <vector>

#include "glmtune/model/config.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/model.h"
#include "glmtune/model/vision/tower.h"

namespace glmtune::model {

// mm_token_type_ids values.
inline constexpr int32_t kTextToken = 0;
inline constexpr int32_t kImageToken = 1;
inline constexpr int32_t kVideoToken = 2;

// The media of one pack, in order of appearance.
struct PackMedia {
  Tensor mm_token_type_ids;  // int32 [T]; may be undefined when the pack has no media
  Tensor image_pixels;       // [rows, C·T·p·p] of every image (undefined: none)
  std::vector<vision::GridThw> image_grid;
  std::vector<int64_t> image_documents;     // the pack document each image belongs to
  Tensor video_pixels;                      // [rows, C·T·p·p] of every video
  std::vector<vision::GridThw> video_grid;  // (t, h, w) per video: t tubelets of h·w patches
  std::vector<int64_t> video_documents;
  // Optional names of the pack's documents (e.g. "data.jsonl:12") for error messages.
  std::vector<std::string> document_names;

  bool empty() const { return image_grid.empty() && video_grid.empty(); }
};

struct ComposeOptions {
  bool freeze_vision = false;     // no gradient for patch_embed, blocks, post_layernorm
  bool freeze_projector = false;  // no gradient for downsample and merger
  // The tower's blocks keep their inputs only and rerun in the backward
  // (vision::VisionContext::recompute_blocks; train.recompute_vision).
  bool recompute_tower = false;
};

// The text model plus the vision tower of one checkpoint, in one compute dtype.
class VisionLanguageModel {
 public:
  // Converts the text and vision weights of `store` (which must have a vision_config and the
  // `model.visual.*` tensors).
  explicit VisionLanguageModel(const ParamStore& store, text::TextModelOptions options = {});

  const text::TextModel& text() const { return text_; }
  text::TextModel& text() { return text_; }
  const VisionConfig& vision_config() const { return vision_config_; }
  const vision::VisionParams& vision() const { return vision_; }
  vision::VisionParams& vision() { return vision_; }

  // Re-reads every weight (text and vision) from `store` after an optimizer step; text weights the
  // model holds undefined (fsdp's sharded decoder layers, updated as slices by their own
  // optimizer) are left so.
  void refresh(const ParamStore& store);

 private:
  text::TextModel text_;
  VisionConfig vision_config_;
  vision::VisionParams vision_;
};

// What the splice keeps for the backward.
struct SpliceContext {
  vision::VisionContext tower;
  std::vector<int64_t> image_positions;  // pack rows that received image features, in order
  std::vector<int64_t> video_positions;  // pack rows that received video features
  bool ran_tower = false;  // `tower` holds a forward (keep_tower and the pack has media)
};

// The token embeddings of `input_ids` [T] with every image and video feature spliced in. The
// counts are checked per document of `cu_seqlens`. `context` (optional) receives the media rows
// and, with `keep_tower`, what the tower's backward needs. With `sequence_parallel` the tower runs
// sharded over its group (collective) and every rank gets the whole pack's embeddings.
Tensor compose_embeddings(const VisionLanguageModel& model, const Tensor& input_ids,
                          const Tensor& cu_seqlens, const PackMedia& media,
                          SpliceContext* context = nullptr, bool keep_tower = true,
                          const RowExchange* sequence_parallel = nullptr,
                          bool recompute_tower = false);

// TextModel::forward on the spliced embeddings (evaluation: losses, logits).
text::ForwardOutput compose_forward(const VisionLanguageModel& model, const text::PackInput& input,
                                    const PackMedia& media,
                                    const text::ForwardOptions& options = {});

// compose_forward_backward in two halves, for callers that read the forward before the backward
// (`glmtune eval --dump-grads` takes its per-document losses from the context's final_normed).
struct ComposeTrainForward {
  text::PackInput input;  // the pack as the text model saw it (spliced embeddings when media)
  text::TrainForward text;
  SpliceContext splice;
  bool spliced = false;  // the pack had media: the lookup and the tower are differentiated here
};
ComposeTrainForward compose_training_forward(const VisionLanguageModel& model,
                                             const text::PackInput& input, const PackMedia& media,
                                             const text::TrainOptions& train,
                                             const ComposeOptions& options);
// The backward of `forward`: the gradients compose_forward_backward adds.
text::BackwardResult compose_backward(const VisionLanguageModel& model,
                                      const ComposeTrainForward& forward,
                                      const text::TrainOptions& train,
                                      const ComposeOptions& options, text::TextGrads& text_grads,
                                      vision::VisionGrads& vision_grads);

// One pack of a training step: forward, the text backward, the embedding and vision backward.
// Parameter gradients add into `text_grads` and `vision_grads` (VisionGrads::zeros_like of the
// model's vision params; parts frozen by `options` are left untouched).
text::StepPackResult compose_forward_backward(const VisionLanguageModel& model,
                                              const text::PackInput& input, const PackMedia& media,
                                              const text::TrainOptions& train,
                                              const ComposeOptions& options,
                                              text::TextGrads& text_grads,
                                              vision::VisionGrads& vision_grads);

}  // namespace glmtune::model
