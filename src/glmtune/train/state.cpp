#include "glmtune/train/state.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <regex>

#include "glmtune/base/error.h"
#include "glmtune/base/fs.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/train/optimizer.h"

namespace glmtune::train {
namespace fs = std::filesystem;
namespace {

constexpr int kFormatVersion = 1;
const std::regex kStepDirRe(R"(^step-(\d+)$)");
// Leftovers of interrupted saves: `.step-N.tmp-PID` (being built) and `.step-N.old-PID` (a
// replaced checkpoint of the same step, about to be deleted).
const std::regex kLeftoverRe(R"(^\.step-\d+\.(tmp|old)-\d+$)");

std::string step_dir_name(int64_t step) { return "step-" + std::to_string(step); }

void check_io(const std::error_code& ec, const std::string& what, const fs::path& path) {
  if (ec)
    throw Error(what + ": " + ec.message(), path.string(),
                "check free disk space and the permissions of the output directory");
}

// Tensor shards are hashed tensor by tensor (glmtune-checksums.json); every other file as a whole.
// Model and optimizer shards carry per-tensor checksums of their own; a LoRA adapter (small) is
// hashed whole.
bool hashed_whole(const std::string& file) {
  return !file.ends_with(".safetensors") || file.starts_with("adapter/");
}

uint64_t file_hash(const fs::path& path) {
  const std::string bytes = read_text_file(path.string(), "checkpoint");
  return io::content_hash({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()});
}

nlohmann::json manifest_of(const fs::path& dir, int64_t step) {
  nlohmann::json files = nlohmann::json::object();
  nlohmann::json hashes = nlohmann::json::object();
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::end(it);
       it.increment(ec)) {
    if (!it->is_regular_file()) continue;
    const std::string name = fs::relative(it->path(), dir).generic_string();
    files[name] = uint64_t(it->file_size());
    if (hashed_whole(name)) hashes[name] = io::hash_hex(file_hash(it->path()));
  }
  check_io(ec, "cannot list the checkpoint being written", dir);
  return {{"format_version", kFormatVersion}, {"step", step}, {"files", files}, {"xxh3", hashes}};
}

// The manifest's checks; adds what is wrong to `r` and returns the manifest when it is readable.
std::optional<nlohmann::json> check_manifest(const fs::path& dir, io::VerifyReport& r) {
  auto no = [&](std::string file, std::string reason) {
    r.problems.push_back({std::move(file), "", std::move(reason)});
    return std::nullopt;
  };
  std::error_code ec;
  const fs::path marker = dir / kCompleteFile;
  if (!fs::is_regular_file(marker, ec))
    return no(kCompleteFile, "no COMPLETE manifest (the save did not finish)");
  nlohmann::json manifest;
  try {
    manifest = nlohmann::json::parse(read_text_file(marker.string(), "checkpoint manifest"));
  } catch (const std::exception& e) {
    return no(kCompleteFile, std::string("unreadable manifest: ") + e.what());
  }
  if (!manifest.is_object() || !manifest.contains("files") || !manifest["files"].is_object() ||
      manifest["files"].empty() || !manifest.contains("step") ||
      !manifest["step"].is_number_integer())
    return no(kCompleteFile, "malformed manifest");
  for (const auto& [file, size] : manifest["files"].items()) {
    const fs::path p = dir / file;
    if (!size.is_number_unsigned()) return no(kCompleteFile, "malformed manifest");
    if (!fs::is_regular_file(p, ec)) {
      no(file, "missing (the manifest lists it)");
      continue;
    }
    if (fs::file_size(p, ec) != size.get<uint64_t>())
      no(file, fmt::format("{} bytes, the manifest says {} ({})", fs::file_size(p, ec),
                           size.get<uint64_t>(),
                           fs::file_size(p, ec) < size.get<uint64_t>() ? "truncated" : "grown"));
  }
  if (!r.problems.empty()) return std::nullopt;
  try {
    const fs::path state_path = dir / kTrainerStateFile;
    const TrainerState s = TrainerState::from_json(
        nlohmann::json::parse(read_text_file(state_path.string(), "trainer state")),
        state_path.string());
    if (s.step != manifest["step"].get<int64_t>())
      return no(kTrainerStateFile,
                fmt::format("trainer state step {} differs from the manifest's {}", s.step,
                            manifest["step"].get<int64_t>()));
  } catch (const std::exception& e) {
    return no(kTrainerStateFile, std::string("unreadable trainer state: ") + e.what());
  }
  return manifest;
}

void remove_leftovers(const fs::path& root) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (!std::regex_match(name, kLeftoverRe)) continue;
    std::error_code rm;
    fs::remove_all(entry.path(), rm);
    if (rm)
      spdlog::warn("could not remove the leftover {} of an interrupted save: {}",
                   entry.path().string(), rm.message());
  }
}

