// `glmtune bench ops` without a GPU: the op list and its pairing with bench/ops_peers.py, the peer
// report's parsing, ratios and shares of the ceilings, the peer process protocol (with stand-in
// interpreters) and the command's error where no GPU is visible.

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "glmtune/base/error.h"
#include "glmtune/tensor/device.h"
#include "ops_common.h"
#include "support/temp_dir.h"

namespace {

using namespace glmtune;
using namespace glmtune::benchops;
namespace fs = std::filesystem;

struct Shell {
  int status;
  std::string out;
};

Shell shell(const std::string& cmd) {
  FILE* pipe = popen((cmd + " 2>&1").c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) out.append(buf.data(), n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

const OpSpec& find_spec(const std::vector<OpSpec>& specs, const std::string& op,
                        const std::string& shape) {
  for (const OpSpec& s : specs)
    if (s.op == op && s.shape == shape) return s;
  throw std::runtime_error("no spec " + op + " @ " + shape);
}

TEST(BenchOps, SpecsAreUniqueAndCountTheirWork) {
  const std::vector<OpSpec> specs = op_specs();
  std::set<std::string> seen;
  for (const OpSpec& s : specs) {
    EXPECT_TRUE(seen.insert(s.op + " @ " + s.shape).second) << s.op << " @ " << s.shape;
    EXPECT_GT(s.work, 0) << s.op;
    EXPECT_EQ(s.peer.empty(), s.peer_key.empty()) << s.op;
  }
  EXPECT_EQ(specs[0].family, Family::matmul_ceiling);
  EXPECT_EQ(specs[1].family, Family::copy_ceiling);
  const OpSpec& gemm = find_spec(specs, "gemm MLP down", "M16384 N4096 K12288 NT");
  EXPECT_DOUBLE_EQ(gemm.work, 2.0 * 16384 * 4096 * 12288);
  const OpSpec& moe = find_spec(specs, "moe down dW", "36x910 N4096 K2048");
  EXPECT_DOUBLE_EQ(moe.work, 2.0 * 36 * 910 * 4096 * 2048);
  const OpSpec& moe_device =
      find_spec(specs, "moe down dW into f32 (device offsets)", "36x910 N4096 K2048");
  EXPECT_DOUBLE_EQ(moe_device.work, moe.work);
  EXPECT_EQ(moe_device.peer_key, moe.peer_key);
  const OpSpec& kda = find_spec(specs, "kda fwd+bwd", "varlen 4x4096 H64 D128");
  EXPECT_DOUBLE_EQ(kda.work, 3 * 2.0 * 16384 * 64 * (2.0 * 16 * 128 + 3.0 * 128 * 128));
  const OpSpec& norm = find_spec(specs, "rmsnorm fwd", "16384x4096");
  EXPECT_EQ(norm.kind, Work::bytes);
  EXPECT_DOUBLE_EQ(norm.work, 2 * 2.0 * 16384 * 4096);
  const OpSpec& conv = find_spec(specs, "short conv bwd (+dw)", "T16384 C4096 Kc4");
  EXPECT_EQ(conv.kind, Work::bytes);
  EXPECT_DOUBLE_EQ(conv.work, 3 * 2.0 * 16384 * 4096);  // x, dy read; dx written
  EXPECT_DOUBLE_EQ(find_spec(specs, "gated o_norm bwd (+dw)", "T16384 C4096 Kc4").work,
                   5 * 2.0 * 16384 * 4096);  // dy, x, gate read; dx, d gate written
}

TEST(BenchOps, OnlyKeepsTheCeilingsAndRejectsBadPatterns) {
  const std::vector<OpSpec> specs = op_specs();
  const std::vector<OpSpec> kda = select_specs(specs, "^kda ");
  ASSERT_EQ(kda.size(), 8u);  // the two ceilings, then fwd, fwd+bwd, fwd+bwd kept at two shapes
  EXPECT_EQ(kda[0].family, Family::matmul_ceiling);
  EXPECT_EQ(kda[1].family, Family::copy_ceiling);
  for (size_t i = 2; i < kda.size(); ++i) EXPECT_EQ(kda[i].family, Family::kda);
  EXPECT_EQ(select_specs(specs, "").size(), specs.size());
  // The pattern bench ops suggests for leaving out the device-offset rows keeps the other twelve.
  const std::vector<OpSpec> moe = select_specs(specs, "^moe \\w+ (fwd|dX|dW) 36");
  ASSERT_EQ(moe.size(), 2u + 12u);
  for (size_t i = 2; i < moe.size(); ++i)
    EXPECT_EQ(moe[i].op.find("device"), std::string::npos) << moe[i].op;
  EXPECT_THROW(select_specs(specs, "(unclosed"), Error);
  EXPECT_THROW(select_specs(specs, "no such op anywhere"), Error);
}

TEST(BenchOps, EveryPeerKeyIsOneThePeerScriptTimes) {
  if (shell("python3 --version").status != 0) GTEST_SKIP() << "no python3 on the PATH";
  const Shell listed =
      shell("python3 " + std::string(GLMTUNE_SOURCE_DIR) + "/bench/ops_peers.py --list");
  ASSERT_EQ(listed.status, 0) << listed.out;
  std::set<std::string> script_keys;
  for (const auto& row : nlohmann::json::parse(listed.out))
    script_keys.insert(row["key"].get<std::string>());
  std::set<std::string> spec_keys;
  for (const OpSpec& s : op_specs())
    if (!s.peer_key.empty()) {
      spec_keys.insert(s.peer_key);
      EXPECT_TRUE(script_keys.count(s.peer_key)) << s.op << ": " << s.peer_key;
    }
  for (const std::string& k : script_keys) EXPECT_TRUE(spec_keys.count(k)) << "unused: " << k;
}

TEST(BenchOps, ParsesThePeerReport) {
  const PeerReport r = parse_peer_report(R"({
    "status": "done", "python": "3.12.3", "torch": "2.11.0", "device": "NVIDIA H200",
    "notes": ["fla 0.6.0"],
    "rows": [{"key": "a", "peer": "torch.mm", "ms": 1.5},
             {"key": "b", "peer": "FLA chunk_kda", "error": "fla is not importable"}]})");
  EXPECT_TRUE(r.error.empty());
  EXPECT_EQ(r.torch, "2.11.0");
  ASSERT_EQ(r.notes.size(), 1u);
  ASSERT_TRUE(r.rows.at("a").ms);
  EXPECT_DOUBLE_EQ(*r.rows.at("a").ms, 1.5);
  EXPECT_FALSE(r.rows.at("b").ms);
  EXPECT_EQ(r.rows.at("b").error, "fla is not importable");

  EXPECT_NE(parse_peer_report("{\"rows\": [").error.find("not JSON"), std::string::npos);
  EXPECT_NE(parse_peer_report("{\"status\": \"x\"}").error.find("rows"), std::string::npos);
  const PeerReport global =
      parse_peer_report(R"({"status": "error", "error": "no torch", "rows": []})");
  EXPECT_EQ(global.error, "no torch");
}

TEST(BenchOps, RatiosSharesAndReasons) {
  OpSpec matmul{"m", "s", Family::matmul_ceiling, "", {}, Work::flops, 800e12 * 1e-3, "", ""};
  OpSpec copy{"c", "s", Family::copy_ceiling, "", {}, Work::bytes, 4000e9 * 1e-3, "", ""};
  OpSpec gemm{"g", "s", Family::gemm, "NT", {}, Work::flops, 400e12 * 1e-3, "torch.mm", "kg"};
  OpSpec norm{"n", "s", Family::rmsnorm, "fwd", {}, Work::bytes, 1000e9 * 1e-3, "", ""};
  OpSpec kda{"k", "s", Family::kda, "fwd", {}, Work::flops, 1e9, "FLA chunk_kda", "kk"};
  OpSpec sdpa{"a", "s", Family::attention, "fwd", {}, Work::flops, 1e9, "torch SDPA", "ka"};
  std::vector<OpResult> results;
  for (const auto& [spec, ms] : std::vector<std::pair<OpSpec, double>>{
           {matmul, 1.0}, {copy, 1.0}, {gemm, 1.0}, {norm, 1.0}, {kda, 2.0}, {sdpa, 3.0}}) {
    OpResult r;
    r.spec = spec;
    r.ms = ms;
    results.push_back(r);
  }
  const Ceilings c = measured_ceilings(results);
  EXPECT_NEAR(c.tflops, 800, 1e-9);
  EXPECT_NEAR(c.gbs, 4000, 1e-9);
  EXPECT_NEAR(ceiling_share(gemm, 1.0, c), 0.5, 1e-12);
  EXPECT_NEAR(ceiling_share(norm, 1.0, c), 0.25, 1e-12);
  EXPECT_NEAR(ceiling_share(norm, 1.0, Ceilings{}), 0, 0);

  PeerReport report = parse_peer_report(R"({"status": "timing", "rows": [
    {"key": "kg", "peer": "torch.mm", "ms": 0.8},
    {"key": "kk", "peer": "FLA chunk_kda", "error": "fla is not importable"}]})");
  attach_peers(results, report);
  ASSERT_TRUE(peer_ratio(results[2]));
  EXPECT_NEAR(*peer_ratio(results[2]), 1.25, 1e-12);
  EXPECT_FALSE(peer_ratio(results[3]));
  EXPECT_TRUE(results[3].peer_note.empty());
  EXPECT_FALSE(peer_ratio(results[4]));
  EXPECT_EQ(results[4].peer_note, "fla is not importable");
  EXPECT_NE(results[5].peer_note.find("no time"), std::string::npos);
  EXPECT_NE(results[5].peer_note.find("timing"), std::string::npos);

