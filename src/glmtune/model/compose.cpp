#include "glmtune/model/compose.h"

#include <fmt/format.h>

#include "glmtune/base/error.h"
#include "glmtune/ops/dispatch.h"
#include "glmtune/ops/elementwise.h"
#include "glmtune/ops/embedding.h"

namespace glmtune::model {
namespace {

std::vector<int64_t> int_values(const Tensor& t) {
  const std::vector<double> v = t.to_doubles();
  return std::vector<int64_t>(v.begin(), v.end());
}

const VisionConfig& require_vision(const ParamStore& store) {
  const auto& vision = store.config().vision();
  if (!vision)
    throw Error("the model has no vision_config", store.config().source(),
                "use a checkpoint of the vision-language model for image or video data");
  return *vision;
}

std::string document_label(const PackMedia& media, int64_t doc) {
  if (size_t(doc) < media.document_names.size() && !media.document_names[size_t(doc)].empty())
    return fmt::format("pack document {} ({})", doc, media.document_names[size_t(doc)]);
  return fmt::format("pack document {}", doc);
}

// Merged feature rows each grid produces: t·h·w / merge².
int64_t feature_rows(const vision::GridThw& g, int64_t merge) {
  return g[0] * g[1] * g[2] / (merge * merge);
}

struct SlotPlan {
  std::vector<int64_t> image_positions, video_positions;
};

// The rows that receive image and video features, after checking the slots against the features
// document by document.
SlotPlan plan_slots(const VisionLanguageModel& model, const Tensor& input_ids,
                    const std::vector<int64_t>& cu, const PackMedia& media) {
  const int64_t t = input_ids.numel();
  const int64_t ndoc = int64_t(cu.size()) - 1;
  SlotPlan plan;
  if (!media.mm_token_type_ids.defined()) {
    if (!media.empty()) throw InternalError("a pack with media needs mm_token_type_ids");
    return plan;
  }
  GLMTUNE_ASSERT(media.mm_token_type_ids.numel() == t,
                 "mm_token_type_ids has {} entries for {} "
                 "tokens",
                 media.mm_token_type_ids.numel(), t);
  GLMTUNE_ASSERT(media.image_documents.size() == media.image_grid.size() &&
                     media.video_documents.size() == media.video_grid.size(),
                 "every image and video needs its document index");
  if (!media.empty()) model.text().config().require_media_tokens("the pack has images or videos");
  const std::vector<int64_t> types = int_values(media.mm_token_type_ids);
  const std::vector<int64_t> ids = int_values(input_ids);
  const int64_t image_token = model.text().config().media().image_token_id;
  const int64_t merge = model.vision_config().spatial_merge_size;
  std::vector<int64_t> want_image(size_t(ndoc), 0), want_video(size_t(ndoc), 0);
  for (size_t i = 0; i < media.image_grid.size(); ++i) {
    const int64_t d = media.image_documents[i];
    GLMTUNE_ASSERT(d >= 0 && d < ndoc, "image {} belongs to document {} of {}", i, d, ndoc);
    want_image[size_t(d)] += feature_rows(media.image_grid[i], merge);
  }
  for (size_t i = 0; i < media.video_grid.size(); ++i) {
    const int64_t d = media.video_documents[i];
    GLMTUNE_ASSERT(d >= 0 && d < ndoc, "video {} belongs to document {} of {}", i, d, ndoc);
    want_video[size_t(d)] += feature_rows(media.video_grid[i], merge);
  }
  for (int64_t d = 0; d < ndoc; ++d) {
    int64_t images = 0, videos = 0;
    for (int64_t r = cu[size_t(d)]; r < cu[size_t(d) + 1]; ++r) {
      const int64_t kind = types[size_t(r)];
      if (kind == kTextToken) continue;
      if ((kind != kImageToken && kind != kVideoToken) || ids[size_t(r)] != image_token)
        throw Error(fmt::format("token {} has mm_token_type_id {} and id {}: media slots are "
                                "<|image|> tokens (id {}) of type 1 (image) or 2 (video)",
                                r - cu[size_t(d)], kind, ids[size_t(r)], image_token),
                    document_label(media, d), "build the token types with the media processor");
      (kind == kImageToken ? plan.image_positions : plan.video_positions).push_back(r);
      ++(kind == kImageToken ? images : videos);
    }
    if (images != want_image[size_t(d)])
      throw Error(fmt::format("{} image placeholder tokens but the document's images give {} "
                              "feature rows",
                              images, want_image[size_t(d)]),
                  document_label(media, d),
                  "expand each <|image|> with the processor's token count for that image (the "
                  "images and the text must come from the same sample)");
    if (videos != want_video[size_t(d)])
      throw Error(fmt::format("{} video placeholder tokens but the document's videos give {} "
                              "feature rows",
                              videos, want_video[size_t(d)]),
                  document_label(media, d),
                  "expand each <|video|> with the processor's frame layout for that video");
  }
  return plan;
}

// Image rows then video rows, and the grid in the same order: one tower call for the pack.
struct TowerInput {
  Tensor pixels;
  std::vector<vision::GridThw> grid;
  int64_t image_features = 0;
};

TowerInput tower_input(const VisionLanguageModel& model, const PackMedia& media) {
  TowerInput in;
  in.grid = media.image_grid;
  in.grid.insert(in.grid.end(), media.video_grid.begin(), media.video_grid.end());
  const int64_t merge = model.vision_config().spatial_merge_size;
  for (const auto& g : media.image_grid) in.image_features += feature_rows(g, merge);
  const DType dt = model.vision().dtype;
  if (!media.image_pixels.defined()) {
    in.pixels = media.video_pixels.to(dt).contiguous();
  } else if (!media.video_pixels.defined()) {
    in.pixels = media.image_pixels.to(dt).contiguous();
  } else {
    const Tensor a = media.image_pixels.to(dt).contiguous(),
                 b = media.video_pixels.to(dt).contiguous();
    GLMTUNE_ASSERT(a.size(1) == b.size(1), "image rows of {} and video rows of {} values",
                   a.size(1), b.size(1));
    in.pixels = Tensor::empty({a.size(0) + b.size(0), a.size(1)}, dt);
    in.pixels.slice(0, 0, a.size(0)).copy_(a);
    in.pixels.slice(0, a.size(0), a.size(0) + b.size(0)).copy_(b);
  }
  return in;
}

// rows[positions[i]] = features[offset + i] (both [·, D], the embeddings' dtype and device).
void scatter_rows(Tensor& embeddings, const Tensor& features, int64_t offset,
                  const std::vector<int64_t>& positions) {
  if (positions.empty()) return;
  ops::scatter_rows_(embeddings, positions, features.narrow(0, offset, int64_t(positions.size())));
}

// The vision tower beside the text model: on the CPU in the text model's dtype; on a GPU in bf16
// (the tower's GPU kernels), also under the text model's fp32 test mode.
vision::VisionParams vision_params(const ParamStore& store, const text::TextModelOptions& o) {
  if (o.device.is_cuda()) return vision::VisionParams::from_store(store, DType::bf16, o.device);
  return vision::VisionParams::from_store(store, o.dtype);
}

}  // namespace

VisionLanguageModel::VisionLanguageModel(const ParamStore& store, text::TextModelOptions options)
    : text_(store, options),
      vision_config_(require_vision(store)),
      vision_(vision_params(store, options)) {
  if (vision_config_.out_hidden_size != text_.text().hidden_size)
    throw Error(fmt::format("vision_config.out_hidden_size {} differs from the text hidden_size "
                            "{}: the features could not replace token embeddings",
                            vision_config_.out_hidden_size, text_.text().hidden_size),
                store.config().source(), "fix config.json");
}

void VisionLanguageModel::refresh(const ParamStore& store) {
  for (auto& [name, t] : text_.weights().named)
    if (t.defined()) t.copy_(store.get(name).to(t.dtype()));
  vision_ = vision::VisionParams::from_store(store, vision_.dtype, vision_.device);
}

Tensor compose_embeddings(const VisionLanguageModel& model, const Tensor& input_ids,
                          const Tensor& cu_seqlens, const PackMedia& media, SpliceContext* context,
                          bool keep_tower, const RowExchange* sequence_parallel,
                          bool recompute_tower) {
  const std::vector<int64_t> cu = int_values(cu_seqlens);
  const SlotPlan plan = plan_slots(model, input_ids, cu, media);
  Tensor embeddings = model.text().embed(input_ids);
  if (context) *context = SpliceContext{};
  if (media.empty()) return embeddings;
  const TowerInput in = tower_input(model, media);
  vision::VisionContext* tower = context && keep_tower ? &context->tower : nullptr;
  if (tower) tower->recompute_blocks = recompute_tower;
  Tensor features;
  if (sequence_parallel) {
    const int64_t merge = model.vision_config().spatial_merge_size;
    const vision::VisionShard shard =
        vision::vision_shard(*sequence_parallel, in.pixels.size(0), merge, "train.sp_size");
    const Tensor mine = in.pixels.narrow(0, shard.patch_begin, shard.patches()).contiguous();
    const vision::VisionOutput out =
        vision::vision_forward(model.vision_config(), model.vision(), mine, in.grid, tower, &shard);
    features = sequence_parallel->gather_rows(out.pooler_output, shard.feature_counts(merge))
                   .to(embeddings.dtype());
  } else {
    // Timed as one op in `glmtune bench step`'s breakdown.
    GLMTUNE_TIME_OP("vision_tower", model.vision().post_layernorm);
    features =
        vision::vision_forward(model.vision_config(), model.vision(), in.pixels, in.grid, tower)
            .pooler_output.to(embeddings.dtype());
  }
  scatter_rows(embeddings, features, 0, plan.image_positions);
  scatter_rows(embeddings, features, in.image_features, plan.video_positions);
  if (context) {
    context->image_positions = plan.image_positions;
    context->video_positions = plan.video_positions;
    context->ran_tower = keep_tower;
  }
  return embeddings;
}

text::ForwardOutput compose_forward(const VisionLanguageModel& model, const text::PackInput& input,
                                    const PackMedia& media, const text::ForwardOptions& options) {
  if (media.empty()) return model.text().forward(input, options);
  text::PackInput in = input;
  in.inputs_embeds = compose_embeddings(model, input.input_ids, input.cu_seqlens, media);
  return model.text().forward(in, options);
}

ComposeTrainForward compose_training_forward(const VisionLanguageModel& model,
                                             const text::PackInput& input, const PackMedia& media,
                                             const text::TrainOptions& train,
                                             const ComposeOptions& options) {
  ComposeTrainForward f;
  f.input = input;
  if (!media.empty()) {
    // Without a trained vision part the tower's forward keeps nothing for a backward.
    const bool train_vision = !options.freeze_vision || !options.freeze_projector;
    f.input.inputs_embeds =
        compose_embeddings(model, input.input_ids, input.cu_seqlens, media, &f.splice, train_vision,
                           train.sequence_parallel, options.recompute_tower);
    f.spliced = true;
  }
  f.text = text::training_forward(model.text(), f.input, train);
  return f;
}

text::BackwardResult compose_backward(const VisionLanguageModel& model,
                                      const ComposeTrainForward& forward,
                                      const text::TrainOptions& train,
                                      const ComposeOptions& options, text::TextGrads& text_grads,
                                      vision::VisionGrads& vision_grads) {
  // A pack without media took the plain text path, whose backward differentiates the lookup.
  text::BackwardResult r =
      text::backward(model.text(), forward.input, *forward.text.context, train, text_grads);
  if (!forward.spliced) return r;
  const SpliceContext& splice = forward.splice;
  const Tensor& d_emb = r.d_embeddings;

  // The lookup of a media row was overwritten: only the text rows reach embed_tokens.
  std::vector<int64_t> media_rows = splice.image_positions;
  media_rows.insert(media_rows.end(), splice.video_positions.begin(), splice.video_positions.end());
  Tensor d_text = d_emb.clone();
  const int64_t width = d_text.size(1);
  ops::scatter_rows_(
      d_text, media_rows,
      Tensor::zeros({int64_t(media_rows.size()), width}, d_text.dtype(), d_text.device()));
  const text::TextWeights& w = model.text().weights();
  ops::embedding_backward(w.embed_tokens, forward.input.input_ids, d_text,
                          model.text().text().pad_token_id, text_grads.embed_tokens);

  if (!options.freeze_vision || !options.freeze_projector) {
    Tensor d_pooler = ops::gather_rows(d_emb, media_rows).to(model.vision().dtype);
    // Sequence parallel: d_emb is this rank's part of the whole pack's gradient; each merged
    // token's gradient is summed on the rank that produced it.
    if (const vision::VisionShard& shard = splice.tower.shard; shard.exchange)
      d_pooler = shard.exchange->sum_scatter_rows(
          d_pooler, shard.feature_counts(model.vision_config().spatial_merge_size));
    vision::VisionBackwardOptions vopt;
    vopt.train_tower = !options.freeze_vision;
    vopt.train_projector = !options.freeze_projector;
    GLMTUNE_TIME_OP("vision_tower_backward", model.vision().post_layernorm);
    vision::vision_backward(model.vision_config(), model.vision(), splice.tower, d_pooler,
                            vision_grads, vopt);
  }
  return r;
}

text::StepPackResult compose_forward_backward(const VisionLanguageModel& model,
                                              const text::PackInput& input, const PackMedia& media,
                                              const text::TrainOptions& train,
                                              const ComposeOptions& options,
                                              text::TextGrads& text_grads,
                                              vision::VisionGrads& vision_grads) {
  ComposeTrainForward f = compose_training_forward(model, input, media, train, options);
  text::StepPackResult r;
  r.backward = compose_backward(model, f, train, options, text_grads, vision_grads);
  r.loads = std::move(f.text.loads);
  return r;
}

}  // namespace glmtune::model
