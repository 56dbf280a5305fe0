#include "glmtune/eval/evaluate.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <numeric>

#include "glmtune/base/error.h"
#include "glmtune/base/fs.h"
#include "glmtune/base/progress.h"
#include "glmtune/data/dataset.h"
#include "glmtune/data/media/vl_processor.h"
#include "glmtune/data/packing.h"
#include "glmtune/data/tokenizer.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/io/safetensors.h"
#include "glmtune/model/compose.h"
#include "glmtune/model/layout.h"
#include "glmtune/model/lora.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/model.h"
#include "glmtune/ops/cross_entropy.h"
#include "glmtune/ops/elementwise.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/norm.h"
#include "glmtune/train/released.h"
#include "glmtune/train/vl_batch.h"

namespace glmtune::eval {
namespace {

namespace fs = std::filesystem;

// One document to evaluate: held in memory (--text, pre-tokenised lines) or a sample of the
// chat / text dataset, loaded when its pack is built.
struct EvalSample {
  std::optional<data::TokenizedSample> tokens;
  int64_t dataset_index = -1;
  bool vl = false;  // dataset_index is into the vision-language dataset, not the text one
  int64_t length = 0;
  std::string source;  // "file:line", "--text" or "dataset sample N"
};

// One forward: samples (indices into the sample list) and the pack length. Chat / text packs are
// padded to --pack-length like training packs; the others are exactly their documents.
struct PackPlan {
  std::vector<int64_t> samples;
  int64_t length = 0;
  bool vl = false;  // samples of the vision-language dataset (only those)
};

struct SampleResult {
  double sum = 0;
  int64_t count = 0;
};

struct Totals {
  std::vector<double> mtp_sum;
  std::vector<int64_t> mtp_count;
  int64_t packs = 0;
  int64_t tokens = 0;  // non-padding tokens
  int64_t slots = 0;   // all pack positions
  double seconds = 0;  // forward time only
};

Tensor int32_tensor(const std::vector<int32_t>& v) {
  return Tensor::from_vector(v, {int64_t(v.size())});
}

// Reads a JSON array of token ids at file:line, each in [0, vocab) (or -100 where `ignore_ok`).
std::vector<int32_t> read_ids(const nlohmann::json& v, const char* key, int64_t vocab,
                              bool ignore_ok, const std::string& where) {
  if (!v.is_array())
    throw Error(fmt::format("\"{}\" must be an array of integers, got {}", key, v.type_name()),
                where, "write the token ids as a JSON array");
  std::vector<int32_t> out;
  out.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const nlohmann::json& x = v[i];
    if (!x.is_number_integer())
      throw Error(fmt::format("\"{}\"[{}] is not an integer: {}", key, i, x.dump()), where,
                  "token ids are integers");
    const int64_t id = x.is_number_unsigned() && x.get<uint64_t>() > uint64_t(INT64_MAX)
                           ? INT64_MAX
                           : x.get<int64_t>();
    if (ignore_ok && id == data::kIgnoreIndex) {
      out.push_back(int32_t(id));
      continue;
    }
    if (id < 0 || id >= vocab)
      throw Error(fmt::format("\"{}\"[{}] = {} is outside the model's vocabulary [0, {}){}", key, i,
                              id, vocab, ignore_ok ? " and is not -100" : ""),
                  where, "tokenize with the checkpoint's tokenizer");
    out.push_back(int32_t(id));
  }
  return out;
}

// Whether a conversation holds an image or video content item (any spelling vl_processor.h reads).
bool has_media_item(const nlohmann::json& messages) {
  if (!messages.is_array()) return false;
  for (const nlohmann::json& m : messages) {
    if (!m.is_object() || !m.contains("content") || !m.at("content").is_array()) continue;
    for (const nlohmann::json& item : m.at("content")) {
      if (!item.is_object() || !item.contains("type") || !item.at("type").is_string()) continue;
      const std::string type = item.at("type").get<std::string>();
      if (type == "image" || type == "image_url" || type == "video" || type == "video_url")
        return true;
    }
  }
  return false;
}

// What the first read of a chat / text file saw: which reader it needs.
struct ChatFileScan {
  bool has_messages = false;  // some line is a {"messages": ...} conversation
  std::string first_media;    // "file:line" of the first conversation with media ("" if none)
};

// The pre-tokenised samples of `file`, or nullopt when no line of it has "input_ids" (then it is
// chat / text data for the dataset reader, and `scan` says what it holds). In a file that has
// them, every non-blank line must be a valid pre-tokenised sample; the first bad line is an error
// naming file:line.
std::optional<std::vector<EvalSample>> read_pretokenised(const std::string& file, int64_t vocab,
                                                         ChatFileScan& scan) {
  // The dataset reader's line reading: a directory, a read error or an oversized line is an
  // error here, not the end of the file.
  data::LineReader in(file);
  std::vector<EvalSample> samples;
  std::optional<Error> first_error;
  bool pretokenised = false;
  std::string line;
  for (data::LineReader::Status status;
       (status = in.next(line)) != data::LineReader::Status::kEnd;) {
    const std::string where = fmt::format("{}:{}", file, in.line_number());
    if (status == data::LineReader::Status::kTooLong)
      throw Error(fmt::format("the line has more than {} bytes", in.max_line_bytes()), where,
                  "write one JSON object per line, each under the limit (docs/data.md)");
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    const bool has_ids = j.is_object() && j.contains("input_ids");
    pretokenised |= has_ids;
    if (j.is_object() && j.contains("messages")) {
      scan.has_messages = true;
      if (scan.first_media.empty() && has_media_item(j.at("messages"))) scan.first_media = where;
    }
    if (first_error) continue;
    try {
      if (j.is_discarded())
        throw Error("the line is not valid JSON", where, "one JSON object a line");
      if (!has_ids)
        throw Error("no \"input_ids\" in a file of pre-tokenised samples", where,
                    "give every line {\"input_ids\": [...], \"labels\": [...]}, or put chat / "
                    "text lines in a file of their own");
      EvalSample s;
      data::TokenizedSample t;
      t.input_ids = read_ids(j.at("input_ids"), "input_ids", vocab, false, where);
      if (t.input_ids.empty())
        throw Error("\"input_ids\" is empty", where, "give at least one token");
      if (j.contains("labels") && !j.at("labels").is_null()) {
        t.labels = read_ids(j.at("labels"), "labels", vocab, true, where);
        if (t.labels.size() != t.input_ids.size())
          throw Error(
              fmt::format("{} labels for {} input ids", t.labels.size(), t.input_ids.size()), where,
              "labels are unshifted (Hugging Face convention): one per input id, -100 "
              "where ignored");
      } else {
        t.labels = t.input_ids;
      }
      s.length = int64_t(t.input_ids.size());
      s.tokens = std::move(t);
      s.source = where;
      samples.push_back(std::move(s));
    } catch (const Error& e) {
      first_error = e;
    }
  }
  if (!pretokenised) return std::nullopt;
  if (first_error) throw *first_error;
  return samples;
}

// What is evaluated: the samples in output order, the packs they go to, and the readers of the
// samples that are loaded pack by pack.
struct EvalData {
  std::vector<EvalSample> samples;
  std::vector<PackPlan> plan;
  std::optional<data::Tokenizer> tokenizer;
  int32_t pad_id = 0;  // never written when no pack is padded
  std::optional<data::JsonlDataset> dataset;
  std::unique_ptr<data::media::VlProcessor> processor;
  std::optional<train::VlDataset> vl_dataset;
  // Output numbering: the evaluated samples in sample order (the text, pre-tokenised lines in file
  // order, then the chat / text samples), whatever pack they went to; -1 for samples left out by
  // max_packs.
  std::vector<int64_t> out_index;
  int64_t evaluated = 0;

