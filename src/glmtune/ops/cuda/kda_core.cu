// The chunked delta rule of KDA on the GPU, forward and backward (ops/cuda/kda.h). Notation as in
// ops/cpu/kda_backward.cpp: qc = scale·q, Γ the in-chunk cumulative log decay, kb = β⊙k,
// kbe = kb⊙e^Γ, vb = β⊙v, −L (strictly lower) in `tri` before the substitution and
// Tm = (I + L)^{-1} after it, A[i][j] = Σ_a qc_i k_j e^{Γ_i−Γ_j} (j ≤ i), U = Tm vb, W = Tm kbe,
// qd = qc⊙e^Γ, kdec = k⊙e^{Γ_last−Γ}, Vn = U − W S0. A chunk shorter than 16 (a document's tail)
// is zero-padded: padded rows have k = q = v = β = 0 and g = 0, so they add exact zeros everywhere
// and Γ of the last row equals Γ of the last real row.
//
// Four kernels, two token-parallel and two that walk a document's chunks in order:
//   prep       one block per (chunk, head), 68 KB of shared memory (three blocks per SM): the
//              chunk-local quantities W, qd, kdec, A in bf16 (three parts in the f32 mode), U,
//              e^{Γ_last} and (for the backward) Tm in f32. L = kb kᵀ and A = qc kᵀ with the
//              per-element decay e^{Γ_i − Γ_j} run as MMAs on the factorised decay (below); U = Tm
//              vb and W = Tm kbe as MMAs; the 16×16 substitution in fp32 on one warp, a column per
//              lane.
//   state_fwd  one block per (head, document, value slice), a warp per 16 value rows of Sᵀ (fp32
//              in the warp's MMA accumulators; the value columns of S evolve independently, so a
//              walk splits into 1, 2 or 4 slices of 8, 4 or 2 warps and few walks still fill the
//              SMs): Vn = U − W S, O = qd S + A Vn, S ← e^{Γ_last} S +
//              kdecᵀ Vn. The backward's replay forms no O; it stores Vn and the entry states:
//              every chunk's, or (where the walks reach 90% of the SMs) every even chunk's of a
//              document, the odd chunk's state following from it as S0 e^{Γ_last} + kdecᵀ Vn of
//              the even chunk.
//   state_bwd  the same walk in reverse carrying d S: dVn = kdec dS + Aᵀ dO, dS ← e^{Γ_last} dS +
//              qdᵀ dO − Wᵀ dVn. The two products that need a chunk's exit gradient d S1 are taken
//              here, while it sits in the registers: d kdec = Vn d S1ᵀ (per warp an MMA over its
//              16 value rows, the accumulator tile transposed into a B operand by movmatrix, the
//              slice's partials summed in warp order through shared memory) and e^{Γ_last}
//              ⟨d S1, S0⟩ per key column (S0 from state_fwd's store, sent to L2 a chunk ahead, or
//              for an odd chunk rebuilt from its partner's with the operations state_fwd ran:
//              the same bits). Stores those (one partial per value slice, which bwd_chunk adds
//              in order) and dVn; d S itself never goes to memory.
//   bwd_chunk  one block per (chunk, head), 81 KB of shared memory (two blocks per SM): from S0,
//              Vn, dVn, d kdec every product as an MMA (d qd, d W over the value dim, for an odd
//              chunk from its partner's stored state; dA, dvb = Tmᵀ dU, dkbe = Tmᵀ dW, dL; the
//              decay terms back to kb, qc, k, Γ on the factorised decay), Tm, U, W taken from
//              prep, every input it reads after staging sent to L2 when the block starts.
//              Each warp owns 8 key/value columns in every phase, so the gradient tiles stay in
//              its accumulators and only cross-warp operands go through shared memory.
// The factorised decay: e^{Γ_i − Γ_j} = e^{Γ_i − ref}·e^{ref − Γ_j}, ref per key channel the mean
// of the chunk's first and last Γ, turns the decayed 16×16×128 products into plain MMAs. A chunk
// whose |Γ − ref| exceeds kMaxExp anywhere (the gate's lower bound −5 keeps real chunks inside)
// takes the exact per-element fp32 path instead, decided per block, so any gate stays correct.
// The backward runs state_fwd again (the replay), and prep too unless the caller kept the
// forward's prep output (KdaChunkCache). Workspace per (chunk, head): prep 22 KB (47 KB in the
// f32 mode); the backward adds S0ᵀ in f32 (64 KB per chunk, or per pair of chunks) and Vnᵀ,
// dVnᵀ, d kdec, e^{Γ_last} ⟨d S1, S0⟩ (24.5 KB, plus 8.5 KB per further value slice): about
// 1.5 GB forward and 6.0 GB backward (8.1 GB with a state per chunk) at T = 16384, H = 64, bf16.
// Matrix products run on the tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate). In bf16
// storage the walks' products and bwd_chunk's products over the key and value dims take bf16
// operands (fp32 values rounded once; the state and every sum stay fp32), as bf16 chunked
// delta-rule kernels commonly do; prep's products and bwd_chunk's decay products split their f32
// operands into a bf16 hi part and a bf16 lo part (the rounding error of hi: hi·hi + hi·lo +
// lo·hi keeps about 16 bits). In the f32 mode every product splits its operands into three
// parts (hi, lo and the rounding error of hi + lo; six MMAs keep about fp32's 24 bits), so it
// matches the f32 CPU op to about 1e-6. Every sum has a fixed order: no atomics, bit-identical
// reruns.

#include <array>
#include <type_traits>

#include "glmtune/ops/cuda/common.cuh"
#include "glmtune/ops/cuda/kda.h"
#include "glmtune/ops/cuda/tensor_core.cuh"

namespace glmtune::cuda {
namespace {

using detail::bf16;
using detail::cptr;
using detail::mptr;

constexpr int kC = 16;          // chunk length
constexpr int kK = 128;         // key = value head dim
constexpr int kLd = kK + 1;     // padded row of the f32 [C, K] tiles (conflict-free columns)
constexpr int kCT = 512;        // chunk kernels: the 16×16 pair loops split in two halves
constexpr int kTs = kK + 8;     // bf16 row of a staged [C, K] tile: 16-byte rows, and
                                // ldmatrix's eight rows fall in distinct banks
constexpr int kAs = kC + 8;     // bf16 row of a staged [C, C] tile
constexpr int kTile = kC * kK;  // elements of one [C, K] tile
static_assert(kTile % kCT == 0, "the chunk kernels' tile loops run kTile / kCT times");

using detail::from_f;
using detail::to_f;
using namespace tc;

// Largest |Γ_i − ref| (per key channel, ref the mean of the chunk's first and last Γ) for which
// bwd_chunk uses the factorised decay e^{Γ_i − Γ_j} = e^{Γ_i − ref}·e^{ref − Γ_j}: each factor
// stays under e^40 ≈ 2.4e17, far from fp32 overflow even times large operands, and far from
// underflow (e^-40 ≈ 4e-18 is a normal number in fp32 and bf16). The gate's lower bound −5 keeps
// a chunk's span under 80, so real chunks take the MMA path; any wider chunk (any gate) takes the
// exact per-element path.
constexpr float kMaxExp = 40.0f;

// The operand precision (bf16 parts per fp32 operand, tensor_core.cuh's mma_x) of the walks'
// products and of bwd_chunk's products over the key and value dims. The f32 mode carries every
// fp32 operand as three bf16 parts (six MMAs, about fp32's 24 bits); the bf16 mode takes bf16
// operands (the hi part alone: one MMA, fp32 accumulation, the state itself still fp32 in the
// accumulators). A walk's per-chunk latency is its time at few documents, and one MMA a product
// shortens each chunk's dependent chain; prep then writes no lo tiles (22 KB per chunk and head,
// 47 KB in the f32 mode).
template <typename T>
constexpr int kWalkParts = std::is_same_v<T, float> ? 3 : 1;
// prep's products and bwd_chunk's 16×16×16 decay products: two parts in bf16 storage (the f32
// values they combine are not bf16-exact), three in the f32 mode.
template <typename T>
constexpr int kPrepParts = std::is_same_v<T, float> ? 3 : 2;

// ---- chunk bookkeeping ------------------------------------------------------------------------

// dc[d] = index of document d's first chunk in the chunk-major buffers, dc[ndoc] = chunk count;
// pc = dc + ndoc + 1 likewise for the stored entry states, one per pair of a document's chunks.
__global__ void doc_chunks_kernel(const int* __restrict__ cu, int ndoc, int* __restrict__ dc) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int* pc = dc + ndoc + 1;
  int acc = 0, pairs = 0;
  for (int d = 0; d < ndoc; ++d) {
    dc[d] = acc;
    pc[d] = pairs;
    const int nch = (cu[d + 1] - cu[d] + kC - 1) / kC;
    acc += nch;
    pairs += (nch + 1) / 2;
  }
  dc[ndoc] = acc;
  pc[ndoc] = pairs;
}

// Chunk `slot` → its document, first token c0 and length n; false past the last chunk.
__device__ __forceinline__ bool find_chunk(const int* __restrict__ cu, const int* __restrict__ dc,
                                           int ndoc, int slot, int& doc, int64_t& c0, int& n) {
  if (slot >= dc[ndoc]) return false;
  int lo = 0, hi = ndoc - 1;  // the last document whose first chunk is ≤ slot
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (dc[mid] <= slot)
      lo = mid;
    else
      hi = mid - 1;
  }
  doc = lo;
  c0 = cu[lo] + int64_t(slot - dc[lo]) * kC;
  const int64_t rest = cu[lo + 1] - c0;
  n = int(rest < kC ? rest : kC);
  return true;
}

// ---- the chunk-local forward ------------------------------------------------------------------

// prep's shared memory tiles (f32 [C][Ld] unless noted).
struct Local {
  float* qc;
  float* kc;
  float* gam;
  float* kbe;
  float* vraw;
  float* kp;    // k e^{ref − Γ}        (the factorised decay's B operand)
  float* kbp;   // kb e^{Γ − ref}       (A operand of L)
  float* qp;    // qc e^{Γ − ref}       (A operand of A)
  float* tri;   // [C][C]
  float* ain;   // [C][C]
  float* beta;  // [C]
  static constexpr int floats() { return 8 * kC * kLd + 2 * kC * kC + kC; }
  __device__ explicit Local(float* base) {
    float* p = base;
    auto take = [&p](int n) {
      float* r = p;
      p += n;
      return r;
    };
    qc = take(kC * kLd);
    kc = take(kC * kLd);
    gam = take(kC * kLd);
    kbe = take(kC * kLd);
    vraw = take(kC * kLd);
    kp = take(kC * kLd);
    kbp = take(kC * kLd);
    qp = take(kC * kLd);
    tri = take(kC * kC);
    ain = take(kC * kC);
    beta = take(kC);
  }
};

// What prep hands to the state kernels, chunk-major: element (chunk s, head h) starts at
// (s·H + h)·size. The bf16 tiles are the f32 values rounded (hi), with their rounding errors (lo,
// then lo2) in the f32 mode only (null otherwise).
struct Prep {
  bf16 *w_hi, *w_lo, *w_lo2;     // W [C][K]
  bf16 *qd_hi, *qd_lo, *qd_lo2;  // qd [C][K]
  bf16 *kd_hi, *kd_lo, *kd_lo2;  // kdec [C][K]
  bf16 *a_hi, *a_lo, *a_lo2;     // A [C][C]
  float* u;                      // U [C][K]
  float* egl;                    // e^{Γ_last} [K]
  float* tm;                     // Tm [C][C], for the backward
};

