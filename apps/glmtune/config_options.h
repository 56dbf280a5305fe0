#pragma once
// Options shared by the commands that build a model config: --preset / a directory, and --set.

#include <memory>
#include <string>
#include <vector>

#include "command.h"
#include "glmtune/model/config.h"

namespace glmtune::cli {

struct ConfigOptions {
  std::string preset;
  std::vector<std::string> sets;
  // Adds --set (repeatable).
  void add_set_option(CLI::App& app);
  // Applies every --set in order; a malformed "key=value" names the flag.
  void apply(model::ModelConfig& config) const;
};

}  // namespace glmtune::cli