  bool has_media() const { return vl_dataset && vl_dataset->has_media(); }
};

// The tokenizer that chat / text data and the text are tokenized with.
void load_tokenizer(EvalData& d, const fs::path& tokenizer_dir, bool given, int64_t vocab) {
  const fs::path tokenizer_file = tokenizer_dir / "tokenizer.json";
  if (!fs::exists(tokenizer_file))
    throw Error(given ? "the --tokenizer folder has no tokenizer.json"
                      : "the checkpoint has no tokenizer.json",
                tokenizer_file.string(),
                "copy the model's tokenizer files next to its weights (glmtune init "
                "--tokenizer DIR does this for random checkpoints), give --tokenizer DIR, "
                "or give pre-tokenised {\"input_ids\": ...} lines");
  d.tokenizer = data::Tokenizer::from_file(tokenizer_file.string());
  d.pad_id = d.tokenizer->require_id("<|endoftext|>");
  if (d.tokenizer->vocab_size() > vocab)
    throw Error(fmt::format("the tokenizer has {} tokens but the model only {}",
                            d.tokenizer->vocab_size(), vocab),
                tokenizer_file.string(), "use the tokenizer that came with the checkpoint");
}

// The same sample a {"text": ...} line gives: the text, a final <|endoftext|>, all tokens trained.
void add_text(EvalData& d, const std::string& text) {
  data::TokenizedSample s;
  s.input_ids = d.tokenizer->encode(text);
  s.input_ids.push_back(d.pad_id);
  s.labels = s.input_ids;
  EvalSample e;
  e.length = int64_t(s.input_ids.size());
  e.tokens = std::move(s);
  e.source = "--text";
  d.plan.push_back({{int64_t(d.samples.size())}, e.length});
  d.samples.push_back(std::move(e));
}

// Documents in file order, packed greedily up to `pack_length` tokens without padding. A longer
// document is never cut (that would change its numbers): it gets its own pack.
void add_pretokenised(EvalData& d, std::vector<EvalSample>& file_samples, int64_t pack_length) {
  PackPlan pack;
  for (EvalSample& s : file_samples) {
    if (!pack.samples.empty() && pack.length + s.length > pack_length) {
      d.plan.push_back(std::move(pack));
      pack = {};
    }
    pack.samples.push_back(int64_t(d.samples.size()));
    pack.length += s.length;
    d.samples.push_back(std::move(s));
  }
  if (!pack.samples.empty()) d.plan.push_back(std::move(pack));
}

// Chat / text files, read and packed as training reads and packs them.
void add_text_dataset(EvalData& d, const std::vector<std::string>& files, int64_t pack_length) {
  data::DatasetConfig dc;
  dc.files = files;
  dc.max_length = pack_length;
  d.dataset = data::JsonlDataset::scan(dc, *d.tokenizer);
  if (d.dataset->size() == 0)
    throw Error("no usable sample in the data", fmt::format("{}", fmt::join(files, ", ")),
                "check the files' format (docs/data.md)");
  std::vector<int64_t> order(size_t(d.dataset->size()));
  std::iota(order.begin(), order.end(), 0);
  const int64_t first = int64_t(d.samples.size());
  for (int64_t i = 0; i < d.dataset->size(); ++i) {
    EvalSample e;
    e.dataset_index = i;
    e.length = d.dataset->length(i);
    e.source = fmt::format("dataset sample {}", i);
    d.samples.push_back(std::move(e));
  }
  for (auto& indices : data::plan_packs(
           order, [&](int64_t i) { return d.dataset->length(i); }, pack_length, 100)) {
    for (int64_t& i : indices) i += first;
    d.plan.push_back({std::move(indices), pack_length});
  }
}

// Vision-language conversations, read as training reads them (VlDataset: tokens from the media
// headers now, pixels decoded per pack), with the same per-line errors.
void add_vl_dataset(EvalData& d, const std::vector<std::string>& files,
                    const std::string& media_root, const fs::path& tokenizer_dir,
                    int64_t pack_length) {
  if (!fs::is_directory(media_root))
    throw Error("--media-root is not a folder", media_root,
                "give the folder that the data's relative media paths resolve against");
  if (!fs::exists(tokenizer_dir / "processor_config.json") &&
      !fs::exists(tokenizer_dir / "preprocessor_config.json"))
    throw Error(
        "no processor_config.json next to the tokenizer: vision-language data needs the image "
        "and video processor settings",
        tokenizer_dir.string(),
        "copy processor_config.json from the model release into that folder, or give "
        "--tokenizer DIR with the release's processor folder");
  d.processor =
      std::make_unique<data::media::VlProcessor>(data::media::VlProcessor::from_dir(tokenizer_dir));
  train::VlDataConfig vc;
  vc.files = files;
  vc.media_root = media_root;
  // Nothing is dropped for its length: a longer sample gets a pack of its own below.
  vc.max_length = std::numeric_limits<int64_t>::max();
  vc.on_bad_line = data::BadLinePolicy::kFail;
  d.vl_dataset.emplace(train::VlDataset::scan(vc, *d.processor));
  if (d.vl_dataset->size() == 0)
    throw Error("no usable sample in the data", fmt::format("{}", fmt::join(files, ", ")),
                "check the conversations: each needs an assistant turn to score "
                "(docs/vision.md)");
  std::vector<int64_t> order, alone;
  const int64_t first = int64_t(d.samples.size());
  for (int64_t i = 0; i < d.vl_dataset->size(); ++i) {
    EvalSample e;
    e.dataset_index = i;
    e.vl = true;
    e.length = d.vl_dataset->length(i);
    e.source = d.vl_dataset->where(i);
    d.samples.push_back(std::move(e));
    (d.vl_dataset->length(i) <= pack_length ? order : alone).push_back(i);
  }
  for (auto& indices : data::plan_packs(
           order, [&](int64_t i) { return d.vl_dataset->length(i); }, pack_length, 100)) {
    for (int64_t& i : indices) i += first;
    d.plan.push_back({std::move(indices), pack_length, true});
  }
  for (int64_t i : alone) d.plan.push_back({{first + i}, d.vl_dataset->length(i), true});
}

// Reads (and checks) every input before the slow model load: pre-tokenised files first, then
// the files that need the tokenizer.
EvalData read_data(const EvalOptions& o, const model::ModelConfig& config) {
  const int64_t vocab = config.text().vocab_size;
  EvalData d;
  std::vector<std::string> dataset_files, vl_files;
  std::vector<std::vector<EvalSample>> pretokenised;
  for (const std::string& file : o.data) {
    ChatFileScan scan;
    if (auto s = read_pretokenised(file, vocab, scan)) {
      pretokenised.push_back(std::move(*s));
    } else if (!o.media_root.empty() && scan.has_messages) {
      vl_files.push_back(file);
    } else {
      // The text reader would refuse the line too, but without pointing at --media-root.
      if (!scan.first_media.empty())
        throw Error(
            "the conversation has image or video content items but no --media-root was given",
            scan.first_media,
            "give --media-root DIR (the folder relative media paths resolve against) to "
            "evaluate vision-language data");
      dataset_files.push_back(file);
    }
  }
  const fs::path tokenizer_dir = o.tokenizer.empty() ? fs::path(o.model) : fs::path(o.tokenizer);
  // The tokenizer is needed only for the text and chat / text data.
  if (!o.text.empty() || !dataset_files.empty() || !vl_files.empty())
    load_tokenizer(d, tokenizer_dir, !o.tokenizer.empty(), vocab);
  if (!o.text.empty()) add_text(d, o.text);
  for (auto& file_samples : pretokenised) add_pretokenised(d, file_samples, o.pack_length);
  if (!dataset_files.empty()) add_text_dataset(d, dataset_files, o.pack_length);
  if (!vl_files.empty()) add_vl_dataset(d, vl_files, o.media_root, tokenizer_dir, o.pack_length);
  // Checked before the checkpoint is read, not at the first pack with media.
  if (d.has_media()) config.require_media_tokens("the --media-root data has images or videos");
  if (o.max_packs > 0 && int64_t(d.plan.size()) > o.max_packs) d.plan.resize(size_t(o.max_packs));

  d.out_index.assign(d.samples.size(), -1);
  for (const PackPlan& p : d.plan)
    for (int64_t i : p.samples) d.out_index[size_t(i)] = 0;
  for (int64_t& i : d.out_index)
    if (i == 0) i = d.evaluated++;
  return d;
}

// The device checks, before anything is read: what a GPU evaluation cannot do is refused up front.
void check_device(const EvalOptions& o) {
  if (!o.device.is_cuda()) return;
#ifndef GLMTUNE_WITH_CUDA
  throw Error(
      fmt::format("device {} asked for, but this glmtune was built without CUDA", o.device.str()),
      "--device",
      "use --device cpu, or build with -DGLMTUNE_CUDA=ON on a machine with the "
      "CUDA toolkit");
#else
  const int visible = cuda_available() ? cuda_device_count() : 0;
  if (o.device.index >= visible)
    throw Error(fmt::format("{} asked for, but {} GPU(s) are visible", o.device.str(), visible),
                "--device",
                visible == 0 ? "run on a machine with a GPU, or use --device cpu"
                             : "pick a device below the number of visible GPUs "
                               "(CUDA_VISIBLE_DEVICES; glmtune env lists them)");
  if (!o.dump_grads.empty())
    throw Error("--dump-grads runs on the CPU only: the dumped gradients are the f32 reference",
                "--device " + o.device.str(),
                "drop --device (or give --device cpu) to dump gradients; evaluate the loss on "
                "the GPU without --dump-grads");
  use_cuda_device(o.device.index);
#endif
}

// The checkpoint's weights: the text model on the evaluation's device (bf16 on a GPU), with the
// vision tower beside it when the data has media. The store stays for the gradients, which are
// named as the checkpoint names weights.
struct LoadedModel {
  model::ParamStore store;
  std::optional<model::VisionLanguageModel> vl;
  std::optional<model::text::TextModel> text;

