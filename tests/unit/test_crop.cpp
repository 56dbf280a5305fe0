// `glmtune crop`: synthetic sharded checkpoints in both released formats (FP8 e4m3 with
// weight_scale_inv, and BF16) are cropped and checked: kept and renamed key sets, the config
// rewrite, BF16 values equal to a float64 reference dequantisation rounded once to BF16 (bit for
// bit), pass-through tensors byte-identical, and every error raised before any work is done.

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <array>
#include <cfenv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "glmtune/base/error.h"
#include "glmtune/base/progress.h"
#include "glmtune/io/checkpoint.h"
#include "glmtune/io/crop.h"
#include "glmtune/io/fp8.h"
#include "support/temp_dir.h"

namespace fs = std::filesystem;
using namespace glmtune;
using namespace glmtune::io;
using ojson = nlohmann::ordered_json;

namespace {

using glmtune::test::read_text;
using glmtune::test::TempDir;
using glmtune::test::write_text;

template <typename Fn>
void expect_error(Fn&& fn, const std::string& expected) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one containing: " << expected;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << "message: " << e.what();
  }
}

// ---- An independent float64 reference for FP8 dequantisation ----

// e4m3fn decoded from its definition: bias 7, subnormals at exponent 0, S.1111.111 is NaN.
double ref_fp8(uint8_t v) {
  const int sign = v >> 7, exp = (v >> 3) & 0xf, man = v & 7;
  if (exp == 0xf && man == 7) return std::nan("");
  double mag = exp == 0 ? std::ldexp(man, -9) : std::ldexp(8 + man, exp - 10);
  return sign ? -mag : mag;
}

// A double rounded once to bfloat16 (nearest, ties to even), from the format's definition:
// 8 significant bits, exponents down to -126, subnormal steps of 2^-133, overflow to infinity.
uint16_t ref_bf16(double x) {
  if (std::isnan(x)) return 0x7fc0;
  const bool neg = std::signbit(x);
  double a = std::fabs(x);
  double r = 0;
  if (a != 0 && std::isfinite(a)) {
    int e;
    std::frexp(a, &e);  // a = m * 2^e with m in [0.5, 1): leading bit at 2^(e-1)
    const int quantum_exp = std::max(e - 1, -126) - 7;
    const double q = std::ldexp(1.0, quantum_exp);
    std::fesetround(FE_TONEAREST);
    r = std::nearbyint(a / q) * q;  // a / q is exact: q is a power of two
  } else {
    r = a;
  }
  const double max_finite = std::ldexp(255.0, 120);  // (2 - 2^-7) * 2^127
  float f = r > max_finite ? INFINITY : float(r);    // r is exact in float when finite
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return uint16_t((bits >> 16) | (neg ? 0x8000u : 0u));
}

uint16_t ref_dequant(uint8_t w, float scale) {
  return ref_bf16(ref_fp8(w) * double(scale));  // exact: 4 x 24 significant bits fit a double
}

// ---- Synthetic released checkpoints ----

constexpr int64_t kLayers = 8;    // layers 0-7, DSA at 3 and 7, dense 0-2; MTP is layer 8
constexpr int64_t kHidden = 160;  // 128 + a partial block of 32
constexpr int64_t kInter = 136;   // 128 + a partial block of 8
constexpr int64_t kQ = 96;        // a single partial block

enum class Format { fp8, bf16 };

bool is_dsa(int64_t l) { return l % 4 == 3 || l == kLayers; }

ojson make_config(Format format) {
  ojson layer_types = ojson::array(), mlp = ojson::array(), indexer = ojson::array();
  ojson kda = ojson::array(), full = ojson::array();
  for (int64_t i = 0; i < kLayers; ++i) {
    layer_types.push_back(is_dsa(i) ? "deepseek_sparse_attention" : "linear_attention");
    mlp.push_back(i < 3 ? "dense" : "sparse");
    indexer.push_back("full");
    (is_dsa(i) ? full : kda).push_back(i);
  }
  ojson text = ojson::object();
  text["attention_bias"] = false;
  text["dtype"] = "bfloat16";
  text["first_k_dense_replace"] = 3;
  text["hidden_size"] = kHidden;
  text["indexer_types"] = indexer;
  if (format == Format::bf16) text["index_source_layer_ids"] = full;
  text["layer_types"] = layer_types;
  text["linear_attn_config"] = {{"num_heads", 2},    {"gate_lower_bound", -5.0},
                                {"head_dim", 8},     {"short_conv_kernel_size", 4},
                                {"kda_layers", kda}, {"full_attn_layers", full}};
  text["mlp_layer_types"] = mlp;
  text["model_type"] = "glm5_next_text";
  text["num_hidden_layers"] = kLayers;
  text["num_nextn_predict_layers"] = 1;
  if (format == Format::bf16) text["kv_source_layer_ids"] = full;
  text["rms_norm_eps"] = 1e-05;
  text["vocab_size"] = 48;
  text["unknown_future_field"] = {{"kept", true}};
  ojson config = ojson::object();
  config["architectures"] = {"Glm5NextForConditionalGeneration"};
  config["text_config"] = text;
  config["vision_config"] = {{"depth", 1}, {"hidden_size", 32}, {"model_type", "glm5_next_vision"}};
  config["image_token_id"] = 47;
  config["model_type"] = "glm5_next";
  config["transformers_version"] = "5.17.0";
  if (format == Format::fp8) {
    std::vector<std::string> skip = {"lm_head", "model.embed_tokens", "model.visual"};
    for (int64_t l = 0; l <= kLayers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      skip.push_back(p + "input_layernorm");
      skip.push_back(p + (is_dsa(l) ? "self_attn.kv_b_proj" : "self_attn.q_proj"));
      if (l == kLayers) skip.push_back(p + "eh_proj");
    }
    std::sort(skip.begin(), skip.end());
    config["quantization_config"] = {{"activation_scheme", "dynamic"},
                                     {"fmt", "e4m3"},
                                     {"modules_to_not_convert", skip},
                                     {"quant_method", "fp8"},
                                     {"weight_block_size", {128, 128}}};
  }
  return config;
}

struct SourceTensor {
  std::string name;
  DType dtype;
  Shape shape;
  bool fp8_in_release;  // quantised (with a scale) in the FP8 release
};

