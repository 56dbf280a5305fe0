// `glmtune plan`: the device bytes per GPU a training layout needs, by part, and whether it fits,
// from a preset, a checkpoint's config or a recipe, without reading any weights
// (train/plan.h; docs/plan.md).

#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "command.h"
#include "config_options.h"
#include "glmtune/base/error.h"
#include "glmtune/train/plan.h"
#include "glmtune/train/recipe.h"

namespace {

using namespace glmtune;
namespace fs = std::filesystem;

struct PlanArgs {
  cli::ConfigOptions config;
  std::string model_dir;
  std::string recipe;
  train::PlanOptions plan;
  std::string base = "bf16";
  int64_t lora_rank = 0;
  std::string lora_targets = "all-linear";
  bool lora_experts = false;
  std::vector<std::string> recipe_target_parameters;  // lora.target_parameters of --config
  bool json = false;
};

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// "all-linear", a comma-separated suffix list, or (anything with a regex character) a regular
// expression over whole module names.
void set_targets(train::PlanLora& lora, const std::string& text) {
  if (text.find_first_of("^$*+?()[]{}|\\") != std::string::npos) {
    lora.target_regex = text;
    lora.target_modules.clear();
    return;
  }
  lora.target_modules.clear();
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) lora.target_modules.push_back(item);
  if (lora.target_modules.empty())
    throw Error("no LoRA target given", "--lora-targets",
                "write all-linear, or suffixes such as q_proj,o_proj,mlp.down_proj");
}

model::ModelConfig load_config(PlanArgs& a, bool from_recipe) {
  model::ModelConfig config = model::ModelConfig::preset("tiny");
  if (!a.model_dir.empty()) {
    const fs::path file = fs::path(a.model_dir) / "config.json";
    if (!fs::exists(file))
      throw Error(fmt::format("no config.json in {}", a.model_dir),
                  from_recipe ? a.recipe + ": model.path" : "--model",
                  "give a checkpoint directory (glmtune init writes one), or --model-preset");
    config = model::ModelConfig::from_file(file.string());
  } else {
    config = model::ModelConfig::preset(a.config.preset);
  }
  a.config.apply(config);
  return config;
}

void print_text(const train::MemoryPlan& p, const model::ModelConfig& config) {
  const train::PlanOptions& o = p.options;
  std::printf("layout: %ld GPU(s): dp %ld, ep %ld, sp %ld%s%s; pack %ld tokens (%ld per GPU)\n",
              long(o.gpus), long(p.dp), long(o.ep), long(o.sp), o.fsdp ? ", fsdp" : "",
              o.fp8_tilewise ? ", FP8 GEMMs" : "", long(o.pack), long(o.pack / o.sp));
  std::printf(
      "activations: %ld decoder layers kept, %ld recomputed, %ld offloaded (--recompute %.2f "
      "--offload %.2f)%s\n",
      long(p.kept_layers), long(p.recomputed_layers), long(p.offloaded_layers), o.recompute,
      o.offload, o.mtp && config.text().has_mtp() ? ", MTP on" : ", MTP off");
  std::printf("parameters: %.3fB text + MTP, %.3fB trained", double(p.base_params) / 1e9,
              double(p.trained_params) / 1e9);
  if (o.lora)
    std::printf(
        " (LoRA rank %ld on %ld projections%s, base %s)", long(o.lora->rank),
        long(p.adapted_modules),
        p.adapted_expert_params
            ? fmt::format(" and {} fused expert parameters", p.adapted_expert_params).c_str()
            : "",
        o.base == train::PlanBase::fp8 ? "fp8" : "bf16");
  std::printf("\n\n%-14s %-58s %10s\n", "part", "item", "GiB/GPU");
  std::string last;
  for (const train::PlanItem& i : p.items) {
    std::printf("%-14s %-58s %10.2f%s%s\n", i.part == last ? "" : i.part.c_str(), i.item.c_str(),
                i.bytes / kGiB, i.note.empty() ? "" : "   ", i.note.c_str());
    last = i.part;
  }
  std::printf("%-14s %-58s %10.2f\n", "total", "", p.total / kGiB);
  std::printf("%-14s %-58s %10.2f\n", "device", "--device-memory", o.device_gib);
  std::printf("%-14s %-58s %10.2f\n", "headroom", "", p.headroom / kGiB);
  std::printf("\n%s\n", p.fits ? "fits" : "does not fit");
  for (const std::string& s : p.suggestions) std::printf("  would fit: %s\n", s.c_str());
  if (p.adapted_expert_params && o.ep > 1)
    std::printf(
        "note: adapters on the routed experts are counted; glmtune trains them under expert "
        "parallelism (--ep) on CPU processes only (LoRA on several GPUs is refused)\n");
  if (o.base == train::PlanBase::fp8 && o.fsdp)
    std::printf(
        "note: an FP8 base is counted as the release stores it; glmtune holds it so without fsdp "
        "(lora.base and train.frozen_weights = \"fp8\" are refused with fsdp)\n");
}

