#pragma once
// Vision-language training data and steps: conversations whose messages hold image and video
// content items (data/media/vl_processor.h), packed like text samples, each pack carrying its
// documents' pixel rows, grids and mm_token_type_ids into the composed model (model/compose.h).
//
//   VlDataset       JSONL of {"messages": [...], "tools"?: [...]}; one pass at scan time computes
//                   every sample's token stream from the media headers alone (no pixel decoding),
//                   so packing sees exact lengths; a pack's pixels are decoded when it is used.
//   pack_media      the PackMedia of one pack (documents in pack order, the padding all text).
//   VlTrainStep     gradient buffers of the vision tower and projector in the released layouts
//                   (what AdamW updates in the ParamStore), and the per-pack forward/backward.
//
// A VL sample is never truncated: cutting it could split an image's placeholder run from its
// features. A sample longer than max_length is an error naming its line (or, under
// on_overlong = "drop", skipped and counted).

#include <cstdint>
#include <exception>
#include <filesystem>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "glmtune/data/dataset.h"
#include "glmtune/data/media/vl_processor.h"
#include "glmtune/data/packing.h"
#include "glmtune/model/compose.h"
#include "glmtune/model/param_store.h"
#include "glmtune/train/optimizer.h"
#include "glmtune/train/recipe.h"

namespace glmtune::train {

struct VlDataConfig {
  std::vector<std::string> files;
  std::filesystem::path media_root;  // relative media paths resolve against it
  int64_t max_length = 4096;
  data::OverlongPolicy on_overlong = data::OverlongPolicy::kDrop;
  data::BadLinePolicy on_bad_line = data::BadLinePolicy::kFail;
  data::ChatTemplateOptions chat;
  // Longer lines are bad lines (data::BadLineReason::kTooLong).
  uint64_t max_line_bytes = data::kMaxLineBytes;
};

class VlDataset : public data::SampleSource {
 public:
  // Reads, renders and tokenizes every line once (media probed, not decoded). `processor` must
  // outlive the dataset. Bad lines (not JSON, no "messages", a missing or undecodable media file,
  // a media token written in the text, over the byte limit) are glmtune::Errors naming
  // "file:line", or skipped and counted under BadLinePolicy::kSkip; a file that cannot be read
  // to its end is an error either way.
  static VlDataset scan(const VlDataConfig& config, const data::media::VlProcessor& processor);

  int64_t size() const override { return int64_t(samples_.size()); }
  int64_t length(int64_t i) const override;
  std::vector<data::TokenizedSample> load(const std::vector<int64_t>& indices) const override;

  // Sample i processed again with its pixels decoded.
  data::media::VlSample with_pixels(int64_t i) const;
  // "file:line" of sample i.
  std::string where(int64_t i) const;
  // Whether any sample has an image or a video.
  bool has_media() const { return media_samples_ > 0; }
  const data::DatasetStats& stats() const { return stats_; }

 private:
  struct Entry {
    std::string file;
    int64_t line = 0;
    data::OrderedJson messages, tools;
    data::media::VlSample tokens;  // without pixels
  };
  VlDataset(VlDataConfig config, const data::media::VlProcessor& processor)
      : config_(std::move(config)), processor_(&processor) {}

  VlDataConfig config_;
  const data::media::VlProcessor* processor_;
  std::vector<Entry> samples_;
  int64_t media_samples_ = 0;
  data::DatasetStats stats_;
};

// Samples processed with their pixels, by dataset index.
using DecodedSamples = std::map<int64_t, data::media::VlSample>;

// The media of `pack` (built by data::build_pack / PackSampler from `dataset`): pixel rows and
// grids of every document's images and videos in pack order, and mm_token_type_ids over the whole
// pack. Checks that each document's tokens are the sample's. Samples found in `decoded` (decoded
// ahead of time) are taken from there, the others decoded now.
model::PackMedia pack_media(const VlDataset& dataset, const data::Pack& pack,
                            const DecodedSamples* decoded = nullptr);

// The vision side of a training step: released-layout gradient buffers for the optimizer and the
// composed forward/backward of one pack.
class VlTrainStep {
 public:
  // Buffers shaped like `params` (the model's vision parameters), on their device. With
  // `host_gradients`, also f32 host copies in the released layouts for a host optimizer.
  VlTrainStep(const model::VisionConfig& config, const model::vision::VisionParams& params,
              model::ComposeOptions options, bool host_gradients = true);