// Stores the first kParts bf16 parts of x.
template <int kParts>
__device__ __forceinline__ void put_parts(bf16* hi, bf16* lo, bf16* lo2, int64_t off, float x) {
  const bf16 h = __float2bfloat16_rn(x);
  hi[off] = h;
  if constexpr (kParts > 1) {
    const float r = x - __bfloat162float(h);
    const bf16 l = __float2bfloat16_rn(r);
    lo[off] = l;
    if constexpr (kParts > 2) lo2[off] = __float2bfloat16_rn(r - __bfloat162float(l));
  }
}

// Element a of the chunk's token i: scale·q, k and g into the f32 tiles qc, kc and gam (rows
// kLd apart), and x (v for prep, dO for bwd_chunk) returned; zeros past the chunk's n tokens.
// prep and bwd_chunk stage through here and gamma_cumsum, so both form the same qc and Γ.
template <typename T>
__device__ __forceinline__ float stage_chunk_element(float* qc, float* kc, float* gam, const T* q,
                                                     const T* k, const float* g, const T* x,
                                                     float scale, int64_t c0, int n, int heads,
                                                     int h, int i, int a) {
  float qv = 0.0f, kv = 0.0f, gv = 0.0f, xv = 0.0f;
  if (i < n) {
    const int64_t off = ((c0 + i) * heads + h) * kK + a;
    qv = to_f(q[off]) * scale;
    kv = to_f(k[off]);
    gv = g[off];
    xv = to_f(x[off]);
  }
  qc[i * kLd + a] = qv;
  kc[i * kLd + a] = kv;
  gam[i * kLd + a] = gv;
  return xv;
}

// Γ from the staged g: the in-chunk cumulative sum down each key column, sequential like the CPU.
__device__ __forceinline__ void gamma_cumsum(float* gam, int tid) {
  if (tid < kK)
    for (int i = 1; i < kC; ++i) gam[i * kLd + tid] += gam[(i - 1) * kLd + tid];
}

// One block per (chunk, head): the chunk-local tiles that do not depend on the state, the 16×16
// systems formed and solved. L = kb kᵀ and A = qc kᵀ (with the decay) run as MMAs on the
// factorised decay when the chunk's Γ range allows (kMaxExp), else as exact fp32 sums.
// Three blocks per SM: 68 KB of shared memory each, registers capped at 40.
template <typename T>
__global__ void __launch_bounds__(kCT, 3)
    kda_prep_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                    const float* __restrict__ g, const float* __restrict__ beta,
                    const int* __restrict__ cu, const int* __restrict__ dc, int ndoc, int heads,
                    float scale, Prep p) {
  constexpr int kParts = kWalkParts<T>;  // parts of the tiles this writes
  extern __shared__ float smem[];
  const Local t(smem);
  const int slot = blockIdx.x, h = blockIdx.y;
  int64_t c0 = 0;
  int n = 0, doc = 0;
  if (!find_chunk(cu, dc, ndoc, slot, doc, c0, n)) return;
  const int64_t sh = int64_t(slot) * heads + h;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gg = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int it = 0; it < kTile / kCT; ++it) {  // unrolled: every load in flight at once
    const int idx = tid + it * kCT;
    const int i = idx / kK, a = idx % kK;
    t.vraw[i * kLd + a] =
        stage_chunk_element(t.qc, t.kc, t.gam, q, k, g, v, scale, c0, n, heads, h, i, a);
  }
  if (tid < kC) t.beta[tid] = tid < n ? beta[(c0 + tid) * heads + h] : 0.0f;
  __syncthreads();
  gamma_cumsum(t.gam, tid);
  __syncthreads();
  // The elementwise tiles; qd and kdec go straight out (nothing here reads them again).
  bool wide = false;
#pragma unroll
  for (int it = 0; it < kTile / kCT; ++it) {  // unrolled: every load in flight at once
    const int idx = tid + it * kCT;
    const int i = idx / kK, a = idx % kK;
    const float gm = t.gam[i * kLd + a], eg = __expf(gm), gl = t.gam[(kC - 1) * kLd + a];
    const float kv = t.kc[i * kLd + a], qv = t.qc[i * kLd + a];
    const float kb = kv * t.beta[i];
    t.kbe[i * kLd + a] = kb * eg;
    const int64_t off = sh * kTile + idx;
    put_parts<kParts>(p.qd_hi, p.qd_lo, p.qd_lo2, off, qv * eg);
    put_parts<kParts>(p.kd_hi, p.kd_lo, p.kd_lo2, off, kv * __expf(gl - gm));
    const float d = gm - 0.5f * (t.gam[a] + gl);
    wide |= !(fabsf(d) <= kMaxExp);  // NaN too
    const float eu = __expf(d), ed = __expf(-d);
    t.kp[i * kLd + a] = kv * ed;
    t.kbp[i * kLd + a] = kb * eu;
    t.qp[i * kLd + a] = qv * eu;
  }
  const bool fast = __syncthreads_or(wide) == 0;
  if (fast) {
    // Warp (mat, nt) < 4: L (mat 0) or A (mat 1), j-columns 8nt.., over the key dim.
    if (warp < 4) {
      const int nt = warp & 1, mat = warp >> 1;
      const float* at = mat == 0 ? t.kbp : t.qp;
      float c[4] = {};
#pragma unroll 4
      for (int kk = 0; kk < 8; ++kk) {
        const FragA fa = load_a_f32(at + 16 * kk, kLd, 1);
        const float* bp = t.kp + (8 * nt + gg) * kLd + 16 * kk + 2 * t4;
        const float x[4] = {bp[0], bp[1], bp[8], bp[9]};
        mma_x<kPrepParts<T>>(c, fa, frag_b(x));
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = gg + (r >> 1) * 8, j = 8 * nt + 2 * t4 + (r & 1);
        if (mat == 0)
          t.tri[i * kC + j] = j < i ? -c[r] : 0.0f;
        else
          t.ain[i * kC + j] = j <= i ? c[r] : 0.0f;
      }
    }
  } else {
    // Exact: pair (i, j) on two adjacent lanes, each summing half of the key dim; the halves
    // meet by a shuffle (a + b in both lanes: the same bits). The second half starts 16 channels
    // in, so the 32 lanes of a warp read 32 distinct banks.
    const int pair = tid >> 1, half = tid & 1, i = pair / kC, j = pair % kC;
    float l = 0.0f, a_in = 0.0f;
    if (j <= i) {
      const float b = t.beta[i];
      for (int it = 0; it < kK / 2; ++it) {
        const int a = half * (kK / 2) + ((it + 16 * half) & (kK / 2 - 1));
        const float decay = __expf(t.gam[i * kLd + a] - t.gam[j * kLd + a]);
        const float kj = t.kc[j * kLd + a];
        l += (t.kc[i * kLd + a] * b) * kj * decay;
        a_in += t.qc[i * kLd + a] * kj * decay;
      }
    }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    a_in += __shfl_xor_sync(0xffffffffu, a_in, 1);
    if (half == 0) {
      t.tri[i * kC + j] = j < i ? -l : 0.0f;
      t.ain[i * kC + j] = j <= i ? a_in : 0.0f;
    }
  }
  __syncthreads();
  // Tm = (I + L)^{-1} by forward substitution on one warp, lane j < 16 walking column j down:
  // Tm[i][j] = Σ_{m<i} tri[i][m] Tm[m][j] for i > j (terms with m < j are exact zeros), the column
  // in registers, every lane reading row i of tri at once (a broadcast); a chain of 120 FMAs
  // instead of 105 dependent shuffle rounds. The other warps write e^{Γ_last} and A meanwhile.
  if (tid < 32) {
    const int j = lane & (kC - 1);
    float x[kC];
#pragma unroll
    for (int i = 0; i < kC; ++i) {
      float acc = 0.0f;
#pragma unroll
      for (int m = 0; m < i; ++m) acc += t.tri[i * kC + m] * x[m];
      x[i] = i < j ? 0.0f : (i == j ? 1.0f : acc);
    }
    __syncwarp();  // every read of tri's −L before the first write of Tm
    if (lane < kC)
#pragma unroll
      for (int i = 0; i < kC; ++i) t.tri[i * kC + j] = x[i];
  } else if (tid >= kCT - kK) {
    const int a = tid - (kCT - kK);
    p.egl[sh * kK + a] = expf(t.gam[(kC - 1) * kLd + a]);
  } else if (tid >= 32 && tid < 32 + kC * kC / 2) {
    const int idx = 2 * (tid - 32);
    uint32_t hi, lo, lo2;
    split3(t.ain[idx], t.ain[idx + 1], hi, lo, lo2);
    *reinterpret_cast<uint32_t*>(p.a_hi + sh * kC * kC + idx) = hi;
    if constexpr (kParts > 1) *reinterpret_cast<uint32_t*>(p.a_lo + sh * kC * kC + idx) = lo;
    if constexpr (kParts > 2) *reinterpret_cast<uint32_t*>(p.a_lo2 + sh * kC * kC + idx) = lo2;
  }
  __syncthreads();
  if (tid < kC * kC) p.tm[sh * kC * kC + tid] = t.tri[tid];
  // U = Tm vb, W = Tm kbe: warp w on columns [8w, 8w + 8), straight to memory.
  {
    const int n0 = 8 * warp, a = n0 + gg;
    const FragA ft = load_a_f32(t.tri, kC, 1);
    float xv[4], xw[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int j = 2 * t4 + (u & 1) + (u >> 1) * 8;
      xv[u] = t.vraw[j * kLd + a] * t.beta[j];
      xw[u] = t.kbe[j * kLd + a];
    }
    float cu4[4] = {}, cw4[4] = {};
    mma_x<kPrepParts<T>>(cu4, ft, frag_b(xv));
    mma_x<kPrepParts<T>>(cw4, ft, frag_b(xw));
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t off = sh * kTile + (gg + 8 * half) * kK + n0 + 2 * t4;
      *reinterpret_cast<float2*>(p.u + off) = make_float2(cu4[2 * half], cu4[2 * half + 1]);
      uint32_t hi, lo, lo2;
      split3(cw4[2 * half], cw4[2 * half + 1], hi, lo, lo2);
      *reinterpret_cast<uint32_t*>(p.w_hi + off) = hi;
      if constexpr (kParts > 1) *reinterpret_cast<uint32_t*>(p.w_lo + off) = lo;
      if constexpr (kParts > 2) *reinterpret_cast<uint32_t*>(p.w_lo2 + off) = lo2;
    }
  }
}

// ---- the state walks --------------------------------------------------------------------------