void prune(const fs::path& output_dir, int64_t keep_last, int64_t just_saved) {
  if (keep_last <= 0) return;
  std::vector<int64_t> steps = complete_checkpoint_steps(output_dir);
  if (int64_t(steps.size()) <= keep_last) return;
  const size_t drop = steps.size() - size_t(keep_last);
  for (size_t i = 0; i < drop; ++i) {
    if (steps[i] == just_saved) continue;
    const fs::path dir = output_dir / kCheckpointsDir / step_dir_name(steps[i]);
    // Renamed first: a kill in the middle of the removal leaves a leftover the next save clears,
    // never a half-deleted step directory that would look corrupt.
    const fs::path doomed = output_dir / kCheckpointsDir /
                            fmt::format(".{}.old-{}", step_dir_name(steps[i]), ::getpid());
    std::error_code ec;
    fs::rename(dir, doomed, ec);
    if (ec) {
      spdlog::warn("could not remove the old checkpoint {}: {}", dir.string(), ec.message());
      continue;
    }
    fs::remove_all(doomed, ec);
    if (ec) spdlog::warn("could not remove the old checkpoint {}: {}", dir.string(), ec.message());
  }
}

int64_t get_int(const nlohmann::json& j, const char* key, const std::string& source,
                int64_t min = 0) {
  if (!j.contains(key) || !j[key].is_number_integer() || j[key].get<int64_t>() < min)
    throw Error(fmt::format("'{}' must be an integer >= {}", key, min), source,
                "the trainer state is damaged: resume from another checkpoint");
  return j[key].get<int64_t>();
}

uint64_t get_uint(const nlohmann::json& j, const char* key, const std::string& source) {
  if (!j.contains(key) || !j[key].is_number_unsigned())
    throw Error(fmt::format("'{}' must be an integer >= 0", key), source,
                "the trainer state is damaged: resume from another checkpoint");
  return j[key].get<uint64_t>();
}

}  // namespace

nlohmann::json TrainerState::to_json() const {
  return {{"format_version", kFormatVersion},
          {"step", step},
          {"total_steps", total_steps},
          {"epoch", epoch},
          {"sampler", sampler},
          {"seed", seed},
          {"rng_offset", rng_offset},
          {"skipped_steps", skipped_steps},
          {"totals", totals.to_json()},
          {"recipe_fingerprint", recipe_fingerprint},
          {"extra", extra}};
}

TrainerState TrainerState::from_json(const nlohmann::json& j, const std::string& source) {
  const std::string fix = "the trainer state is damaged: resume from another checkpoint";
  if (!j.is_object()) throw Error("the trainer state must be a JSON object", source, fix);
  if (get_int(j, "format_version", source, 1) != kFormatVersion)
    throw Error(fmt::format("trainer state format {} is not the supported {}",
                            j["format_version"].get<int64_t>(), kFormatVersion),
                source, "resume with the glmtune version that wrote this checkpoint");
  TrainerState s;
  s.step = get_int(j, "step", source);
  s.total_steps = get_int(j, "total_steps", source);
  s.epoch = get_int(j, "epoch", source);
  s.seed = get_uint(j, "seed", source);
  s.rng_offset = get_uint(j, "rng_offset", source);
  s.skipped_steps = get_int(j, "skipped_steps", source);
  if (!j.contains("sampler") || !j["sampler"].is_object())
    throw Error("'sampler' must be an object", source, fix);
  s.sampler = j["sampler"];
  if (!j.contains("totals")) throw Error("'totals' is missing", source, fix);
  s.totals = ThroughputTotals::from_json(j["totals"], source);
  if (!j.contains("recipe_fingerprint") || !j["recipe_fingerprint"].is_string())
    throw Error("'recipe_fingerprint' must be a string", source, fix);
  s.recipe_fingerprint = j["recipe_fingerprint"].get<std::string>();
  if (j.contains("extra")) {
    if (!j["extra"].is_object()) throw Error("'extra' must be an object", source, fix);
    s.extra = j["extra"];
  }
  return s;
}

void save_optimizer_state(const fs::path& dir,
                          const std::vector<std::pair<std::string, Shape>>& trained, int64_t step,
                          const WholeOptimizerState& whole) {
  io::CheckpointWriterOptions options;
  options.shard_metadata = {{"format", kOptimizerFormat}};
  io::CheckpointWriter writer(dir, options);
  // AdamW::save's sequence: the step count, then each parameter's master and moments.
  std::vector<io::TensorSpec> specs = {{kOptimizerStepName, DType::i64, Shape{1}}};
  for (const auto& [name, shape] : trained)
    for (int kind = 0; kind < 3; ++kind)
      specs.push_back({optimizer_state_name(kind, name), DType::f32, shape});
  writer.plan_in_order(std::move(specs));
  writer.put(kOptimizerStepName, Tensor::from_vector<int64_t>({step}, {1}));
  for (const auto& [name, shape] : trained) {
    const std::array<Tensor, 3> state = whole(name);
    for (int kind = 0; kind < 3; ++kind) {
      const Tensor& t = state[size_t(kind)];
      GLMTUNE_ASSERT(t.defined() && t.dtype() == DType::f32 && t.numel() == shape_numel(shape),
                     "state {} of '{}' is {}, expected f32 {}", kind, name,
                     t.defined() ? t.str() : std::string("undefined"), shape_str(shape));
      writer.put(optimizer_state_name(kind, name), t.contiguous().view(shape));
    }
  }
  writer.finish();
}

