#include "config_options.h"

#include "glmtune/base/error.h"

namespace glmtune::cli {

void ConfigOptions::add_set_option(CLI::App& app) {
  app.add_option("--set", sets,
                 "Override a config field: section.field=value (repeatable), "
                 "e.g. text_config.n_routed_experts=36")
      ->take_all();
}

void ConfigOptions::apply(model::ModelConfig& config) const {
  std::vector<std::pair<std::string, std::string>> overrides;
  for (const auto& s : sets) {
    auto eq = s.find('=');
    if (eq == std::string::npos || eq == 0)
      throw Error("expected key=value, got '" + s + "'", "--set",
                  "write e.g. --set text_config.n_routed_experts=36");
    overrides.emplace_back(s.substr(0, eq), s.substr(eq + 1));
  }
  // All together: some fields are only consistent jointly (text width and vision output width).
  if (!overrides.empty()) config.set_all(overrides);
}

}  // namespace glmtune::cli