  const std::string table = format_table(results, c, report);
  EXPECT_NE(table.find("1.25"), std::string::npos) << table;
  EXPECT_NE(table.find("50% matmul"), std::string::npos) << table;
  EXPECT_NE(table.find("25% copy"), std::string::npos) << table;
  EXPECT_NE(table.find("[1] no peer time: fla is not importable"), std::string::npos) << table;
  const nlohmann::json j = report_json(results, c, report, "dev");
  EXPECT_DOUBLE_EQ(j["rows"][2]["ratio"].get<double>(), 1.25);
  EXPECT_TRUE(j["rows"][3]["peer"].is_null());
  EXPECT_EQ(j["rows"][4]["peer_note"], "fla is not importable");

  report.error = "torch is not importable";
  attach_peers(results, report);
  EXPECT_FALSE(peer_ratio(results[2]));
  EXPECT_EQ(results[2].peer_note, "torch is not importable");
}

// A stand-in interpreter: a shell script run as `python SCRIPT --out FILE --gpu-lock LOCK ...`.
std::string stand_in(const fs::path& dir, const std::string& name, const std::string& body) {
  const fs::path p = dir / name;
  std::ofstream(p) << "#!/bin/sh\nwhile [ $# -gt 0 ]; do case $1 in --out) out=$2;; "
                      "--gpu-lock) lock=$2;; --keys) keys=$2;; esac; shift; done\n"
                   << body << "\n";
  fs::permissions(p, fs::perms::owner_all);
  return p.string();
}