  // Marks the vision parameters of `params` trainable (unless frozen) and returns, aligned with
  // `params`, the host gradient buffer of each vision parameter (undefined for the others, and
  // for all without host buffers), in the parameter's released shape.
  std::vector<Tensor> attach(std::vector<NamedParam>& params) const;

  void zero();
  // One pack: composed forward and backward, text gradients into `text_grads`, vision gradients
  // accumulated for `export_grads`.
  model::text::StepPackResult run(const model::VisionLanguageModel& model,
                                  const model::text::PackInput& input,
                                  const model::PackMedia& media,
                                  const model::text::TrainOptions& train,
                                  model::text::TextGrads& text_grads);
  // Copies the accumulated gradients into the buffers `attach` returned (released layouts); nothing
  // to do without host buffers.
  void export_grads();

  const model::ComposeOptions& options() const { return options_; }
  const model::vision::VisionGrads& grads() const { return grads_; }

 private:
  model::ComposeOptions options_;
  model::VisionConfig config_;
  model::vision::VisionGrads grads_;
  std::vector<std::pair<std::string, Tensor>> released_;  // name -> released-layout buffer
};

// Everything `glmtune train` needs for a vision-language recipe (data.media_root set): the
// processor of the tokenizer directory, the dataset, the composed model and the vision gradients.
class VlTraining {
 public:
  // Scans the data. `processor_dir` holds tokenizer.json and processor_config.json (the tokenizer
  // directory).
  VlTraining(const Recipe& recipe, const std::filesystem::path& processor_dir);

  const VlDataset& dataset() const { return *dataset_; }

  // Freezes the whole vision tower and/or projector as well (train.freeze patterns covering
  // them); before attach.
  void freeze(bool tower, bool projector) {
    options_.freeze_vision = options_.freeze_vision || tower;
    options_.freeze_projector = options_.freeze_projector || projector;
  }

  // Before the optimizer is built: the vision gradient buffers, attached to `params` (see
  // VlTrainStep::attach); host buffers only with `host_gradients` (a host optimizer).
  std::vector<Tensor> attach(std::vector<NamedParam>& params, const model::ParamStore& store,
                             bool host_gradients = true);
  // After the optimizer state is restored: the composed model from the store's weights, on
  // `options.device` (on a GPU the vision gradient buffers move there too).
  void load_model(const model::ParamStore& store, model::text::TextModelOptions options = {});
  // The tower's and projector's compute tensors and gradient buffers, viewed in their released
  // shapes under their released names: what a device optimizer updates in place.
  std::pair<std::vector<std::pair<std::string, Tensor>>,
            std::vector<std::pair<std::string, Tensor>>>
  device_tensors() const;

  model::VisionLanguageModel& model() { return *model_; }
  VlTrainStep& step() { return *step_; }

  // One pack of the step: its media come from the prefetch when it decoded them, else they are
  // decoded now.
  model::text::StepPackResult run(const data::Pack& pack, const model::text::PackInput& input,
                                  const model::text::TrainOptions& train,
                                  model::text::TextGrads& text_grads);

  // Starts decoding the media of the packs `next` (sample indices per pack, the sampler's peek)
  // on a host thread, so that the next step's packs are ready when it starts: the GPU (or the
  // CPU's compute) does not wait on JPEG or FFmpeg in steady state. A failure to decode is thrown
  // by the run() that needs the sample, naming its file and line, as without the prefetch.
  void prefetch(const std::vector<std::vector<int64_t>>& next);
  // Turns the prefetch off (on by default); the packs are then decoded in run().
  void set_prefetch(bool on) { prefetch_on_ = on; }

 private:
  model::ComposeOptions options_;
  std::unique_ptr<data::media::VlProcessor> processor_;
  std::unique_ptr<VlDataset> dataset_;
  std::unique_ptr<model::VisionLanguageModel> model_;
  std::unique_ptr<VlTrainStep> step_;
  bool prefetch_on_ = true;
  // The prefetch in flight: each sample decoded, or the error that stopped it.
  struct Decoded {
    DecodedSamples samples;
    std::map<int64_t, std::exception_ptr> errors;
  };
  std::future<Decoded> pending_;
  std::vector<int64_t> pending_samples_;  // the samples `pending_` decodes
  Decoded ready_;  // what earlier prefetches decoded and no pack has used yet
  // Waits for the prefetch in flight and keeps what it decoded.
  void collect_prefetch();
};

}  // namespace glmtune::train