// The tensor inventory of the synthetic model, in the released naming scheme.
std::vector<SourceTensor> inventory() {
  std::vector<SourceTensor> out;
  const std::string lm = "model.language_model.";
  out.push_back({lm + "embed_tokens.weight", DType::bf16, {48, kHidden}, false});
  out.push_back({lm + "norm.weight", DType::bf16, {kHidden}, false});
  out.push_back({"lm_head.weight", DType::bf16, {48, kHidden}, false});
  out.push_back({"model.visual.patch_embed.proj.weight", DType::bf16, {32, 3, 2, 2, 2}, false});
  out.push_back({"model.visual.blocks.0.attn.qkv.weight", DType::bf16, {96, 32}, false});
  out.push_back({"model.visual.merger.proj.weight", DType::bf16, {kHidden, 32}, false});
  for (int64_t l = 0; l <= kLayers; ++l) {
    const std::string p = lm + "layers." + std::to_string(l) + ".";
    const bool mtp = l == kLayers;
    out.push_back({p + "input_layernorm.weight", DType::bf16, {kHidden}, false});
    out.push_back({p + "post_attention_layernorm.weight", DType::bf16, {kHidden}, false});
    if (!mtp) {
      out.push_back({p + "hc_attn_fn", DType::bf16, {24, 4 * 8}, false});
      out.push_back({p + "hc_attn_base", DType::f32, {24}, false});
      out.push_back({p + "hc_ffn_scale", DType::f32, {3}, false});
    }
    if (is_dsa(l)) {
      out.push_back({p + "self_attn.q_a_proj.weight", DType::fp8e4m3, {kQ, kHidden}, true});
      out.push_back({p + "self_attn.o_proj.weight", DType::fp8e4m3, {kHidden, kQ}, true});
      out.push_back({p + "self_attn.kv_b_proj.weight", DType::bf16, {64, 16}, false});
      out.push_back(
          {p + "self_attn.indexer.index_kpool_compress_ape", DType::bf16, {4, 16}, false});
    } else {
      out.push_back({p + "self_attn.q_proj.weight", DType::bf16, {16, kHidden}, false});
      out.push_back({p + "self_attn.A_log", DType::f32, {2}, false});
      out.push_back({p + "self_attn.dt_bias", DType::f32, {16}, false});
    }
    if (l < 3) {
      out.push_back({p + "mlp.gate_proj.weight", DType::fp8e4m3, {kInter, kHidden}, true});
      out.push_back({p + "mlp.down_proj.weight", DType::fp8e4m3, {kHidden, kInter}, true});
    } else {
      out.push_back({p + "mlp.gate.weight", DType::bf16, {4, kHidden}, false});
      out.push_back({p + "mlp.gate.e_score_correction_bias", DType::f32, {4}, false});
      for (int e = 0; e < 2; ++e)
        out.push_back({p + "mlp.experts." + std::to_string(e) + ".up_proj.weight",
                       DType::fp8e4m3,
                       {32, kHidden},
                       true});
      out.push_back(
          {p + "mlp.shared_experts.down_proj.weight", DType::fp8e4m3, {kHidden, 32}, true});
    }
    if (mtp) {
      out.push_back({p + "eh_proj.weight", DType::bf16, {kHidden, 2 * kHidden}, false});
      out.push_back({p + "enorm.weight", DType::bf16, {kHidden}, false});
      out.push_back({p + "hnorm.weight", DType::bf16, {kHidden}, false});
      out.push_back({p + "shared_head.norm.weight", DType::bf16, {kHidden}, false});
    }
  }
  return out;
}

Tensor random_tensor(DType dtype, const Shape& shape, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, dtype);
  auto* p = static_cast<uint8_t*>(t.data_ptr());
  std::uniform_int_distribution<int> byte(0, 255);
  if (dtype == DType::fp8e4m3) {
    // Every finite code (NaN codes 0x7f/0xff excluded: released weights have none).
    for (size_t i = 0; i < t.nbytes(); ++i) {
      uint8_t v;
      do v = uint8_t(byte(rng));
      while ((v & 0x7f) == 0x7f);
      p[i] = v;
    }
  } else if (dtype == DType::bf16) {
    std::normal_distribution<float> n(0.f, 0.05f);
    auto* q = static_cast<uint16_t*>(t.data_ptr());
    for (int64_t i = 0; i < t.numel(); ++i) q[i] = f32_to_bf16(n(rng));
  } else {
    std::normal_distribution<float> n(0.f, 1.f);
    auto* q = static_cast<float*>(t.data_ptr());
    for (int64_t i = 0; i < t.numel(); ++i) q[i] = n(rng);
  }
  return t;
}

// Block scales like the release's (amax / 448 of each block): positive floats with all 24
// mantissa bits in use, so products carry up to 28 significant bits.
Tensor random_scale(const Shape& shape, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, DType::f32);
  std::uniform_real_distribution<float> u(1e-5f, 2e-2f);
  auto* q = static_cast<float*>(t.data_ptr());
  for (int64_t i = 0; i < t.numel(); ++i) q[i] = u(rng);
  return t;
}

const std::map<std::string, std::string> kExtraFiles = {
    {"tokenizer.json", "{\"model\": {\"type\": \"BPE\"}}\n"},
    {"tokenizer_config.json", "{\"model_max_length\": 1048576}\n"},
    {"chat_template.jinja", "[gMASK]<sop>{% for m in messages %}{{ m.content }}{% endfor %}"},
    {"processor_config.json", "{\"image_processor\": {}}\n"},
    {"generation_config.json", "{\"eos_token_id\": [1, 2]}\n"},
};