// One chunk's prep output staged in shared memory (bf16 rows padded to kTs / kAs); the forward
// walk's Stage adds U.
struct StageBwd {
  bf16 w_hi[kC * kTs], w_lo[kC * kTs];
  bf16 qd_hi[kC * kTs], qd_lo[kC * kTs];
  bf16 kd_hi[kC * kTs], kd_lo[kC * kTs];
  bf16 x_hi[kC * kTs], x_lo[kC * kTs];  // forward: unused; backward: dO
  bf16 a_hi[kC * kAs], a_lo[kC * kAs];
  float egl[kK];
};
// The lo2 parts of a stage's tiles, for three-part operands (the f32 mode); without them the
// names the kernels read in every mode are null constants (x_lo2 is only read with three parts).
struct StageLo2 {
  bf16 w_lo2[kC * kTs], qd_lo2[kC * kTs], kd_lo2[kC * kTs], x_lo2[kC * kTs];
  bf16 a_lo2[kC * kAs];
};
struct NoLo2 {
  static constexpr bf16* w_lo2 = nullptr;
  static constexpr bf16* qd_lo2 = nullptr;
  static constexpr bf16* kd_lo2 = nullptr;
  static constexpr bf16* a_lo2 = nullptr;
};
template <int kParts>
struct StageBwdP : StageBwd, std::conditional_t<kParts == 3, StageLo2, NoLo2> {};
template <int kParts>
struct Stage : StageBwdP<kParts> {
  float u[kTile];
};

// Two accumulator tiles acc[0], acc[1] of a state (columns col0 .. col0 + 15, this lane's 2t,
// 2t + 1 of each eight) times the per-column e^{Γ_last} in egl: the walks' S ⊙ e^{Γ_last}.
__device__ __forceinline__ void scale_by_egl(float (*acc)[4], const float* egl, int col0, int t4) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int a = col0 + 8 * j + 2 * t4;
    const float e0 = egl[a], e1 = egl[a + 1];
    acc[j][0] *= e0;
    acc[j][1] *= e1;
    acc[j][2] *= e0;
    acc[j][3] *= e1;
  }
}

// A [C][K] bf16 tile in 16-byte pieces by kNT threads.
template <int kNT>
__device__ __forceinline__ void stage_tile(bf16* dst, const bf16* src) {
#pragma unroll
  for (int j = 0; j < kTile / 8; j += kNT) {
    const int piece = j + int(threadIdx.x), row = piece >> 4, col = (piece & 15) * 8;
    cp_async16(dst + row * kTs + col, src + row * kK + col);
  }
}
// kWithU: U (the forward walk), only the value columns [e0, e0 + kNT / 2) its block walks;
// kWithQA: qd and A (every walk but the backward's replay, which forms no output); kParts: the
// bf16 parts of the tiles that the walk's products read. kNT threads.
template <bool kWithU, bool kWithQA, int kParts, int kNT, typename S>
__device__ void stage_load(S& st, const Prep& p, int64_t sh, int e0) {
  const int tid = threadIdx.x;
  const auto tiles = [&](bf16* hi, bf16* lo, bf16* lo2, const bf16* src_hi, const bf16* src_lo,
                         const bf16* src_lo2) {
    stage_tile<kNT>(hi, src_hi + sh * kTile);
    if constexpr (kParts > 1) stage_tile<kNT>(lo, src_lo + sh * kTile);
    if constexpr (kParts > 2) stage_tile<kNT>(lo2, src_lo2 + sh * kTile);
  };
  tiles(st.w_hi, st.w_lo, st.w_lo2, p.w_hi, p.w_lo, p.w_lo2);
  if constexpr (kWithQA) tiles(st.qd_hi, st.qd_lo, st.qd_lo2, p.qd_hi, p.qd_lo, p.qd_lo2);
  tiles(st.kd_hi, st.kd_lo, st.kd_lo2, p.kd_hi, p.kd_lo, p.kd_lo2);
  // 16-byte pieces: e^{Γ_last} (32), then with kWithQA the rows of A's parts (32 each).
  constexpr int kPieces = 32 + (kWithQA ? 32 * kParts : 0);
#pragma unroll
  for (int j = 0; j < kPieces; j += kNT) {
    const int piece = j + tid;
    if (piece >= kPieces) break;
    if (piece < 32) {
      cp_async16(st.egl + piece * 4, p.egl + sh * kK + piece * 4);
    } else {
      const int part = (piece - 32) >> 5, r = (piece & 31) >> 1, col = (piece & 1) * 8;
      bf16* dst = part == 0 ? st.a_hi : part == 1 ? st.a_lo : st.a_lo2;
      const bf16* src = part == 0 ? p.a_hi : part == 1 ? p.a_lo : p.a_lo2;
      cp_async16(dst + r * kAs + col, src + sh * kC * kC + r * kC + col);
    }
  }
  if constexpr (kWithU) {
    constexpr int kRowPieces = kNT / 8;  // 16-byte pieces of a row's kNT / 2 value columns
#pragma unroll
    for (int j = 0; j < kC * kRowPieces; j += kNT) {
      const int piece = j + tid, off = (piece / kRowPieces) * kK + e0 + 4 * (piece % kRowPieces);
      cp_async16(st.u + off, p.u + sh * kTile + off);
    }
  }
}

// One block per (head, document, value slice): the kWarps warps of slice z own rows
// e ∈ [16·(kWarps·z + w), +16) of Sᵀ [e][a] (the value columns of S evolve independently), held in
// the accumulators s[nt] (row e = eb + g (+8), column a = 8·nt + 2t (+1)). With kStore (the
// backward's replay: no O), Vnᵀ of every chunk goes to vnt ([chunk·H + h] blocks, [e][i]) and the
// entry states to s0 ([e][a] blocks): every chunk's ([chunk·H + h]), or with kPairs every even
// chunk's of the document ([pair·H + h], pc as made by doc_chunks_kernel), the odd chunk's state
// following from it and the even chunk's Vn, kdec, e^{Γ_last}.
template <typename T, bool kStore, bool kPairs, int kWarps>
__global__ void __launch_bounds__(32 * kWarps)
    kda_state_fwd_kernel(Prep p, const int* __restrict__ cu, const int* __restrict__ dc,
                         const int* __restrict__ pc, int heads, T* __restrict__ out,
                         float* __restrict__ s0, float* __restrict__ vnt) {
  constexpr int kParts = kWalkParts<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Stage<kParts>* stages = reinterpret_cast<Stage<kParts>*>(smem_raw);
  constexpr int kNT = 32 * kWarps;
  // One slice (kWarps = 8) starts at row 0: a constant keeps the registers of the unsliced walk.
  const int h = blockIdx.x, doc = blockIdx.y, e0 = kWarps == 8 ? 0 : 16 * kWarps * int(blockIdx.z);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int eb = e0 + 16 * warp;
  const int64_t start = cu[doc], end = cu[doc + 1];
  const int nch = int((end - start + kC - 1) / kC), first = dc[doc];
  float s[16][4];
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
  constexpr bool kOut = !kStore;  // the backward's replay forms no output
  if (nch > 0) stage_load<true, kOut, kParts, kNT>(stages[0], p, int64_t(first) * heads + h, e0);
  cp_async_commit();
  for (int c = 0; c < nch; ++c) {
    const int64_t sh = int64_t(first + c) * heads + h, c0 = start + int64_t(c) * kC;
    const int n = int(end - c0 < kC ? end - c0 : kC);
    if (c + 1 < nch) {
      stage_load<true, kOut, kParts, kNT>(stages[(c + 1) & 1], p, sh + heads, e0);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const Stage<kParts>& st = stages[c & 1];
    if (kStore && (!kPairs || (c & 1) == 0)) {
      float* dst = s0 + (kPairs ? int64_t(pc[doc] + c / 2) * heads + h : sh) * kK * kK;
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        const int a = 8 * nt + 2 * t4;
        *reinterpret_cast<float2*>(dst + (eb + g) * kK + a) = make_float2(s[nt][0], s[nt][1]);
        *reinterpret_cast<float2*>(dst + (eb + g + 8) * kK + a) = make_float2(s[nt][2], s[nt][3]);
      }
    }
    // Sᵀ Wᵀ (Vnᵀ = Uᵀ − Sᵀ Wᵀ below) and Oᵀ = Sᵀ qdᵀ, k over the key dim. The backward's replay
    // (kStore) needs the states and Vn only, not O.
    float vn[2][4] = {}, o[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      const FragA sa = frag_from_acc(s[2 * kk], s[2 * kk + 1], 1.0f);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        mma_x<kParts>(vn[nt], sa,
                      lds_b_nk_x<kParts>({st.w_hi, st.w_lo, st.w_lo2}, kTs, 8 * nt, 16 * kk));
        if constexpr (kOut)
          mma_x<kParts>(o[nt], sa,
                        lds_b_nk_x<kParts>({st.qd_hi, st.qd_lo, st.qd_lo2}, kTs, 8 * nt, 16 * kk));
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = 8 * nt + 2 * t4 + (r & 1), e = eb + g + (r >> 1) * 8;
        vn[nt][r] = st.u[i * kK + e] - vn[nt][r];
      }
    // Oᵀ += Vnᵀ Aᵀ.
    const FragA fv = frag_from_acc(vn[0], vn[1], 1.0f);
    if constexpr (kOut) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
        mma_x<kParts>(o[nt], fv, lds_b_nk_x<kParts>({st.a_hi, st.a_lo, st.a_lo2}, kAs, 8 * nt, 0));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = 8 * nt + 2 * t4 + (r & 1), e = eb + g + (r >> 1) * 8;
          if (i < n) out[((c0 + i) * heads + h) * kK + e] = from_f<T>(o[nt][r]);
        }
    }
    if constexpr (kStore) {
      float* dst = vnt + sh * kTile;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int i = 8 * nt + 2 * t4;
        *reinterpret_cast<float2*>(dst + (eb + g) * kC + i) = make_float2(vn[nt][0], vn[nt][1]);
        *reinterpret_cast<float2*>(dst + (eb + g + 8) * kC + i) = make_float2(vn[nt][2], vn[nt][3]);
      }
    }
    // Sᵀ ← Sᵀ ⊙ e^{Γ_last} (per column a) + Vnᵀ kdec.
#pragma unroll
    for (int np = 0; np < 8; ++np) {
      FragB b0, b1;
      ldsm_b_kn_x<kParts>({st.kd_hi, st.kd_lo, st.kd_lo2}, kTs, 0, 16 * np, b0, b1);
      scale_by_egl(s + 2 * np, st.egl, 16 * np, t4);
      mma_x<kParts>(s[2 * np], fv, b0);
      mma_x<kParts>(s[2 * np + 1], fv, b1);
    }
    __syncthreads();  // the stage is refilled by the next iteration's prefetch
  }
}

// state_bwd's shared memory: two stages, the per-warp partials of d kdec for 16 key columns
// (two buffers, [warp][i][16] with the column XOR-swizzled by 8·(i/2 mod 2): conflict-free float2
// writes from the accumulator layout and reads by row), the per-warp ⟨d S1, S0⟩ columns, and
// kdec and e^{Γ_last} of the chunk before an odd chunk (loaded one chunk ahead, with the stage).
constexpr int kRedCols = 16;
// kdec of the chunk before an odd chunk: its lo2 part with three-part operands (null otherwise).
struct KdbLo2 {
  bf16 kdb_lo2[kC * kTs];
};
struct NoKdbLo2 {
  static constexpr bf16* kdb_lo2 = nullptr;
};
template <int kWarps, int kParts>
struct StateBwdSmem : std::conditional_t<kParts == 3, KdbLo2, NoKdbLo2> {
  // With fewer than eight warps (value slices: the walks of few documents, one block per SM) the
  // block's rows of a chunk's stored entry state are staged here with the chunk's other operands,
  // a chunk ahead, so no round waits on L2 for them. Rows padded by 8 floats: the float2 loads of
  // eight rows then fall in the fewest wavefronts.
  static constexpr bool kStageS0 = kWarps < 8;
  static constexpr int kS0Ld = kK + 8;
  StageBwdP<kParts> stages[2];
  float red[2][kWarps][kC * kRedCols];
  float dot[kWarps][kK];
  bf16 kdb_hi[kC * kTs], kdb_lo[kC * kTs];
  float eglb[kK];
  float s0[kStageS0 ? 2 : 1][kStageS0 ? 16 * kWarps * kS0Ld : 4];
};