void visit_optimizer_state(const std::vector<std::pair<std::string, Shape>>& trained,
                           const WholeOptimizerState& whole) {
  for (const auto& [name, shape] : trained) whole(name);
}

CheckpointDir save_checkpoint(const fs::path& output_dir, const TrainerState& state,
                              const ModelWriter& write_model, const AdamW& optimizer,
                              int64_t keep_last) {
  return save_checkpoint(
      output_dir, state, write_model, [&](const fs::path& dir) { optimizer.save(dir); }, keep_last);
}

CheckpointDir save_checkpoint(const fs::path& output_dir, const TrainerState& state,
                              const ModelWriter& write_model,
                              const OptimizerWriter& write_optimizer, int64_t keep_last) {
  GLMTUNE_ASSERT(state.step >= 0, "checkpoint of negative step {}", state.step);
  const fs::path root = output_dir / kCheckpointsDir;
  std::error_code ec;
  fs::create_directories(root, ec);
  check_io(ec, "cannot create the checkpoints directory", root);
  remove_leftovers(root);

  const std::string name = step_dir_name(state.step);
  const fs::path final_dir = root / name;
  const fs::path tmp = root / fmt::format(".{}.tmp-{}", name, ::getpid());
  fs::create_directory(tmp, ec);
  check_io(ec, "cannot create the temporary checkpoint directory", tmp);
  try {
    write_model(tmp / "model");
    write_optimizer(tmp / "optimizer");
    write_file_atomic((tmp / kTrainerStateFile).string(), state.to_json().dump(2) + "\n");
    // The manifest is written last: its presence, with matching sizes, is what makes the
    // checkpoint complete.
    write_file_atomic((tmp / kCompleteFile).string(), manifest_of(tmp, state.step).dump(2) + "\n");
    fsync_directory(tmp.string());
  } catch (...) {
    std::error_code rm;
    fs::remove_all(tmp, rm);
    throw;
  }

  fs::path aside;
  if (fs::exists(final_dir)) {
    // rename() cannot replace a non-empty directory: move the old one aside first.
    aside = root / fmt::format(".{}.old-{}", name, ::getpid());
    fs::rename(final_dir, aside, ec);
    check_io(ec, "cannot move the previous checkpoint of this step aside", final_dir);
  }
  fs::rename(tmp, final_dir, ec);
  check_io(ec, "cannot move the new checkpoint into place", final_dir);
  fsync_directory(root.string());
  if (!aside.empty()) fs::remove_all(aside, ec);
  write_file_atomic((root / kLatestFile).string(), name + "\n");
  prune(output_dir, keep_last, state.step);
  return {final_dir};
}

bool is_complete_checkpoint(const fs::path& dir, std::string* why) {
  io::VerifyReport r;
  if (check_manifest(dir, r)) return true;
  if (why) *why = r.problems.front().str();
  return false;
}

io::VerifyReport verify_training_checkpoint(const fs::path& dir) {
  io::VerifyReport r;
  const std::optional<nlohmann::json> manifest = check_manifest(dir, r);
  if (!manifest) return r;
  bool files_hashed = manifest->contains("xxh3") && (*manifest)["xxh3"].is_object();
  if (files_hashed)
    for (const auto& [file, want] : (*manifest)["xxh3"].items()) {
      std::string got;
      try {
        got = io::hash_hex(file_hash(dir / file));
      } catch (const Error& e) {
        r.problems.push_back({file, "", "unreadable: " + e.problem()});
        continue;
      }
      if (!want.is_string() || want.get<std::string>() != got)
        r.problems.push_back(
            {file, "",
             fmt::format("the content changed since it was written (xxh3 {}, recorded {})", got,
                         want.is_string() ? want.get<std::string>() : "?")});
    }
  const CheckpointDir ck{dir};
  // A LoRA checkpoint holds the adapter (hashed whole above) and no model.
  const bool adapter_only = !fs::exists(ck.model_dir()) && fs::exists(dir / "adapter");
  io::VerifyReport model;
  if (adapter_only)
    model.has_checksums = true;
  else
    model = io::verify_checkpoint(ck.model_dir());
  const io::VerifyReport optimizer = io::verify_checkpoint(ck.optimizer_dir());
  r.merge(model, "model/");
  r.merge(optimizer, "optimizer/");
  r.has_checksums = files_hashed && model.has_checksums && optimizer.has_checksums;
  return r;
}