// Writes a synthetic sharded checkpoint in one of the released formats. Shards are small so
// that the checkpoint spans several; in the FP8 format the MTP layer's scales are written first,
// so that they sit in a different shard from their weights (as in the release).
void make_source(const fs::path& dir, Format format, uint32_t seed = 1) {
  std::mt19937 rng(seed);
  CheckpointWriterOptions options;
  options.max_shard_bytes = 48 * 1024;
  CheckpointWriter w(dir, options);
  std::vector<std::pair<std::string, Tensor>> deferred;
  for (const auto& t : inventory()) {
    if (format == Format::fp8 && t.fp8_in_release) {
      Tensor weight = random_tensor(DType::fp8e4m3, t.shape, rng);
      Tensor scale = random_scale(fp8_scale_shape(t.shape), rng);
      if (t.name.find("layers." + std::to_string(kLayers) + ".") != std::string::npos) {
        w.add(t.name + "_scale_inv", scale);
        deferred.emplace_back(t.name, weight);
      } else {
        w.add(t.name, weight);
        w.add(t.name + "_scale_inv", scale);
      }
    } else {
      DType dtype = t.dtype == DType::fp8e4m3 ? DType::bf16 : t.dtype;
      w.add(t.name, random_tensor(dtype, t.shape, rng));
    }
  }
  for (auto& [name, t] : deferred) w.add(name, t);
  w.add_file("config.json", make_config(format).dump(2, ' ', true) + "\n");
  for (const auto& [name, content] : kExtraFiles) w.add_file(name, content);
  w.finish();
}

// What the output should hold: source name -> output name, derived independently of the crop
// code from the inventory.
std::map<std::string, std::string> expected_names(const std::vector<int64_t>& layers, bool mtp,
                                                  bool vision, bool keep_scales, Format format) {
  std::map<int64_t, int64_t> renumber;
  for (size_t i = 0; i < layers.size(); ++i) renumber[layers[i]] = int64_t(i);
  if (mtp) renumber[kLayers] = int64_t(layers.size());
  std::map<std::string, std::string> out;
  const std::string lp = "model.language_model.layers.";
  for (const auto& t : inventory()) {
    std::vector<std::string> names = {t.name};
    if (format == Format::fp8 && t.fp8_in_release && keep_scales)
      names.push_back(t.name + "_scale_inv");
    for (const auto& name : names) {
      if (name.rfind(lp, 0) == 0) {
        size_t dot = name.find('.', lp.size());
        int64_t layer = std::stoll(name.substr(lp.size(), dot - lp.size()));
        if (!renumber.count(layer)) continue;
        out[name] = lp + std::to_string(renumber[layer]) + name.substr(dot);
      } else if (name.rfind("model.visual.", 0) == 0) {
        if (vision) out[name] = name;
      } else {
        out[name] = name;
      }
    }
  }
  return out;
}

std::vector<std::string> keys_of(const ojson& obj) {
  std::vector<std::string> keys;
  for (auto it = obj.begin(); it != obj.end(); ++it) keys.push_back(it.key());
  return keys;
}

CropResult crop(const fs::path& src, const fs::path& dst, const std::string& layers,
                std::optional<bool> mtp = std::nullopt, bool vision = true,
                CropDType dtype = CropDType::bf16, uint64_t shard = 40 * 1024) {
  CropOptions options;
  options.layers = parse_layer_list(layers);
  options.mtp = mtp;
  options.vision = vision;
  options.dtype = dtype;
  options.max_shard_bytes = shard;
  // Small chunks, so that tensors stream in several parts (a partial one last) as large ones do.
  options.chunk_bytes = 3000;
  CropPlan plan = plan_crop(src, dst, options);
  return run_crop(plan, options, /*show_progress=*/false);
}

// Every output tensor checked against its source: dequantised ones against the float64
// reference, everything else byte for byte.
void check_values(const CheckpointReader& src, const CheckpointReader& out,
                  const std::map<std::string, std::string>& names, bool dequantized) {
  size_t n_dequant = 0, n_copied = 0;
  for (const auto& [from, to] : names) {
    SCOPED_TRACE(from + " -> " + to);
    ASSERT_TRUE(out.contains(to));
    const TensorInfo& si = src.info(from);
    const TensorInfo& oi = out.info(to);
    EXPECT_EQ(oi.shape, si.shape);
    auto sb = src.bytes(from);
    auto ob = out.bytes(to);
    const std::string scale = from + "_scale_inv";
    if (dequantized && src.contains(scale)) {
      ++n_dequant;
      ASSERT_EQ(si.dtype, DType::fp8e4m3);
      ASSERT_EQ(oi.dtype, DType::bf16);
      const int64_t rows = si.shape[0], cols = si.shape[1];
      const int64_t scols = (cols + 127) / 128;
      auto scale_bytes = src.bytes(scale);
      std::vector<float> s(scale_bytes.size() / 4);
      std::memcpy(s.data(), scale_bytes.data(), scale_bytes.size());
      size_t mismatches = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          uint16_t got;
          std::memcpy(&got, ob.data() + 2 * (r * cols + c), 2);
          uint16_t want =
              ref_dequant(sb[size_t(r * cols + c)], s[size_t((r / 128) * scols + c / 128)]);
          mismatches += got != want;
        }
      EXPECT_EQ(mismatches, 0u);
    } else {
      ++n_copied;
      EXPECT_EQ(oi.dtype, si.dtype);
      ASSERT_EQ(ob.size(), sb.size());
      EXPECT_EQ(std::memcmp(ob.data(), sb.data(), sb.size()), 0) << "not bit-identical";
    }
  }
  EXPECT_GT(n_copied, 0u);
  if (dequantized) EXPECT_GT(n_dequant, 0u);
}

}  // namespace

TEST(CropLayers, ParseLayerList) {
  EXPECT_EQ(parse_layer_list("0-4"), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(parse_layer_list("7, 0,2-3"), (std::vector<int64_t>{0, 2, 3, 7}));
  EXPECT_EQ(parse_layer_list("5"), (std::vector<int64_t>{5}));
  expect_error([] { parse_layer_list(""); }, "no layers given");
  expect_error([] { parse_layer_list("1,,2"); }, "empty item");
  expect_error([] { parse_layer_list("4-2"); }, "runs backwards");
  expect_error([] { parse_layer_list("-1"); }, "is not a layer");
  expect_error([] { parse_layer_list("x"); }, "is not a layer index");
  expect_error([] { parse_layer_list("0-3,2"); }, "layer 2 is listed twice");
}

TEST(CropLayers, ParseLayerName) {
  auto a = parse_layer_name("model.language_model.layers.45.mlp.experts.3.up_proj.weight");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->prefix, "model.language_model.layers.");
  EXPECT_EQ(a->layer, 45);
  EXPECT_EQ(a->rest, "mlp.experts.3.up_proj.weight");
  auto b = parse_layer_name("model.layers.0.input_layernorm");
  ASSERT_TRUE(b);
  EXPECT_EQ(b->layer, 0);
  EXPECT_FALSE(parse_layer_name("model.visual.blocks.0.norm1.weight"));
  EXPECT_FALSE(parse_layer_name("model.language_model.embed_tokens.weight"));
  EXPECT_FALSE(parse_layer_name("model.language_model.layers.x.w"));
  EXPECT_FALSE(parse_layer_name("model.language_model.layers.3"));
}

