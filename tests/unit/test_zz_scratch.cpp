#include <gtest/gtest.h>
#include <cmath>
#include <random>
#include "glmtune/io/checkpoint.h"
#include "glmtune/model/init.h"
#include "glmtune/model/lora.h"
#include "glmtune/model/param_store.h"
#include "glmtune/model/text/backward.h"
#include "glmtune/model/text/model.h"
#include "support/gpu_tiny_model.h"
#include "support/temp_dir.h"
using namespace glmtune; using namespace glmtune::model; using namespace glmtune::model::text; using namespace glmtune::test;
TEST(Scratch, Cpu) {
  const ModelConfig config = gpu_tiny_config();
  TempDir dir("scratch");
  InitOptions init; init.seed = 5;
  write_random_checkpoint(config, dir.path() / "ck", init);
  ParamStore store = ParamStore::load(io::CheckpointReader::open(dir.path() / "ck"), config);
  fprintf(stderr, "loaded\n");
  LoraConfig lora; lora.rank = 4; lora.alpha = 8; lora.target_modules = {"q_proj"};
  const std::vector<std::string> modules = resolve_lora_targets(store, lora, "test");
  add_lora_adapters(store, lora, modules, 7);
  fprintf(stderr, "added\n");
  std::mt19937_64 rng(3); std::normal_distribution<double> n(0.0, 1.0);
  for (const InternalParam& p : store.params()) {
    if (!p.adapter) { store.set_trainable(p.name, false); continue; }
    std::vector<double> v(size_t(p.value.numel()));
    for (double& x : v) x = 0.1 * n(rng);
    store.get(p.name) = Tensor::from_doubles(v, p.value.shape(), DType::f32).to(DType::f32);
  }
  fprintf(stderr, "redrawn\n");
  TextModel cpu(store);
  fprintf(stderr, "model\n");
  const std::vector<int32_t> cu_values = {0, 1, 71, 128, 136};
  const int64_t tokens = cu_values.back();
  std::uniform_int_distribution<int32_t> token(1, int32_t(config.text().vocab_size) - 1);
  std::vector<int32_t> ids(static_cast<size_t>(tokens)), labels(static_cast<size_t>(tokens), -100);
  for (int32_t& id : ids) id = token(rng);
  for (size_t d = 0; d + 2 < cu_values.size(); ++d)
    for (int32_t i = cu_values[d]; i + 1 < cu_values[d + 1]; ++i) labels[size_t(i)] = ids[size_t(i + 1)];
  PackInput in;
  in.input_ids = Tensor::from_vector(ids, {tokens});
  in.cu_seqlens = Tensor::from_vector(cu_values, {int64_t(cu_values.size())});
  in.labels = Tensor::from_vector(labels, {tokens});
  in.padding_tokens = 8;
  TrainOptions opt; opt.balancing_alpha = 0.01;
  TextGrads g = TextGrads::zeros_like(cpu.weights());
  fprintf(stderr, "grads %zu\n", g.named.size());
  auto r = forward_backward(cpu, in, opt, g);
  fprintf(stderr, "done %f\n", r.backward.lm_loss);
}
