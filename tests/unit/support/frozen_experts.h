#pragma once
// The checkpoint of a run that froze the routed experts (train.freeze = ['mlp\.experts\.']):
// the experts' released tensors byte-identical to the initial checkpoint's, every other trained
// tensor changed, and optimizer state for none of the experts.

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>

#include "glmtune/io/checkpoint.h"
#include "glmtune/io/safetensors.h"

namespace glmtune::test {

struct FrozenExpertsCheck {
  int64_t experts = 0;    // released expert tensors compared
  int64_t others = 0;     // other trained tensors
  int64_t changed = 0;    // of which changed
  int64_t optimizer = 0;  // optimizer tensors saved
};

// `initial`: the model the run started from; `step`: one of its checkpoints (model/, optimizer/).
inline FrozenExpertsCheck expect_frozen_experts(const std::filesystem::path& initial,
                                                const std::filesystem::path& step) {
  FrozenExpertsCheck c;
  const io::CheckpointReader before = io::CheckpointReader::open(initial);
  const io::CheckpointReader after = io::CheckpointReader::open(step / "model");
  for (const std::string& name : before.names()) {
    EXPECT_TRUE(after.contains(name)) << name;
    if (!after.contains(name)) continue;
    const auto a = before.bytes(name), b = after.bytes(name);
    const bool same = a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size()) == 0;
    if (name.find(".mlp.experts.") != std::string::npos) {
      ++c.experts;
      EXPECT_TRUE(same) << name << " is frozen but changed";
    } else if (name.find(".indexer.") == std::string::npos &&
               !name.ends_with("e_score_correction_bias") && !name.starts_with("model.visual.")) {
      ++c.others;
      c.changed += same ? 0 : 1;
    }
  }
  EXPECT_GT(c.experts, 0);
  // Every trained tensor moves in a few steps at the tests' learning rates.
  EXPECT_EQ(c.changed, c.others);
  for (const auto& e : std::filesystem::directory_iterator(step / "optimizer"))
    if (e.path().extension() == ".safetensors")
      for (const std::string& n : io::SafetensorsFile::open(e.path()).names()) {
        EXPECT_EQ(n.find(".mlp.experts."), std::string::npos) << "optimizer state " << n;
        ++c.optimizer;
      }
  EXPECT_GT(c.optimizer, 0);
  return c;
}

}  // namespace glmtune::test