TEST(Fp8, EveryCodeTimesManyScalesMatchesTheFloat64Reference) {
  std::mt19937 rng(42);
  std::vector<float> scales = {1.0f,
                               0.5f,
                               3.0f,
                               1e-3f,
                               448.0f,
                               1.0e-38f,
                               1.0e-44f /* subnormal */,
                               3.0e38f /* products overflow */,
                               0.0f,
                               -2.5f};
  std::uniform_int_distribution<uint32_t> bits(0, 0x7f7fffffu);
  for (int i = 0; i < 3000; ++i) {
    uint32_t u = bits(rng);
    float f;
    std::memcpy(&f, &u, 4);
    scales.push_back(f);
  }
  size_t checked = 0;
  for (float s : scales)
    for (int code = 0; code < 256; ++code) {
      const uint16_t got = dequantize_fp8_value_bf16(uint8_t(code), s);
      if (std::isnan(ref_fp8(uint8_t(code)))) {
        EXPECT_TRUE(std::isnan(bf16_to_f32(got)));
        continue;
      }
      const uint16_t want = ref_dequant(uint8_t(code), s);
      ASSERT_EQ(got, want) << "code 0x" << std::hex << code << " scale " << s;
      ++checked;
    }
  EXPECT_GT(checked, 700000u);
}

TEST(Fp8, BlocksIncludingPartialEdgeBlocks) {
  std::mt19937 rng(5);
  for (auto [rows, cols, br, bc] : std::vector<std::array<int64_t, 4>>{
           {300, 260, 128, 128}, {128, 128, 128, 128}, {5, 7, 128, 128}, {37, 50, 16, 8}}) {
    SCOPED_TRACE(fmt::format("{}x{} in {}x{} blocks", rows, cols, br, bc));
    Tensor w = random_tensor(DType::fp8e4m3, {rows, cols}, rng);
    Tensor s = random_scale(fp8_scale_shape({rows, cols}, br, bc), rng);
    EXPECT_EQ(s.shape(), (Shape{(rows + br - 1) / br, (cols + bc - 1) / bc}));
    Tensor out = dequantize_fp8_block(w, s, br, bc);
    ASSERT_EQ(out.dtype(), DType::bf16);
    const auto* wp = static_cast<const uint8_t*>(w.data_ptr());
    const auto* sp = static_cast<const float*>(s.data_ptr());
    const auto* op = static_cast<const uint16_t*>(out.data_ptr());
    const int64_t scols = s.size(1);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        ASSERT_EQ(op[r * cols + c], ref_dequant(wp[r * cols + c], sp[(r / br) * scols + c / bc]))
            << "at [" << r << ", " << c << "]";
  }
  Tensor w = random_tensor(DType::fp8e4m3, {10, 10}, rng);
  expect_error(
      [&] {
        dequantize_fp8_block(w, random_scale({2, 1}, rng), 128, 128, "x.weight");
      },
      "x.weight: scale_inv has shape [2, 1] but a [10, 10] weight in 128x128 blocks needs [1, 1]");
  expect_error(
      [&] {
        dequantize_fp8_block(Tensor::zeros({10, 10}, DType::bf16), random_scale({1, 1}, rng));
      },
      "is bf16, not fp8e4m3");
}

TEST(Crop, Fp8ReleaseFirstLayersWithMtp) {
  TempDir tmp;
  const fs::path src = tmp / "fp8", dst = tmp / "crop";
  make_source(src, Format::fp8);
  auto source = CheckpointReader::open(src);
  ASSERT_GT(source.shard_files().size(), 3u);
  CropResult result = crop(src, dst, "0-4");
  EXPECT_GT(result.shards, 1u);

  auto out = CheckpointReader::open(dst);
  out.validate();
  // Kept and renamed key sets: layers 0-4 as they are, MTP layer 8 as layer 5, scales gone.
  const auto names = expected_names({0, 1, 2, 3, 4}, true, true, false, Format::fp8);
  std::vector<std::string> want;
  for (const auto& [from, to] : names) want.push_back(to);
  std::sort(want.begin(), want.end());
  EXPECT_EQ(out.names(), want);
  EXPECT_TRUE(out.contains("model.language_model.layers.5.eh_proj.weight"));
  EXPECT_TRUE(out.contains("model.language_model.layers.5.mlp.experts.1.up_proj.weight"));
  EXPECT_FALSE(out.contains("model.language_model.layers.8.eh_proj.weight"));
  for (const auto& name : out.names())
    EXPECT_EQ(name.find("_scale_inv"), std::string::npos) << name;
  check_values(source, out, names, true);

  // The config rewrite.
  const ojson before = nlohmann::ordered_json::parse(read_text(src / "config.json"));
  const ojson after = nlohmann::ordered_json::parse(read_text(dst / "config.json"));
  const ojson& t = after["text_config"];
  EXPECT_EQ(t["num_hidden_layers"], 5);
  EXPECT_EQ(t["num_nextn_predict_layers"], 1);
  EXPECT_EQ(t["first_k_dense_replace"], 3);
  EXPECT_EQ(t["layer_types"], ojson({"linear_attention", "linear_attention", "linear_attention",
                                     "deepseek_sparse_attention", "linear_attention"}));
  EXPECT_EQ(t["mlp_layer_types"], ojson({"dense", "dense", "dense", "sparse", "sparse"}));
  EXPECT_EQ(t["indexer_types"].size(), 5u);
  EXPECT_EQ(t["linear_attn_config"]["kda_layers"], ojson({0, 1, 2, 4}));
  EXPECT_EQ(t["linear_attn_config"]["full_attn_layers"], ojson({3}));
  EXPECT_EQ(t["unknown_future_field"], before["text_config"]["unknown_future_field"]);
  EXPECT_FALSE(after.contains("quantization_config"));
  // Key order is preserved (quantization_config aside) and nothing else changed.
  std::vector<std::string> root_keys = keys_of(before);
  root_keys.erase(std::find(root_keys.begin(), root_keys.end(), "quantization_config"));
  EXPECT_EQ(keys_of(after), root_keys);
  EXPECT_EQ(keys_of(t), keys_of(before["text_config"]));
  EXPECT_EQ(after["vision_config"], before["vision_config"]);
  // Tokenizer, template and processor files travel along unchanged.
  for (const auto& [name, content] : kExtraFiles) EXPECT_EQ(read_text(dst / name), content) << name;
  // Nothing temporary is left beside the output.
  for (const auto& e : fs::directory_iterator(tmp.path()))
    EXPECT_TRUE(e.path() == src || e.path() == dst) << e.path();
}