// The reverse walk: warp w of value slice z owns rows e of d Sᵀ (as s in the forward). Before a
// chunk is undone, d S is its exit gradient d S1, and the walk takes the two products of
// bwd_chunk that need it: d kdec = Vn d S1ᵀ (over the value dim: each warp's 16 rows by an MMA
// whose B operand is the accumulator tile transposed by movmatrix, then the slice's warps'
// partials summed in order through shared memory) to dkd, and e^{Γ_last} ⟨d S1, S0⟩ per key column
// to dgs: S0 read from the forward's store for an even chunk, for an odd one rebuilt from the even
// chunk's as state_fwd formed it (e^{Γ_last} S0 + Vnᵀ kdec of the chunk before, the same
// operations: the same bits). Also stores dVnᵀ to dvnt. d S itself never leaves the registers. d
// kdec and ⟨d S1, S0⟩ are sums over the value rows: each slice z stores its own (dkd + z·kd_stride,
// dgs + z·gs_stride), and bwd_chunk adds the slices in order.
template <typename T, bool kPairs, int kWarps>
__global__ void __launch_bounds__(32 * kWarps, 2)
    kda_state_bwd_kernel(Prep p, const T* __restrict__ dout, const int* __restrict__ cu,
                         const int* __restrict__ dc, const int* __restrict__ pc, int heads,
                         const float* __restrict__ s0, const float* __restrict__ vnt,
                         float* __restrict__ dvnt, float* __restrict__ dkd, float* __restrict__ dgs,
                         int64_t kd_stride, int64_t gs_stride) {
  constexpr int kParts = kWalkParts<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  using Smem = StateBwdSmem<kWarps, kParts>;
  using StageT = StageBwdP<kParts>;
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  StageT* stages = sm.stages;
  constexpr int kNT = 32 * kWarps, kRows = 16 * kWarps;  // threads, value rows of the slice
  const int h = blockIdx.x, doc = blockIdx.y, z = kWarps == 8 ? 0 : int(blockIdx.z), e0 = kRows * z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int eb = e0 + 16 * warp;
  if constexpr (kWarps < 8) {  // more than one slice
    dkd += z * kd_stride;
    dgs += z * gs_stride;
  }
  const int64_t start = cu[doc], end = cu[doc + 1];
  const int nch = int((end - start + kC - 1) / kC), first = dc[doc];
  // Where chunk c's stored entry state (its own, or with kPairs its even partner's) starts.
  auto state_at = [&](int c) {
    const int64_t idx =
        kPairs ? int64_t(pc[doc] + c / 2) * heads + h : int64_t(first + c) * heads + h;
    return s0 + idx * kK * kK;
  };
  // dO of a chunk over the slice's value columns: thread tid holds row tid / (2·kWarps), eight
  // columns from xc (zero past the end).
  const int xr = tid / (2 * kWarps), xc = e0 + (tid % (2 * kWarps)) * 8;
  float xo[8];
  auto fetch_dout = [&](int c) {
    const int64_t row = start + int64_t(c) * kC + xr;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      xo[j] = row < end ? to_f(dout[(row * heads + h) * kK + xc + j]) : 0.0f;
  };
  auto put_dout = [&](StageT& st) {
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      uint32_t hi, lo, lo2;
      split3(xo[j], xo[j + 1], hi, lo, lo2);
      *reinterpret_cast<uint32_t*>(st.x_hi + xr * kTs + xc + j) = hi;
      if constexpr (kParts > 1) *reinterpret_cast<uint32_t*>(st.x_lo + xr * kTs + xc + j) = lo;
      if constexpr (kParts > 2) *reinterpret_cast<uint32_t*>(st.x_lo2 + xr * kTs + xc + j) = lo2;
    }
  };
  // Chunk c's stored entry-state rows [e0, e0 + kRows) into s0[c & 1] (kStageS0).
  auto stage_s0 = [&](int c) {
    if constexpr (Smem::kStageS0) {
      const float* src = state_at(c) + e0 * kK;
      float* dst = sm.s0[c & 1];
      for (int piece = tid; piece < kRows * (kK / 4); piece += kNT) {
        const int r = piece / (kK / 4), col = (piece % (kK / 4)) * 4;
        cp_async16(dst + r * Smem::kS0Ld + col, src + r * kK + col);
      }
    }
  };
  // kdec and e^{Γ_last} of chunk c into kdb_hi, kdb_lo, eglb.
  auto load_before = [&](int c) {
    const int64_t shb = int64_t(first + c) * heads + h;
    stage_tile<kNT>(sm.kdb_hi, p.kd_hi + shb * kTile);
    if constexpr (kParts > 1) stage_tile<kNT>(sm.kdb_lo, p.kd_lo + shb * kTile);
    if constexpr (kParts > 2) stage_tile<kNT>(sm.kdb_lo2, p.kd_lo2 + shb * kTile);
    if (tid < 32) cp_async16(sm.eglb + tid * 4, p.egl + shb * kK + tid * 4);
  };
  float ds[16][4];
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) ds[nt][0] = ds[nt][1] = ds[nt][2] = ds[nt][3] = 0.0f;
  if (nch > 0) {
    stage_load<false, true, kParts, kNT>(stages[(nch - 1) & 1], p,
                                         int64_t(first + nch - 1) * heads + h, e0);
    if (kPairs && ((nch - 1) & 1)) load_before(nch - 2);
    stage_s0(nch - 1);
    fetch_dout(nch - 1);
    put_dout(stages[(nch - 1) & 1]);
    if (tid == 0) {
      const int64_t sh = int64_t(first + nch - 1) * heads + h;
      if (!Smem::kStageS0) prefetch_l2(state_at(nch - 1) + e0 * kK, kRows * kK * sizeof(float));
      prefetch_l2(vnt + sh * kTile + e0 * kC, kRows * kC * sizeof(float));
      if (kPairs && nch > 1)
        prefetch_l2(vnt + (sh - heads) * kTile + e0 * kC, kRows * kC * sizeof(float));
    }
  }
  cp_async_commit();
  for (int c = nch - 1; c >= 0; --c) {
    const int64_t sh = int64_t(first + c) * heads + h;
    // An odd chunk rebuilds its entry state from the chunk before (kdb, eglb: loaded with the
    // previous stage; the next odd chunk's go with this one).
    const bool rebuild = kPairs && (c & 1);
    if (c > 0) {
      stage_load<false, true, kParts, kNT>(stages[(c - 1) & 1], p, sh - heads, e0);
      if (kPairs && c >= 2 && ((c - 1) & 1)) load_before(c - 2);
      stage_s0(c - 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const StageT& st = stages[c & 1];
    // The next chunk's S0ᵀ and Vnᵀ head for L2 now (this chunk's were sent one iteration ago),
    // and the dO rows that fetch_dout reads one iteration from now. With kPairs the stored state
    // changes every second chunk, and an odd chunk also reads the Vnᵀ of the chunk before.
    if (c > 0 && tid == 0) {
      if (!Smem::kStageS0 && (!kPairs || (c & 1) == 0))
        prefetch_l2(state_at(c - 1) + e0 * kK, kRows * kK * sizeof(float));
      prefetch_l2(vnt + (sh - heads) * kTile + e0 * kC, kRows * kC * sizeof(float));
      if (kPairs && c > 1 && (c & 1) == 0)
        prefetch_l2(vnt + (sh - 2 * heads) * kTile + e0 * kC, kRows * kC * sizeof(float));
    }
    if (c > 1 && tid >= 32 && tid < 32 + kC) {  // dO rows of the chunk after next
      const int64_t row = start + int64_t(c - 2) * kC + (tid - 32);
      if (row < end) prefetch_l2(dout + (row * heads + h) * kK + e0, kRows * sizeof(T));
    }
    // S0ᵀ of this chunk in the accumulator layout (rows e, columns a: as state_fwd stored it),
    // two n-tiles at a time, one round ahead: from shared memory when staged, else from L2.
    const float* s0c = Smem::kStageS0 ? sm.s0[c & 1] : state_at(c);
    const int s0_ld = Smem::kStageS0 ? Smem::kS0Ld : kK, s0_row = Smem::kStageS0 ? eb - e0 : eb;
    auto load_s0 = [&](int grp, float2(&x)[2][2]) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int a = 8 * (2 * grp + j) + 2 * t4;
        x[j][0] = *reinterpret_cast<const float2*>(s0c + (s0_row + g) * s0_ld + a);
        x[j][1] = *reinterpret_cast<const float2*>(s0c + (s0_row + g + 8) * s0_ld + a);
      }
    };
    float2 xs0[2][2][2];
    load_s0(0, xs0[0]);
    // Vn [i][e] over this warp's value rows as the A operand (vnt holds Vnᵀ [e][i]).
    const FragA fvn = load_a_f32(vnt + sh * kTile + eb * kC, 1, kC);
    // Rebuilding: Vnᵀ of the chunk before over this warp's rows as the A operand (rows e, k = i),
    // as state_fwd's update took it.
    FragA fvb{};
    if (rebuild) fvb = load_a_f32(vnt + (sh - heads) * kTile + eb * kC, kC, 1);
    // Sixteen key columns (two n-tiles, k-tile grp of d Sᵀ) per round: dVnᵀ = d Sᵀ kdecᵀ (+ dOᵀ A
    // after the rounds), d kdec = Vn d S1ᵀ and ⟨d S1, S0⟩, the first two from one hi/lo split.
    float dvn[2][4] = {};
    constexpr int kRounds = kK / kRedCols;
#pragma unroll
    for (int grp = 0; grp < kRounds; ++grp) {
      if (grp + 1 < kRounds) load_s0(grp + 1, xs0[(grp + 1) & 1]);
      // This chunk's S0ᵀ for the two n-tiles, rows g and g + 8 (the accumulator layout).
      float sv[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float2(&x)[2] = xs0[grp & 1][j];
        sv[j][0] = x[0].x;
        sv[j][1] = x[0].y;
        sv[j][2] = x[1].x;
        sv[j][3] = x[1].y;
      }
      if (rebuild) {
        FragB b0, b1;
        ldsm_b_kn_x<kParts>({sm.kdb_hi, sm.kdb_lo, sm.kdb_lo2}, kTs, 0, 16 * grp, b0, b1);
        scale_by_egl(sv, sm.eglb, 16 * grp, t4);
        mma_x<kParts>(sv[0], fvb, b0);
        mma_x<kParts>(sv[1], fvb, b1);
      }
      const FragA fa = frag_from_acc(ds[2 * grp], ds[2 * grp + 1], 1.0f);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
        mma_x<kParts>(dvn[nt], fa,
                      lds_b_nk_x<kParts>({st.kd_hi, st.kd_lo, st.kd_lo2}, kTs, 8 * nt, 16 * grp));
      float part[2][4] = {};
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int nt = 2 * grp + j, a = 8 * nt + 2 * t4;
        // ⟨d S1, S0⟩ of columns a, a + 1: rows g, g + 8 here, then the g-lanes (butterfly: the
        // same two numbers added in both lanes, identical bits everywhere).
        float d0 = ds[nt][0] * sv[j][0] + ds[nt][2] * sv[j][2];
        float d1 = ds[nt][1] * sv[j][1] + ds[nt][3] * sv[j][3];
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
          d0 += __shfl_xor_sync(0xffffffffu, d0, o);
          d1 += __shfl_xor_sync(0xffffffffu, d1, o);
        }
        if (g == 0) *reinterpret_cast<float2*>(&sm.dot[warp][a]) = make_float2(d0, d1);
        // The B operand (k = e, n = a) is the accumulator tile (rows e, columns a) transposed:
        // fa's halves j hold that tile split.
        FragB b;
        b.hi[0] = mov_trans(fa.hi[2 * j]);
        b.hi[1] = mov_trans(fa.hi[2 * j + 1]);
        if constexpr (kParts > 1) {
          b.lo[0] = mov_trans(fa.lo[2 * j]);
          b.lo[1] = mov_trans(fa.lo[2 * j + 1]);
        }
        if constexpr (kParts > 2) {
          b.lo2[0] = mov_trans(fa.lo2[2 * j]);
          b.lo2[1] = mov_trans(fa.lo2[2 * j + 1]);
        }
        mma_x<kParts>(part[j], fvn, b);
      }
      float* red = sm.red[grp & 1][warp];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = g + 8 * half, col = (8 * j + 2 * t4) ^ (8 * ((i >> 1) & 1));
          *reinterpret_cast<float2*>(red + i * kRedCols + col) =
              make_float2(part[j][2 * half], part[j][2 * half + 1]);
        }
      __syncthreads();
      // The slice's warps' partials summed in warp order: d kdec two columns a job (kC·kRedCols/2
      // jobs), and after the last round ⟨d S1, S0⟩ one key column a job (kK more).
      constexpr int kRedJobs = kC * kRedCols / 2;
      const int jobs = grp == kRounds - 1 ? kRedJobs + kK : kRedJobs;
