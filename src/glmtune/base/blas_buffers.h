#pragma once
// OpenBLAS under an address-space limit (RLIMIT_AS, `ulimit -v`).
//
// OpenBLAS maps one GEMM buffer per thread (its workers when they start, the caller at its first
// GEMM) and, when that mmap fails, retries it forever: under a tight `ulimit -v` a run spins
// instead of failing.

namespace glmtune {

// With an address-space limit: measures OpenBLAS's buffer in a helper process (this program run
// again with the environment variable below and one BLAS thread), then either maps the caller's
// buffer now, so that no later GEMM maps one, or throws an Error saying how far to raise the limit
// or how many BLAS threads fit. Without a limit it does nothing. Call it at startup, before
// anything else maps much. After an Error, end the process with _Exit: OpenBLAS's exit handlers
// wait for workers that may be stuck retrying their mapping.
void prepare_blas_buffers();

// The helper's side: when the variable is set, main() runs blas_probe_main() and nothing else.
inline constexpr const char* kBlasProbeVariable = "GLMTUNE_BLAS_PROBE";
int blas_probe_main();

}  // namespace glmtune