TEST(Crop, Bf16ReleaseLayerListRenumbersAndCutsSchedules) {
  TempDir tmp;
  const fs::path src = tmp / "bf16", dst = tmp / "crop";
  make_source(src, Format::bf16);
  // Layers 1, 3 and 5: neither contiguous nor from 0; layer 3 (DSA) becomes layer 1.
  crop(src, dst, "1,3,5", /*mtp=*/false, /*vision=*/false);
  auto source = CheckpointReader::open(src);
  auto out = CheckpointReader::open(dst);
  const auto names = expected_names({1, 3, 5}, false, false, false, Format::bf16);
  std::vector<std::string> want;
  for (const auto& [from, to] : names) want.push_back(to);
  std::sort(want.begin(), want.end());
  EXPECT_EQ(out.names(), want);
  EXPECT_TRUE(out.contains("model.language_model.layers.1.self_attn.kv_b_proj.weight"));
  EXPECT_TRUE(out.contains("model.language_model.layers.0.mlp.gate_proj.weight"));  // old 1: dense
  EXPECT_FALSE(out.contains("model.visual.merger.proj.weight"));
  check_values(source, out, names, false);

  const ojson t = nlohmann::ordered_json::parse(read_text(dst / "config.json"))["text_config"];
  EXPECT_EQ(t["num_hidden_layers"], 3);
  EXPECT_EQ(t["num_nextn_predict_layers"], 0);
  EXPECT_EQ(t["layer_types"],
            ojson({"linear_attention", "deepseek_sparse_attention", "linear_attention"}));
  EXPECT_EQ(t["mlp_layer_types"], ojson({"dense", "sparse", "sparse"}));
  EXPECT_EQ(t["first_k_dense_replace"], 1);
  EXPECT_EQ(t["linear_attn_config"]["kda_layers"], ojson({0, 2}));
  EXPECT_EQ(t["linear_attn_config"]["full_attn_layers"], ojson({1}));
  EXPECT_EQ(t["kv_source_layer_ids"], ojson({1}));
  EXPECT_EQ(t["index_source_layer_ids"], ojson({1}));
}

TEST(Crop, WithoutTheDenseLayersTheMlpScheduleStaysRight) {
  TempDir tmp;
  make_source(tmp / "src", Format::bf16);
  crop(tmp / "src", tmp / "out", "4-6");
  const ojson t =
      nlohmann::ordered_json::parse(read_text(tmp / "out" / "config.json"))["text_config"];
  EXPECT_EQ(t["mlp_layer_types"], ojson({"sparse", "sparse", "sparse"}));
  EXPECT_EQ(t["first_k_dense_replace"], 0);
  EXPECT_EQ(t["layer_types"], ojson({"linear_attention", "linear_attention", "linear_attention"}));
  EXPECT_EQ(t["linear_attn_config"]["full_attn_layers"], ojson::array());
  EXPECT_EQ(t["num_nextn_predict_layers"], 1);
  auto out = CheckpointReader::open(tmp / "out");
  EXPECT_TRUE(out.contains("model.language_model.layers.0.mlp.gate.weight"));
  EXPECT_TRUE(out.contains("model.language_model.layers.3.eh_proj.weight"));  // MTP after 3 layers
}

TEST(Crop, SchedulesAbsentFromTheConfigAreWrittenExplicitly) {
  // A config that leaves the schedules to the model's defaults: after renumbering the defaults
  // would describe other layers, so the crop writes the kept layers' values.
  ojson config = {{"text_config", {{"num_hidden_layers", 8}, {"num_nextn_predict_layers", 1}}}};
  ojson out = rewrite_crop_config(config, {2, 3, 4}, 1, true);
  EXPECT_EQ(out["text_config"]["layer_types"],
            ojson({"linear_attention", "deepseek_sparse_attention", "linear_attention"}));
  EXPECT_EQ(out["text_config"]["mlp_layer_types"], ojson({"dense", "sparse", "sparse"}));
  EXPECT_EQ(out["text_config"]["indexer_types"], ojson({"full", "full", "full"}));
  // A prefix crop keeps them implicit: the defaults of the smaller model are the same values.
  ojson prefix = rewrite_crop_config(config, {0, 1}, 1, true);
  EXPECT_FALSE(prefix["text_config"].contains("layer_types"));
  EXPECT_EQ(prefix["text_config"]["num_hidden_layers"], 2);
  // A schedule of the wrong length is an error naming the key.
  ojson bad = config;
  bad["text_config"]["layer_types"] = {"linear_attention"};
  expect_error([&] { rewrite_crop_config(bad, {0}, 0, true); },
               "text_config.layer_types has 1 entries but num_hidden_layers is 8");
}

TEST(Crop, KeepDTypeCopiesFp8AndRenumbersModulesToNotConvert) {
  TempDir tmp;
  const fs::path src = tmp / "fp8", dst = tmp / "crop";
  make_source(src, Format::fp8);
  crop(src, dst, "0,3", std::nullopt, true, CropDType::keep);
  auto source = CheckpointReader::open(src);
  auto out = CheckpointReader::open(dst);
  const auto names = expected_names({0, 3}, true, true, true, Format::fp8);
  std::vector<std::string> want;
  for (const auto& [from, to] : names) want.push_back(to);
  std::sort(want.begin(), want.end());
  EXPECT_EQ(out.names(), want);
  EXPECT_EQ(out.info("model.language_model.layers.2.mlp.experts.0.up_proj.weight_scale_inv").dtype,
            DType::f32);  // MTP (8 -> 2) scale, renamed with its weight
  check_values(source, out, names, false);

  const ojson before = nlohmann::ordered_json::parse(read_text(src / "config.json"));
  const ojson after = nlohmann::ordered_json::parse(read_text(dst / "config.json"));
  ASSERT_TRUE(after.contains("quantization_config"));
  std::vector<std::string> expected;
  for (const auto& v : before["quantization_config"]["modules_to_not_convert"]) {
    std::string s = v.get<std::string>();
    if (s.rfind("model.layers.", 0) == 0) {
      size_t dot = s.find('.', 13);
      int64_t l = std::stoll(s.substr(13, dot - 13));
      if (l == 0)
        s = "model.layers.0" + s.substr(dot);
      else if (l == 3)
        s = "model.layers.1" + s.substr(dot);
      else if (l == kLayers)
        s = "model.layers.2" + s.substr(dot);
      else
        continue;
    }
    expected.push_back(s);
  }
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(after["quantization_config"]["modules_to_not_convert"], ojson(expected));
  EXPECT_EQ(after["quantization_config"]["weight_block_size"], ojson({128, 128}));
}