#pragma unroll
      for (int j0 = 0; j0 < jobs; j0 += kNT) {
        const int job = j0 + tid;
        if (job >= jobs) break;
        if (job < kRedJobs) {
          const int i = job >> 3, al = 2 * (job & 7), col = al ^ (8 * ((i >> 1) & 1));
          float2 acc = *reinterpret_cast<const float2*>(&sm.red[grp & 1][0][i * kRedCols + col]);
#pragma unroll
          for (int w = 1; w < kWarps; ++w) {
            const float2 x =
                *reinterpret_cast<const float2*>(&sm.red[grp & 1][w][i * kRedCols + col]);
            acc.x += x.x;
            acc.y += x.y;
          }
          *reinterpret_cast<float2*>(dkd + sh * kTile + i * kK + kRedCols * grp + al) = acc;
        } else {
          const int a = job - kRedJobs;
          float acc = sm.dot[0][a];
#pragma unroll
          for (int w = 1; w < kWarps; ++w) acc += sm.dot[w][a];
          dgs[sh * kK + a] = st.egl[a] * acc;
        }
      }
    }
    if (c > 0) fetch_dout(c - 1);  // the next chunk's dO (sent to L2 one iteration ago)
    // dVnᵀ += dOᵀ A (d Sᵀ kdecᵀ went in with the rounds above).
    {
      FragA fo;
      ldsm_a_km(st.x_hi, kTs, 0, eb, fo.hi);
      if constexpr (kParts > 1) ldsm_a_km(st.x_lo, kTs, 0, eb, fo.lo);
      if constexpr (kParts > 2) ldsm_a_km(st.x_lo2, kTs, 0, eb, fo.lo2);
      FragB b0, b1;
      ldsm_b_kn_x<kParts>({st.a_hi, st.a_lo, st.a_lo2}, kAs, 0, 0, b0, b1);
      mma_x<kParts>(dvn[0], fo, b0);
      mma_x<kParts>(dvn[1], fo, b1);
    }
    {
      float* dst = dvnt + sh * kTile;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int i = 8 * nt + 2 * t4;
        *reinterpret_cast<float2*>(dst + (eb + g) * kC + i) = make_float2(dvn[nt][0], dvn[nt][1]);
        *reinterpret_cast<float2*>(dst + (eb + g + 8) * kC + i) =
            make_float2(dvn[nt][2], dvn[nt][3]);
      }
    }
    // d Sᵀ ← d Sᵀ ⊙ e^{Γ_last} + dOᵀ qd − dVnᵀ W.
    FragA fo;
    ldsm_a_km(st.x_hi, kTs, 0, eb, fo.hi);
    if constexpr (kParts > 1) ldsm_a_km(st.x_lo, kTs, 0, eb, fo.lo);
    if constexpr (kParts > 2) ldsm_a_km(st.x_lo2, kTs, 0, eb, fo.lo2);
    const FragA fv = frag_from_acc(dvn[0], dvn[1], -1.0f);
#pragma unroll
    for (int np = 0; np < 8; ++np) {
      FragB q0, q1, w0, w1;
      ldsm_b_kn_x<kParts>({st.qd_hi, st.qd_lo, st.qd_lo2}, kTs, 0, 16 * np, q0, q1);
      ldsm_b_kn_x<kParts>({st.w_hi, st.w_lo, st.w_lo2}, kTs, 0, 16 * np, w0, w1);
      scale_by_egl(ds + 2 * np, st.egl, 16 * np, t4);
      mma_x<kParts>(ds[2 * np], fo, q0);
      mma_x<kParts>(ds[2 * np + 1], fo, q1);
      mma_x<kParts>(ds[2 * np], fv, w0);
      mma_x<kParts>(ds[2 * np + 1], fv, w1);
    }
    __syncthreads();  // the other stage is refilled next; this one's dO is rewritten after
    if (c > 0) put_dout(stages[(c - 1) & 1]);
  }
}

// ---- the chunk-local backward -----------------------------------------------------------------

// bwd_chunk's shared memory (81 KB: two blocks per SM). Every gradient tile of the chunk lives in
// registers in the m16n8k16 accumulator layout: warp w owns key/value columns [8w, 8w + 8) of all
// 16 rows in every phase, so only the operands that cross warps go through here.
// kSm bf16 parts per staged operand (two in bf16 storage, where only hi is read, so the layout and
// the two blocks per SM stay; three in the f32 mode).
template <int kSm>
struct BwdSmem {
  float qc[kC * kLd], kc[kC * kLd], gam[kC * kLd];  // scale·q, k, Γ
  float scr[kC * kLd];         // per-warp columns: dW (as a B operand), then dΓ (for the cumsum)
  bf16 xs[3 * kSm][kC * kTs];  // Vn, dO, dVn: the parts of operand m at [kSm·m, kSm·m + kSm)
  bf16 dx[2 * kSm][kC * kTs];  // dvb, dkbe likewise (the A operands of dL)
  float tm[kC * kC];           // Tm
  float da[kC * kC];           // dA (lower, diagonal included)
  float dlp[2][kC * kC];  // −dL's two products; before them dO Vn'ᵀ, dVn Vn'ᵀ (odd chunks)
  float dl[kC * kC];      // dL (strictly lower)
  float beta[kC];
  float dgl[kK];            // d Γ_last
  float dbp[kCT / 32][kC];  // dβ partial sums per warp
};

