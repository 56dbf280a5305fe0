// glmtune merge: a LoRA adapter folded into its base model, written in the released layout.

#include <spdlog/spdlog.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "command.h"
#include "glmtune/base/error.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/model/config.h"
#include "glmtune/model/lora.h"
#include "glmtune/model/param_store.h"

namespace {

namespace fs = std::filesystem;

struct MergeArgs {
  std::string model;
  std::string adapter;
  std::string out;
  bool overwrite = false;
};

void check_output(const MergeArgs& a) {
  std::error_code ec;
  const fs::path out(a.out);
  if (!fs::exists(out, ec)) return;
  if (fs::equivalent(out, a.model, ec))
    throw glmtune::Error("the output is the base model", a.out, "choose another --out");
  if (!fs::is_directory(out, ec))
    throw glmtune::Error("the output exists and is not a directory", a.out, "choose another --out");
  if (!fs::is_empty(out, ec) && !a.overwrite)
    throw glmtune::Error("the output directory is not empty", a.out,
                         "choose a new --out, or pass --overwrite to replace it (atomically, once "
                         "the merged model is complete)");
}

int run_merge(const MergeArgs& a) {
  using namespace glmtune;
  check_output(a);
  const fs::path config_file = fs::path(a.model) / "config.json";
  if (!fs::exists(config_file))
    throw Error("no config.json in the base model directory", a.model,
                "point --model at the checkpoint the adapter was trained on");
  const model::ModelConfig config = model::ModelConfig::from_file(config_file.string());
  const io::CheckpointReader reader = io::CheckpointReader::open(a.model);
  const model::CheckpointReport report = model::check_checkpoint(reader, config);
  model::ParamStore store = model::ParamStore::load(reader, config);
  const model::LoraConfig lora = model::load_lora_adapter(store, a.adapter);
  if (!report.fp8_weights.empty())
    spdlog::warn(
        "the base holds {} FP8 weights: the merged model is written in bf16 (merging into FP8 "
        "would round most of the adapter's small delta away)",
        report.fp8_weights.size());
  const int64_t merged = model::merge_lora_adapters(store);
  // ParamStore::save writes into a temporary directory and replaces --out only when complete.
  store.save(a.out);
  io::copy_tokenizer_files(a.model, a.out);
  std::printf(
      "merged %lld projections of %s (rank %lld, scale %g) into %s (released layout, "
      "bf16)\n",
      static_cast<long long>(merged), a.adapter.c_str(), static_cast<long long>(lora.rank),
      lora.scale(), a.out.c_str());
  return 0;
}

}  // namespace

GLMTUNE_COMMAND(merge, "merge",
                "Fold a LoRA adapter into its base model: W + scale B A, written in the released "
                "layout (bf16)",
                [](CLI::App& app) {
                  auto a = std::make_shared<MergeArgs>();
                  app.add_option("--model", a->model, "The base model directory")->required();
                  app.add_option("--adapter", a->adapter,
                                 "The adapter directory (adapter_config.json, "
                                 "adapter_model.safetensors)")
                      ->required();
                  app.add_option("--out", a->out, "Where to write the merged model")->required();
                  app.add_flag(
                      "--overwrite", a->overwrite,
                      "Replace a non-empty --out (atomically, when the merge is complete)");
                  return [a] { return run_merge(*a); };
                });