TEST(Crop, ErrorsComeBeforeAnyWork) {
  TempDir tmp;
  const fs::path src = tmp / "src";
  make_source(src, Format::fp8);
  const fs::path dst = tmp / "out";
  auto plan = [&](const std::string& layers, std::optional<bool> mtp = std::nullopt) {
    CropOptions o;
    o.layers = parse_layer_list(layers);
    o.mtp = mtp;
    return plan_crop(src, dst, o);
  };
  expect_error([&] { plan("0-8"); },
               "layer 8 is out of range: the source has layers 0-7 (num_hidden_layers 8)");

  // A source that is itself a crop without MTP.
  crop(src, tmp / "nomtp", "0-1", false);
  {
    CropOptions o;
    o.layers = {0};
    o.mtp = true;
    expect_error([&] { plan_crop(tmp / "nomtp", dst, o); }, "the source has no MTP layer");
  }
  // Config and weights disagree: the config claims layers the shards do not have.
  {
    ojson config = ojson::parse(read_text(tmp / "nomtp" / "config.json"));
    config["text_config"]["num_hidden_layers"] = 4;
    config["text_config"]["layer_types"] = {"a", "b", "c", "d"};
    write_text(tmp / "nomtp" / "config.json", config.dump(2));
    CropOptions o;
    o.layers = {0, 1, 2};
    expect_error([&] { plan_crop(tmp / "nomtp", dst, o); },
                 "the source checkpoint has no tensors for layer 2");
  }
  // Output not empty, and output == source.
  fs::create_directories(dst);
  write_text(dst / "keep.txt", "mine");
  expect_error([&] { plan("0"); }, "output directory is not empty");
  {
    CropOptions o;
    o.layers = {0};
    expect_error([&] { plan_crop(src, src, o); }, "the output is the source checkpoint");
  }
  EXPECT_EQ(read_text(dst / "keep.txt"), "mine");
  fs::remove_all(dst);

  // A missing shard and a mismatched index are found before anything is written.
  const fs::path index = src / "model.safetensors.index.json";
  const std::string good = read_text(index);
  auto reader = CheckpointReader::open(src);
  const std::string last = reader.shard_files().back();
  fs::rename(src / last, tmp / "moved");
  expect_error([&] { plan("0"); }, "the index names shard \"" + last + "\", which does not exist");
  fs::rename(tmp / "moved", src / last);
  ojson idx = ojson::parse(good);
  const std::string first = reader.shard_files().front();
  for (auto& [name, file] : idx["weight_map"].items())
    if (file != first) {
      file = first;  // points a tensor at the wrong shard
      break;
    }
  write_text(index, idx.dump(2));
  expect_error([&] { plan("0"); }, "but it is in");
  write_text(index, good);
  // Missing config.
  fs::rename(src / "config.json", tmp / "config.json");
  expect_error([&] { plan("0"); }, "config.json not found");
  fs::rename(tmp / "config.json", src / "config.json");
  EXPECT_FALSE(fs::exists(dst));
}

TEST(Crop, Fp8WithoutScaleOrOrphanScaleIsAnError) {
  TempDir tmp;
  std::mt19937 rng(1);
  Tensor w = random_tensor(DType::fp8e4m3, {8, 8}, rng);
  auto write = [&](const fs::path& dir, bool with_weight_scale, bool orphan) {
    CheckpointWriter cw(dir);
    cw.add("model.language_model.layers.0.mlp.down_proj.weight", w);
    if (with_weight_scale)
      cw.add("model.language_model.layers.0.mlp.down_proj.weight_scale_inv",
             Tensor::full({1, 1}, 0.5, DType::f32));
    if (orphan)
      cw.add("model.language_model.layers.0.x.weight_scale_inv",
             Tensor::full({1, 1}, 1, DType::f32));
    cw.add_file("config.json", R"({"num_hidden_layers": 1})");
    cw.finish();
  };
  write(tmp / "a", false, false);
  CropOptions o;
  o.layers = {0};
  expect_error([&] { plan_crop(tmp / "a", tmp / "out", o); }, "FP8 tensor has no");
  o.dtype = CropDType::keep;
  EXPECT_NO_THROW(plan_crop(tmp / "a", tmp / "out", o));
  write(tmp / "b", true, true);
  expect_error([&] { plan_crop(tmp / "b", tmp / "out", o); },
               "scale \"model.language_model.layers.0.x.weight_scale_inv\" has no weight");
  // A text-only config (no text_config) works the same way.
  write(tmp / "c", true, false);
  o.dtype = CropDType::bf16;
  auto plan = plan_crop(tmp / "c", tmp / "out", o);
  run_crop(plan, o, false);
  auto out = CheckpointReader::open(tmp / "out");
  auto t = out.tensor("model.language_model.layers.0.mlp.down_proj.weight");
  ASSERT_EQ(t.dtype(), DType::bf16);
  const auto* wp = static_cast<const uint8_t*>(w.data_ptr());
  const auto* op = static_cast<const uint16_t*>(t.data_ptr());
  for (int i = 0; i < 64; ++i) EXPECT_EQ(op[i], ref_dequant(wp[i], 0.5f));
  EXPECT_EQ(ojson::parse(read_text(tmp / "out" / "config.json"))["num_hidden_layers"], 1);
}

