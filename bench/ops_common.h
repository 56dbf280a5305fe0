#pragma once
// `glmtune bench ops` without the GPU: the list of timed ops (shape, FLOP or byte count, peer), the
// peer process (bench/ops_peers.py) and its JSON report, ratios and shares of the measured
// ceilings, the printed table and the JSON output. The GPU timings live in
// apps/glmtune/cmd_bench_ops.cpp; the formulas are written out in docs/PERF.md.

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace glmtune::benchops {

enum class Work { flops, bytes };

// Which timing code runs an op; `OpSpec::dims` and `OpSpec::variant` are its parameters.
enum class Family {
  matmul_ceiling,    // dims {n}: bf16 n×n×n through cuBLASLt, the rate ceiling
  copy_ceiling,      // dims {bytes}: device-to-device copy, the bandwidth ceiling
  kda,               // dims {document lengths...}; variant fwd | fwd+bwd | fwd+bwd kept
  grouped_gemm,      // dims {rows per expert, n, k}; variant fwd | dX | dW, each also with
                     // " device" (the device-offset kernels, dW into f32)
  attention,         // dims {tokens, heads, head dim}; variant per-head fwd | fwd+bwd,
                     // absorbed fwd | fwd+bwd
  absorbed_sparse,   // dims {tokens, heads, keys per query}; variant fwd | bwd (the kernel alone)
  gemm,              // dims {m, n, k}; variant NT | NN | TN (which operand is stored transposed)
  mhc,               // dims {tokens, streams, hidden}; variant pre fwd | pre bwd | post fwd | ...
  rmsnorm,           // dims {rows, width}; variant fwd | bwd
  kda_small,         // dims {tokens, channels, taps}; variant conv fwd | conv bwd | qk conv fwd |
                     // qk conv bwd | l2 fwd | l2 bwd (heads of 128) | o_norm fwd | o_norm bwd
  swiglu,            // dims {rows, width}; variant fwd | bwd
  lm_head_ce,        // dims {tokens, hidden, vocabulary, chunk rows}; variant fwd+bwd
  vision_attention,  // dims {segments, rows per segment, heads, head dim}; variant fwd | fwd+bwd
  fp8_gemm,          // dims {m, n, k} of C[m, n] (reduction k); variant fwd | dX | dW
  fp8_grouped_gemm,  // dims {rows per expert, n, k}; variant fwd | dX | dW [| one launch]
  fp8_quantize,      // dims {rows, cols}; variant 1x128 | 128x128 | 128x1 | transpose (W's codes)
};

struct OpSpec {
  std::string op, shape;  // the table's first two columns
  Family family = Family::gemm;
  std::string variant;
  std::vector<int64_t> dims;
  Work kind = Work::flops;
  double work = 0;       // FLOPs or bytes of one run
  std::string peer;      // what the peer runs; empty where no peer exists
  std::string peer_key;  // the row of bench/ops_peers.py that times it
};

// Every op the command times, in table order: the two ceilings first.
std::vector<OpSpec> op_specs();

// The specs whose "op shape" matches `regex` (ECMAScript, searched anywhere), plus the two
// ceilings, which every share needs. Throws glmtune::Error on a bad regex or when nothing matches.
std::vector<OpSpec> select_specs(const std::vector<OpSpec>& specs, const std::string& regex);

// ---- the peers' report ------------------------------------------------------------------------

struct PeerRow {
  std::string peer;
  std::optional<double> ms;  // empty: `error` says why
  std::string error;
};

struct PeerReport {
  std::string error;  // why no row has a peer time (empty when the peers ran)
  std::string status, python, torch, device;
  std::vector<std::string> notes;
  std::map<std::string, PeerRow> rows;  // by peer key
};

// Reads bench/ops_peers.py's JSON; malformed text gives a report whose `error` says so.
PeerReport parse_peer_report(const std::string& json_text);

// ---- results ----------------------------------------------------------------------------------

struct Ceilings {
  double tflops = 0;  // the measured bf16 matrix rate
  double gbs = 0;     // the measured copy bandwidth (bytes read + written)
};

struct OpResult {
  OpSpec spec;
  double ms = 0;
  std::optional<double> peer_ms;
  std::string peer_note;  // why there is no peer time ("" where the spec has no peer)
};

// TFLOP/s or GB/s of one run in `ms`.
double achieved_rate(const OpSpec& spec, double ms);
// The share of the matching ceiling (0 when that ceiling was not measured).
double ceiling_share(const OpSpec& spec, double ms, const Ceilings& ceilings);
// From the results of the two ceiling ops; a missing one stays 0.
Ceilings measured_ceilings(const std::vector<OpResult>& results);
// ours / peer; empty without a peer time.
std::optional<double> peer_ratio(const OpResult& result);

// Pairs every result with its peer row, or says why it has none.
void attach_peers(std::vector<OpResult>& results, const PeerReport& report);

std::string format_table(const std::vector<OpResult>& results, const Ceilings& ceilings,
                         const PeerReport& report);
nlohmann::json report_json(const std::vector<OpResult>& results, const Ceilings& ceilings,
                           const PeerReport& report, const std::string& device);

// ---- the peer process -------------------------------------------------------------------------

struct PeerOptions {
  std::string python = "python3";
  std::string script;  // bench/ops_peers.py
  std::vector<std::string> keys;
  int fla_max_configs = 1;
  double timeout_s = 480;  // from the start, after which the peer is told to stop preparing
  double grace_s = 90;     // then this long to time what is ready before it is killed
};

// The script next to the sources: `given` when set, else $GLMTUNE_SOURCE_DIR/bench/ops_peers.py,
// else bench/ops_peers.py under the current directory. Empty when none exists.
std::string find_peer_script(const std::string& given);

// bench/ops_peers.py as a child process. The constructor takes the GPU lock (a file lock the peer
// waits for before it times), then starts the child, so the peer prepares (compiles) while we time
// and times only after release_gpu(). A child that cannot start leaves the reason in finish().
class PeerProcess {
 public:
  explicit PeerProcess(const PeerOptions& options);
  ~PeerProcess();
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;

  void release_gpu();
  // Waits for the child (telling it to stop preparing at the time limit, killing it after the
  // grace period) and returns its report, or one whose `error` says why there is none.
  PeerReport finish();

 private:
  PeerOptions options_;
  std::string dir_, report_path_;
  int lock_fd_ = -1;
  pid_t pid_ = -1;
  std::string start_error_;
  double started_ = 0;
};

}  // namespace glmtune::benchops
