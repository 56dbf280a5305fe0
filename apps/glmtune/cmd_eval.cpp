// `glmtune eval`: the text model's loss, MTP loss and perplexity over data, on the CPU reference
// path (docs/model/text_model.md, "glmtune eval").
//
// Data comes from --text, from chat / text JSONL (tokenized with the checkpoint's tokenizer and
// packed into fixed-length packs, as training does) and from pre-tokenised JSONL, one
// {"input_ids": [...], "labels": [...]} document per line (labels in the Hugging Face convention:
// unshifted, -100 ignored). Several documents share one forward for speed; the forward computes
// every document as if alone, and the per-document losses and logits below are taken from that
// document's rows only, so packing changes no number.
//
// --dump-grads runs the training forward and backward instead of the plain forward and writes the
// gradient of the reported loss (the mean LM cross-entropy over every label token; no MTP, no
// balancing loss) for every trainable parameter, under the released names.
//
// With --media-root, chat files go through the vision-language pipeline training uses
// (train/vl_batch.h): image and video content items are resolved against the media root,
// expanded with the processor of the tokenizer folder, decoded pack by pack and spliced into the
// token stream by the composed model (model/compose.h). A VL sample is never cut (its media
// placeholders would lose their features): one longer than --pack-length gets a pack of its own.

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>

#include "command.h"
#include "glmtune/base/error.h"
#include "glmtune/data/dataset.h"
#include "glmtune/data/media/vl_processor.h"
#include "glmtune/data/packing.h"
#include "glmtune/data/tokenizer.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/io/mmap_file.h"
#include "glmtune/io/safetensors.h"
#include "glmtune/model/compose.h"
#include "glmtune/model/layout.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/model.h"
#include "glmtune/ops/cross_entropy.h"
#include "glmtune/ops/linear.h"
#include "glmtune/ops/norm.h"
#include "glmtune/train/released.h"
#include "glmtune/train/vl_batch.h"

namespace {

using namespace glmtune;
namespace fs = std::filesystem;

struct EvalArgs {
  std::string model;
  std::vector<std::string> data;
  std::string text;
  std::string tokenizer;
  std::string media_root;
  std::string dump_logits;
  std::string dump_grads;
  int64_t pack_length = 4096;
  int64_t max_packs = 0;
  int64_t loss_chunk = 1024;
  bool no_mtp = false;
  bool json = false;
};

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
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error("cannot open the data file", file, "check the path");
  std::vector<EvalSample> samples;
  std::optional<Error> first_error;
  bool pretokenised = false;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", file, n);
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

// Deletes a partly written output file unless it was completed and renamed.
class TempFile {
 public:
  explicit TempFile(fs::path final_path)
      : final_(std::move(final_path)),
        tmp_(final_.string() + ".tmp." + std::to_string(::getpid())) {}
  ~TempFile() {
    std::error_code ec;
    if (!committed_) fs::remove(tmp_, ec);
  }
  const fs::path& path() const { return tmp_; }
  void commit() {
    fs::rename(tmp_, final_);
    io::sync_directory(final_.parent_path().empty() ? fs::path(".") : final_.parent_path());
    committed_ = true;
  }

 private:
  fs::path final_, tmp_;
  bool committed_ = false;
};

}  // namespace

