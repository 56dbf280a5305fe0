// `glmtune crop`: a reduced-layer checkpoint (the first N decoder layers, or any list of them, plus
// the MTP layer, vision tower, embeddings and head) from a released FP8 or BF16 checkpoint.

#include <spdlog/spdlog.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "command.h"
#include "glmtune/base/error.h"
#include "glmtune/base/fs.h"
#include "glmtune/base/progress.h"
#include "glmtune/io/crop.h"

namespace {

struct CropArgs {
  std::string source;
  std::string out;
  std::string layers;
  std::optional<bool> mtp;
  bool no_vision = false;
  std::string dtype = "bf16";
  std::string max_shard_size = "5GB";
  bool dry_run = false;
  bool overwrite = false;
};

// "5GB", "500MB", "1.5GB", "2GiB", "4096": decimal units as Hugging Face's max_shard_size.
uint64_t parse_size(const std::string& text) {
  size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(text, &pos);
  } catch (const std::exception&) {
    pos = 0;
  }
  std::string unit = text.substr(pos);
  for (auto& c : unit) c = char(std::toupper(static_cast<unsigned char>(c)));
  double scale = 0;
  if (unit.empty() || unit == "B")
    scale = 1;
  else if (unit == "KB")
    scale = 1e3;
  else if (unit == "MB")
    scale = 1e6;
  else if (unit == "GB")
    scale = 1e9;
  else if (unit == "TB")
    scale = 1e12;
  else if (unit == "KIB")
    scale = 1024.0;
  else if (unit == "MIB")
    scale = 1024.0 * 1024;
  else if (unit == "GIB")
    scale = 1024.0 * 1024 * 1024;
  if (pos == 0 || scale == 0 || !(value > 0) || !std::isfinite(value * scale))
    throw glmtune::Error("not a size: " + text, "--max-shard-size",
                         "write a size such as 5GB, 500MB or 2GiB");
  return uint64_t(value * scale);
}

}  // namespace

GLMTUNE_COMMAND(
    crop, "crop",
    "Build a reduced-layer checkpoint (first N layers + MTP + vision) from a released one",
    [](CLI::App& app) {
      auto a = std::make_shared<CropArgs>();
      app.add_option("source", a->source, "Released checkpoint directory (FP8 or BF16)")
          ->required();
      app.add_option("--out", a->out, "Output checkpoint directory")->required();
      app.add_option("--layers", a->layers,
                     "Decoder layers to keep: ranges and lists, e.g. 0-4 or 0,1,2,7 (renumbered "
                     "0..n-1 in order)")
          ->required();
      auto* mtp = app.add_flag_callback(
          "--mtp", [a] { a->mtp = true; }, "Keep the MTP layer (default: when the source has it)");
      auto* no_mtp = app.add_flag_callback(
          "--no-mtp", [a] { a->mtp = false; }, "Drop the MTP layer");
      mtp->excludes(no_mtp);
      no_mtp->excludes(mtp);
      app.add_flag("--no-vision", a->no_vision, "Drop the vision tower (model.visual.*)");
      app.add_option("--dtype", a->dtype,
                     "bf16: dequantise FP8 weights to BF16 (default); keep: copy tensors as stored")
          ->check(CLI::IsMember({"bf16", "keep"}));
      app.add_option("--max-shard-size", a->max_shard_size,
                     "Largest output shard, e.g. 5GB (default) or 500MB");
      app.add_flag("--dry-run", a->dry_run,
                   "List what would be kept, dequantised and renamed, with sizes; write nothing");
      app.add_flag("--overwrite", a->overwrite,
                   "Replace a non-empty output directory (atomically, once the crop is complete)");
      return [a] {
        using namespace glmtune;
        io::CropOptions options;
        options.layers = io::parse_layer_list(a->layers);
        options.mtp = a->mtp;
        options.vision = !a->no_vision;
        options.dtype = a->dtype == "keep" ? io::CropDType::keep : io::CropDType::bf16;
        options.max_shard_bytes = parse_size(a->max_shard_size);
        options.overwrite = a->overwrite;

        io::CropPlan plan = io::plan_crop(a->source, a->out, options);
        if (a->dry_run) {
          io::print_crop_plan(plan, stdout);
          return 0;
        }
        create_parent_directory(a->out, "--out");
        spdlog::info("crop {} -> {}: {} tensors, {} parameters, {} in {} shards", a->source, a->out,
                     plan.tensors.size(), plan.output_parameters,
                     format_bytes(double(plan.output_bytes)), plan.shard_starts.size());
        io::CropResult result = io::run_crop(plan, options);
        spdlog::info("wrote {}: {} tensors, {} parameters, {} in {} shards, {} ({}/s)", a->out,
                     result.tensors, result.parameters, format_bytes(double(result.bytes_written)),
                     result.shards, format_duration(result.seconds),
                     format_bytes(double(result.bytes_written) / std::max(result.seconds, 1e-9)));
        return 0;
      };
    });
