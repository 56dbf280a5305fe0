// `glmtune inspect`: what a checkpoint (or a preset) holds, counted from the config alone when
// there are no weights, and checked against the released layout when there are.

#include <fmt/format.h>

#include <cstdio>
#include <filesystem>

#include "command.h"
#include "config_options.h"
#include "glmtune/base/error.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/model/layout.h"
#include "glmtune/model/param_store.h"

namespace {

using namespace glmtune;
using model::Json;

struct InspectArgs {
  cli::ConfigOptions config;
  std::string dir;
  bool json = false;
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
      return [a] {
        namespace fs = std::filesystem;
        if (a->dir.empty() && a->config.preset.empty())
          throw Error("nothing to inspect", "glmtune inspect",
                      "give a checkpoint directory or --preset tiny|crop25b|full");
        model::ModelConfig config =
            a->dir.empty()
                ? model::ModelConfig::preset(a->config.preset)
                : model::ModelConfig::from_file((fs::path(a->dir) / "config.json").string());
        a->config.apply(config);
        const auto layout = model::released_layout(config);
        const auto counts = model::count_params(config, layout);
        const model::TextConfig& t = config.text();

        std::optional<model::CheckpointReport> report;
        bool has_weights = !a->dir.empty() && (fs::exists(fs::path(a->dir) / io::kIndexFileName) ||
                                               fs::exists(fs::path(a->dir) / io::kSingleFileName));
        if (has_weights) {
          auto reader = io::CheckpointReader::open(a->dir);
          reader.validate();
          report = model::check_checkpoint(reader, config);
        }

        if (a->json) {
          Json out = {{"source", a->dir.empty() ? "preset " + a->config.preset : a->dir},
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
                        {"vision", config.vision().has_value()}}},
                      {"schedule", schedule_string(t)},
                      {"params", counts_json(counts)}};
          if (report) {
            out["checkpoint"] = {{"tensors", report->tensors},
                                 {"bytes", report->bytes},
                                 {"dtype_tensors", report->dtype_tensors},
                                 {"dtype_bytes", report->dtype_bytes},
                                 {"fp8_weights", report->fp8_weights.size()},
                                 {"missing", report->missing},
                                 {"unexpected", report->unexpected},
                                 {"misshaped", Json::array()}};
            for (const auto& m : report->misshaped)
              out["checkpoint"]["misshaped"].push_back(
                  {{"name", m.name}, {"expected", m.expected}, {"found", m.found}});
          }
          std::puts(out.dump(2).c_str());
          return report && !report->ok() ? 1 : 0;
        }

        std::printf("%s\n",
                    a->dir.empty() ? ("preset " + a->config.preset).c_str() : a->dir.c_str());
        std::printf(
            "  text: %ld layers (%ld KDA, %ld DSA; %ld dense, %ld MoE), hidden %ld, vocab %ld\n",
            t.num_hidden_layers, t.count(model::AttnKind::kda), t.count(model::AttnKind::dsa),
            t.count(model::MlpKind::dense), t.count(model::MlpKind::sparse), t.hidden_size,
            t.vocab_size);
        std::printf("  MoE: %ld routed experts (top-%ld, %ld groups), %ld shared, width %ld\n",
                    t.n_routed_experts, t.num_experts_per_tok, t.n_group, t.n_shared_experts,
                    t.moe_intermediate_size);
        std::printf(
            "  KDA: %ld heads x %ld; MLA: %ld heads; indexer: top-%ld tokens in pools of %ld\n",
            t.linear_num_heads, t.linear_head_dim, t.num_attention_heads, t.index_topk,
            t.index_kpool);
        std::printf("  MTP layers: %ld; vision: %s\n", t.num_nextn_predict_layers,
                    config.vision() ? fmt::format("{} blocks, width {}", config.vision()->depth,
                                                  config.vision()->hidden_size)
                                          .c_str()
                                    : "none");
        std::printf("  schedule (K=KDA D=DSA, d=dense m=MoE): %s\n", schedule_string(t).c_str());
        std::printf(
            "parameters: %s total (%s text, %s MTP, %s vision; %s embeddings + head), %s "
            "trainable\n",
            billions(counts.total).c_str(), billions(counts.text).c_str(),
            billions(counts.mtp).c_str(), billions(counts.vision).c_str(),
            billions(counts.embeddings_and_head).c_str(), billions(counts.trainable).c_str());
        for (const auto& [name, k] : counts.per_layer_kind)
          std::printf("  %-10s %3ld layers x %s = %s\n", name.c_str(), k.layers,
                      billions(k.params / k.layers).c_str(), billions(k.params).c_str());
        std::printf(
            "  %ld tensors, %.2f GB as stored by glmtune (bf16, fp32-kept parameters in f32)\n",
            counts.tensors, counts.bytes / 1e9);
        if (report) {
          std::printf("checkpoint: %ld tensors, %.2f GB on disk\n", report->tensors,
                      report->bytes / 1e9);
          for (const auto& [dtype, n] : report->dtype_tensors)
            std::printf("  %-8s %6ld tensors %10.3f GB\n", dtype.c_str(), n,
                        report->dtype_bytes.at(dtype) / 1e9);
          if (!report->fp8_weights.empty())
            std::printf("  %zu FP8 weights with block scales\n", report->fp8_weights.size());
          if (report->ok())
            std::printf("  layout: complete, no unexpected or mis-shaped tensors\n");
          else
            std::printf("%s", report->describe().c_str());
          return report->ok() ? 0 : 1;
        }
        return 0;
      };
    });
