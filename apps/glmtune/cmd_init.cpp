// `glmtune init`: a random-initialised checkpoint in the released layout.

#include <spdlog/spdlog.h>

#include <chrono>
#include <filesystem>

#include "command.h"
#include "config_options.h"
#include "glmtune/base/error.h"
#include "glmtune/base/fs.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/model/init.h"
#include "glmtune/model/layout.h"

namespace {
struct InitArgs {
  glmtune::cli::ConfigOptions config;
  std::string out;
  uint64_t seed = 0;
  double shard_gb = 5.0;
  std::string tokenizer;
  bool force = false;
  bool fp8 = false;
};
}  // namespace

GLMTUNE_COMMAND(
    init, "init", "Write a random-initialised GLM-5.3-Flash checkpoint", [](CLI::App& app) {
      auto a = std::make_shared<InitArgs>();
      app.add_option("--preset", a->config.preset, "Model geometry: tiny, crop25b or full")
          ->required()
          ->check(CLI::IsMember(glmtune::model::ModelConfig::preset_names()));
      app.add_option("--out", a->out, "Output checkpoint directory")->required();
      app.add_option("--seed", a->seed, "Initialisation seed");
      app.add_option("--shard-gb", a->shard_gb, "Largest shard size in GB")
          ->check(CLI::PositiveNumber);
      app.add_option(
          "--tokenizer", a->tokenizer,
          "Directory whose tokenizer files (tokenizer.json, tokenizer_config.json, "
          "chat_template.jinja, and processor_config.json when present) are copied alongside");
      app.add_flag("--force", a->force, "Replace an existing non-empty output directory");
      app.add_flag("--fp8", a->fp8,
                   "The FP8 release's layout: experts, dense MLPs and MLA projections in e4m3 with "
                   "a float32 weight_scale_inv per 128x128 block");
      a->config.add_set_option(app);
      return [a] {
        using namespace glmtune;
        namespace fs = std::filesystem;
        model::ModelConfig config = model::ModelConfig::preset(a->config.preset);
        a->config.apply(config);
        if (fs::exists(a->out) && !fs::is_empty(a->out) && !a->force)
          throw Error("output directory is not empty", a->out,
                      "choose a new --out, or pass --force to replace it");
        create_parent_directory(a->out, "--out");
        const auto counts = model::count_params(config, model::released_layout(config));
        spdlog::info("init {}: {:.3f}B parameters, {:.2f} GB in {} tensors -> {}", a->config.preset,
                     counts.total / 1e9, counts.bytes / 1e9, counts.tensors, a->out);
        model::InitOptions options;
        options.seed = a->seed;
        options.fp8 = a->fp8;
        options.max_shard_bytes = uint64_t(a->shard_gb * 1e9);
        auto start = std::chrono::steady_clock::now();
        auto last = start;
        options.progress = [&](uint64_t done, uint64_t total) {
          auto now = std::chrono::steady_clock::now();
          if (now - last < std::chrono::seconds(5) && done < total) return;
          last = now;
          double secs = std::chrono::duration<double>(now - start).count();
          spdlog::info("  {:.1f}% ({:.2f} / {:.2f} GB, {:.0f} MB/s)", 100.0 * done / total,
                       done / 1e9, total / 1e9, done / 1e6 / std::max(secs, 1e-9));
        };
        if (!a->tokenizer.empty()) {
          for (const char* file :
               {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}) {
            fs::path src = fs::path(a->tokenizer) / file;
            if (!fs::exists(src))
              throw Error(std::string("missing ") + file, src.string(),
                          "point --tokenizer at a directory with the tokenizer files");
            options.extra_files.emplace_back(src, file);
          }
          // The image/video processor settings, when the tokenizer folder has them (a release
          // does), so that the checkpoint evaluates and trains on vision-language data as is.
          const fs::path processor = fs::path(a->tokenizer) / "processor_config.json";
          if (fs::exists(processor))
            options.extra_files.emplace_back(processor, "processor_config.json");
        }
        model::write_random_checkpoint(config, a->out, options);
        spdlog::info("wrote {}", a->out);
        return 0;
      };
    });