void print_json(const train::MemoryPlan& p) {
  const train::PlanOptions& o = p.options;
  nlohmann::ordered_json j;
  j["gpus"] = o.gpus;
  j["dp"] = p.dp;
  j["ep"] = o.ep;
  j["sp"] = o.sp;
  j["fsdp"] = o.fsdp;
  j["fp8"] = o.fp8_tilewise ? "tilewise" : "none";
  j["freeze"] = o.freeze;
  j["recompute"] = o.recompute;
  j["offload"] = o.offload;
  j["pack"] = o.pack;
  j["base"] = o.base == train::PlanBase::fp8 ? "fp8" : "bf16";
  j["kept_layers"] = p.kept_layers;
  j["recomputed_layers"] = p.recomputed_layers;
  j["offloaded_layers"] = p.offloaded_layers;
  j["base_params"] = p.base_params;
  j["trained_params"] = p.trained_params;
  if (o.lora) {
    j["lora"] = {{"rank", o.lora->rank},
                 {"modules", p.adapted_modules},
                 {"params", p.adapter_params},
                 {"expert_parameters", p.adapted_expert_params},
                 {"experts_trainable", o.ep <= 1}};
  }
  nlohmann::ordered_json items = nlohmann::ordered_json::array();
  for (const train::PlanItem& i : p.items)
    items.push_back(
        {{"part", i.part}, {"item", i.item}, {"bytes", int64_t(i.bytes)}, {"gib", i.bytes / kGiB}});
  j["items"] = items;
  nlohmann::ordered_json parts;
  for (const char* part : {"weights", "adapters", "gradients", "optimizer", "activations",
                           "communication", "allocator"})
    parts[part] = p.part_bytes(part) / kGiB;
  j["parts_gib"] = parts;
  j["total_gib"] = p.total / kGiB;
  j["device_gib"] = o.device_gib;
  j["headroom_gib"] = p.headroom / kGiB;
  j["fits"] = p.fits;
  j["suggestions"] = p.suggestions;
  std::printf("%s\n", j.dump(2).c_str());
}

int run_plan(PlanArgs& a, const CLI::App& app) {
  auto given = [&](const char* flag) { return app.count(flag) > 0; };
  bool from_recipe = false;
  if (!a.recipe.empty()) {
    // The recipe's values, then any flag given beside it wins.
    const train::Recipe r = train::Recipe::load(a.recipe);
    from_recipe = a.model_dir.empty() && a.config.preset.empty();
    if (from_recipe) a.model_dir = r.model_path;
    if (!given("--ep")) a.plan.ep = r.ep_size;
    if (!given("--sp")) a.plan.sp = r.sp_size;
    if (!given("--fsdp")) a.plan.fsdp = r.fsdp;
    if (!given("--fp8")) a.plan.fp8_tilewise = r.fp8_tilewise;
    if (!given("--freeze")) a.plan.freeze = r.freeze;
    if (!given("--base") && r.frozen_fp8 && !r.freeze.empty()) a.base = "fp8";
    if (!given("--recompute")) a.plan.recompute = r.recompute;
    if (!given("--offload")) a.plan.offload = r.offload;
    if (!given("--pack")) a.plan.pack = r.pack_max_length;
    if (r.lora && !given("--lora-rank")) {
      a.lora_rank = r.lora->rank;
      if (!given("--lora-targets")) {
        train::PlanLora l;
        l.target_modules = r.lora->target_modules;
        l.target_regex = r.lora->target_regex;
        a.plan.lora = l;
      }
      if (!given("--lora-experts")) a.recipe_target_parameters = r.lora->target_parameters;
      if (!given("--base") && r.lora->fp8_base) a.base = "fp8";
    }
  }
  if (a.model_dir.empty() && a.config.preset.empty())
    throw Error("no model to plan for", "glmtune plan",
                "give --model-preset tiny|crop25b|full, --model DIR or --config recipe.toml");
  if (a.base != "bf16" && a.base != "fp8")
    throw Error(fmt::format("--base {}", a.base), "--base", "write --base bf16 or --base fp8");
  a.plan.base = a.base == "fp8" ? train::PlanBase::fp8 : train::PlanBase::bf16;
  if (a.lora_rank < 0)
    throw Error(fmt::format("--lora-rank {} must be at least 1", a.lora_rank), "--lora-rank",
                "give the adapters' rank, e.g. 16 (leave it out for full fine-tuning)");
  if (a.lora_rank > 0) {
    if (!a.plan.lora) {
      a.plan.lora = train::PlanLora{};
      set_targets(*a.plan.lora, a.lora_targets);
    }
    a.plan.lora->rank = a.lora_rank;
    a.plan.lora->target_parameters =
        a.lora_experts
            ? std::vector<std::string>{"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
            : a.recipe_target_parameters;
  } else if (given("--lora-targets") || a.lora_experts) {
    throw Error("LoRA targets without a rank", "--lora-targets / --lora-experts",
                "add --lora-rank R (e.g. 16)");
  }
  if (a.plan.base == train::PlanBase::fp8 && !a.plan.lora && a.plan.freeze.empty())
    throw Error("an FP8 base needs LoRA or frozen tensors: trained weights are bf16 compute copies",
                "--base", "add --lora-rank R or --freeze PATTERN, or plan with --base bf16");
  const model::ModelConfig config = load_config(a, from_recipe);
  const train::MemoryPlan plan = train::plan_memory(config, a.plan);
  if (a.json)
    print_json(plan);
  else
    print_text(plan, config);
  return 0;
}

}  // namespace

