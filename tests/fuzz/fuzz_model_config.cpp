// libFuzzer entry: arbitrary bytes as a model config.json, read through ModelConfig::from_file
// (the path every command takes). Every input must either be rejected with a glmtune::Error or give
// a config whose derived per-layer schedules have one entry per decoder layer, and whose document
// written back with the schedules (as `glmtune init` / `crop` save it) reads back as the same
// model. Anything else escaping (a crash, a sanitizer report, nlohmann's or another exception, an
// allocation the file's size does not justify) is a bug.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>

#include "fuzz_util.h"
#include "glmtune/base/error.h"
#include "glmtune/model/config.h"

using glmtune::fuzz::bug;
using glmtune::model::ModelConfig;
using glmtune::model::TextConfig;

namespace {

glmtune::fuzz::InputFile* g_file = nullptr;

void check_text(const TextConfig& t) {
  const auto layers = size_t(t.num_hidden_layers);
  if (t.layer_types.size() != layers || t.mlp_layer_types.size() != layers ||
      t.indexer_types.size() != layers)
    bug("a per-layer schedule without one entry per layer");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  static glmtune::fuzz::InputFile file;
  g_file = &file;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  g_file->write(data, size);
  std::optional<ModelConfig> config;
  try {
    config.emplace(ModelConfig::from_file(g_file->path()));
  } catch (const glmtune::Error& e) {
    if (e.where().empty()) bug("a rejected config does not say where");
    return 0;
  }
  check_text(config->text());
  try {
    const ModelConfig again = ModelConfig::from_json(config->to_json_with_schedules(), "again");
    check_text(again.text());
    const TextConfig &a = config->text(), &b = again.text();
    if (a.layer_types != b.layer_types || a.mlp_layer_types != b.mlp_layer_types ||
        a.indexer_types != b.indexer_types || a.num_hidden_layers != b.num_hidden_layers ||
        a.vocab_size != b.vocab_size || a.hidden_size != b.hidden_size ||
        config->vision().has_value() != again.vision().has_value() ||
        config->is_flat() != again.is_flat())
      bug("the config saved with its schedules reads back as another model");
  } catch (const glmtune::Error&) {
    bug("the config saved with its schedules does not read back");
  }
  (void)config->document().dump(2);
  return 0;
}