GLMTUNE_COMMAND(
    eval, "eval",
    "Evaluate loss, MTP loss and perplexity of a checkpoint on text, JSONL or vision-language data",
    [](CLI::App& app) {
      auto a = std::make_shared<EvalArgs>();
      app.add_option("--model", a->model, "Checkpoint directory (config.json, weights, tokenizer)")
          ->required();
      app.add_option("--data", a->data,
                     "JSONL file(s): pre-tokenised ({\"input_ids\": [...], \"labels\": [...]}), "
                     "chat ({\"messages\": ...}) or text ({\"text\": ...}) lines");
      app.add_option("--text", a->text, "A text to evaluate, as one {\"text\": ...} sample");
      app.add_option("--media-root", a->media_root,
                     "Evaluate chat files as vision-language conversations: {\"type\": "
                     "\"image\", \"image\": PATH} / {\"type\": \"video\", \"video\": PATH} "
                     "content items, relative PATHs resolved against this folder (docs/vision.md)");
      app.add_option("--tokenizer", a->tokenizer,
                     "Folder with tokenizer.json and, for --media-root, processor_config.json "
                     "(default: the --model folder)");
      app.add_option("--dump-logits", a->dump_logits,
                     "Write each sample's logits as float32 logits.<i> [len_i, vocab] to this "
                     "safetensors file");
      app.add_option(
          "--dump-grads", a->dump_grads,
          "Write the gradient of the reported loss (mean LM cross-entropy; no MTP, no "
          "balancing loss) for every trainable parameter, float32 under the released "
          "names, to this safetensors file (with images or videos in the data, the vision "
          "tower's and projector's model.visual.* too)");
      app.add_option("--pack-length", a->pack_length,
                     "Tokens per pack (chat / text samples longer than this are truncated; a "
                     "longer pre-tokenised or vision-language sample gets a pack of its own)")
          ->check(CLI::PositiveNumber);
      app.add_option("--max-packs", a->max_packs, "Stop after this many packs (0: all)")
          ->check(CLI::NonNegativeNumber);
      app.add_option("--loss-chunk", a->loss_chunk, "Rows per lm_head chunk of the loss")
          ->check(CLI::PositiveNumber);
      app.add_flag("--no-mtp", a->no_mtp, "Skip the MTP layer");
      app.add_flag("--json", a->json, "Print one JSON object instead of a summary");
      return [a] {
        if (a->data.empty() && a->text.empty())
          throw Error("nothing to evaluate", "glmtune eval", "give --data FILE.jsonl or --text");
        // Progress goes to stdout through the default logger; --json keeps stdout one object.
        if (a->json) spdlog::set_level(spdlog::level::warn);
        const fs::path dir(a->model);
        const model::ModelConfig config =
            model::ModelConfig::from_file((dir / "config.json").string());
        const int64_t vocab = config.text().vocab_size;

        // Pre-tokenised files are read (and checked) before the slow model load.
        std::vector<EvalSample> samples;
        std::vector<PackPlan> plan;
        std::vector<std::string> dataset_files, vl_files;
        std::vector<std::vector<EvalSample>> pretokenised;
        for (const std::string& file : a->data) {
          ChatFileScan scan;
          if (auto s = read_pretokenised(file, vocab, scan)) {
            pretokenised.push_back(std::move(*s));
          } else if (!a->media_root.empty() && scan.has_messages) {
            vl_files.push_back(file);
          } else {
            // The text reader would refuse the line too, but without pointing at --media-root.
            if (!scan.first_media.empty())
              throw Error(
                  "the conversation has image or video content items but no --media-root "
                  "was given",
                  scan.first_media,
                  "give --media-root DIR (the folder relative media paths resolve "
                  "against) to evaluate vision-language data");
            dataset_files.push_back(file);
          }
        }
        const fs::path tokenizer_dir = a->tokenizer.empty() ? dir : fs::path(a->tokenizer);

        // The tokenizer is needed only for --text and chat / text data.
        std::optional<data::Tokenizer> tokenizer;
        int32_t pad_id = 0;  // never written when no pack is padded
        if (!a->text.empty() || !dataset_files.empty() || !vl_files.empty()) {
          const fs::path tokenizer_file = tokenizer_dir / "tokenizer.json";
          if (!fs::exists(tokenizer_file))
            throw Error(a->tokenizer.empty() ? "the checkpoint has no tokenizer.json"
                                             : "the --tokenizer folder has no tokenizer.json",
                        tokenizer_file.string(),
                        "copy the model's tokenizer files next to its weights (glmtune init "
                        "--tokenizer DIR does this for random checkpoints), give --tokenizer DIR, "
                        "or give pre-tokenised {\"input_ids\": ...} lines");
          tokenizer = data::Tokenizer::from_file(tokenizer_file.string());
          pad_id = tokenizer->require_id("<|endoftext|>");
          if (tokenizer->vocab_size() > vocab)
            throw Error(fmt::format("the tokenizer has {} tokens but the model only {}",
                                    tokenizer->vocab_size(), vocab),
                        tokenizer_file.string(), "use the tokenizer that came with the checkpoint");
        }

        if (!a->text.empty()) {
          // The same sample a {"text": ...} line gives: the text, a final <|endoftext|>, all
          // tokens trained.
          data::TokenizedSample s;
          s.input_ids = tokenizer->encode(a->text);
          s.input_ids.push_back(pad_id);
          s.labels = s.input_ids;
          EvalSample e;
          e.length = int64_t(s.input_ids.size());
          e.tokens = std::move(s);
          e.source = "--text";
          plan.push_back({{int64_t(samples.size())}, e.length});
          samples.push_back(std::move(e));
        }
        for (auto& file_samples : pretokenised) {
          // Documents in file order, packed greedily up to --pack-length tokens without padding. A
          // longer document is never cut (that would change its numbers): it gets its own pack.
          PackPlan pack;
          for (EvalSample& s : file_samples) {
            if (!pack.samples.empty() && pack.length + s.length > a->pack_length) {
              plan.push_back(std::move(pack));
              pack = {};
            }
            pack.samples.push_back(int64_t(samples.size()));
            pack.length += s.length;
            samples.push_back(std::move(s));
          }
          if (!pack.samples.empty()) plan.push_back(std::move(pack));
        }
        std::optional<data::JsonlDataset> dataset;
        if (!dataset_files.empty()) {
          data::DatasetConfig dc;
          dc.files = dataset_files;
          dc.max_length = a->pack_length;
          dataset = data::JsonlDataset::scan(dc, *tokenizer);
          if (dataset->size() == 0)
            throw Error("no usable sample in the data",
                        fmt::format("{}", fmt::join(dataset_files, ", ")),
                        "check the files' format (docs/data.md)");
          std::vector<int64_t> order(size_t(dataset->size()));
          std::iota(order.begin(), order.end(), 0);
          const int64_t first = int64_t(samples.size());
          for (int64_t i = 0; i < dataset->size(); ++i) {
            EvalSample e;
            e.dataset_index = i;
            e.length = dataset->length(i);
            e.source = fmt::format("dataset sample {}", i);
            samples.push_back(std::move(e));
          }
          for (auto& indices : data::plan_packs(
                   order, [&](int64_t i) { return dataset->length(i); }, a->pack_length, 100)) {
            for (int64_t& i : indices) i += first;
            plan.push_back({std::move(indices), a->pack_length});
          }
        }
        // Vision-language conversations, read as training reads them (VlDataset: tokens from the
        // media headers now, pixels decoded per pack), with the same per-line errors.
        std::unique_ptr<data::media::VlProcessor> processor;
        std::optional<train::VlDataset> vl_dataset;
        if (!vl_files.empty()) {
          if (!fs::is_directory(a->media_root))
            throw Error("--media-root is not a folder", a->media_root,
                        "give the folder that the data's relative media paths resolve against");
          if (!fs::exists(tokenizer_dir / "processor_config.json") &&
              !fs::exists(tokenizer_dir / "preprocessor_config.json"))
            throw Error(
                "no processor_config.json next to the tokenizer: vision-language data needs "
                "the image and video processor settings",
                tokenizer_dir.string(),
                "copy processor_config.json from the model release into that folder, or "
                "give --tokenizer DIR with the release's processor folder");
          processor = std::make_unique<data::media::VlProcessor>(
              data::media::VlProcessor::from_dir(tokenizer_dir));
          train::VlDataConfig vc;
          vc.files = vl_files;
          vc.media_root = a->media_root;
          // Nothing is dropped for its length: a longer sample gets a pack of its own below.
          vc.max_length = std::numeric_limits<int64_t>::max();
          vc.on_bad_line = data::BadLinePolicy::kFail;
          vl_dataset.emplace(train::VlDataset::scan(vc, *processor));
          if (vl_dataset->size() == 0)
            throw Error("no usable sample in the data",
                        fmt::format("{}", fmt::join(vl_files, ", ")),
                        "check the conversations: each needs an assistant turn to score "
                        "(docs/vision.md)");
          std::vector<int64_t> order;
          std::vector<int64_t> alone;
          const int64_t first = int64_t(samples.size());
          for (int64_t i = 0; i < vl_dataset->size(); ++i) {
            EvalSample e;
            e.dataset_index = i;
            e.vl = true;
            e.length = vl_dataset->length(i);
            e.source = vl_dataset->where(i);
            samples.push_back(std::move(e));
            (vl_dataset->length(i) <= a->pack_length ? order : alone).push_back(i);
          }
          for (auto& indices : data::plan_packs(
                   order, [&](int64_t i) { return vl_dataset->length(i); }, a->pack_length, 100)) {
            for (int64_t& i : indices) i += first;
            plan.push_back({std::move(indices), a->pack_length, true});
          }
          for (int64_t i : alone) plan.push_back({{first + i}, vl_dataset->length(i), true});
        }
        // Checked before the checkpoint is read, not at the first pack with media.
        if (vl_dataset && vl_dataset->has_media())
          config.require_media_tokens("the --media-root data has images or videos");
        if (a->max_packs > 0 && int64_t(plan.size()) > a->max_packs)
          plan.resize(size_t(a->max_packs));

        // Output numbering: the evaluated samples in sample order (--text, pre-tokenised lines in
        // file order, then the chat / text samples), whatever pack they went to.
        std::vector<int64_t> out_index(samples.size(), -1);
        for (const PackPlan& p : plan)
          for (int64_t i : p.samples) out_index[size_t(i)] = 0;
        int64_t evaluated = 0;
        for (int64_t& o : out_index)
          if (o == 0) o = evaluated++;

        const auto load_start = std::chrono::steady_clock::now();
        // The store stays for --dump-grads, which names gradients as the checkpoint names weights.
        const io::CheckpointReader reader = io::CheckpointReader::open(dir);
        const model::ParamStore store = model::ParamStore::load(reader, config);
        // The vision tower is loaded only for data that has media; then the composed model holds
        // the text model every pack runs on.
        std::optional<model::VisionLanguageModel> vl_model;
        std::optional<model::text::TextModel> text_model;
        if (vl_dataset && vl_dataset->has_media())
          vl_model.emplace(store);
        else
          text_model.emplace(store);
        const model::text::TextModel& model = vl_model ? vl_model->text() : *text_model;
        spdlog::info(
            "loaded {} in {:.1f}s", a->model,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count());

        // Logits are written one sample at a time into a file whose layout is planned up front,
        // under a temporary name renamed into place once complete.
        std::optional<TempFile> dump_file;
        std::optional<io::SafetensorsWriter> writer;
        if (!a->dump_logits.empty()) {
          std::vector<io::TensorSpec> specs;
          for (size_t i = 0; i < samples.size(); ++i)
            if (out_index[i] >= 0)
              specs.push_back(
                  {fmt::format("logits.{}", out_index[i]), DType::f32, {samples[i].length, vocab}});
          dump_file.emplace(a->dump_logits);
          writer.emplace(dump_file->path(), std::move(specs), io::Metadata{{"format", "pt"}});
        }

        // Gradients add up over the packs as sums of CE; divided by the label count at the end.
        std::optional<model::text::TextGrads> grads;
        std::optional<model::vision::VisionGrads> vision_grads;
        const model::ComposeOptions compose_options;  // nothing frozen: every gradient is dumped
        model::text::TrainOptions grad_options;
        if (!a->dump_grads.empty()) {
          grads.emplace(model::text::TextGrads::zeros_like(model.weights()));
          if (vl_model)
            vision_grads.emplace(model::vision::VisionGrads::zeros_like(vl_model->vision()));
          grad_options.mtp = false;
          grad_options.balancing_alpha = 0;
          grad_options.lm_denominator = 1;
          grad_options.loss_chunk_rows = a->loss_chunk;
        }

        model::text::ForwardOptions options;
        options.logits = false;
        options.loss_chunk_rows = a->loss_chunk;
        options.mtp = !a->no_mtp && !grads;
        const bool run_mtp = model.has_mtp() && options.mtp;
        const model::text::TextWeights& weights = model.weights();
        std::vector<SampleResult> results(samples.size());
        Totals totals;
        int64_t images = 0, videos = 0;
        auto last_log = std::chrono::steady_clock::now();
        for (const PackPlan& p : plan) {
          std::vector<data::TokenizedSample> docs;
          std::vector<int64_t> dataset_indices;
          for (int64_t i : p.samples)
            if (samples[size_t(i)].dataset_index >= 0)
              dataset_indices.push_back(samples[size_t(i)].dataset_index);
          std::vector<data::TokenizedSample> loaded;
          if (!dataset_indices.empty())
            loaded = p.vl ? vl_dataset->load(dataset_indices) : dataset->load(dataset_indices);
          size_t next_loaded = 0;
          for (int64_t i : p.samples)
            docs.push_back(samples[size_t(i)].tokens ? *samples[size_t(i)].tokens
                                                     : std::move(loaded[next_loaded++]));
          // pack_media finds a VL pack's conversations by their dataset indices.
          const data::Pack pack =
              data::build_pack(docs, p.vl ? dataset_indices : p.samples, p.length, pad_id);
          // Decoding errors name the conversation's file:line, as in training.
          model::PackMedia media;
          if (p.vl) media = train::pack_media(*vl_dataset, pack);
          GLMTUNE_ASSERT(media.empty() || vl_model, "a pack with media but no vision tower loaded");
          images += int64_t(media.image_grid.size());
          videos += int64_t(media.video_grid.size());

          model::text::PackInput in;
          in.input_ids = int32_tensor(pack.input_ids);
          in.cu_seqlens = int32_tensor(pack.cu_seqlens);
          // The forward's own LM loss is over the whole pack; the per-sample losses are computed
          // below. Labels go in only for the MTP loss, which needs them.
          if (run_mtp || grads) in.labels = int32_tensor(pack.labels);
          in.padding_tokens = pack.num_padding;
          const auto start = std::chrono::steady_clock::now();
          model::text::ForwardOutput out;
          std::shared_ptr<model::text::ForwardContext> context;
          std::optional<model::ComposeTrainForward> composed;
          Tensor normed;
          if (grads && vl_model) {
            composed.emplace(model::compose_training_forward(*vl_model, in, media, grad_options,
                                                             compose_options));
            normed = composed->text.context->final_normed;
          } else if (grads) {
            context = model::text::training_forward(model, in, grad_options).context;
            normed = context->final_normed;
          } else {
            out = vl_model ? model::compose_forward(*vl_model, in, media, options)
                           : model.forward(in, options);
            // The forward's final norm, recomputed from its output (the same op on the same
            // input), then the head applied to one document's rows at a time.
            normed = ops::rms_norm(out.hidden, weights.final_norm, model.text().rms_norm_eps);
          }
          for (size_t d = 0; d < p.samples.size(); ++d) {
            const int64_t b = pack.cu_seqlens[d], e = pack.cu_seqlens[d + 1];
            const Tensor rows = normed.slice(0, b, e).contiguous();
            const Tensor labels = int32_tensor(
                std::vector<int32_t>(pack.labels.begin() + b, pack.labels.begin() + e));
            ops::CrossEntropyResult ce;
            if (writer) {
              const Tensor logits = ops::linear(rows, weights.lm_head);
              ce = ops::cross_entropy_forward(logits, labels);
              writer->write(fmt::format("logits.{}", out_index[size_t(p.samples[d])]), logits);
            } else {
              ops::CrossEntropyOptions ce_opts;
              ce_opts.chunk_rows = a->loss_chunk;
              ce = ops::lm_head_cross_entropy(rows, weights.lm_head, labels, ce_opts);
            }
            results[size_t(p.samples[d])] = {ce.loss_sum, ce.n_tokens};
          }
          if (composed)
            model::compose_backward(*vl_model, *composed, grad_options, compose_options, *grads,
                                    *vision_grads);
          else if (grads)
            model::text::backward(model, in, *context, grad_options, *grads);
          totals.seconds +=
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          if (out.mtp) {
            totals.mtp_sum.resize(out.mtp->ce.size(), 0.0);
            totals.mtp_count.resize(out.mtp->ce.size(), 0);
            for (size_t k = 0; k < out.mtp->ce.size(); ++k) {
              totals.mtp_sum[k] += out.mtp->ce[k].sum;
              totals.mtp_count[k] += out.mtp->ce[k].count;
            }
          }
          ++totals.packs;
          totals.slots += int64_t(pack.input_ids.size());
          totals.tokens += int64_t(pack.input_ids.size()) - pack.num_padding;
          const auto now = std::chrono::steady_clock::now();
          if (now - last_log > std::chrono::seconds(10)) {
            last_log = now;
            spdlog::info("pack {}/{}", totals.packs, plan.size());
          }
        }

        // The loss is the mean over every label token of every sample (not a mean of means).
        double lm_sum = 0;
        int64_t lm_count = 0;
        nlohmann::ordered_json per_sample = nlohmann::ordered_json::array();
        for (size_t i = 0; i < samples.size(); ++i) {
          if (out_index[i] < 0) continue;
          const SampleResult& r = results[i];
          lm_sum += r.sum;
          lm_count += r.count;
          nlohmann::ordered_json s;
          // A sample without label tokens has no loss (null rather than a made-up number).
          s["loss"] = r.count > 0 ? nlohmann::ordered_json(r.sum / double(r.count))
                                  : nlohmann::ordered_json(nullptr);
          s["tokens"] = r.count;
          s["length"] = samples[i].length;
          s["source"] = samples[i].source;
          per_sample.push_back(std::move(s));
        }
        if (lm_count == 0)
          throw Error("no token carries a loss", "glmtune eval",
                      "evaluate text with at least two tokens, or chat data with assistant turns");
        if (writer) {
          writer->finish();
          writer.reset();
          dump_file->commit();
        }
        if (grads) {
          auto views = train::released_views(
              store, [&](const model::InternalParam& p) { return grads->find(p.name); });
          if (vision_grads) {
            // The tower's and projector's gradients, already under their released names and
            // shapes, merged into the released layout's order.
            std::map<std::string, Tensor> by_name(views.begin(), views.end());
            for (auto& [name, g] : vision_grads->released(vl_model->vision_config()))
              by_name.emplace(name, std::move(g));
            views.clear();
            for (const model::ParamSpec& spec : model::released_layout(store.config())) {
              auto it = by_name.find(spec.name);
              if (it == by_name.end()) continue;
              GLMTUNE_ASSERT(it->second.shape() == spec.shape, "gradient '{}' is {}, released {}",
                             spec.name, shape_str(it->second.shape()), shape_str(spec.shape));
              views.emplace_back(spec.name, it->second);
            }
          }
          std::vector<io::TensorSpec> specs;
          for (const auto& [name, g] : views) specs.push_back({name, DType::f32, g.shape()});
          TempFile file(a->dump_grads);
          io::SafetensorsWriter grad_writer(
              file.path(), std::move(specs),
              io::Metadata{{"format", "pt"},
                           {"objective", "mean LM cross-entropy (no MTP, no balancing loss)"},
                           {"tokens", std::to_string(lm_count)}});
          for (const auto& [name, g] : views) {
            const Tensor mean = g.to(DType::f32).contiguous();
            float* v = mean.data<float>();
            for (int64_t i = 0; i < mean.numel(); ++i)
              v[i] = float(double(v[i]) / double(lm_count));
            grad_writer.write(name, mean);
          }
          grad_writer.finish();
          file.commit();
        }

        const double loss = lm_sum / double(lm_count);
        nlohmann::ordered_json j;
        j["loss"] = loss;
        j["tokens"] = lm_count;  // label tokens: the loss's denominator
        j["per_sample"] = std::move(per_sample);
        j["mtp_loss"] = nullptr;
        if (!totals.mtp_sum.empty()) {
          // The logged MTP loss is the training one: scale × mean over depths of each depth's
          // token-mean CE (here over every pack evaluated).
          double mean = 0;
          for (size_t k = 0; k < totals.mtp_sum.size(); ++k)
            mean += totals.mtp_count[k] > 0 ? totals.mtp_sum[k] / double(totals.mtp_count[k]) : 0;
          mean /= double(totals.mtp_sum.size());
          j["mtp_loss"] = options.mtp_loss_scale * mean;
          j["mtp_ce"] = mean;
          j["mtp_targets"] = totals.mtp_count[0];
        }
        j["perplexity"] = std::exp(loss);
        j["samples"] = evaluated;
        j["images"] = images;
        j["videos"] = videos;
        j["packs"] = totals.packs;
        j["input_tokens"] = totals.tokens;
        j["slots"] = totals.slots;
        j["seconds"] = totals.seconds;
        j["tokens_per_second"] = totals.tokens / std::max(totals.seconds, 1e-9);
        if (a->json) {
          std::printf("%s\n", j.dump().c_str());
        } else {
          std::printf("samples      %lld in %lld packs (%lld tokens, %lld slots, %lld targets)\n",
                      (long long)evaluated, (long long)totals.packs, (long long)totals.tokens,
                      (long long)totals.slots, (long long)lm_count);
          if (images + videos > 0)
            std::printf("media        %lld images, %lld videos\n", (long long)images,
                        (long long)videos);
          std::printf("loss         %.6f\n", loss);
          std::printf("perplexity   %.4f\n", std::exp(loss));
          if (!j["mtp_loss"].is_null())
            std::printf("mtp_loss     %.6f (%.2f x mtp CE %.6f over %lld targets)\n",
                        j["mtp_loss"].get<double>(), options.mtp_loss_scale,
                        j["mtp_ce"].get<double>(), (long long)j["mtp_targets"].get<int64_t>());
          std::printf("tokens/s     %.1f (%.2fs forward)\n", j["tokens_per_second"].get<double>(),
                      totals.seconds);
          if (!a->dump_logits.empty()) std::printf("logits       %s\n", a->dump_logits.c_str());
          if (!a->dump_grads.empty()) std::printf("gradients    %s\n", a->dump_grads.c_str());
        }
        return 0;
      };
    });