TEST(BenchOps, PeerProcessWaitsForTheGpuAndReadsTheReport) {
  test::TempDir dir;
  PeerOptions o;
  o.script = "unused.py";
  o.keys = {"k1", "k2"};
  // The stand-in writes the moment it gets the lock, recording whether the report of "ours"
  // existed then: it must, since we write it before we release the GPU.
  o.python = stand_in(dir.path(), "py",
                      R"(flock "$lock" true
first=$(cat ")" + (dir.path() / "ours").string() +
                          R"(" 2>/dev/null)
echo "{\"status\": \"done\", \"notes\": [\"$first\"], \"rows\": [{\"key\": \"k1\", \"ms\": 2.5}, {\"key\": \"$keys\", \"error\": \"x\"}]}" > "$out")");
  if (shell("command -v flock").status != 0) GTEST_SKIP() << "no flock(1) here";
  PeerProcess peer(o);
  std::ofstream(dir.path() / "ours") << "ours first";
  const PeerReport r = peer.finish();
  ASSERT_TRUE(r.error.empty()) << r.error;
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_EQ(r.notes[0], "ours first");
  ASSERT_TRUE(r.rows.at("k1").ms);
  EXPECT_DOUBLE_EQ(*r.rows.at("k1").ms, 2.5);
  EXPECT_TRUE(r.rows.count("k1,k2"));
}

TEST(BenchOps, PeerProcessSaysWhyThereAreNoPeers) {
  test::TempDir dir;
  PeerOptions o;
  o.script = "unused.py";
  o.keys = {"k"};
  o.python = (dir.path() / "no-such-python").string();
  EXPECT_NE(PeerProcess(o).finish().error.find("--python"), std::string::npos);

  o.python = stand_in(dir.path(), "exit3", "exit 3");
  EXPECT_NE(PeerProcess(o).finish().error.find("status 3"), std::string::npos);

  // Past its time limit the peer gets SIGTERM, and after the grace period SIGKILL.
  o.python = stand_in(dir.path(), "late", "trap '' TERM\nexec sleep 30");
  o.timeout_s = 0.2;
  o.grace_s = 0.3;
  const PeerReport late = PeerProcess(o).finish();
  EXPECT_NE(late.error.find("signal 9"), std::string::npos) << late.error;
}

TEST(BenchOps, FindsThePeerScript) {
  EXPECT_EQ(find_peer_script("/no/such/ops_peers.py"), "");
  const std::string script = std::string(GLMTUNE_SOURCE_DIR) + "/bench/ops_peers.py";
  EXPECT_EQ(find_peer_script(script), script);
}

TEST(BenchOps, CommandNamesTheMissingGpu) {
  if (cuda_available()) GTEST_SKIP() << "a GPU is visible: the command would run";
  const Shell r = shell(std::string(GLMTUNE_BINARY) + " bench ops --no-peers");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("CUDA"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("bench ops"), std::string::npos) << r.out;
}

}  // namespace