std::vector<int64_t> complete_checkpoint_steps(const fs::path& output_dir) {
  std::vector<int64_t> steps;
  const fs::path root = output_dir / kCheckpointsDir;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return steps;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory() || !std::regex_match(name, m, kStepDirRe)) continue;
    if (is_complete_checkpoint(entry.path())) steps.push_back(std::stoll(m[1].str()));
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

namespace {

// Renames a checkpoint that failed verification out of the way of saves, pruning and resumes.
void set_aside(const fs::path& dir) {
  fs::path target;
  for (int i = 1;; ++i) {
    target = dir.string() + (i == 1 ? ".corrupt" : ".corrupt." + std::to_string(i));
    std::error_code ec;
    if (!fs::exists(target, ec)) break;
  }
  std::error_code ec;
  fs::rename(dir, target, ec);
  if (ec) {
    spdlog::warn("could not rename {} to {} ({}): it stays where it is", dir.string(),
                 target.string(), ec.message());
    return;
  }
  fsync_directory(dir.parent_path().string());
  spdlog::warn(
      "{} is kept, renamed to {}, for inspection (`glmtune inspect --verify {}`); "
      "nothing was deleted: remove it when you are done with it",
      dir.filename().string(), target.string(), target.string());
}

}  // namespace

std::optional<ResumePoint> load_latest_checkpoint(const fs::path& output_dir,
                                                  const LoadCheckpointOptions& options) {
  const fs::path root = output_dir / kCheckpointsDir;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return std::nullopt;
  std::vector<std::pair<int64_t, fs::path>> candidates;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory() || !std::regex_match(name, m, kStepDirRe)) continue;
    candidates.emplace_back(std::stoll(m[1].str()), entry.path());
  }
  std::sort(candidates.begin(), candidates.end(), std::greater<>());
  std::optional<int64_t> best;
  std::vector<std::string> failed;  // "step-N (why)", newest first
  for (const auto& [step, path] : candidates) {
    io::VerifyReport report;
    const bool started = fs::exists(path / kCompleteFile, ec);
    if (options.verify) {
      report = verify_training_checkpoint(path);
    } else if (std::string why; !is_complete_checkpoint(path, &why)) {
      report.problems.push_back({"", "", why});
    }
    if (report.ok()) {
      if (options.verify && !report.has_checksums)
        spdlog::warn(
            "{} has no checksums (written by an older glmtune): its contents are "
            "unverified",
            path.string());
      best = step;
      break;
    }
    if (!started) {
      // Never saved completely (a save builds its directory under another name): not a
      // checkpoint, and a later save of the same step replaces it.
      spdlog::warn("ignoring incomplete checkpoint {}: {}", path.string(),
                   report.problems.front().str());
      continue;
    }
    spdlog::error("checkpoint {} is corrupt ({} problem{}), not resuming from it:\n{}",
                  path.string(), report.problems.size(), report.problems.size() == 1 ? "" : "s",
                  report.describe(8, "  ").substr(0, report.describe(8, "  ").size() - 1));
    failed.push_back(
        fmt::format("{} ({})", path.filename().string(), report.problems.front().str()));
    if (options.set_aside_failed) set_aside(path);
  }
  if (!best) {
    if (failed.empty()) return std::nullopt;
    throw Error(fmt::format("no checkpoint to resume from verifies: {}", fmt::join(failed, "; ")),
                root.string(),
                "inspect them with `glmtune inspect --verify DIR` (they were kept); to train "
                "from the start instead, run without --resume into another [output] dir");
  }
  ResumePoint r;
  r.checkpoint.dir = root / step_dir_name(*best);
  const fs::path state_path = r.checkpoint.trainer_state_path();
  r.state = TrainerState::from_json(
      nlohmann::json::parse(read_text_file(state_path.string(), "trainer state")),
      state_path.string());
  if (!failed.empty())
    spdlog::warn("falling back to {}, the newest checkpoint that verifies, instead of {}",
                 step_dir_name(*best), fmt::join(failed, "; "));
  const fs::path latest = root / kLatestFile;
  if (fs::exists(latest, ec) && failed.empty()) {
    std::string named = read_text_file(latest.string(), "latest pointer");
    while (!named.empty() && (named.back() == '\n' || named.back() == '\r')) named.pop_back();
    if (named != step_dir_name(*best))
      spdlog::warn("{} names '{}', but the newest complete checkpoint is {}: resuming from it",
                   latest.string(), named, step_dir_name(*best));
  }
  return r;
}

}  // namespace glmtune::train
