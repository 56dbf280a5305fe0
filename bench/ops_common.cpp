#include "ops_common.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>
#include <tuple>

#include "glmtune/base/error.h"

extern char** environ;

namespace glmtune::benchops {

namespace fs = std::filesystem;

namespace {

constexpr int64_t kTokens = 16384, kHidden = 4096;

std::string gemm_shape(const std::string& layout, int64_t m, int64_t n, int64_t k) {
  return fmt::format("M{} N{} K{} {}", m, n, k, layout);
}

std::string mm_key(const std::string& layout, int64_t m, int64_t n, int64_t k) {
  return fmt::format("mm {} M{} N{} K{}", layout, m, n, k);
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

std::vector<OpSpec> op_specs() {
  std::vector<OpSpec> s;
  const int64_t n = 8192;
  s.push_back({"bf16 matmul (rate ceiling)",
               gemm_shape("NT", n, n, n),
               Family::matmul_ceiling,
               "",
               {n},
               Work::flops,
               2.0 * n * n * n,
               "torch.mm",
               mm_key("NT", n, n, n)});
  const int64_t copy_bytes = int64_t(4) << 30;
  s.push_back({"d2d copy (bandwidth ceiling)",
               "4 GiB",
               Family::copy_ceiling,
               "",
               {copy_bytes},
               Work::bytes,
               2.0 * double(copy_bytes),
               "",
               ""});

  // The delta rule in chunks of 16: 2·(2·16·K + 3·K²) FLOPs per token and head (K = V = 128);
  // the backward counted as twice the forward.
  const std::vector<std::pair<std::string, std::vector<int64_t>>> kda_shapes = {
      {"varlen 4x4096 H64 D128", {4096, 4096, 4096, 4096}}, {"T16384 1 doc H64 D128", {kTokens}}};
  for (const auto& [shape, lengths] : kda_shapes) {
    int64_t tokens = 0;
    for (int64_t len : lengths) tokens += len;
    const double fwd = 2.0 * double(tokens) * 64 * (2.0 * 16 * 128 + 3.0 * 128 * 128);
    s.push_back({"kda fwd", shape, Family::kda, "fwd", lengths, Work::flops, fwd, "FLA chunk_kda",
                 "fla fwd " + shape});
    s.push_back({"kda fwd+bwd", shape, Family::kda, "fwd+bwd", lengths, Work::flops, 3 * fwd,
                 "FLA chunk_kda", "fla fwd+bwd " + shape});
    s.push_back({"kda fwd+bwd (chunk tiles kept)", shape, Family::kda, "fwd+bwd kept", lengths,
                 Work::flops, 3 * fwd, "FLA chunk_kda", "fla fwd+bwd " + shape});
  }

  // bench_cuda_moe's expert shapes: 36 experts (one GPU's share at expert parallel 8), hidden
  // 4096, expert width 2048, ~910 and ~3641 rows per expert.
  // Each also on the device-offset kernels (GLMTUNE_GROUPED_GEMM=wgmma; Hopper only), their rows
  // after the cuBLASLt ones, the weight gradient into f32 as the training step accumulates it.
  for (const bool device : {false, true})
    for (int64_t rows : {910, 3641})
      for (const auto& [name, out, in] : std::vector<std::tuple<std::string, int64_t, int64_t>>{
               {"gate_up", 4096, 4096}, {"down", 4096, 2048}})
        for (const std::string which : {"fwd", "dX", "dW"})
          s.push_back({device ? fmt::format("moe {} {}{} (device offsets)", name, which,
                                            which == "dW" ? " into f32" : "")
                              : fmt::format("moe {} {}", name, which),
                       fmt::format("36x{} N{} K{}", rows, out, in),
                       Family::grouped_gemm,
                       device ? which + " device" : which,
                       {rows, out, in},
                       Work::flops,
                       2.0 * 36 * double(rows) * double(out * in),
                       "torch._grouped_mm",
                       fmt::format("grouped {} {} 36x{} N{} K{}", name, which, rows, out, in)});

  // Dense causal attention of one document, T4096, 64 heads of 256 (bench_cuda_mla's shape),
  // every key ≤ i selected. FLOPs as FlashAttention counts them: 4·pairs·H·D forward, 2.5× that
  // backward. The absorbed form counts what it executes: 2 products of NH·512 per pair forward,
  // 5 backward, and the per-head q-absorb / o-expand GEMMs (2·T·NH·256·512 each, twice backward).
  {
    const int64_t t = 4096, h = 64, d = 256, r = 512;
    const double pairs = double(t) * double(t + 1) / 2;
    const double fwd = 4.0 * pairs * h * d;
    const std::string shape = "T4096 H64 D256 causal";
    s.push_back({"attention fwd (per-head kernel, every key)",
                 shape,
                 Family::attention,
                 "per-head fwd",
                 {t, h, d},
                 Work::flops,
                 fwd,
                 "torch SDPA",
                 "sdpa fwd " + shape});
    s.push_back({"attention fwd+bwd (per-head kernel, every key)",
                 shape,
                 Family::attention,
                 "per-head fwd+bwd",
                 {t, h, d},
                 Work::flops,
                 3.5 * fwd,
                 "torch SDPA",
                 "sdpa fwd+bwd " + shape});
    const double pair = 2.0 * pairs * h * r, gemms = 2.0 * 2.0 * t * h * d * r;
    s.push_back({"attention fwd (absorbed MLA + GEMMs, every key)",
                 shape + " R512",
                 Family::attention,
                 "absorbed fwd",
                 {t, h, d},
                 Work::flops,
                 2 * pair + gemms,
                 "torch SDPA",
                 "sdpa fwd " + shape});
    s.push_back({"attention fwd+bwd (absorbed MLA + GEMMs, every key)",
                 shape + " R512",
                 Family::attention,
                 "absorbed fwd+bwd",
                 {t, h, d},
                 Work::flops,
                 7 * pair + 2 * gemms,
                 "torch SDPA",
                 "sdpa fwd+bwd " + shape});
  }

  // The absorbed kernel alone at the model's sparse shape: T16384, 64 heads, top-2048 keys (pools
  // of 4) per query, the first 2048 queries every earlier key. FLOPs as executed: 2 products of
  // NH·512 per pair forward, 5 backward (the units of the kernels' TFLOP/s targets).
  {
    const int64_t t = 16384, h = 64, top = 2048, r = 512;
    const double pairs = double(top) * double(top + 1) / 2 + double(t - top) * double(top);
    const double pair = 2.0 * pairs * h * r;
    const std::string shape = "T16384 H64 top2048 R512";
    for (const auto& [which, products] : {std::pair<std::string, int>{"fwd", 2}, {"bwd", 5}})
      s.push_back({fmt::format("attention {} (absorbed MLA kernel, sparse)", which),
                   shape,
                   Family::absorbed_sparse,
                   which,
                   {t, h, top},
                   Work::flops,
                   products * pair,
                   "",
                   ""});
  }

  // The vision tower's attention: bidirectional within each image, 16 heads of 64. Sixteen
  // 448×448 images (1024 patches each) packed, and one 16384-patch segment. FLOPs as
  // FlashAttention counts them (4·L²·H·D forward per segment, 2.5× that backward).
  for (const auto& [segments, rows] :
       std::vector<std::pair<int64_t, int64_t>>{{16, 1024}, {1, 16384}}) {
    const int64_t h = 16, d = 64;
    const double fwd = 4.0 * double(segments) * double(rows) * double(rows) * h * d;
    const std::string shape = fmt::format("{}x{} H{} D{}", segments, rows, h, d);
    for (const char* which : {"fwd", "fwd+bwd"})
      s.push_back({fmt::format("vision attention {}", which),
                   shape,
                   Family::vision_attention,
                   which,
                   {segments, rows, h, d},
                   Work::flops,
                   std::string(which) == "fwd" ? fwd : 3.5 * fwd,
                   "torch SDPA",
                   fmt::format("sdpa {} vision {}", which, shape)});
  }

  // The step's projection GEMMs at T = 16384 tokens (y = x Wᵀ is NT; dX NN; dW TN).
  const std::vector<std::tuple<std::string, std::string, int64_t, int64_t, int64_t>> gemms = {
      {"gemm KDA q/k/v proj", "NT", kTokens, 8192, kHidden},
      {"gemm KDA o_proj", "NT", kTokens, kHidden, 8192},
      {"gemm MLA q_b_proj", "NT", kTokens, 16384, 1536},
      {"gemm MLA o_proj", "NT", kTokens, kHidden, 16384},
      {"gemm MLP gate_up", "NT", kTokens, 24576, kHidden},
      {"gemm MLP down", "NT", kTokens, kHidden, 12288},
      {"gemm MLP gate_up dX", "NN", kTokens, kHidden, 24576},
      {"gemm MLP gate_up dW (bf16 out)", "TN", 24576, kHidden, kTokens}};
  for (const auto& [name, layout, m, nn, k] : gemms)
    s.push_back({name,
                 gemm_shape(layout, m, nn, k),
                 Family::gemm,
                 layout,
                 {m, nn, k},
                 Work::flops,
                 2.0 * double(m) * double(nn) * double(k),
                 "torch.mm",
                 mm_key(layout, m, nn, k)});

  // The same projections in block-scaled FP8 (ops/cuda/fp8.h), operands quantised beforehand:
  // each shape is also timed in bf16 above (same shape column), the same-run comparison; the peer
  // is torch._scaled_mm with the same 1x128 / 128x128 scales. dX is y = dy · Wᵀᵀ with the
  // transposed weight's blocks, dW reduces over the 16384 tokens (1x128 tiles on both operands).
  const std::vector<std::tuple<std::string, std::string, std::string, int64_t, int64_t, int64_t>>
      fp8_gemms = {{"fp8 gemm KDA q/k/v proj", "fwd", "NT", kTokens, 8192, kHidden},
                   {"fp8 gemm MLP gate_up", "fwd", "NT", kTokens, 24576, kHidden},
                   {"fp8 gemm MLP down", "fwd", "NT", kTokens, kHidden, 12288},
                   {"fp8 gemm MLP gate_up dX", "dX", "NN", kTokens, kHidden, 24576},
                   {"fp8 gemm MLP gate_up dW (bf16 out)", "dW", "TN", 24576, kHidden, kTokens}};
  for (const auto& [name, which, layout, m, nn, k] : fp8_gemms)
    s.push_back({name,
                 gemm_shape(layout, m, nn, k),
                 Family::fp8_gemm,
                 which,
                 {m, nn, k},
                 Work::flops,
                 2.0 * double(m) * double(nn) * double(k),
                 "torch._scaled_mm",
                 fmt::format("scaled_mm {} M{} N{} K{}", which, m, nn, k)});
  // The expert GEMMs in FP8: one dense FP8 GEMM per expert, and ("one launch") the grouped kernel
  // with the offsets on the device, its dX including the transposes of the weights, the operands
  // quantised outside the timing as in the per-expert rows (the bf16 "moe" rows above are the
  // same-run comparison; no public per-expert block-scaled peer is timed).
  for (int64_t rows : {910, 3641})
    for (const auto& [name, out, in] : std::vector<std::tuple<std::string, int64_t, int64_t>>{
             {"gate_up", 4096, 4096}, {"down", 4096, 2048}})
      for (const char* which :
           {"fwd", "dX", "dW", "fwd one launch", "dX one launch", "dW one launch"})
        s.push_back({fmt::format("fp8 moe {} {}", name, which),
                     fmt::format("36x{} N{} K{}", rows, out, in),
                     Family::fp8_grouped_gemm,
                     which,
                     {rows, out, in},
                     Work::flops,
                     2.0 * 36 * double(rows) * double(out * in),
                     "",
                     ""});
  // The quantisers: bf16 read once, one code written per element, one f32 scale per tile.
  for (const auto& [which, rows, cols, tile] :
       std::vector<std::tuple<std::string, int64_t, int64_t, int64_t>>{
           {"1x128", kTokens, kHidden, 128},
           {"128x1", kTokens, kHidden, 128},
           {"128x128", 24576, kHidden, 128 * 128}})
    s.push_back(
        {"fp8 quantise " + which,
         fmt::format("{}x{} bf16", rows, cols),
         Family::fp8_quantize,
         which,
         {rows, cols},
         Work::bytes,
         3.0 * double(rows) * double(cols) + 4.0 * double(rows) * double(cols) / double(tile),
         "",
         ""});
  // The input gradient's weight, its codes transposed (and its block scales): a byte read and
  // written per weight.
  s.push_back({"fp8 transpose weight",
               fmt::format("{}x{} codes", 24576, kHidden),
               Family::fp8_quantize,
               "transpose",
               {24576, kHidden},
               Work::bytes,
               2.0 * 24576 * double(kHidden),
               "",
               ""});

  // Bandwidth-bound ops: the fewest bytes each must move (every input read once, every output
  // written once), bf16 activations.
  {
    const int64_t h = 4;
    const double xb = 2.0 * kTokens * h * kHidden, yb = 2.0 * kTokens * kHidden;
    const std::string shape = "T16384 H4 D4096";
    const std::vector<int64_t> dims = {kTokens, h, kHidden};
    s.push_back({"mhc pre fwd", shape, Family::mhc, "pre fwd", dims, Work::bytes, xb + yb, "", ""});
    s.push_back(
        {"mhc pre bwd", shape, Family::mhc, "pre bwd", dims, Work::bytes, 2 * xb + yb, "", ""});
    s.push_back(
        {"mhc post fwd", shape, Family::mhc, "post fwd", dims, Work::bytes, 2 * xb + yb, "", ""});
    s.push_back({"mhc post bwd", shape, Family::mhc, "post bwd", dims, Work::bytes, 3 * xb + 2 * yb,
                 "", ""});
  }
  {
    const double act = 2.0 * kTokens * kHidden;
    const std::string shape = fmt::format("{}x{}", kTokens, kHidden);
    s.push_back({"rmsnorm fwd",
                 shape,
                 Family::rmsnorm,
                 "fwd",
                 {kTokens, kHidden},
                 Work::bytes,
                 2 * act,
                 "",
                 ""});
    s.push_back({"rmsnorm bwd (+dw)",
                 shape,
                 Family::rmsnorm,
                 "bwd",
                 {kTokens, kHidden},
                 Work::bytes,
                 3 * act,
                 "",
                 ""});
  }
  {
    // KDA's short conv (+ SiLU) on one of q, k, v and its gated output norm, 32 heads of 128.
    const int64_t channels = 4096, taps = 4;
    const double act = 2.0 * kTokens * channels;
    const std::string shape = fmt::format("T{} C{} Kc{}", kTokens, channels, taps);
    const std::vector<int64_t> dims = {kTokens, channels, taps};
    s.push_back({"short conv fwd", shape, Family::kda_small, "conv fwd", dims, Work::bytes, 2 * act,
                 "", ""});
    s.push_back({"short conv bwd (+dw)", shape, Family::kda_small, "conv bwd", dims, Work::bytes,
                 3 * act, "", ""});
    s.push_back({"l2 norm fwd (heads of 128)", shape, Family::kda_small, "l2 fwd", dims,
                 Work::bytes, 2 * act, "", ""});
    s.push_back({"l2 norm bwd (heads of 128)", shape, Family::kda_small, "l2 bwd", dims,
                 Work::bytes, 3 * act, "", ""});
    // q and k: the conv, SiLU and each head's L2 norm in one pass (f32 norms of 32 heads aside).
    s.push_back({"q/k conv+l2 fwd", shape, Family::kda_small, "qk conv fwd", dims, Work::bytes,
                 2 * act, "", ""});
    s.push_back({"q/k conv+l2 bwd (+dw)", shape, Family::kda_small, "qk conv bwd", dims,
                 Work::bytes, 3 * act, "", ""});
    s.push_back({"gated o_norm fwd", shape, Family::kda_small, "o_norm fwd", dims, Work::bytes,
                 3 * act, "", ""});
    s.push_back({"gated o_norm bwd (+dw)", shape, Family::kda_small, "o_norm bwd", dims,
                 Work::bytes, 5 * act, "", ""});
  }
  {
    const int64_t width = 12288;
    const double e = 2.0 * kTokens * width;
    const std::string shape = fmt::format("{}x{}", kTokens, width);
    s.push_back({"clamped swiglu fwd",
                 shape,
                 Family::swiglu,
                 "fwd",
                 {kTokens, width},
                 Work::bytes,
                 3 * e,
                 "",
                 ""});
    s.push_back({"clamped swiglu bwd",
                 shape,
                 Family::swiglu,
                 "bwd",
                 {kTokens, width},
                 Work::bytes,
                 5 * e,
                 "",
                 ""});
  }
  // The fused head is matrix-bound: 2·T·D·V forward, 3× that with both gradients.
  {
    const int64_t vocab = 154880, chunk = 4096;
    s.push_back({"lm_head+CE fwd+bwd",
                 fmt::format("T16384 D4096 V154880 chunk {}", chunk),
                 Family::lm_head_ce,
                 "fwd+bwd",
                 {kTokens, kHidden, vocab, chunk},
                 Work::flops,
                 3 * 2.0 * kTokens * kHidden * double(vocab),
                 "",
                 ""});
  }
  return s;
}

std::vector<OpSpec> select_specs(const std::vector<OpSpec>& specs, const std::string& regex) {
  std::regex re;
  try {
    re = std::regex(regex, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    throw Error(fmt::format("--only '{}' is not a regular expression: {}", regex, e.what()),
                "--only", "give an ECMAScript regular expression, e.g. 'kda|moe'");
  }
  std::vector<OpSpec> out;
  bool matched = false;
  for (const OpSpec& s : specs) {
    const bool ceiling = s.family == Family::matmul_ceiling || s.family == Family::copy_ceiling;
    const bool hit = std::regex_search(s.op + " " + s.shape, re);
    matched = matched || hit;
    if (ceiling || hit) out.push_back(s);
  }
  if (!matched)
    throw Error(fmt::format("--only '{}' matches no op", regex), "--only",
                "match against the op and shape columns, e.g. --only 'kda|gemm MLP'");
  return out;
}

PeerReport parse_peer_report(const std::string& json_text) {
  PeerReport r;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    r.error = fmt::format("the peer report is not JSON ({})", e.what());
    return r;
  }
  if (!j.is_object() || !j.contains("rows") || !j["rows"].is_array()) {
    r.error = "the peer report has no \"rows\" list";
    return r;
  }
  auto text = [&](const char* key) {
    return j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : std::string();
  };
  r.error = text("error");
  r.status = text("status");
  r.python = text("python");
  r.torch = text("torch");
  r.device = text("device");
  if (j.contains("notes") && j["notes"].is_array())
    for (const auto& n : j["notes"])
      if (n.is_string()) r.notes.push_back(n.get<std::string>());
  for (const auto& row : j["rows"]) {
    if (!row.is_object() || !row.contains("key") || !row["key"].is_string()) {
      r.error = "the peer report has a row without a \"key\"";
      return r;
    }
    PeerRow p;
    p.peer = row.value("peer", std::string());
    if (row.contains("ms") && row["ms"].is_number() && row["ms"].get<double>() > 0)
      p.ms = row["ms"].get<double>();
    else
      p.error = row.contains("error") && row["error"].is_string()
                    ? row["error"].get<std::string>()
                    : "the peer reported neither a time nor an error";
    r.rows[row["key"].get<std::string>()] = p;
  }
  return r;
}

double achieved_rate(const OpSpec& spec, double ms) {
  const double per_s = spec.work / (ms * 1e-3);
  return spec.kind == Work::flops ? per_s / 1e12 : per_s / 1e9;
}

double ceiling_share(const OpSpec& spec, double ms, const Ceilings& ceilings) {
  const double ceiling = spec.kind == Work::flops ? ceilings.tflops : ceilings.gbs;
  return ceiling > 0 ? achieved_rate(spec, ms) / ceiling : 0;
}

Ceilings measured_ceilings(const std::vector<OpResult>& results) {
  Ceilings c;
  for (const OpResult& r : results) {
    if (r.spec.family == Family::matmul_ceiling) c.tflops = achieved_rate(r.spec, r.ms);
    if (r.spec.family == Family::copy_ceiling) c.gbs = achieved_rate(r.spec, r.ms);
  }
  return c;
}

std::optional<double> peer_ratio(const OpResult& result) {
  if (!result.peer_ms || *result.peer_ms <= 0) return std::nullopt;
  return result.ms / *result.peer_ms;
}

void attach_peers(std::vector<OpResult>& results, const PeerReport& report) {
  for (OpResult& r : results) {
    r.peer_ms.reset();
    r.peer_note.clear();
    if (r.spec.peer_key.empty()) continue;
    if (!report.error.empty()) {
      r.peer_note = report.error;
      continue;
    }
    const auto it = report.rows.find(r.spec.peer_key);
    if (it == report.rows.end())
      r.peer_note = fmt::format("the peer gave no time for '{}' (its last status: {})",
                                r.spec.peer_key, report.status.empty() ? "none" : report.status);
    else if (it->second.ms)
      r.peer_ms = it->second.ms;
    else
      r.peer_note = it->second.error;
  }
}

std::string format_table(const std::vector<OpResult>& results, const Ceilings& ceilings,
                         const PeerReport& report) {
  std::ostringstream out;
  out << fmt::format("{:<52} {:<30} {:>9} {:>15} {:>13}  {:<18} {:>9} {:>10}\n", "op", "shape",
                     "ours ms", "rate", "of ceiling", "peer", "peer ms", "ours/peer");
  std::vector<std::string> reasons;
  for (const OpResult& r : results) {
    const double rate = achieved_rate(r.spec, r.ms);
    const bool flops = r.spec.kind == Work::flops;
    const std::string rate_text =
        flops ? fmt::format("{:.1f} TFLOP/s", rate) : fmt::format("{:.0f} GB/s", rate);
    const double share = ceiling_share(r.spec, r.ms, ceilings);
    const std::string share_text =
        share > 0 ? fmt::format("{:.0f}% {}", 100 * share, flops ? "matmul" : "copy") : "-";
    std::string peer = r.spec.peer.empty() ? "—" : r.spec.peer, peer_ms = "—", ratio = "—";
    if (const auto q = peer_ratio(r)) {
      peer_ms = fmt::format("{:.3f}", *r.peer_ms);
      ratio = fmt::format("{:.2f}", *q);
    } else if (!r.spec.peer.empty()) {
      auto it = std::find(reasons.begin(), reasons.end(), r.peer_note);
      if (it == reasons.end()) it = reasons.insert(reasons.end(), r.peer_note);
      peer_ms = fmt::format("[{}]", it - reasons.begin() + 1);
      ratio = "n/a";
    }
    out << fmt::format("{:<52} {:<30} {:>9.3f} {:>15} {:>13}  {:<18} {:>9} {:>10}\n", r.spec.op,
                       r.spec.shape, r.ms, rate_text, share_text, peer, peer_ms, ratio);
  }
  for (size_t i = 0; i < reasons.size(); ++i)
    out << fmt::format("[{}] no peer time: {}\n", i + 1, reasons[i]);
  out << fmt::format(
      "ceilings (this run): bf16 matmul {:.0f} TFLOP/s (cuBLASLt 8192^3), copy {:.0f} GB/s "
      "(device-to-device, bytes read + written); ours/peer < 1: ours is faster\n",
      ceilings.tflops, ceilings.gbs);
  if (!report.torch.empty())
    out << fmt::format("peers: python {}, torch {}, {}\n", report.python, report.torch,
                       report.device);
  for (const std::string& note : report.notes) out << "peers: " << note << "\n";
  return out.str();
}

nlohmann::json report_json(const std::vector<OpResult>& results, const Ceilings& ceilings,
                           const PeerReport& report, const std::string& device) {
  nlohmann::json rows = nlohmann::json::array();
  for (const OpResult& r : results) {
    const bool flops = r.spec.kind == Work::flops;
    nlohmann::json row = {
        {"op", r.spec.op},
        {"shape", r.spec.shape},
        {"ms", r.ms},
        {flops ? "flop" : "bytes", r.spec.work},
        {flops ? "tflops" : "gbs", achieved_rate(r.spec, r.ms)},
        {"ceiling_share", ceiling_share(r.spec, r.ms, ceilings)},
        {"peer", r.spec.peer.empty() ? nlohmann::json() : nlohmann::json(r.spec.peer)}};
    if (const auto q = peer_ratio(r)) {
      row["peer_ms"] = *r.peer_ms;
      row["ratio"] = *q;
    } else if (!r.spec.peer.empty()) {
      row["peer_note"] = r.peer_note;
    }
    rows.push_back(row);
  }
  return {{"device", device},
          {"ceilings", {{"bf16_matmul_tflops", ceilings.tflops}, {"copy_gbs", ceilings.gbs}}},
          {"peers",
           {{"error", report.error},
            {"python", report.python},
            {"torch", report.torch},
            {"device", report.device},
            {"notes", report.notes}}},
          {"rows", rows}};
}

std::string find_peer_script(const std::string& given) {
  if (!given.empty()) return fs::exists(given) ? given : std::string();
  std::vector<fs::path> candidates;
  if (const char* src = std::getenv("GLMTUNE_SOURCE_DIR"))
    candidates.push_back(fs::path(src) / "bench" / "ops_peers.py");
  candidates.push_back(fs::current_path() / "bench" / "ops_peers.py");
  for (const fs::path& p : candidates)
    if (fs::exists(p)) return p.string();
  return {};
}

PeerProcess::PeerProcess(const PeerOptions& options) : options_(options) {
  started_ = now_s();
  std::string tmpl = (fs::temp_directory_path() / "glmtune-bench-ops-XXXXXX").string();
  if (!mkdtemp(tmpl.data()))
    throw Error(
        fmt::format("cannot create a folder for the peer report ({})", std::strerror(errno)), tmpl,
        "make the temp folder ($TMPDIR) writable");
  dir_ = tmpl;
  report_path_ = dir_ + "/peers.json";
  const std::string lock_path = dir_ + "/gpu.lock";
  lock_fd_ = ::open(lock_path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
  if (lock_fd_ < 0 || ::flock(lock_fd_, LOCK_EX) != 0)
    throw Error(fmt::format("cannot lock {} ({})", lock_path, std::strerror(errno)), lock_path,
                "make the temp folder ($TMPDIR) a local, writable file system");

  std::string keys;
  for (const std::string& k : options_.keys) keys += (keys.empty() ? "" : ",") + k;
  std::vector<std::string> args = {options_.python,
                                   options_.script,
                                   "--out",
                                   report_path_,
                                   "--gpu-lock",
                                   lock_path,
                                   "--keys",
                                   keys,
                                   "--fla-max-configs",
                                   std::to_string(options_.fla_max_configs),
                                   "--time-limit",
                                   fmt::format("{:.0f}", options_.timeout_s)};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  // The peer's progress goes to our stderr, so that stdout holds the table alone.
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, STDERR_FILENO, STDOUT_FILENO);
  const int rc =
      posix_spawnp(&pid_, options_.python.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    pid_ = -1;
    start_error_ = fmt::format(
        "cannot start the peer process '{}' ({}): pass --python with an interpreter that has "
        "torch, or --no-peers",
        options_.python, std::strerror(rc));
  }
}

PeerProcess::~PeerProcess() {
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  if (lock_fd_ >= 0) ::close(lock_fd_);
  std::error_code ignored;
  if (!dir_.empty()) fs::remove_all(dir_, ignored);
}

void PeerProcess::release_gpu() {
  if (lock_fd_ >= 0) ::flock(lock_fd_, LOCK_UN);
}

PeerReport PeerProcess::finish() {
  release_gpu();
  PeerReport none;
  if (pid_ <= 0) {
    none.error = start_error_;
    return none;
  }
  int status = 0;
  double term_at = 0;
  bool killed = false;
  while (true) {
    const pid_t done = ::waitpid(pid_, &status, WNOHANG);
    if (done == pid_) break;
    const double t = now_s();
    if (term_at == 0 && t - started_ > options_.timeout_s) {
      std::fprintf(stderr, "bench ops: the peer runs longer than %.0f s: it times what is ready\n",
                   options_.timeout_s);
      ::kill(pid_, SIGTERM);
      term_at = t;
    } else if (term_at > 0 && !killed && t - term_at > options_.grace_s) {
      ::kill(pid_, SIGKILL);
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  pid_ = -1;
  const std::string how = WIFEXITED(status)
                              ? fmt::format("exited with status {}", WEXITSTATUS(status))
                              : fmt::format("was ended by signal {}", WTERMSIG(status));
  const std::string text = read_file(report_path_);
  if (text.empty()) {
    none.error =
        fmt::format("the peer process {} before it wrote a report (its messages are above)", how);
    return none;
  }
  PeerReport report = parse_peer_report(text);
  if (killed)
    report.notes.push_back(fmt::format(
        "the peer was killed {:.0f} s after the time limit; rows it had not timed say so",
        options_.grace_s));
  else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    report.notes.push_back("the peer process " + how);
  return report;
}

}  // namespace glmtune::benchops
