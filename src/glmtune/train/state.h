#pragma once
// Training checkpoints and resume.
//
// A checkpoint is a directory OUT/checkpoints/step-N holding
//   model/               the released layout (ParamStore::save, or any writer): config.json and
//                        safetensors shards, as `glmtune init` writes them
//   optimizer/           AdamW state (master weights, moments, step count), see optimizer.h
//   trainer_state.json   step, sampler position, seeds, throughput totals, recipe fingerprint
//   COMPLETE             written last: the manifest of every file above with its size, and the
//                        XXH3-64 hash of each file that is not a tensor shard (the shards' tensors
//                        are hashed one by one in model/ and optimizer/glmtune-checksums.json)
//
// Saving builds everything in a temporary sibling (checkpoints/.step-N.tmp-PID), writes the
// COMPLETE manifest, renames the directory into place (atomic), then rewrites the
// checkpoints/latest pointer (atomic) and prunes old checkpoints down to keep_last. A kill at any
// moment leaves either no step-N or a complete one; leftovers are a temporary directory, which the
// next save removes, or a step directory without a valid manifest, which resume ignores.
//
// Resume picks the highest-numbered checkpoint whose manifest matches its files and whose
// contents verify (every tensor against its checksum, every other file against its hash). `latest`
// names the same one except when a run was killed between the rename and the pointer update; the
// manifest, not the pointer, is what makes a checkpoint usable. A newer checkpoint that fails is
// named in the log with the file and tensor at fault, and set aside as step-N.corrupt: nothing is
// deleted. One process saves (rank 0 in a distributed run).

#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "glmtune/io/checkpoint.h"
#include "glmtune/tensor/tensor.h"
#include "glmtune/train/metrics.h"

namespace glmtune::train {

class AdamW;

inline constexpr const char* kCheckpointsDir = "checkpoints";
inline constexpr const char* kLatestFile = "latest";
inline constexpr const char* kCompleteFile = "COMPLETE";
inline constexpr const char* kTrainerStateFile = "trainer_state.json";

// What, beyond the model and the optimizer, a resumed run needs to continue exactly.
struct TrainerState {
  int64_t step = 0;         // optimizer steps completed
  int64_t total_steps = 0;  // the run's length when saved
  int64_t epoch = 0;        // data epoch of the next pack (the sampler state is authoritative)
  nlohmann::json sampler = nlohmann::json::object();  // data::PackSampler::save_state()
  uint64_t seed = 0;                                  // the recipe's seed
  // Position in the counter-based random stream (Philox offsets consumed so far); the next draw
  // starts here. glmtune's training math draws nothing today; kept so that anything random added
  // later resumes on the same numbers.
  uint64_t rng_offset = 0;
  int64_t skipped_steps = 0;       // updates skipped for a non-finite gradient norm
  ThroughputTotals totals;         // behind exp_tgs and eta
  std::string recipe_fingerprint;  // Recipe::fingerprint() of the run that saved
  // Free-form extras of the trainer (kept verbatim).
  nlohmann::json extra = nlohmann::json::object();

  nlohmann::json to_json() const;
  // Throws glmtune::Error naming `source` for a missing or ill-typed field.
  static TrainerState from_json(const nlohmann::json& j, const std::string& source);
};

// A checkpoint directory and its parts.
struct CheckpointDir {
  std::filesystem::path dir;
  std::filesystem::path model_dir() const { return dir / "model"; }
  std::filesystem::path optimizer_dir() const { return dir / "optimizer"; }
  std::filesystem::path trainer_state_path() const { return dir / kTrainerStateFile; }
};

// Writes the model in the released layout into the directory it is given (which does not exist
// yet).
using ModelWriter = std::function<void(const std::filesystem::path& model_dir)>;

// Writes the optimizer state into the directory it is given (which does not exist yet), in the
// format of AdamW::save.
using OptimizerWriter = std::function<void(const std::filesystem::path& optimizer_dir)>;

// The whole state of one trained parameter, {master, exp_avg, exp_avg_sq} (f32, the parameter's
// element count), produced right before it is written (gathered from the ranks holding its
// pieces); may be undefined on a rank that writes nothing.
using WholeOptimizerState = std::function<std::array<Tensor, 3>(const std::string& param)>;
// Writes into `dir` exactly the files AdamW::save writes for an optimizer at step `step` whose
// trained parameters are `trained` (name and whole shape, in the optimizer's order), taking each
// parameter's state from `whole` one at a time and writing it before asking for the next: memory
// holds one parameter's state, never the whole optimizer's.
void save_optimizer_state(const std::filesystem::path& dir,
                          const std::vector<std::pair<std::string, Shape>>& trained, int64_t step,
                          const WholeOptimizerState& whole);
// Calls `whole` exactly as save_optimizer_state does, writing nothing: what the other ranks run
// while one rank saves, when `whole` is collective.
void visit_optimizer_state(const std::vector<std::pair<std::string, Shape>>& trained,
                           const WholeOptimizerState& whole);

// Saves checkpoint step-<state.step> under OUT/checkpoints, replacing an existing one of the
// same step, then prunes complete checkpoints beyond the newest `keep_last` (0 keeps all).
// Returns the checkpoint. Throws glmtune::Error naming the path on I/O failure; what was there
// before is then untouched.
CheckpointDir save_checkpoint(const std::filesystem::path& output_dir, const TrainerState& state,
                              const ModelWriter& write_model, const AdamW& optimizer,
                              int64_t keep_last);
// The same with the optimizer state written by `write_optimizer` (save_optimizer_state).
CheckpointDir save_checkpoint(const std::filesystem::path& output_dir, const TrainerState& state,
                              const ModelWriter& write_model,
                              const OptimizerWriter& write_optimizer, int64_t keep_last);

struct ResumePoint {
  CheckpointDir checkpoint;
  TrainerState state;
};

struct LoadCheckpointOptions {
  // Check the contents (verify_training_checkpoint) and fall back to an older checkpoint when the
  // newest does not verify. Without it only the manifest is checked (sizes, no reading).
  bool verify = true;
  // Rename a checkpoint that failed to step-N.corrupt (step-N.corrupt.2, ...), so that neither a
  // later save of the same step nor pruning deletes it, and no later resume picks it. One process
  // of a distributed run does it.
  bool set_aside_failed = false;
};

// The newest usable checkpoint under OUT/checkpoints, or nullopt when there is none (a fresh
// run). Incomplete or corrupt directories are skipped with a warning naming what is wrong; when
// complete checkpoints exist but none verifies, throws glmtune::Error listing them.
std::optional<ResumePoint> load_latest_checkpoint(const std::filesystem::path& output_dir,
                                                  const LoadCheckpointOptions& options = {});

// Steps of the complete checkpoints under OUT/checkpoints, ascending.
std::vector<int64_t> complete_checkpoint_steps(const std::filesystem::path& output_dir);

// Whether `dir` is a complete checkpoint: a manifest naming files that all exist with their
// recorded sizes, and a readable trainer state. `why` (if given) receives the reason when not.
bool is_complete_checkpoint(const std::filesystem::path& dir, std::string* why = nullptr);

// Everything a resume reads, checked without loading it: the manifest (is_complete_checkpoint),
// the hash of every file it lists that is not a tensor shard, and model/ and optimizer/ with
// io::verify_checkpoint. Problems name files relative to `dir` ("model/model-00001-of-00001...").
// has_checksums is false for a checkpoint of an older glmtune (unverified, structure checked).
io::VerifyReport verify_training_checkpoint(const std::filesystem::path& dir);

}  // namespace glmtune::train