// One block per (chunk, head). Phases (warp w on columns [8w, 8w + 8), lane (g, t) on rows g,
// g + 8 and columns 8w + 2t, +1, as the accumulators of every product):
//   1. stage scale·q, k, Γ (cumsum), β, Tm and the hi/lo tiles of Vn, dO, dVn; pick the decay path;
//   2. dA = dO Vnᵀ (two warps); d qd = dO S0ᵀ, d W = −dVn S0ᵀ over the value dim with S0 read
//      once from memory; d kdec and d Γ_last's e^{Γ_last} ⟨d S1, S0⟩ as state_bwd left them.
//      An odd chunk of a document has no stored S0: with primes for the even chunk before it,
//      S0ᵀ = S0'ᵀ e^{Γ'_last} + Vn'ᵀ kdec', so dO S0ᵀ = (dO S0'ᵀ) e^{Γ'_last} + (dO Vn'ᵀ) kdec' and
//      likewise for dVn (four more warps form the two 16×16 products dO Vn'ᵀ, dVn Vn'ᵀ);
//   3. dvb = Tmᵀ dVn, dkbe = Tmᵀ dW; dL = −dvb Uᵀ − dkbe Wᵀ (four warps, U and W from prep);
//   4. L and A back to kb, qc, k and Γ: with the factorised decay four 16×16×16 MMAs per warp
//      (dL K', dA K', dLᵀ KB' + dAᵀ Q' with K' = k e^{ref−Γ}, KB' = kb e^{Γ−ref}, Q' = qc
//      e^{Γ−ref}), else the exact per-element sums in fp32;
//   5. dq, dk, dv from registers; dg (a reverse cumsum per column) and dβ (fixed-order partials).
// d kdec and ⟨d S1, S0⟩ arrive as kSlices partials (state_bwd's value slices), added in order.
template <typename T, bool kPairs, int kSlices>
__global__ void __launch_bounds__(kCT, 2)
    kda_bwd_chunk_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                         const float* __restrict__ g, const float* __restrict__ beta,
                         const T* __restrict__ dout, const int* __restrict__ cu,
                         const int* __restrict__ dc, const int* __restrict__ pc, int ndoc,
                         int heads, float scale, Prep p, const float* __restrict__ s0,
                         const float* __restrict__ vnt, const float* __restrict__ dvnt,
                         const float* __restrict__ dkdg, const float* __restrict__ dgs,
                         int64_t kd_stride, int64_t gs_stride, T* __restrict__ dq,
                         T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dg,
                         float* __restrict__ dbeta) {
  constexpr int kParts = kWalkParts<T>, kSm = kParts > 2 ? 3 : 2, kDecayParts = kPrepParts<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  BwdSmem<kSm>& sm = *reinterpret_cast<BwdSmem<kSm>*>(smem_raw);
  // The staged parts of operand m of xs / dx, and the first of them as an A operand.
  const auto xs_parts = [&sm](int m) {
    return Parts{sm.xs[kSm * m], sm.xs[kSm * m + 1], kSm > 2 ? sm.xs[kSm * m + kSm - 1] : nullptr};
  };
  const auto lds_a_parts = [](const Parts& t, int k0, FragA& a) {
    lds_a_mk(t.hi, kTs, 0, k0, a.hi);
    if constexpr (kParts > 1) lds_a_mk(t.lo, kTs, 0, k0, a.lo);
    if constexpr (kParts > 2) lds_a_mk(t.lo2, kTs, 0, k0, a.lo2);
  };
  const int slot = blockIdx.x, h = blockIdx.y;
  int64_t c0 = 0;
  int n = 0, doc = 0;
  if (!find_chunk(cu, dc, ndoc, slot, doc, c0, n)) return;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gg = lane >> 2, t4 = lane & 3;
  const int n0 = 8 * warp;
  const int64_t sh = int64_t(slot) * heads + h;
  const int local = slot - dc[doc];
  const bool rebuild = kPairs && (local & 1);
  const float* s0c = s0 + (kPairs ? int64_t(pc[doc] + local / 2) * heads + h : sh) * kK * kK;
  // What phases 2, 3 and 5 read from memory goes to L2 while the block stages its inputs.
  if (tid == 0) {
    prefetch_l2(s0c, kK * kK * sizeof(float));
#pragma unroll
    for (int z = 0; z < kSlices; ++z)
      prefetch_l2(dkdg + z * kd_stride + sh * kTile, kTile * sizeof(float));
    prefetch_l2(p.u + sh * kTile, kTile * sizeof(float));
    prefetch_l2(p.w_hi + sh * kTile, kTile * sizeof(bf16));
    if (kParts > 1) prefetch_l2(p.w_lo + sh * kTile, kTile * sizeof(bf16));
    if (kParts > 2) prefetch_l2(p.w_lo2 + sh * kTile, kTile * sizeof(bf16));
  } else if (tid >= 32 && tid < 32 + n) {  // the v rows of phase 5
    prefetch_l2(v + ((c0 + tid - 32) * heads + h) * kK, kK * sizeof(T));
  }

  // ---- 1. staging. dO row by row, Vnᵀ and dVnᵀ ([e][i] blocks) column by column: coalesced.
  auto put = [&sm](int m, int i, int e, float x) {
    put_parts<kParts>(sm.xs[kSm * m], sm.xs[kSm * m + 1], sm.xs[kSm * m + kSm - 1], i * kTs + e, x);
  };
  for (int idx = tid; idx < kTile; idx += kCT) {
    const int i = idx / kK, a = idx % kK;
    put(1, i, a,
        stage_chunk_element(sm.qc, sm.kc, sm.gam, q, k, g, dout, scale, c0, n, heads, h, i, a));
  }
  for (int idx = tid; idx < kTile; idx += kCT) {
    const int e = idx / kC, i = idx % kC;
    put(0, i, e, vnt[sh * kTile + idx]);
    put(2, i, e, dvnt[sh * kTile + idx]);
  }
  if (tid < kC) sm.beta[tid] = tid < n ? beta[(c0 + tid) * heads + h] : 0.0f;
  if (tid < kC * kC) sm.tm[tid] = p.tm[sh * kC * kC + tid];
  __syncthreads();
  gamma_cumsum(sm.gam, tid);
  __syncthreads();
  bool wide = false;
  for (int idx = tid; idx < kTile; idx += kCT) {
    const int i = idx / kK, a = idx % kK;
    const float ref = 0.5f * (sm.gam[a] + sm.gam[(kC - 1) * kLd + a]);
    wide |= !(fabsf(sm.gam[i * kLd + a] - ref) <= kMaxExp);  // NaN too
  }
  const bool fast = __syncthreads_or(wide) == 0;  // also the barrier after the cumsum's readers

  // ---- 2. dA (warps 0, 1: j-columns 8w..) and the products over the value dim.
  if (warp < 2) {
    float c[4] = {};
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      FragA fa;
      lds_a_parts(xs_parts(1), 16 * kk, fa);
      mma_x<kParts>(c, fa, lds_b_nk_x<kParts>(xs_parts(0), kTs, n0, 16 * kk));
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = gg + (r >> 1) * 8, j = n0 + 2 * t4 + (r & 1);
      sm.da[i * kC + j] = j <= i ? c[r] : 0.0f;
    }
  } else if (rebuild && warp < 6) {  // warp (m, nt): dO Vn'ᵀ or dVn Vn'ᵀ, j-columns 8nt..
    const int nt = warp & 1, m = (warp - 2) >> 1;
    const float* vnb = vnt + (sh - heads) * kTile;  // Vn'ᵀ [e][j]: the B operand (k = e, n = j)
    float c[4] = {};
#pragma unroll 4
    for (int kk = 0; kk < 8; ++kk) {
      FragA fa;
      lds_a_parts(xs_parts(1 + m), 16 * kk, fa);
      mma_x<kParts>(c, fa, load_b_f32(vnb, kC, 16 * kk, 8 * nt));
    }
#pragma unroll
    for (int r = 0; r < 4; ++r)
      sm.dlp[m][(gg + (r >> 1) * 8) * kC + 8 * nt + 2 * t4 + (r & 1)] = c[r];
  }
  // d kdec and e^{Γ_last} ⟨d S1, S0⟩ come from state_bwd; d qd, d W over the value dim here
  // (S0ᵀ [e][a], or S0'ᵀ).
  float dkd[4], dqd[4] = {}, dwa[4] = {};
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int64_t off = sh * kTile + (gg + (r >> 1) * 8) * kK + n0 + 2 * t4 + (r & 1);
    dkd[r] = dkdg[off];
#pragma unroll
    for (int z = 1; z < kSlices; ++z) dkd[r] += dkdg[z * kd_stride + off];
  }
#pragma unroll 2
  for (int kk = 0; kk < 8; ++kk) {
    const int64_t base = int64_t(16 * kk + 2 * t4) * kK + n0 + gg;
    const float x0[4] = {s0c[base], s0c[base + kK], s0c[base + 8 * kK], s0c[base + 9 * kK]};
    const FragB bs0 = frag_b(x0);
    FragA fa;
    lds_a_parts(xs_parts(1), 16 * kk, fa);
    mma_x<kParts>(dqd, fa, bs0);
    lds_a_parts(xs_parts(2), 16 * kk, fa);
    mma_x<kParts>(dwa, fa, bs0);
  }
  if (rebuild) {
    const int64_t shb = sh - heads;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float e = p.egl[shb * kK + n0 + 2 * t4 + (r & 1)];
      dqd[r] *= e;
      dwa[r] *= e;
    }
    // kdec' as the B operand (k = j, n = a) from prep's [j][a] tiles.
    FragB bk;
    const int64_t kb = shb * kTile + int64_t(2 * t4) * kK + n0 + gg;
    bk.hi[0] = pack2(p.kd_hi[kb], p.kd_hi[kb + kK]);
    bk.hi[1] = pack2(p.kd_hi[kb + 8 * kK], p.kd_hi[kb + 9 * kK]);
    if constexpr (kParts > 1) {
      bk.lo[0] = pack2(p.kd_lo[kb], p.kd_lo[kb + kK]);
      bk.lo[1] = pack2(p.kd_lo[kb + 8 * kK], p.kd_lo[kb + 9 * kK]);
    }
    if constexpr (kParts > 2) {
      bk.lo2[0] = pack2(p.kd_lo2[kb], p.kd_lo2[kb + kK]);
      bk.lo2[1] = pack2(p.kd_lo2[kb + 8 * kK], p.kd_lo2[kb + 9 * kK]);
    }
    __syncthreads();  // dO Vn'ᵀ and dVn Vn'ᵀ
    mma_x<kParts>(dqd, load_a_f32(sm.dlp[0], kC, 1), bk);
    mma_x<kParts>(dwa, load_a_f32(sm.dlp[1], kC, 1), bk);
  }
  // Through kdec = k e^{Γ_last − Γ} and qd = qc e^Γ; the accumulators of dq, dk and dΓ start here.
  float dqa[4], dka[4], dgm[4], tsum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int i = gg + (r >> 1) * 8, a = n0 + 2 * t4 + (r & 1);
    const float gm = sm.gam[i * kLd + a], gl = sm.gam[(kC - 1) * kLd + a];
    const float eg = __expf(gm), el = __expf(gl - gm);
    const float kdv = sm.kc[i * kLd + a] * el, qdv = sm.qc[i * kLd + a] * eg;
    dka[r] = dkd[r] * el;
    dqa[r] = dqd[r] * eg;
    dgm[r] = -dkd[r] * kdv + dqd[r] * qdv;
    tsum[r & 1] += dkd[r] * kdv;
    sm.scr[i * kLd + a] = -dwa[r];
  }
  // d Γ_last = e^{Γ_last} ⟨d S1, S0⟩ + Σ_i d kdec ⊙ kdec over the rows (g-lanes, butterfly).
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) tsum[c] += __shfl_xor_sync(0xffffffffu, tsum[c], o);
    const int a = n0 + 2 * t4 + c;
    if (gg == 0) {
      float dot = dgs[sh * kK + a];
#pragma unroll
      for (int z = 1; z < kSlices; ++z) dot += dgs[z * gs_stride + sh * kK + a];
      sm.dgl[a] = dot + tsum[c];
    }
  }
  __syncwarp();

  // ---- 3. dvb = Tmᵀ dVn, dkbe = Tmᵀ dW (Tm lower triangular), then dL.
  float dvb[4] = {}, dkbe[4] = {};
  {
    const FragA ta = load_a_f32(sm.tm, 1, kC);
    FragB bv;
    const Parts dvn_parts = xs_parts(2);
    ldsm_b_kn8(dvn_parts.hi, kTs, n0, bv.hi);
    if constexpr (kParts > 1) ldsm_b_kn8(dvn_parts.lo, kTs, n0, bv.lo);
    if constexpr (kParts > 2) ldsm_b_kn8(dvn_parts.lo2, kTs, n0, bv.lo2);
    const FragB bw = load_b_f32(sm.scr, kLd, 0, n0);
    mma_x<kParts>(dvb, ta, bv);
    mma_x<kParts>(dkbe, ta, bw);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = gg + 8 * half, a = n0 + 2 * t4;
#pragma unroll
      for (int prod = 0; prod < 2; ++prod) {
        const float* x = prod == 0 ? dvb : dkbe;
        uint32_t part[3];
        split3(x[2 * half], x[2 * half + 1], part[0], part[1], part[2]);
#pragma unroll
        for (int q = 0; q < kParts; ++q)
          *reinterpret_cast<uint32_t*>(&sm.dx[kSm * prod + (q == 2 ? kSm - 1 : q)][i * kTs + a]) =
              part[q];
      }
    }
  }
  __syncthreads();
  if (warp < 4) {  // warp (prod, nt): dvb Uᵀ or dkbe Wᵀ, j-columns 8nt..
    const int nt = warp & 1, prod = warp >> 1;
    float c[4] = {};
#pragma unroll 4
    for (int kk = 0; kk < 8; ++kk) {
      FragA fa;
      lds_a_parts({sm.dx[kSm * prod], sm.dx[kSm * prod + 1], sm.dx[kSm * prod + kSm - 1]}, 16 * kk,
                  fa);
      FragB fb;
      if (prod == 0) {
        const float* pu = p.u + sh * kTile + (8 * nt + gg) * kK + 16 * kk + 2 * t4;
        const float x[4] = {pu[0], pu[1], pu[8], pu[9]};
        fb = frag_b(x);
      } else {
        const int64_t off = sh * kTile;
        fb = lds_b_nk_x<kParts>({p.w_hi + off, kParts > 1 ? p.w_lo + off : nullptr,
                                 kParts > 2 ? p.w_lo2 + off : nullptr},
                                kK, 8 * nt, 16 * kk);
      }
      mma_x<kParts>(c, fa, fb);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r)
      sm.dlp[prod][(gg + (r >> 1) * 8) * kC + 8 * nt + 2 * t4 + (r & 1)] = c[r];
  }
  __syncthreads();
  if (tid < kC * kC) {
    const int i = tid / kC, j = tid % kC;
    sm.dl[tid] = j < i ? -(sm.dlp[0][tid] + sm.dlp[1][tid]) : 0.0f;
  }
  __syncthreads();

  // ---- 4. L and A to kb, qc, k and Γ through the decay e^{Γ_i − Γ_j}.
  float dkb[4];
  if (fast) {
    // Row side: dkb_i = e^{Γ_i−ref} Σ_j dL_ij K'_j, dqc_i += e^{Γ_i−ref} Σ_j dA_ij K'_j;
    // column side: dk_j += e^{ref−Γ_j} Σ_i (dL_ij KB'_i + dA_ij Q'_i). dL, dA are zero above
    // the diagonal, so the products need no mask.
    const FragA adl = load_a_f32(sm.dl, kC, 1), ada = load_a_f32(sm.da, kC, 1);
    const FragA adlt = load_a_f32(sm.dl, 1, kC), adat = load_a_f32(sm.da, 1, kC);
    const int a = n0 + gg;
    const float ref = 0.5f * (sm.gam[a] + sm.gam[(kC - 1) * kLd + a]);
    float kp[4], kbp[4], qp[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int kr = 2 * t4 + (u & 1) + (u >> 1) * 8;
      const float d = sm.gam[kr * kLd + a] - ref, eu = __expf(d), ed = __expf(-d);
      const float kv = sm.kc[kr * kLd + a];
      kp[u] = kv * ed;
      kbp[u] = kv * sm.beta[kr] * eu;
      qp[u] = sm.qc[kr * kLd + a] * eu;
    }
    const FragB bk = frag_b(kp), bkb = frag_b(kbp), bq = frag_b(qp);
    float x[4] = {}, y[4] = {}, z[4] = {};
    mma_x<kDecayParts>(x, adl, bk);
    mma_x<kDecayParts>(y, ada, bk);
    mma_x<kDecayParts>(z, adlt, bkb);
    mma_x<kDecayParts>(z, adat, bq);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = gg + (r >> 1) * 8, ac = n0 + 2 * t4 + (r & 1);
      const float refc = 0.5f * (sm.gam[ac] + sm.gam[(kC - 1) * kLd + ac]);
      const float d = sm.gam[i * kLd + ac] - refc, eu = __expf(d), ed = __expf(-d);
      const float kv = sm.kc[i * kLd + ac];
      const float dkbr = eu * x[r], dqv = eu * y[r], dkv = ed * z[r];
      dkb[r] = dkbr;
      dqa[r] += dqv;
      dka[r] += dkv;
      dgm[r] += (kv * sm.beta[i]) * dkbr + sm.qc[i * kLd + ac] * dqv - dkv * kv;
    }
  } else {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = gg + (r >> 1) * 8, a = n0 + 2 * t4 + (r & 1);
      const float gi = sm.gam[i * kLd + a], kv = sm.kc[i * kLd + a];
      const float kbi = kv * sm.beta[i], qi = sm.qc[i * kLd + a];
      float dkbr = 0.0f, dqv = 0.0f, dgv = 0.0f, dkv = 0.0f;
      for (int j = 0; j <= i; ++j) {  // row i
        const float decay = __expf(gi - sm.gam[j * kLd + a]);
        const float kj = sm.kc[j * kLd + a];
        const float tl = sm.dl[i * kC + j] * decay, ta = sm.da[i * kC + j] * decay;
        dkbr += tl * kj;
        dqv += ta * kj;
        dgv += (tl * kbi + ta * qi) * kj;
      }
      for (int i2 = i; i2 < kC; ++i2) {  // column i
        const float decay = __expf(sm.gam[i2 * kLd + a] - gi);
        const float kbi2 = sm.kc[i2 * kLd + a] * sm.beta[i2], qi2 = sm.qc[i2 * kLd + a];
        dkv += (sm.dl[i2 * kC + i] * decay) * kbi2 + (sm.da[i2 * kC + i] * decay) * qi2;
      }
      dkb[r] = dkbr;
      dqa[r] += dqv;
      dka[r] += dkv;
      dgm[r] += dgv - dkv * kv;
    }
  }

  // ---- 5. kbe = kb ⊙ e^Γ, kb = β k, vb = β v, qc = scale·q; outputs.
  float dbr[2] = {0.0f, 0.0f};
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = gg + 8 * half, a = n0 + 2 * t4;
    const float b = sm.beta[i];
    float dqo[2], dko[2], dvo[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int r = 2 * half + c;
      const float eg = __expf(sm.gam[i * kLd + a + c]), kv = sm.kc[i * kLd + a + c];
      const float dkbt = dkb[r] + dkbe[r] * eg;
      float dgr = dgm[r] + dkbe[r] * (kv * b * eg);
      if (i == kC - 1) dgr += sm.dgl[a + c];
      sm.scr[i * kLd + a + c] = dgr;
      dqo[c] = dqa[r] * scale;
      dko[c] = dka[r] + dkbt * b;
      dvo[c] = dvb[r] * b;
      const float vv = i < n ? to_f(v[((c0 + i) * heads + h) * kK + a + c]) : 0.0f;
      dbr[half] += dkbt * kv + dvb[r] * vv;
    }
    if (i < n) {
      const int64_t off = ((c0 + i) * heads + h) * kK + a;
      store2(dq + off, dqo[0], dqo[1]);
      store2(dk + off, dko[0], dko[1]);
      store2(dv + off, dvo[0], dvo[1]);
    }
  }
  // dβ_i = ⟨dkb_i, k_i⟩ + ⟨dvb_i, v_i⟩: t-lanes, then warps in order.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    dbr[half] += __shfl_xor_sync(0xffffffffu, dbr[half], 1);
    dbr[half] += __shfl_xor_sync(0xffffffffu, dbr[half], 2);
    if (t4 == 0) sm.dbp[warp][gg + 8 * half] = dbr[half];
  }
  __syncwarp();
  // dg_i = Σ_{i' ≥ i} dΓ_{i'}: lane l < 8 walks column 8w + l upwards.
  if (lane < 8) {
    const int a = n0 + lane;
    float acc = 0.0f;
    for (int i = kC - 1; i >= 0; --i) {
      acc += sm.scr[i * kLd + a];
      if (i < n) dg[((c0 + i) * heads + h) * kK + a] = acc;
    }
  }
  __syncthreads();
  if (tid < n) {
    float acc = 0.0f;
    for (int w = 0; w < kCT / 32; ++w) acc += sm.dbp[w][tid];
    dbeta[(c0 + tid) * heads + h] = acc;
  }
}