GLMTUNE_COMMAND(
    plan, "plan",
    "Predict the device bytes per GPU of a training layout, by part, and whether it fits "
    "(no weights read, no GPU needed)",
    [](CLI::App& app) {
      auto a = std::make_shared<PlanArgs>();
      auto* model_opt = app.add_option("--model", a->model_dir,
                                       "A checkpoint directory (only its config.json is read)");
      auto* preset = app.add_option("--model-preset", a->config.preset, "A preset")
                         ->check(CLI::IsMember(model::ModelConfig::preset_names()));
      model_opt->excludes(preset);
      a->config.add_set_option(app);
      app.add_option("--config", a->recipe,
                     "A recipe: model, ep/sp sizes, fsdp, recompute, offload, pack length and "
                     "[lora] from it (flags given beside it win)");
      app.add_option("--gpus", a->plan.gpus, "GPUs in the run (one rank each)");
      app.add_option("--ep", a->plan.ep, "Expert-parallel size (train.ep_size)");
      app.add_option("--sp", a->plan.sp, "Sequence-parallel size (train.sp_size)");
      app.add_flag("--fsdp", a->plan.fsdp, "Shard the decoder layers (train.fsdp)");
      app.add_flag("--fp8", a->plan.fp8_tilewise,
                   "Block-scaled FP8 GEMMs (train.fp8 = \"tilewise\"): their weight blocks kept "
                   "for the step, frozen FP8 weights read from their codes");
      app.add_option("--recompute", a->plan.recompute,
                     "Fraction of decoder layers recomputed in the backward (train.recompute)");
      app.add_option("--offload", a->plan.offload,
                     "Fraction of decoder layers, after the recomputed ones, offloaded to host "
                     "memory (train.offload)");
      app.add_option("--pack", a->plan.pack, "Tokens per pack (data.pack_max_length)");
      app.add_option("--loss-chunk-rows", a->plan.loss_chunk_rows,
                     "Rows per lm_head + cross-entropy chunk (the trainer's 256; bench step 4096)");
      app.add_flag("!--no-mtp", a->plan.mtp, "Leave the MTP layer out");
      app.add_option("--lora-rank", a->lora_rank, "LoRA rank (0: full fine-tuning)");
      app.add_option("--lora-targets", a->lora_targets,
                     "all-linear, PEFT suffixes (q_proj,o_proj,mlp.down_proj) or a regular "
                     "expression over module names");
      app.add_flag("--lora-experts", a->lora_experts,
                   "Adapters on every routed expert too (lora.target_parameters; each GPU holds "
                   "its experts' under --ep)");
      app.add_option("--base", a->base,
                     "bf16, or fp8: the frozen base's FP8 tensors kept as the release stores them "
                     "(lora.base, or train.frozen_weights with --freeze)");
      app.add_option("--freeze", a->plan.freeze,
                     "A train.freeze pattern (repeatable): the matching tensors get no gradient or "
                     "optimizer state");
      app.add_option("--device-memory", a->plan.device_gib,
                     "Usable GiB per GPU (139: an H200's 140.4 GiB less the CUDA context)");
      app.add_flag("--json", a->json, "Print one JSON object");
      return [a, &app]() -> int { return run_plan(*a, app); };
    });