  const model::text::TextModel& model() const { return vl ? vl->text() : *text; }
};

LoadedModel load_model(const EvalOptions& o, const model::ModelConfig& config, bool media) {
  const auto start = std::chrono::steady_clock::now();
  const io::CheckpointReader reader = io::CheckpointReader::open(o.model);
  LoadedModel m{model::ParamStore::load(reader, config), std::nullopt, std::nullopt};
  if (!o.adapter.empty()) {
    const model::LoraConfig c = model::load_lora_adapter(m.store, o.adapter);
    spdlog::info("adapter {}: rank {}, scale {}", o.adapter, c.rank, c.scale());
  }
  if (media && o.device.is_cuda())
    m.vl.emplace(m.store, model::text::TextModelOptions{DType::bf16, o.device});
  else if (media)
    m.vl.emplace(m.store);
  else if (o.device.is_cuda())
    m.text.emplace(m.store, model::text::TextModelOptions{DType::bf16, o.device});
  else
    m.text.emplace(m.store);
  spdlog::info("loaded {} on {} in {:.1f}s", o.model, o.device.str(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return m;
}

// What one evaluation adds up over its packs.
struct EvalRun {
  EvalRun(const EvalOptions& o, EvalData& d, LoadedModel& m)
      : options(o), data(d), loaded(m), results(d.samples.size()) {}

  const EvalOptions& options;
  EvalData& data;
  LoadedModel& loaded;
  std::vector<SampleResult> results;
  Totals totals;
  int64_t images = 0, videos = 0;
  // Logits are written one sample at a time into a file whose layout is planned up front, under
  // a temporary name renamed into place once complete (WriteMode::kAtomic).
  std::optional<io::SafetensorsWriter> writer;
  // Gradients add up over the packs as sums of CE; divided by the label count at the end.
  std::optional<model::text::TextGrads> grads;
  std::optional<model::vision::VisionGrads> vision_grads;
  model::text::TrainOptions grad_options;
  model::text::ForwardOptions forward_options;
};

void open_outputs(EvalRun& r) {
  const EvalOptions& o = r.options;
  const int64_t vocab = r.loaded.model().text().vocab_size;
  if (!o.dump_logits.empty()) {
    std::vector<io::TensorSpec> specs;
    for (size_t i = 0; i < r.data.samples.size(); ++i)
      if (r.data.out_index[i] >= 0)
        specs.push_back({fmt::format("logits.{}", r.data.out_index[i]),
                         DType::f32,
                         {r.data.samples[i].length, vocab}});
    r.writer.emplace(o.dump_logits, std::move(specs), io::Metadata{{"format", "pt"}},
                     io::WriteMode::kAtomic);
  }
  if (!o.dump_grads.empty()) {
    r.grads.emplace(model::text::TextGrads::zeros_like(r.loaded.model().weights()));
    if (r.loaded.vl)
      r.vision_grads.emplace(model::vision::VisionGrads::zeros_like(r.loaded.vl->vision()));
    r.grad_options.mtp = false;
    r.grad_options.balancing_alpha = 0;
    r.grad_options.lm_denominator = 1;
    r.grad_options.loss_chunk_rows = o.loss_chunk;
  }
  r.forward_options.logits = false;
  r.forward_options.loss_chunk_rows = o.loss_chunk;
  r.forward_options.mtp = o.mtp && !r.grads;
}

// The pack's documents, loaded from their readers where they are not held in memory.
data::Pack build_pack(EvalData& d, const PackPlan& p, std::vector<int64_t>& dataset_indices) {
  std::vector<data::TokenizedSample> docs;
  for (int64_t i : p.samples)
    if (d.samples[size_t(i)].dataset_index >= 0)
      dataset_indices.push_back(d.samples[size_t(i)].dataset_index);
  std::vector<data::TokenizedSample> loaded;
  if (!dataset_indices.empty())
    loaded = p.vl ? d.vl_dataset->load(dataset_indices) : d.dataset->load(dataset_indices);
  size_t next_loaded = 0;
  for (int64_t i : p.samples)
    docs.push_back(d.samples[size_t(i)].tokens ? *d.samples[size_t(i)].tokens
                                               : std::move(loaded[next_loaded++]));
  // pack_media finds a VL pack's conversations by their dataset indices.
  return data::build_pack(docs, p.vl ? dataset_indices : p.samples, p.length, d.pad_id);
}

// Each document's loss from its own rows of the final norm's output `normed` (on the model's
// device); its logits to the dump file when one is written.
void score_documents(EvalRun& r, const PackPlan& p, const data::Pack& pack, const Tensor& normed) {
  const model::text::TextWeights& weights = r.loaded.model().weights();
  for (size_t d = 0; d < p.samples.size(); ++d) {
    const int64_t b = pack.cu_seqlens[d], e = pack.cu_seqlens[d + 1];
    const Tensor rows = normed.slice(0, b, e).contiguous();
    const Tensor labels =
        int32_tensor(std::vector<int32_t>(pack.labels.begin() + b, pack.labels.begin() + e));
    ops::CrossEntropyResult ce;
    if (r.writer) {
      // The head's product in f32 (on a GPU: bf16 operands, f32 accumulation and output), so
      // the dump holds no rounding the loss does not see; the loss from those logits.
      Tensor logits =
          Tensor::empty({e - b, weights.lm_head.weight.size(0)}, DType::f32, rows.device());
      const ops::Linear& head = weights.lm_head;
      ops::linear_out(logits, rows, head.weight);
      if (head.lora.defined()) {
        // The adapter's scale · (h Aᵀ) Bᵀ accumulated into the same f32 logits.
        Tensor u = ops::linear(rows, head.lora.A);
        ops::scale_into(u, head.lora.scale);
        ops::linear_out(logits, u, head.lora.B, Tensor(), /*accumulate=*/true);
      }
      logits = logits.to(Device::cpu());
      ce = ops::cross_entropy_forward(logits, labels);
      r.writer->write(fmt::format("logits.{}", r.data.out_index[size_t(p.samples[d])]), logits);
    } else {
      ops::CrossEntropyOptions ce_opts;
      ce_opts.chunk_rows = r.options.loss_chunk;
      ce = ops::lm_head_cross_entropy(rows, weights.lm_head, labels, ce_opts);
    }
    r.results[size_t(p.samples[d])] = {ce.loss_sum, ce.n_tokens};
  }
}

// One pack: its forward (or the training forward and backward for gradients), then the losses.
void run_pack(EvalRun& r, const PackPlan& p) {
  const model::text::TextModel& model = r.loaded.model();
  std::vector<int64_t> dataset_indices;
  const data::Pack pack = build_pack(r.data, p, dataset_indices);
  // Decoding errors name the conversation's file:line, as in training.
  model::PackMedia media;
  if (p.vl) media = train::pack_media(*r.data.vl_dataset, pack);
  GLMTUNE_ASSERT(media.empty() || r.loaded.vl, "a pack with media but no vision tower loaded");
  r.images += int64_t(media.image_grid.size());
  r.videos += int64_t(media.video_grid.size());

  model::text::PackInput in;
  in.input_ids = int32_tensor(pack.input_ids);
  in.cu_seqlens = int32_tensor(pack.cu_seqlens);
  // The forward's own LM loss is over the whole pack; the per-sample losses are computed from the
  // documents' rows. Labels go in only for the MTP loss, which needs them.
  const bool run_mtp = model.has_mtp() && r.forward_options.mtp;
  if (run_mtp || r.grads) in.labels = int32_tensor(pack.labels);
  in.padding_tokens = pack.num_padding;
  const auto start = std::chrono::steady_clock::now();
  const model::ComposeOptions compose_options;  // nothing frozen: every gradient is dumped
  model::text::ForwardOutput out;
  std::shared_ptr<model::text::ForwardContext> context;
  std::optional<model::ComposeTrainForward> composed;
  Tensor normed;
  if (r.grads && r.loaded.vl) {
    composed.emplace(
        model::compose_training_forward(*r.loaded.vl, in, media, r.grad_options, compose_options));
    normed = composed->text.context->final_normed;
  } else if (r.grads) {
    context = model::text::training_forward(model, in, r.grad_options).context;
    normed = context->final_normed;
  } else {
    out = r.loaded.vl ? model::compose_forward(*r.loaded.vl, in, media, r.forward_options)
                      : model.forward(in, r.forward_options);
    // The forward's final norm, recomputed from its output (the same op on the same input), then
    // the head applied to one document's rows at a time.
    normed = ops::rms_norm(out.hidden, model.weights().final_norm, model.text().rms_norm_eps);
  }
  score_documents(r, p, pack, normed);
  if (composed)
    model::compose_backward(*r.loaded.vl, *composed, r.grad_options, compose_options, *r.grads,
                            *r.vision_grads);
  else if (r.grads)
    model::text::backward(model, in, *context, r.grad_options, *r.grads);
  // The losses were read back to the host above, so the device's work is done.
  r.totals.seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (out.mtp) {
    r.totals.mtp_sum.resize(out.mtp->ce.size(), 0.0);
    r.totals.mtp_count.resize(out.mtp->ce.size(), 0);
    for (size_t k = 0; k < out.mtp->ce.size(); ++k) {
      r.totals.mtp_sum[k] += out.mtp->ce[k].sum;
      r.totals.mtp_count[k] += out.mtp->ce[k].count;
    }
  }
  ++r.totals.packs;
  r.totals.slots += int64_t(pack.input_ids.size());
  r.totals.tokens += int64_t(pack.input_ids.size()) - pack.num_padding;
}

// The gradients of the mean LM loss over `label_tokens` targets, under the released names (the
// tower's and projector's too when it ran), written atomically.
void write_grads(EvalRun& r, int64_t label_tokens) {
  auto views = train::released_views(
      r.loaded.store, [&](const model::InternalParam& p) { return r.grads->find(p.name); });
  if (r.vision_grads) {
    // The tower's and projector's gradients, already under their released names and shapes,
    // merged into the released layout's order.
    std::map<std::string, Tensor> by_name(views.begin(), views.end());
    for (auto& [name, g] : r.vision_grads->released(r.loaded.vl->vision_config()))
      by_name.emplace(name, std::move(g));
    views.clear();
    for (const model::ParamSpec& spec : model::released_layout(r.loaded.store.config())) {
      auto it = by_name.find(spec.name);
      if (it == by_name.end()) continue;
      GLMTUNE_ASSERT(it->second.shape() == spec.shape, "gradient '{}' is {}, released {}",
                     spec.name, shape_str(it->second.shape()), shape_str(spec.shape));
      views.emplace_back(spec.name, it->second);
    }
  }
  std::vector<io::TensorSpec> specs;
  for (const auto& [name, g] : views) specs.push_back({name, DType::f32, g.shape()});
  io::SafetensorsWriter grad_writer(
      r.options.dump_grads, std::move(specs),
      io::Metadata{{"format", "pt"},
                   {"objective", "mean LM cross-entropy (no MTP, no balancing loss)"},
                   {"tokens", std::to_string(label_tokens)}},
      io::WriteMode::kAtomic);
  for (const auto& [name, g] : views) {
    const Tensor mean = g.to(DType::f32).contiguous();
    float* v = mean.data<float>();
    for (int64_t i = 0; i < mean.numel(); ++i) v[i] = float(double(v[i]) / double(label_tokens));
    grad_writer.write(name, mean);
  }
  grad_writer.finish();
}

// The result of the packs run so far: per-sample losses and the totals.
EvalResult summarize(const EvalRun& r) {
  EvalResult res;
  res.device = r.options.device;
  double lm_sum = 0;
  for (size_t i = 0; i < r.data.samples.size(); ++i) {
    if (r.data.out_index[i] < 0) continue;
    const SampleResult& s = r.results[i];
    lm_sum += s.sum;
    res.tokens += s.count;
    SampleLoss out;
    // A sample without label tokens has no loss (none rather than a made-up number).
    if (s.count > 0) out.loss = s.sum / double(s.count);
    out.tokens = s.count;
    out.length = r.data.samples[i].length;
    out.source = r.data.samples[i].source;
    res.per_sample.push_back(std::move(out));
  }
  if (res.tokens == 0)
    throw Error("no token carries a loss", "glmtune eval",
                "evaluate text with at least two tokens, or chat data with assistant turns");
  res.loss = lm_sum / double(res.tokens);
  res.mtp_loss_scale = r.forward_options.mtp_loss_scale;
  if (!r.totals.mtp_sum.empty()) {
    double mean = 0;
    for (size_t k = 0; k < r.totals.mtp_sum.size(); ++k)
      mean += r.totals.mtp_count[k] > 0 ? r.totals.mtp_sum[k] / double(r.totals.mtp_count[k]) : 0;
    mean /= double(r.totals.mtp_sum.size());
    res.mtp_loss = res.mtp_loss_scale * mean;
    res.mtp_ce = mean;
    res.mtp_targets = r.totals.mtp_count[0];
  }
  res.samples = r.data.evaluated;
  res.images = r.images;
  res.videos = r.videos;
  res.packs = r.totals.packs;
  res.input_tokens = r.totals.tokens;
  res.slots = r.totals.slots;
  res.seconds = r.totals.seconds;
  return res;
}

}  // namespace

double EvalResult::perplexity() const { return std::exp(loss); }

double EvalResult::tokens_per_second() const {
  return double(input_tokens) / std::max(seconds, 1e-9);
}

nlohmann::ordered_json EvalResult::to_json() const {
  nlohmann::ordered_json j;
  j["loss"] = loss;
  j["tokens"] = tokens;
  nlohmann::ordered_json samples_json = nlohmann::ordered_json::array();
  for (const SampleLoss& s : per_sample) {
    nlohmann::ordered_json o;
    o["loss"] = s.loss ? nlohmann::ordered_json(*s.loss) : nlohmann::ordered_json(nullptr);
    o["tokens"] = s.tokens;
    o["length"] = s.length;
    o["source"] = s.source;
    samples_json.push_back(std::move(o));
  }
  j["per_sample"] = std::move(samples_json);
  j["mtp_loss"] = nullptr;
  if (mtp_loss) {
    j["mtp_loss"] = *mtp_loss;
    j["mtp_ce"] = *mtp_ce;
    j["mtp_targets"] = mtp_targets;
  }
  j["perplexity"] = perplexity();
  j["samples"] = samples;
  j["images"] = images;
  j["videos"] = videos;
  j["packs"] = packs;
  j["input_tokens"] = input_tokens;
  j["slots"] = slots;
  j["seconds"] = seconds;
  j["tokens_per_second"] = tokens_per_second();
  j["device"] = device.str();
  return j;
}

EvalResult evaluate(const EvalOptions& o) {
  if (o.data.empty() && o.text.empty())
    throw Error("nothing to evaluate", "glmtune eval", "give --data FILE.jsonl or --text");
  check_device(o);
  // Output locations that cannot be written fail before the model is loaded.
  if (!o.dump_logits.empty()) create_parent_directory(o.dump_logits, "--dump-logits");
  if (!o.dump_grads.empty()) create_parent_directory(o.dump_grads, "--dump-grads");
  const model::ModelConfig config =
      model::ModelConfig::from_file((fs::path(o.model) / "config.json").string());
  EvalData data = read_data(o, config);
  LoadedModel loaded = load_model(o, config, data.has_media());
  EvalRun run(o, data, loaded);
  open_outputs(run);
  int64_t planned_tokens = 0;
  for (const PackPlan& p : data.plan) planned_tokens += p.length;
  std::optional<Progress> progress;
  if (o.progress) {
    Progress::Options po;
    po.unit = "tokens";
    progress.emplace("eval", uint64_t(planned_tokens), po);
  }
  for (const PackPlan& p : data.plan) {
    run_pack(run, p);
    if (progress) progress->advance(uint64_t(p.length));
  }
  if (progress) progress->finish();
  EvalResult result = summarize(run);
  if (run.writer) {
    run.writer->finish();
    run.writer.reset();
  }
  if (run.grads) write_grads(run, result.tokens);
  return result;
}

}  // namespace glmtune::eval
