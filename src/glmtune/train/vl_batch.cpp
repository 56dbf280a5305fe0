#include "glmtune/train/vl_batch.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "glmtune/base/error.h"

namespace glmtune::train {
namespace {

// Marks a vision parameter trainable unless `options` freeze its part (tower or projector); true
// for a vision parameter left trainable.
bool mark_vision_param(NamedParam& p, const model::ComposeOptions& options) {
  if (!p.name.starts_with("model.visual.")) return false;
  const bool frozen =
      model::vision::is_projector_param(p.name) ? options.freeze_projector : options.freeze_vision;
  p.trainable = !frozen;
  return !frozen;
}

namespace fs = std::filesystem;
using data::media::VlSample;

// Trained tokens some earlier token predicts (what the shifted labels hold).
int64_t targets(const std::vector<int32_t>& labels) {
  int64_t n = 0;
  for (size_t i = 1; i < labels.size(); ++i) n += labels[i] != data::kIgnoreIndex;
  return n;
}

// The processor's media errors name the media file (or the message); a dataset's errors must also
// name the line, so the file comes into the message and the line becomes the place.
Error at_line(const Error& e, const std::string& where) {
  if (e.where().starts_with(where)) return e;
  return Error(e.where().empty() ? e.problem() : fmt::format("{}: {}", e.where(), e.problem()),
               where, e.fix());
}

}  // namespace

VlDataset VlDataset::scan(const VlDataConfig& config, const data::media::VlProcessor& processor) {
  VlDataset ds(config, processor);
  if (config.files.empty())
    throw Error("no data files", "data.files", "list the JSONL files of the conversations");
  for (const std::string& file : config.files) {
    data::LineReader in(file, config.max_line_bytes);
    std::string text;
    for (;;) {
      const data::LineReader::Status status = in.next(text);
      if (status == data::LineReader::Status::kEnd) break;
      const int64_t line = in.line_number();
      ++ds.stats_.lines;
      if (status == data::LineReader::Status::kLine &&
          text.find_first_not_of(" \t\r") == std::string::npos)
        continue;
      const std::string where = fmt::format("{}:{}", file, line);
      Entry e;
      e.file = file;
      e.line = line;
      data::BadLineReason reason = data::BadLineReason::kTooLong;
      try {
        if (status == data::LineReader::Status::kTooLong)
          throw Error(fmt::format("the line has more than {} bytes: the file probably lacks "
                                  "newlines between its samples",
                                  config.max_line_bytes),
                      where, "write one JSON object per line, each under the limit");
        reason = data::BadLineReason::kNotJson;
        data::OrderedJson doc;
        try {
          doc = data::OrderedJson::parse(text);
        } catch (const data::OrderedJson::exception& ex) {
          throw Error("not valid JSON: " + data::json_error_text(ex), where,
                      ex.id == 406 ? "write the number within a double's range (about ±1.8e308), "
                                     "or as a string"
                                   : "write one JSON object per line");
        }
        reason = data::BadLineReason::kMissingField;
        if (!doc.is_object() || !doc.contains("messages") || !doc["messages"].is_array())
          throw Error("a vision-language sample needs a \"messages\" array", where,
                      "write {\"messages\": [...]} per line (docs/vision.md)");
        e.messages = doc["messages"];
        e.tools = doc.contains("tools") ? doc["tools"] : data::OrderedJson();
        reason = data::BadLineReason::kMedia;
        for (const auto& [value, key] : {std::pair{&e.messages, "messages"}, {&e.tools, "tools"}})
          if (auto found = data::find_literal_media_token(*value, key))
            throw Error(data::literal_media_token_problem(*found), where,
                        std::string(data::kLiteralMediaTokenFix));
        try {
          e.tokens = processor.process(e.messages, e.tools, config.chat, config.media_root, where,
                                       /*with_pixels=*/false);
        } catch (const Error& ex) {
          throw at_line(ex, where);
        } catch (const data::OrderedJson::exception& ex) {
          throw Error("the conversation cannot be rendered: " + data::json_error_text(ex), where,
                      "fix the line against docs/vision.md");
        }
      } catch (const Error& ex) {
        if (config.on_bad_line == data::BadLinePolicy::kFail) throw;
        // what() would repeat the place: it starts with where() already.
        ds.stats_.add_skipped(reason, file, fmt::format("{}: {}", ex.where(), ex.problem()));
        continue;
      }
      const int64_t length = int64_t(e.tokens.input_ids.size());
      if (length > config.max_length) {
        if (config.on_overlong == data::OverlongPolicy::kTruncate)
          throw Error(fmt::format("the sample has {} tokens, more than max_length {}, and a "
                                  "vision-language sample cannot be truncated (its media "
                                  "placeholders would lose their features)",
                                  length, config.max_length),
                      where,
                      "raise max_length (and pack_max_length), or set on_overlong = "
                      "\"drop\"");
        ++ds.stats_.dropped_overlong;
        continue;
      }
      const int64_t trained = targets(e.tokens.labels);
      if (trained == 0) {
        ++ds.stats_.dropped_untrained;
        continue;
      }
      ++ds.stats_.samples;
      ds.stats_.tokens += length;
      ds.stats_.trained_tokens += trained;
      if (!e.tokens.image_grid_thw.empty() || !e.tokens.video_grid_thw.empty()) ++ds.media_samples_;
      ds.samples_.push_back(std::move(e));
    }
  }
  return ds;
}

int64_t VlDataset::length(int64_t i) const {
  return int64_t(samples_.at(size_t(i)).tokens.input_ids.size());
}

std::vector<data::TokenizedSample> VlDataset::load(const std::vector<int64_t>& indices) const {
  std::vector<data::TokenizedSample> out;
  out.reserve(indices.size());
  for (int64_t i : indices) {
    const VlSample& s = samples_.at(size_t(i)).tokens;
    out.push_back({s.input_ids, s.labels});
  }
  return out;
}

VlSample VlDataset::with_pixels(int64_t i) const {
  const Entry& e = samples_.at(size_t(i));
  // Decoding can fail where the scan's header probe did not (a truncated image, a broken frame).
  try {
    return processor_->process(e.messages, e.tools, config_.chat, config_.media_root, where(i),
                               /*with_pixels=*/true);
  } catch (const Error& ex) {
    throw at_line(ex, where(i));
  }
}

std::string VlDataset::where(int64_t i) const {
  const Entry& e = samples_.at(size_t(i));
  return fmt::format("{}:{}", e.file, e.line);
}

model::PackMedia pack_media(const VlDataset& dataset, const data::Pack& pack,
                            const DecodedSamples* decoded) {
  model::PackMedia media;
  const int64_t total = int64_t(pack.input_ids.size());
  std::vector<int32_t> types(size_t(total), model::kTextToken);
  std::vector<Tensor> images, videos;
  for (size_t d = 0; d < pack.sample_indices.size(); ++d) {
    const int64_t index = pack.sample_indices[d];
    const auto found = decoded ? decoded->find(index) : DecodedSamples::const_iterator();
    const VlSample s =
        decoded && found != decoded->end() ? found->second : dataset.with_pixels(index);
    const int64_t start = pack.cu_seqlens[d], end = pack.cu_seqlens[d + 1];
    if (end - start != int64_t(s.input_ids.size()) ||
        !std::equal(s.input_ids.begin(), s.input_ids.end(), pack.input_ids.begin() + start))
      throw Error(
          "the sample's tokens changed since the data was scanned (a media file was "
          "replaced?)",
          dataset.where(index), "restart the run so that the data is scanned again");
    std::copy(s.mm_token_type_ids.begin(), s.mm_token_type_ids.end(), types.begin() + start);
    for (const auto& g : s.image_grid_thw) {
      media.image_grid.push_back(g);
      media.image_documents.push_back(int64_t(d));
    }
    for (const auto& g : s.video_grid_thw) {
      media.video_grid.push_back(g);
      media.video_documents.push_back(int64_t(d));
    }
    if (!s.image_grid_thw.empty()) images.push_back(s.pixel_values);
    if (!s.video_grid_thw.empty()) videos.push_back(s.pixel_values_videos);
    media.document_names.push_back(dataset.where(index));
  }
  auto concat = [](const std::vector<Tensor>& parts) {
    if (parts.empty()) return Tensor();
    int64_t rows = 0;
    for (const Tensor& p : parts) rows += p.size(0);
    Tensor out = Tensor::empty({rows, parts[0].size(1)}, parts[0].dtype());
    int64_t at = 0;
    for (const Tensor& p : parts) {
      out.slice(0, at, at + p.size(0)).copy_(p);
      at += p.size(0);
    }
    return out;
  };
  media.image_pixels = concat(images);
  media.video_pixels = concat(videos);
  media.mm_token_type_ids = Tensor::from_vector(types, {total});
  return media;
}

VlTrainStep::VlTrainStep(const model::VisionConfig& config,
                         const model::vision::VisionParams& params, model::ComposeOptions options,
                         bool host_gradients)
    : options_(options), config_(config), grads_(model::vision::VisionGrads::zeros_like(params)) {
  if (host_gradients)
    for (auto& [name, g] : grads_.released(config_))
      released_.emplace_back(name, g.to(Device::cpu()).to(DType::f32));
}

std::vector<Tensor> VlTrainStep::attach(std::vector<NamedParam>& params) const {
  std::vector<Tensor> out(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    NamedParam& p = params[i];
    if (!mark_vision_param(p, options_) || released_.empty()) continue;
    for (const auto& [name, g] : released_)
      if (name == p.name) out[i] = g;
    GLMTUNE_ASSERT(out[i].defined(), "vision parameter '{}' has no gradient buffer", p.name);
    GLMTUNE_ASSERT(out[i].shape() == p.value.shape(), "gradient of '{}' is {}, parameter {}",
                   p.name, shape_str(out[i].shape()), shape_str(p.value.shape()));
  }
  return out;
}

void VlTrainStep::zero() { grads_.zero(); }

model::text::StepPackResult VlTrainStep::run(const model::VisionLanguageModel& model,
                                             const model::text::PackInput& input,
                                             const model::PackMedia& media,
                                             const model::text::TrainOptions& train,
                                             model::text::TextGrads& text_grads) {
  return model::compose_forward_backward(model, input, media, train, options_, text_grads, grads_);
}

void VlTrainStep::export_grads() {
  if (released_.empty()) return;
  const auto now = grads_.released(config_);
  GLMTUNE_ASSERT(now.size() == released_.size(), "vision gradient list changed");
  for (size_t i = 0; i < now.size(); ++i)
    released_[i].second.copy_(now[i].second.to(released_[i].second.dtype()));
}

VlTraining::VlTraining(const Recipe& recipe, const std::filesystem::path& processor_dir) {
  if (!recipe.data_cache.empty())
    throw Error("a token cache holds no media", recipe.source() + ": data.cache",
                "use data.files (JSONL conversations) with data.media_root");
  options_.freeze_vision = recipe.freeze_vision;
  options_.freeze_projector = recipe.freeze_projector;
  options_.recompute_tower = recipe.recompute_vision;
  processor_ =
      std::make_unique<data::media::VlProcessor>(data::media::VlProcessor::from_dir(processor_dir));
  VlDataConfig dc;
  dc.files = recipe.data_files;
  dc.media_root = recipe.media_root;
  dc.max_length = recipe.max_length;
  dc.on_overlong = recipe.on_overlong;
  dc.on_bad_line = recipe.on_bad_line;
  dataset_ = std::make_unique<VlDataset>(VlDataset::scan(dc, *processor_));
}

std::vector<Tensor> VlTraining::attach(std::vector<NamedParam>& params,
                                       const model::ParamStore& store, bool host_gradients) {
  const auto& config = store.config().vision();
  if (!config)
    throw Error("data.media_root is set but the model has no vision tower", store.config().source(),
                "train a vision-language checkpoint, or drop media_root");
  // Before the first step, not at the first pack with media: no step is spent on a doomed run.
  if (dataset_->has_media())
    store.config().require_media_tokens("the training data has images or videos");
  if (!host_gradients) {
    // A device optimizer reads the buffers load_model puts beside the tower on its device: no
    // host copy of the tower is built here, only the parameters' trainable flags are set.
    for (NamedParam& p : params) mark_vision_param(p, options_);
    return std::vector<Tensor>(params.size());
  }
  step_ = std::make_unique<VlTrainStep>(*config, model::vision::VisionParams::from_store(store),
                                        options_);
  return step_->attach(params);
}

void VlTraining::load_model(const model::ParamStore& store, model::text::TextModelOptions options) {
  model_ = std::make_unique<model::VisionLanguageModel>(store, options);
  // On a GPU the gradient buffers go beside the tower (f32), read there by the device optimizer.
  if (options.device.is_cuda())
    step_ = std::make_unique<VlTrainStep>(model_->vision_config(), model_->vision(), options_,
                                          /*host_gradients=*/false);
}

std::pair<std::vector<std::pair<std::string, Tensor>>, std::vector<std::pair<std::string, Tensor>>>
VlTraining::device_tensors() const {
  GLMTUNE_ASSERT(model_ && step_, "VlTraining::device_tensors before load_model and attach");
  return {model::vision::released_views(model_->vision_config(), model_->vision()),
          model::vision::released_views(model_->vision_config(), step_->grads().params)};
}

model::text::StepPackResult VlTraining::run(const data::Pack& pack,
                                            const model::text::PackInput& input,
                                            const model::text::TrainOptions& train,
                                            model::text::TextGrads& text_grads) {
  for (int64_t index : pack.sample_indices)
    if (std::find(pending_samples_.begin(), pending_samples_.end(), index) !=
        pending_samples_.end()) {
      collect_prefetch();
      break;
    }
  for (int64_t index : pack.sample_indices)
    if (auto e = ready_.errors.find(index); e != ready_.errors.end()) {
      const std::exception_ptr error = e->second;
      ready_.errors.erase(e);
      std::rethrow_exception(error);
    }
  const model::PackMedia media = pack_media(*dataset_, pack, &ready_.samples);
  for (int64_t index : pack.sample_indices) ready_.samples.erase(index);
  return step_->run(*model_, input, media, train, text_grads);
}

void VlTraining::collect_prefetch() {
  if (!pending_.valid()) return;
  Decoded d = pending_.get();
  ready_.samples.merge(d.samples);
  ready_.errors.merge(d.errors);
  pending_samples_.clear();
}

void VlTraining::prefetch(const std::vector<std::vector<int64_t>>& next) {
  if (!prefetch_on_) return;
  // The previous prefetch holds this step's packs: it had the whole last step to finish.
  collect_prefetch();
  std::vector<int64_t> samples;
  for (const auto& pack : next)
    for (int64_t index : pack)
      if (!ready_.samples.count(index)) samples.push_back(index);
  if (samples.empty()) return;
  pending_samples_ = samples;
  const VlDataset* dataset = dataset_.get();
  pending_ = std::async(std::launch::async, [dataset, samples] {
    Decoded d;
    for (int64_t index : samples) {
      try {
        d.samples.emplace(index, dataset->with_pixels(index));
      } catch (...) {
        d.errors.emplace(index, std::current_exception());
      }
    }
    return d;
  });
}

}  // namespace glmtune::train
