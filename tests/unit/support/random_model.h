#pragma once
// A random tiny-preset model in the released layout, loaded into a ParamStore, for the model-level
// tests (model backward, LoRA).

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "glmtune/io/checkpoint.h"
#include "glmtune/model/config.h"
#include "glmtune/model/init.h"
#include "glmtune/model/param_store.h"
#include "temp_dir.h"

namespace glmtune::test {

// A model of the tiny preset (with `sets` applied) written with `seed`, its constant-initialised
// parameters (norm weights, mHC base / scale, A_log, router bias) redrawn so that no code path
// sees a trivial value.
struct RandomModel {
  TempDir dir;
  model::ModelConfig config = model::ModelConfig::preset("tiny");
  std::unique_ptr<model::ParamStore> store;

  RandomModel(const std::string& tag, uint64_t seed, const std::vector<std::string>& sets = {})
      : dir(tag) {
    for (const std::string& s : sets) {
      const size_t eq = s.find('=');
      config.set(s.substr(0, eq), s.substr(eq + 1));
    }
    model::InitOptions options;
    options.seed = seed;
    model::write_random_checkpoint(config, dir.path() / "ck", options);
    store = std::make_unique<model::ParamStore>(
        model::ParamStore::load(io::CheckpointReader::open(dir.path() / "ck"), config));
  }

  void redraw_constants(std::mt19937_64& rng) {
    std::normal_distribution<double> n(0.0, 1.0);
    for (const model::InternalParam& p : store->params()) {
      const std::string& name = p.name;
      double mean = 0, sd = 0;
      if (name.ends_with("e_score_correction_bias"))
        sd = 0.05;
      else if (name.ends_with("_base") || name.ends_with("A_log"))
        sd = 0.5;
      else if (name.ends_with("_scale"))
        mean = 1.0, sd = 0.3;
      else if (name.find("norm") != std::string::npos && name.ends_with("weight") &&
               name.find(".indexer.") == std::string::npos)
        mean = 1.0, sd = 0.2;
      else
        continue;
      std::vector<double> v(size_t(p.value.numel()));
      for (double& x : v) x = mean + sd * n(rng);
      store->get(name) = Tensor::from_doubles(v, p.value.shape(), DType::f32);
    }
  }
};

}  // namespace glmtune::test