// ---- host side --------------------------------------------------------------------------------

struct CoreArgs {
  int64_t tokens = 0;
  int heads = 0, ndoc = 0;
  int slices = 1;  // blocks per (head, document) walk, each on 128 / slices value rows
};

CoreArgs check_core(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                    const Tensor& beta, const Tensor& cu, const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(q.defined() && q.device().is_cuda() &&
                              (q.dtype() == DType::bf16 || q.dtype() == DType::f32) &&
                              q.dim() == 3 && q.size(2) == kK && q.is_contiguous(),
                          std::string(op) + ": q " + detail::describe(q) +
                              " must be a contiguous bf16/f32 CUDA tensor [T, NL, 128]");
  for (const Tensor* x : {&k, &v})
    GLMTUNE_CUDA_OP_REQUIRE(x->defined() && x->dtype() == q.dtype() && x->shape() == q.shape() &&
                                x->is_contiguous() && x->device() == q.device(),
                            std::string(op) + ": k/v " + detail::describe(*x) +
                                " must be contiguous and match q " + q.str());
  GLMTUNE_CUDA_OP_REQUIRE(g.defined() && g.dtype() == DType::f32 && g.shape() == q.shape() &&
                              g.is_contiguous() && g.device() == q.device(),
                          std::string(op) + ": g " + detail::describe(g) +
                              " must be contiguous f32 shaped like q " + q.str());
  GLMTUNE_CUDA_OP_REQUIRE(
      beta.defined() && beta.dtype() == DType::f32 && beta.dim() == 2 &&
          beta.size(0) == q.size(0) && beta.size(1) == q.size(1) && beta.is_contiguous() &&
          beta.device() == q.device(),
      std::string(op) + ": beta " + detail::describe(beta) + " must be contiguous f32 [T, NL]");
  GLMTUNE_CUDA_OP_REQUIRE(cu.defined() && cu.dtype() == DType::i32 && cu.dim() == 1 &&
                              cu.size(0) >= 2 && cu.is_contiguous() && cu.device() == q.device(),
                          std::string(op) + ": cu_seqlens " + detail::describe(cu) +
                              " must be an int32 CUDA tensor [ndoc + 1]");
  return {q.size(0), int(q.size(1)), int(cu.size(0) - 1)};
}

// The chunk table and prep's output for one call. Chunks are counted by an upper bound on the
// host (T/16 + ndoc), so nothing waits for the device; slots past the real count stay unused.
struct Workspace {
  int64_t slots = 0;
  Tensor dc, tiles, f32s;
  Prep p{};
};

// bf16 elements of prep's tiles per (chunk, head): W, qd, kdec and A, with as many parts as the
// kernels read (three in the f32 mode, one in bf16 storage).
template <typename T>
constexpr int kPrepTiles = kWalkParts<T>*(3 * kTile + kC * kC);

// Points w.p into w.tiles and w.f32s (the part tiles past kWalkParts null).
template <typename T>
void bind_prep(Workspace& w, int heads) {
  const int64_t sh = w.slots * heads;
  bf16* b = mptr<bf16>(w.tiles);
  auto take = [&b, sh](int64_t n) {
    bf16* r = b;
    b += sh * n;
    return r;
  };
  auto take_part = [&take](int part, int64_t n) {
    return part < kWalkParts<T> ? take(n) : nullptr;
  };
  for (auto [parts, n] :
       {std::pair{std::array{&w.p.w_hi, &w.p.w_lo, &w.p.w_lo2}, int64_t(kTile)},
        std::pair{std::array{&w.p.qd_hi, &w.p.qd_lo, &w.p.qd_lo2}, int64_t(kTile)},
        std::pair{std::array{&w.p.kd_hi, &w.p.kd_lo, &w.p.kd_lo2}, int64_t(kTile)},
        std::pair{std::array{&w.p.a_hi, &w.p.a_lo, &w.p.a_lo2}, int64_t(kC * kC)}})
    for (int part = 0; part < 3; ++part) *parts[size_t(part)] = take_part(part, n);
  w.p.u = w.f32s.data<float>();
  w.p.egl = w.p.u + sh * kTile;
  w.p.tm = w.p.egl + sh * kK;
}

template <typename T>
Workspace run_prep(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                   const Tensor& beta, const Tensor& cu, const CoreArgs& a, float scale,
                   cudaStream_t stream) {
  Workspace w;
  const Device dev = q.device();
  w.slots = a.tokens / kC + a.ndoc;
  const int64_t sh = w.slots * a.heads;
  w.dc = Tensor::empty({2 * (int64_t(a.ndoc) + 1)}, DType::i32, dev);  // dc, then pc
  w.tiles = Tensor::empty({sh * int64_t(kPrepTiles<T>)}, DType::bf16, dev);
  w.f32s = Tensor::empty({sh * (kTile + kK + kC * kC)}, DType::f32, dev);
  bind_prep<T>(w, a.heads);
  doc_chunks_kernel<<<1, 32, 0, stream>>>(cu.data<int32_t>(), a.ndoc, w.dc.data<int32_t>());
  constexpr int bytes = Local::floats() * int(sizeof(float));
  auto kernel = kda_prep_kernel<T>;
  GLMTUNE_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  // Three blocks per SM need the largest shared-memory carveout.
  GLMTUNE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          int(cudaSharedmemCarveoutMaxShared)));
  kernel<<<dim3(unsigned(w.slots), unsigned(a.heads)), kCT, bytes, stream>>>(
      cptr<T>(q), cptr<T>(k), cptr<T>(v), g.data<float>(), beta.data<float>(), cu.data<int32_t>(),
      w.dc.data<int32_t>(), a.ndoc, a.heads, scale, w.p);
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  return w;
}

