// `glmtune inspect`: what a checkpoint (or a preset) holds, counted from the config alone when
// there are no weights, and checked against the released layout when there are.

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "command.h"
#include "config_options.h"
#include "glmtune/base/error.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/model/init.h"
#include "glmtune/model/layout.h"
#include "glmtune/model/param_store.h"
#include "glmtune/train/plan.h"
#include "glmtune/train/state.h"

namespace {

using namespace glmtune;
using model::Json;

struct InspectArgs {
  cli::ConfigOptions config;
  std::string dir;
  bool json = false;
  bool verify = false;
  // train.freeze patterns: the device bytes with only the FP8 tensors they match kept in FP8
  // (train.frozen_weights = "fp8").
  std::vector<std::string> freeze;
};

Json counts_json(const model::ParamCounts& n) {
  Json kinds = Json::object();
  for (const auto& [name, k] : n.per_layer_kind)
    kinds[name] = {{"layers", k.layers},
                   {"params", k.params},
                   {"params_per_layer", k.layers ? k.params / k.layers : 0}};
  Json parts = Json::object();
  for (const auto& [name, k] : n.per_part) parts[name] = k;
  return {
      {"total", n.total},     {"text", n.text},     {"embeddings_and_head", n.embeddings_and_head},
      {"mtp", n.mtp},         {"vision", n.vision}, {"trainable", n.trainable},
      {"tensors", n.tensors}, {"bytes", n.bytes},   {"per_layer_kind", kinds},
      {"per_part", parts}};
}

std::string schedule_string(const model::TextConfig& t) {
  std::string s;
  for (int64_t l = 0; l < t.num_hidden_layers; ++l) {
    s += t.layer_types[l] == model::AttnKind::kda ? "K" : "D";
    s += t.mlp_layer_types[l] == model::MlpKind::dense ? "d" : "m";
    s += l + 1 < t.num_hidden_layers ? " " : "";
  }
  return s;
}

std::string billions(int64_t n) {
  return n >= 100'000'000 ? fmt::format("{:.2f}B", n / 1e9) : fmt::format("{:.3f}M", n / 1e6);
}

// `--verify`: a training checkpoint (step-N, with its COMPLETE manifest), every checkpoint of a
// run's output directory, or a model directory. Exit 1 when anything fails.
int verify(const std::string& dir, bool json) {
  namespace fs = std::filesystem;
  std::vector<std::pair<fs::path, io::VerifyReport>> reports;
  const fs::path path(dir);
  std::error_code ec;
  if (fs::is_directory(path / train::kCheckpointsDir, ec) &&
      !fs::exists(path / io::kIndexFileName, ec)) {
    std::vector<fs::path> steps;
    for (const auto& e : fs::directory_iterator(path / train::kCheckpointsDir, ec))
      if (e.is_directory() && e.path().filename().string().starts_with("step-"))
        steps.push_back(e.path());
    std::sort(steps.begin(), steps.end());
    if (steps.empty())
      throw Error("no checkpoint to verify", (path / train::kCheckpointsDir).string(),
                  "give a checkpoint directory (step-N) or a model directory");
    for (const auto& s : steps) reports.emplace_back(s, train::verify_training_checkpoint(s));
  } else if (fs::exists(path / train::kCompleteFile, ec) ||
             fs::exists(path / train::kTrainerStateFile, ec)) {
    reports.emplace_back(path, train::verify_training_checkpoint(path));
  } else {
    if (!fs::exists(path, ec)) throw Error("checkpoint not found", dir, "check the path");
    reports.emplace_back(path, io::verify_checkpoint(path));
  }
  bool all_ok = true;
  Json out = Json::array();
  for (const auto& [p, r] : reports) {
    all_ok = all_ok && r.ok();
    if (json) {
      Json problems = Json::array();
      for (const auto& q : r.problems)
        problems.push_back({{"file", q.file}, {"tensor", q.tensor}, {"problem", q.problem}});
      out.push_back({{"dir", p.string()},
                     {"ok", r.ok()},
                     {"verified", r.ok() && r.has_checksums},
                     {"has_checksums", r.has_checksums},
                     {"tensors_verified", r.tensors_verified},
                     {"bytes_verified", r.bytes_verified},
                     {"problems", problems}});
      continue;
    }
    if (!r.ok())
      std::printf("%s: CORRUPT, %zu problem%s:\n%s", p.string().c_str(), r.problems.size(),
                  r.problems.size() == 1 ? "" : "s", r.describe(SIZE_MAX, "  ").c_str());
    else if (r.has_checksums)
      std::printf("%s: OK, %ld tensors (%.3f GB) match their checksums\n", p.string().c_str(),
                  long(r.tensors_verified), double(r.bytes_verified) / 1e9);
    else
      std::printf(
          "%s: UNVERIFIED, no checksums (written by another tool or an older glmtune); "
          "its index and shard headers are consistent\n",
          p.string().c_str());
  }
  if (json) std::puts((reports.size() == 1 ? out[0] : out).dump(2).c_str());
  return all_ok ? 0 : 1;
}

// What `inspect` reports on a model: its config, the released layout's counts, the checkpoint's
// check when there are weights, and the device bytes of the weights under each way of holding
// them.
struct Inspection {
  model::ModelConfig config;
  model::ParamCounts counts;
  std::optional<model::CheckpointReport> report;
  // The checkpoint's own FP8 tensors, or where it has none, those the FP8 release stores in FP8.
  bool stored_fp8 = false;
  train::WeightBytes device;
  // --freeze: only the FP8 tensors the patterns freeze stay in FP8.
  bool frozen = false;
  train::WeightBytes frozen_device;
};

std::vector<std::regex> freeze_patterns(const InspectArgs& a,
                                        const std::vector<model::ParamSpec>& layout) {
  std::vector<std::regex> frozen;
  for (const std::string& pattern : a.freeze) try {
      frozen.emplace_back(pattern, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      throw Error(fmt::format("'{}' is not a regular expression ({})", pattern, e.what()),
                  "glmtune inspect --freeze",
                  "write an ECMAScript regular expression, e.g. 'mlp\\.experts\\.'");
    }
  for (size_t i = 0; i < frozen.size(); ++i)
    if (std::none_of(layout.begin(), layout.end(), [&](const model::ParamSpec& s) {
          return std::regex_search(s.name, frozen[i]);
        }))
      throw Error(
          fmt::format("the freeze pattern '{}' matches no parameter of this model", a.freeze[i]),
          "glmtune inspect --freeze",
          "patterns are searched in the released names, such as "
          "model.language_model.layers.1.mlp.experts.0.gate_proj.weight");
  return frozen;
}

Inspection inspect_model(const InspectArgs& a) {
  namespace fs = std::filesystem;
  Inspection in{a.dir.empty()
                    ? model::ModelConfig::preset(a.config.preset)
                    : model::ModelConfig::from_file((fs::path(a.dir) / "config.json").string())};
  a.config.apply(in.config);
  const model::ModelConfig& config = in.config;
  const auto layout = model::released_layout(config);
  in.counts = model::count_params(config, layout);
  const bool has_weights = !a.dir.empty() && (fs::exists(fs::path(a.dir) / io::kIndexFileName) ||
                                              fs::exists(fs::path(a.dir) / io::kSingleFileName));
  if (has_weights) {
    auto reader = io::CheckpointReader::open(a.dir);
    reader.validate();
    in.report = model::check_checkpoint(reader, config);
  }
  in.stored_fp8 = in.report && !in.report->fp8_weights.empty();
  const std::set<std::string> fp8_names =
      in.stored_fp8
          ? std::set<std::string>(in.report->fp8_weights.begin(), in.report->fp8_weights.end())
          : std::set<std::string>();
  const auto in_fp8 = [&](const model::ParamSpec& s) {
    return in.stored_fp8 ? fp8_names.count(s.name) > 0 : model::released_in_fp8(config, s);
  };
  in.device = train::device_weight_bytes(config, in_fp8);
  const std::vector<std::regex> frozen = freeze_patterns(a, layout);
  in.frozen = !frozen.empty();
  in.frozen_device = train::device_weight_bytes(config, [&](const model::ParamSpec& s) {
    return in_fp8(s) && std::any_of(frozen.begin(), frozen.end(),
                                    [&](const auto& re) { return std::regex_search(s.name, re); });
  });
  return in;
}

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

int print_inspection_json(const InspectArgs& a, const Inspection& in) {
  const model::TextConfig& t = in.config.text();
  const train::WeightBytes& device = in.device;
  Json out = {{"source", a.dir.empty() ? "preset " + a.config.preset : a.dir},
              {"config",
               {{"num_hidden_layers", t.num_hidden_layers},
                {"hidden_size", t.hidden_size},
                {"vocab_size", t.vocab_size},
                {"kda_layers", t.count(model::AttnKind::kda)},
                {"dsa_layers", t.count(model::AttnKind::dsa)},
                {"dense_layers", t.count(model::MlpKind::dense)},
                {"moe_layers", t.count(model::MlpKind::sparse)},
                {"n_routed_experts", t.n_routed_experts},
                {"num_experts_per_tok", t.num_experts_per_tok},
                {"mtp_layers", t.num_nextn_predict_layers},
                {"vision", in.config.vision().has_value()}}},
              {"schedule", schedule_string(t)},
              {"params", counts_json(in.counts)},
              {"device_weight_bytes",
               {{"bf16", device.bf16},
                {"fp8_base", device.fp8()},
                {"fp8_values", device.fp8_values},
                {"fp8_scales", device.fp8_scales},
                {"fp8_running_layer", device.fp8_running_layer},
                {"fp8_from", in.stored_fp8 ? "checkpoint" : "release layout"}}}};
  if (in.frozen) out["device_weight_bytes"]["fp8_frozen"] = in.frozen_device.fp8();
  if (in.report) {
    const model::CheckpointReport& r = *in.report;
    out["checkpoint"] = {{"tensors", r.tensors},
                         {"bytes", r.bytes},
                         {"dtype_tensors", r.dtype_tensors},
                         {"dtype_bytes", r.dtype_bytes},
                         {"fp8_weights", r.fp8_weights.size()},
                         {"f32_not_bf16", r.f32_not_bf16},
                         {"missing", r.missing},
                         {"unexpected", r.unexpected},
                         {"misshaped", Json::array()}};
    for (const auto& m : r.misshaped)
      out["checkpoint"]["misshaped"].push_back(
          {{"name", m.name}, {"expected", m.expected}, {"found", m.found}});
  }
  std::puts(out.dump(2).c_str());
  return in.report && !in.report->ok() ? 1 : 0;
}

void print_model_text(const InspectArgs& a, const Inspection& in) {
  const model::TextConfig& t = in.config.text();
  const model::ParamCounts& counts = in.counts;
  std::printf("%s\n", a.dir.empty() ? ("preset " + a.config.preset).c_str() : a.dir.c_str());
  std::printf("  text: %ld layers (%ld KDA, %ld DSA; %ld dense, %ld MoE), hidden %ld, vocab %ld\n",
              t.num_hidden_layers, t.count(model::AttnKind::kda), t.count(model::AttnKind::dsa),
              t.count(model::MlpKind::dense), t.count(model::MlpKind::sparse), t.hidden_size,
              t.vocab_size);
  std::printf("  MoE: %ld routed experts (top-%ld, %ld groups), %ld shared, width %ld\n",
              t.n_routed_experts, t.num_experts_per_tok, t.n_group, t.n_shared_experts,
              t.moe_intermediate_size);
  std::printf("  KDA: %ld heads x %ld; MLA: %ld heads; indexer: top-%ld tokens in pools of %ld\n",
              t.linear_num_heads, t.linear_head_dim, t.num_attention_heads, t.index_topk,
              t.index_kpool);
  std::printf("  MTP layers: %ld; vision: %s\n", t.num_nextn_predict_layers,
              in.config.vision() ? fmt::format("{} blocks, width {}", in.config.vision()->depth,
                                               in.config.vision()->hidden_size)
                                       .c_str()
                                 : "none");
  std::printf("  schedule (K=KDA D=DSA, d=dense m=MoE): %s\n", schedule_string(t).c_str());
  std::printf(
      "parameters: %s total (%s text, %s MTP, %s vision; %s embeddings + head), %s "
      "trainable\n",
      billions(counts.total).c_str(), billions(counts.text).c_str(), billions(counts.mtp).c_str(),
      billions(counts.vision).c_str(), billions(counts.embeddings_and_head).c_str(),
      billions(counts.trainable).c_str());
  for (const auto& [name, k] : counts.per_layer_kind)
    std::printf("  %-10s %3ld layers x %s = %s\n", name.c_str(), k.layers,
                billions(k.params / k.layers).c_str(), billions(k.params).c_str());
  std::printf("  %ld tensors, %.2f GB as stored by glmtune (bf16, fp32-kept parameters in f32)\n",
              counts.tensors, counts.bytes / 1e9);
}

void print_device_bytes_text(const Inspection& in) {
  const train::WeightBytes& device = in.device;
  const train::WeightBytes& frozen = in.frozen_device;
  std::printf("weights on a GPU (docs/plan.md counts a whole run):\n");
  std::printf("  dequantised to bf16 at load             %9.2f GiB\n", device.bf16 / kGiB);
  std::printf(
      "  FP8 kept (lora.base = \"fp8\")            %9.2f GiB: %.2f in FP8 codes and "
      "scales%s, the running layer %.2f in bf16, the rest %.2f\n",
      device.fp8() / kGiB, (device.fp8_values + device.fp8_scales) / kGiB,
      in.stored_fp8 ? "" : " (as the FP8 release stores them)", device.fp8_running_layer / kGiB,
      device.fp8_others / kGiB);
  if (in.frozen)
    std::printf(
        "  FP8 kept where --freeze matches       %9.2f GiB: %.2f in FP8 codes and scales, "
        "the running layer %.2f in bf16, the rest %.2f (train.frozen_weights = \"fp8\")\n",
        frozen.fp8() / kGiB, (frozen.fp8_values + frozen.fp8_scales) / kGiB,
        frozen.fp8_running_layer / kGiB, frozen.fp8_others / kGiB);
}

// The checkpoint's tensors by dtype and its check against the layout; 1 when it fails.
int print_checkpoint_text(const model::CheckpointReport& report) {
  std::printf("checkpoint: %ld tensors, %.2f GB on disk\n", report.tensors, report.bytes / 1e9);
  for (const auto& [dtype, n] : report.dtype_tensors)
    std::printf("  %-8s %6ld tensors %10.3f GB\n", dtype.c_str(), n,
                report.dtype_bytes.at(dtype) / 1e9);
  if (!report.fp8_weights.empty())
    std::printf("  %zu FP8 weights with block scales\n", report.fp8_weights.size());
  // An export in float32: glmtune keeps the values, but its checkpoints store the released
  // dtypes, so a model trained from it is saved rounded (docs/checkpoints.md).
  if (!report.f32_not_bf16.empty())
    std::printf(
        "  %zu tensors stored in f32 that the release stores in bf16 (e.g. %s): computed "
        "with their f32 values; a glmtune train checkpoint stores them in bf16\n",
        report.f32_not_bf16.size(), report.f32_not_bf16.front().c_str());
  if (report.ok())
    std::printf("  layout: complete, no unexpected or mis-shaped tensors\n");
  else
    std::printf("%s", report.describe().c_str());
  return report.ok() ? 0 : 1;
}

int run_inspect(const InspectArgs& a) {
  if (a.verify) {
    if (a.dir.empty())
      throw Error("nothing to verify", "glmtune inspect --verify", "give a directory");
    return verify(a.dir, a.json);
  }
  if (a.dir.empty() && a.config.preset.empty())
    throw Error("nothing to inspect", "glmtune inspect",
                "give a checkpoint directory or --preset tiny|crop25b|full");
  const Inspection in = inspect_model(a);
  if (a.json) return print_inspection_json(a, in);
  print_model_text(a, in);
  print_device_bytes_text(in);
  return in.report ? print_checkpoint_text(*in.report) : 0;
}

}  // namespace

GLMTUNE_COMMAND(
    inspect, "inspect", "Summarise a checkpoint or preset: config, schedule, parameters, problems",
    [](CLI::App& app) {
      auto a = std::make_shared<InspectArgs>();
      auto* dir =
          app.add_option("dir", a->dir, "Checkpoint directory (or one holding only config.json)");
      auto* preset =
          app.add_option("--preset", a->config.preset, "Inspect a built-in preset instead")
              ->check(CLI::IsMember(model::ModelConfig::preset_names()));
      dir->excludes(preset);
      a->config.add_set_option(app);
      app.add_flag("--json", a->json, "Print one JSON object");
      app.add_option("--freeze", a->freeze,
                     "A train.freeze pattern (repeatable): also print the device bytes with only "
                     "the FP8 tensors it matches kept in FP8 (train.frozen_weights = \"fp8\")");
      app.add_flag("--verify", a->verify,
                   "Check every tensor against the checksums written with the checkpoint (a "
                   "model directory, a training checkpoint step-N, or a run's output directory); "
                   "exit 1 naming each bad tensor and file")
          ->excludes(preset);
      return [a] { return run_inspect(*a); };
    });