TEST(Crop, DryRunListsActionsAndWritesNothing) {
  TempDir tmp;
  make_source(tmp / "src", Format::fp8);
  CropOptions o;
  o.layers = parse_layer_list("0-1");
  CropPlan plan = plan_crop(tmp / "src", tmp / "out", o);
  char* buffer = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&buffer, &size);
  print_crop_plan(plan, f);
  std::fclose(f);
  std::string text(buffer, size);
  std::free(buffer);
  EXPECT_FALSE(fs::exists(tmp / "out"));
  EXPECT_NE(text.find("dequant "), std::string::npos) << text;
  EXPECT_NE(text.find("dequant+rename"), std::string::npos) << text;
  EXPECT_NE(text.find("model.language_model.layers.8.eh_proj.weight -> "
                      "model.language_model.layers.2.eh_proj.weight"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("fp8->bf16"), std::string::npos);
  EXPECT_NE(text.find("num_hidden_layers 8 -> 2"), std::string::npos) << text;
  EXPECT_NE(text.find("quantization_config removed"), std::string::npos);
  EXPECT_NE(text.find("tokenizer.json"), std::string::npos);
  // The plan's totals agree with what a run writes.
  CropResult r = run_crop(plan, o, false);
  EXPECT_EQ(r.bytes_written, plan.output_bytes);
  EXPECT_EQ(r.parameters, plan.output_parameters);
  EXPECT_EQ(r.tensors, plan.tensors.size());
}

TEST(Crop, AFailedRunLeavesTheOutputUntouched) {
  TempDir tmp;
  make_source(tmp / "src", Format::bf16);
  crop(tmp / "src", tmp / "out", "0");
  const std::string before = read_text(tmp / "out" / "model.safetensors.index.json");
  CropOptions o;
  o.layers = {0, 1};
  o.overwrite = true;
  CropPlan plan = plan_crop(tmp / "src", tmp / "out", o);
  // A file vanishes between planning and the end of the run: the run fails late, after writing
  // every shard.
  fs::remove(tmp / "src" / "tokenizer.json");
  EXPECT_THROW(run_crop(plan, o, false), Error);
  EXPECT_EQ(read_text(tmp / "out" / "model.safetensors.index.json"), before);
  std::vector<std::string> entries;
  for (const auto& e : fs::directory_iterator(tmp.path())) entries.push_back(e.path().filename());
  std::sort(entries.begin(), entries.end());
  EXPECT_EQ(entries, (std::vector<std::string>{"out", "src"}));
  // With --overwrite the next complete run replaces it.
  write_text(tmp / "src" / "tokenizer.json", "{}");
  run_crop(plan_crop(tmp / "src", tmp / "out", o), o, false);
  EXPECT_EQ(
      ojson::parse(read_text(tmp / "out" / "config.json"))["text_config"]["num_hidden_layers"], 2);
}