// Calls f with the warps per walk block (8, 4 or 2) of `slices` (1, 2 or 4) as a constant.
template <typename F>
void with_warps(int slices, F&& f) {
  if (slices == 1)
    f(std::integral_constant<int, 8>{});
  else if (slices == 2)
    f(std::integral_constant<int, 4>{});
  else
    f(std::integral_constant<int, 2>{});
}

template <typename T, bool kStore, bool kPairs>
void run_state_fwd(const Workspace& w, const Tensor& cu, const CoreArgs& a, T* out, float* s0,
                   float* vnt, cudaStream_t stream) {
  with_warps(a.slices, [&](auto warps) {
    constexpr int kWarps = decltype(warps)::value;
    constexpr int bytes = 2 * int(sizeof(Stage<kWalkParts<T>>));
    auto kernel = kda_state_fwd_kernel<T, kStore, kPairs, kWarps>;
    GLMTUNE_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    const int* dc = w.dc.data<int32_t>();
    kernel<<<dim3(unsigned(a.heads), unsigned(a.ndoc), unsigned(a.slices)), 32 * kWarps, bytes,
             stream>>>(w.p, cu.data<int32_t>(), dc, dc + a.ndoc + 1, a.heads, out, s0, vnt);
  });
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void launch_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                const Tensor& beta, const Tensor& cu, const CoreArgs& a, float scale, Tensor& out,
                KdaChunkCache* keep, cudaStream_t stream) {
  const Workspace w = run_prep<T>(q, k, v, g, beta, cu, a, scale, stream);
  run_state_fwd<T, false, false>(w, cu, a, mptr<T>(out), nullptr, nullptr, stream);
  if (keep) {
    keep->chunks = w.dc;
    keep->tiles = w.tiles;
    keep->f32s = w.f32s;
    keep->slots = w.slots;
    keep->inputs = {q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr()};
    keep->scale = scale;
  }
}

// The backward's chunk-local quantities: from `cached` when given (checked against these inputs),
// else formed again.
template <typename T>
Workspace backward_prep(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                        const Tensor& beta, const Tensor& cu, const CoreArgs& a, float scale,
                        const KdaChunkCache* cached, cudaStream_t stream) {
  if (!cached) return run_prep<T>(q, k, v, g, beta, cu, a, scale, stream);
  const std::array<const void*, 5> inputs = {q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(),
                                             beta.data_ptr()};
  GLMTUNE_CUDA_OP_REQUIRE(
      cached->tiles.defined() && cached->inputs == inputs && cached->scale == scale &&
          cached->slots == a.tokens / kC + a.ndoc && cached->chunks.numel() == 2 * (a.ndoc + 1),
      "cuda::kda_chunked_backward: the KdaChunkCache was filled by kda_chunked on other inputs "
      "(pass the cache of the forward of these q, k, v, g, beta, or none)");
  Workspace w;
  w.slots = cached->slots;
  w.dc = cached->chunks;
  w.tiles = cached->tiles;
  w.f32s = cached->f32s;
  bind_prep<T>(w, a.heads);
  return w;
}

template <typename T, bool kPairs>
void launch_bwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                const Tensor& beta, const Tensor& cu, const CoreArgs& a, float scale,
                const Tensor& dout, const KdaChunkCache* cached, ops::KdaCoreGrads& r,
                cudaStream_t stream) {
  const Device dev = q.device();
  const Workspace w = backward_prep<T>(q, k, v, g, beta, cu, a, scale, cached, stream);
  const int64_t sh = w.slots * a.heads;
  const int* dc = w.dc.data<int32_t>();
  const int* pc = dc + a.ndoc + 1;
  // S0ᵀ of every chunk, or with kPairs of every even chunk of a document (at most slots / 2 +
  // ndoc).
  const int64_t stored = kPairs ? (w.slots / 2 + a.ndoc) * a.heads : sh;
  Tensor states = Tensor::empty({stored, kK, kK}, DType::f32, dev);
  // Vnᵀ, dVnᵀ [C][K] per (chunk, head), then per value slice d kdec [C][K] and
  // e^{Γ_last} ⟨d S1, S0⟩ [K] per (chunk, head).
  Tensor small = Tensor::empty({sh * (2 * kTile + a.slices * (kTile + kK))}, DType::f32, dev);
  float* s0 = states.data<float>();
  float* vnt = small.data<float>();
  float* dvnt = vnt + sh * kTile;
  float* dkd = dvnt + sh * kTile;
  float* dgs = dkd + a.slices * sh * kTile;
  const int64_t kd_stride = sh * kTile, gs_stride = sh * kK;
  run_state_fwd<T, true, kPairs>(w, cu, a, nullptr, s0, vnt, stream);
  with_warps(a.slices, [&](auto warps) {
    constexpr int kWarps = decltype(warps)::value;
    constexpr int bytes = int(sizeof(StateBwdSmem<kWarps, kWalkParts<T>>));
    auto kernel = kda_state_bwd_kernel<T, kPairs, kWarps>;
    GLMTUNE_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    // Two blocks per SM need the largest shared-memory carveout.
    GLMTUNE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                            int(cudaSharedmemCarveoutMaxShared)));
    kernel<<<dim3(unsigned(a.heads), unsigned(a.ndoc), unsigned(a.slices)), 32 * kWarps, bytes,
             stream>>>(w.p, cptr<T>(dout), cu.data<int32_t>(), dc, pc, a.heads, s0, vnt, dvnt, dkd,
                       dgs, kd_stride, gs_stride);
  });
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
  with_warps(a.slices, [&](auto warps) {
    constexpr int kSm = kWalkParts<T> == 3 ? 3 : 2, bytes = int(sizeof(BwdSmem<kSm>));
    auto kernel = kda_bwd_chunk_kernel<T, kPairs, 8 / decltype(warps)::value>;
    GLMTUNE_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    kernel<<<dim3(unsigned(w.slots), unsigned(a.heads)), kCT, bytes, stream>>>(
        cptr<T>(q), cptr<T>(k), cptr<T>(v), g.data<float>(), beta.data<float>(), cptr<T>(dout),
        cu.data<int32_t>(), dc, pc, a.ndoc, a.heads, scale, w.p, s0, vnt, dvnt, dkd, dgs, kd_stride,
        gs_stride, mptr<T>(r.dq), mptr<T>(r.dk), mptr<T>(r.dv), r.dg.data<float>(),
        r.dbeta.data<float>());
  });
  GLMTUNE_CUDA_CHECK(cudaGetLastError());
}

int multiprocessors(const Device& dev) {
  int sms = 0;
  GLMTUNE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev.index));
  return sms;
}

// The value slices per walk: `requested` (1, 2 or 4), or with 0: one where the walks reach 90%
// of the SMs, else two, or four where four still give no SM two blocks. A walk's chunks run in
// sequence, so with fewer (head, document) pairs than SMs the rest of the GPU idles unless each
// walk is split over its value rows; but two-warp blocks sharing an SM run slower than one-slice
// walks (on an H200 at 64 walks, fwd+bwd: 23.6 ms in one slice, 20.4 in two, 23.7 in four).
int value_slices(int requested, int64_t walks, int sms, const char* op) {
  GLMTUNE_CUDA_OP_REQUIRE(requested == 0 || requested == 1 || requested == 2 || requested == 4,
                          std::string(op) + ": value_slices " + std::to_string(requested) +
                              " must be 0 (automatic), 1, 2 or 4");
  if (requested != 0) return requested;
  if (walks * 10 >= int64_t(sms) * 9) return 1;
  return walks * 4 <= sms ? 4 : 2;
}

}  // namespace

Tensor kda_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                   const Tensor& beta, const Tensor& cu_seqlens, double scale, cudaStream_t stream,
                   int slices, KdaChunkCache* keep) {
  const char* op = "cuda::kda_chunked";
  CoreArgs a = check_core(q, k, v, g, beta, cu_seqlens, op);
  a.slices = value_slices(slices, int64_t(a.heads) * a.ndoc, multiprocessors(q.device()), op);
  detail::DeviceGuard guard(q.device().index);
  if (keep) *keep = KdaChunkCache{};
  Tensor out = Tensor::empty(v.shape(), q.dtype(), q.device());
  if (a.tokens == 0) return out;
  if (q.dtype() == DType::bf16)
    launch_fwd<bf16>(q, k, v, g, beta, cu_seqlens, a, float(scale), out, keep, stream);
  else
    launch_fwd<float>(q, k, v, g, beta, cu_seqlens, a, float(scale), out, keep, stream);
  return out;
}

ops::KdaCoreGrads kda_chunked_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& g, const Tensor& beta,
                                       const Tensor& cu_seqlens, double scale, const Tensor& d_out,
                                       cudaStream_t stream, int slices,
                                       const KdaChunkCache* cached) {
  const char* op = "cuda::kda_chunked_backward";
  CoreArgs a = check_core(q, k, v, g, beta, cu_seqlens, op);
  GLMTUNE_CUDA_OP_REQUIRE(d_out.defined() && d_out.dtype() == q.dtype() &&
                              d_out.shape() == v.shape() && d_out.is_contiguous() &&
                              d_out.device() == q.device(),
                          std::string(op) + ": d_out " + detail::describe(d_out) +
                              " must be contiguous and shaped like v " + v.str());
  detail::DeviceGuard guard(q.device().index);
  const Device dev = q.device();
  ops::KdaCoreGrads r{
      Tensor::empty(q.shape(), q.dtype(), dev), Tensor::empty(k.shape(), q.dtype(), dev),
      Tensor::empty(v.shape(), q.dtype(), dev), Tensor::empty(g.shape(), DType::f32, dev),
      Tensor::empty(beta.shape(), DType::f32, dev)};
  if (a.tokens == 0) return r;
  // One stored state per pair of chunks halves the states' memory and traffic but lengthens
  // state_bwd's sequential walk (every odd chunk rebuilds its state): a gain where the walks
  // (value slices included) reach 90% of the SMs, a loss where one walk's latency is the whole
  // time (on an H200: 1.2 ms faster at 256 walks, 0.5 ms slower at 64, 0.07 ms faster at 64
  // walks in two slices).
  const int sms = multiprocessors(dev);
  const int64_t walks = int64_t(a.heads) * a.ndoc;
  a.slices = value_slices(slices, walks, sms, op);
  const bool pairs = walks * a.slices * 10 >= int64_t(sms) * 9;
  const float sc = float(scale);
  if (q.dtype() == DType::bf16) {
    if (pairs)
      launch_bwd<bf16, true>(q, k, v, g, beta, cu_seqlens, a, sc, d_out, cached, r, stream);
    else
      launch_bwd<bf16, false>(q, k, v, g, beta, cu_seqlens, a, sc, d_out, cached, r, stream);
  } else {
    if (pairs)
      launch_bwd<float, true>(q, k, v, g, beta, cu_seqlens, a, sc, d_out, cached, r, stream);
    else
      launch_bwd<float, false>(q, k, v, g, beta, cu_seqlens, a, sc, d_out, cached, r, stream);
  }
  return r;
}

}  // namespace glmtune::cuda