TEST(Crop, CommandLine) {
  const fs::path binary = GLMTUNE_BINARY;
  if (!fs::exists(binary)) GTEST_SKIP() << "the glmtune binary is not built";
  TempDir tmp;
  make_source(tmp / "src", Format::fp8);
  auto run = [&](const std::string& args) {
    std::string cmd = binary.string() + " crop " + args + " > " + (tmp / "stdout").string() +
                      " 2> " + (tmp / "stderr").string();
    int status = std::system(cmd.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  const std::string src = (tmp / "src").string(), out = (tmp / "out").string();
  EXPECT_EQ(run(src + " --out " + out + " --layers 0-1 --dry-run"), 0);
  EXPECT_NE(read_text(tmp / "stdout").find("dry run"), std::string::npos);
  EXPECT_FALSE(fs::exists(tmp / "out"));
  EXPECT_EQ(run(src + " --out " + out + " --layers 0-1 --no-mtp --max-shard-size 30KB"), 0)
      << read_text(tmp / "stderr");
  auto reader = CheckpointReader::open(tmp / "out");
  EXPECT_FALSE(reader.contains("model.language_model.layers.2.eh_proj.weight"));
  EXPECT_GT(reader.shard_files().size(), 1u);
  const std::string fresh = (tmp / "fresh").string();
  EXPECT_EQ(run(src + " --out " + fresh + " --layers 9"), 2);
  EXPECT_NE(read_text(tmp / "stderr").find("layer 9 is out of range"), std::string::npos)
      << read_text(tmp / "stderr");
  EXPECT_EQ(run(src + " --out " + fresh + " --layers 0 --max-shard-size lots"), 2);
  EXPECT_NE(read_text(tmp / "stderr").find("not a size: lots"), std::string::npos);
  EXPECT_EQ(run(src + " --out " + out + " --layers 0"), 2);
  EXPECT_NE(read_text(tmp / "stderr").find("output directory is not empty"), std::string::npos);
  EXPECT_NE(run(src + " --out " + fresh + " --layers 0 --mtp --no-mtp"), 0);
  EXPECT_NE(read_text(tmp / "stderr").find("excludes"), std::string::npos)
      << read_text(tmp / "stderr");
}

namespace {

// The released FP8 rule: expert, shared-expert and dense MLP weights, and the MLA projections of
// DSA layers (the MTP layer included), are stored in FP8.
bool fp8_in_release(const std::string& name, const std::set<int64_t>& dsa_layers) {
  auto ln = parse_layer_name(name);
  if (!ln || !name.ends_with(".weight")) return false;
  const std::string& r = ln->rest;
  if (r.starts_with("mlp.experts.") || r.starts_with("mlp.shared_experts.")) return true;
  if (r == "mlp.gate_proj.weight" || r == "mlp.up_proj.weight" || r == "mlp.down_proj.weight")
    return true;
  return dsa_layers.count(ln->layer) &&
         (r == "self_attn.q_a_proj.weight" || r == "self_attn.q_b_proj.weight" ||
          r == "self_attn.kv_a_proj_with_mqa.weight" || r == "self_attn.o_proj.weight");
}

// Quantises a 2-D weight as the release does: per 128x128 block, scale = amax / 448.
std::pair<Tensor, Tensor> quantize_fp8(const Tensor& weight) {
  const int64_t rows = weight.size(0), cols = weight.size(1);
  const std::vector<double> w = weight.to_doubles();
  Tensor scale = Tensor::empty(fp8_scale_shape(weight.shape()), DType::f32);
  Tensor q = Tensor::empty(weight.shape(), DType::fp8e4m3);
  auto* sp = static_cast<float*>(scale.data_ptr());
  auto* qp = static_cast<uint8_t*>(q.data_ptr());
  for (int64_t br = 0; br < scale.size(0); ++br)
    for (int64_t bc = 0; bc < scale.size(1); ++bc) {
      double amax = 0;
      for (int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r)
        for (int64_t c = bc * 128; c < std::min(cols, bc * 128 + 128); ++c)
          amax = std::max(amax, std::fabs(w[size_t(r * cols + c)]));
      const float s = amax > 0 ? float(amax / 448.0) : 1.0f;
      sp[br * scale.size(1) + bc] = s;
      for (int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r)
        for (int64_t c = bc * 128; c < std::min(cols, bc * 128 + 128); ++c)
          qp[r * cols + c] = f32_to_fp8e4m3(float(w[size_t(r * cols + c)]) / s);
    }
  return {q, scale};
}

}  // namespace

TEST(Crop, GlmtuneEvalLoadsTheCrop) {
  const fs::path binary = GLMTUNE_BINARY;
  const fs::path tokenizer = fs::path(GLMTUNE_SOURCE_DIR) / "examples" / "tiny" / "tokenizer";
  if (!fs::exists(binary)) GTEST_SKIP() << "the glmtune binary is not built";
  TempDir tmp;
  auto run = [&](const std::string& args) {
    std::string cmd = binary.string() + " " + args + " > " + (tmp / "stdout").string() + " 2> " +
                      (tmp / "stderr").string();
    int status = std::system(cmd.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  const fs::path bf16 = tmp / "bf16", fp8 = tmp / "fp8";
  ASSERT_EQ(run("init --preset tiny --seed 5 --out " + bf16.string() + " --tokenizer " +
                tokenizer.string()),
            0)
      << read_text(tmp / "stderr");

  // The FP8 release of the same model, with the layout and config block of the real one.
  {
    auto reader = CheckpointReader::open(bf16);
    ojson config = ojson::parse(read_text(bf16 / "config.json"));
    const ojson& text = config["text_config"];
    std::set<int64_t> dsa = {text["num_hidden_layers"].get<int64_t>()};  // MTP
    for (size_t i = 0; i < text["layer_types"].size(); ++i)
      if (text["layer_types"][i] == "deepseek_sparse_attention") dsa.insert(int64_t(i));
    config["quantization_config"] = {{"activation_scheme", "dynamic"},
                                     {"fmt", "e4m3"},
                                     {"quant_method", "fp8"},
                                     {"weight_block_size", {128, 128}}};
    CheckpointWriterOptions options;
    options.max_shard_bytes = 256 * 1024;
    CheckpointWriter w(fp8, options);
    size_t quantized = 0;
    for (const auto& name : reader.names()) {
      Tensor t = reader.tensor(name);
      if (fp8_in_release(name, dsa)) {
        auto [q, s] = quantize_fp8(t);
        w.add(name, q);
        w.add(name + "_scale_inv", s);
        ++quantized;
      } else {
        w.add(name, t);
      }
    }
    ASSERT_GT(quantized, 20u);
    w.add_file("config.json", config.dump(2) + "\n");
    for (const char* f : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"})
      w.copy_file(bf16 / f, f);
    w.finish();
  }

  const std::string text = "--text 'The quick brown fox jumps over the lazy dog. Hello world!'";
  auto eval = [&](const fs::path& model) {
    EXPECT_EQ(run("eval --json --model " + model.string() + " " + text), 0)
        << read_text(tmp / "stderr");
    // The JSON object is the last line that starts with '{' (log lines start with '[').
    std::istringstream lines(read_text(tmp / "stdout"));
    std::string line, json;
    while (std::getline(lines, line))
      if (line.starts_with("{")) json = line;
    return ojson::parse(json);
  };
  for (const auto& [source, out, layers] :
       std::vector<std::array<std::string, 3>>{{"bf16", "bf16-full", "0-4"},
                                               {"fp8", "fp8-full", "0-4"},
                                               {"bf16", "bf16-part", "0,3"},
                                               {"fp8", "fp8-part", "1-3"}})
    ASSERT_EQ(run("crop " + (tmp / source).string() + " --out " + (tmp / out).string() +
                  " --layers " + layers),
              0)
        << read_text(tmp / "stderr");

  const ojson reference = eval(bf16);
  // A crop that keeps every layer is the same model: the same losses, exactly.
  const ojson full = eval(tmp / "bf16-full");
  EXPECT_EQ(full["loss"], reference["loss"]);
  EXPECT_EQ(full["mtp_loss"], reference["mtp_loss"]);
  // Dequantised FP8 is within quantisation error of the BF16 model it came from.
  const double fp8_loss = eval(tmp / "fp8-full")["loss"].get<double>();
  // (A random-init model is near-uniform: all-zero weights would still give a loss within 0.04.)
  EXPECT_NEAR(fp8_loss, reference["loss"].get<double>(), 0.002);
  // Renumbered crops load and evaluate.
  for (const char* part : {"bf16-part", "fp8-part"}) {
    const ojson r = eval(tmp / part);
    EXPECT_TRUE(std::isfinite(r["loss"].get<double>())) << part;
    EXPECT_TRUE(r.contains("mtp_loss")) << part;
  }
}

TEST(Progress, FormatsAndReports) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(999), "999 B");
  EXPECT_EQ(format_bytes(1500), "1.50 KB");
  EXPECT_EQ(format_bytes(24.95e9), "24.95 GB");
  EXPECT_EQ(format_duration(42), "42s");
  EXPECT_EQ(format_duration(185), "3m05s");
  EXPECT_EQ(format_duration(7620), "2h07m");
  char* buffer = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&buffer, &size);
  {
    Progress::Options options;
    options.force_tty = 1;
    options.out = f;
    Progress p("crop", 2000, options);
    p.advance(500);
    EXPECT_NE(p.status().find("crop: 500 B / 2.00 KB (25%)"), std::string::npos) << p.status();
    p.advance(1500);
    p.finish();
  }
  std::fclose(f);
  std::string text(buffer, size);
  std::free(buffer);
  EXPECT_NE(text.find("[########################] crop: 2.00 KB / 2.00 KB (100%) in"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.back(), '\n');
}
