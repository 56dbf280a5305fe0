#pragma once
// Hopper warpgroup MMA (wgmma.mma_async, sm_90a): 128 threads (four consecutive, aligned warps)
// multiply bf16 operands read from shared memory into fp32 accumulators held in registers.
//
// Operands are stored in the 128-byte-swizzled layout: a "panel" holds 64 columns (128 bytes) of
// every row, rows 128 bytes apart, and the 16-byte chunk c of row r sits at chunk position
// c ^ (r mod 8). Panels start at 1024-byte boundaries (the swizzle repeats every 8 rows), so the
// position follows from the address alone and a descriptor may start at any 32-byte k offset
// inside a row. Accumulator element e of a thread (lane = 4g + t, warp w of the warpgroup) is row
// 16w + g + 8·((e / 2) mod 2), column 8·(e / 4) + 2t + (e mod 2).

#include <cstdint>

namespace glmtune::cuda::wgmma {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}

// Byte offset of element (row, col) in a swizzled panel (col < 64, 16-bit elements).
__device__ __forceinline__ uint32_t swizzled(int row, int col) {
  return uint32_t(row * 128 + ((((col >> 3) ^ (row & 7))) << 4) + (col & 7) * 2);
}

// K-major operand (rows × k, k contiguous): 8-row groups 1024 bytes apart; the leading offset
// is unused while a k16 step stays inside one 128-byte row.
__device__ __forceinline__ uint64_t desc_k_major(const void* start) {
  return uint64_t((smem_u32(start) & 0x3FFFF) >> 4) | (uint64_t(1) << 16) |
         (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// MN-major operand (k rows × n, n contiguous), as the B of P · V where V's rows are keys: panels
// of 64 columns `panel_bytes` apart along n, 8-row groups 1024 bytes apart along k.
__device__ __forceinline__ uint64_t desc_mn_major(const void* start, uint32_t panel_bytes) {
  return uint64_t((smem_u32(start) & 0x3FFFF) >> 4) |
         (uint64_t((panel_bytes >> 4) & 0x3FFF) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

// The descriptor of the operand `bytes` (a multiple of 16) further on: only the start address
// field moves, and as shared-memory addresses stay below 2^18 it never carries into the next
// field. Hot loops take a base descriptor once and advance it by constants, where forming each
// descriptor from its address again costs a dozen instructions a wgmma.
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  return (desc >> 32 << 32) | uint32_t(uint32_t(desc) + (bytes >> 4));
}

// Four 8 × 8 bf16 matrices from accumulator fragments (thread 4g + t: row g, columns 2t and
// 2t + 1, packed) into shared memory transposed: lane 8i + j names the 16-byte row j of matrix
// i's transpose, i.e. column j of matrix i (stmatrix).
__device__ __forceinline__ void stsm_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// Orders this thread's earlier register writes before the next wgmma (required before the first
// wgmma of a batch whose accumulators were touched by ordinary instructions).
__device__ __forceinline__ void fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes this thread's ordinary (and cp.async) shared-memory writes visible to wgmma's reads;
// follow it with a barrier so the other threads' writes are covered too.
__device__ __forceinline__ void fence_shared_for_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Register accumulators must stay put while a wgmma is in flight: this tells the compiler they
// are read and written here.
template <int N>
__device__ __forceinline__ void pin(float (&acc)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// clang-format off
// The 128 fp32 accumulators of an m64n256 wgmma: their operand numbers %0 .. %127 as written in
// the instruction, and the matching read-write operand list of an array `acc`.
#define GLMTUNE_WGMMA_ACC128_REGS \
  "{" \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22," \
  "%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43," \
  "%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64," \
  "%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85," \
  "%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104," \
  "%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120," \
  "%121,%122,%123,%124,%125,%126,%127" \
  "}"
#define GLMTUNE_WGMMA_ACC128_OPERANDS(acc) \
  "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]), "+f"(acc[4]), "+f"(acc[5]), \
  "+f"(acc[6]), "+f"(acc[7]), "+f"(acc[8]), "+f"(acc[9]), "+f"(acc[10]), "+f"(acc[11]), \
  "+f"(acc[12]), "+f"(acc[13]), "+f"(acc[14]), "+f"(acc[15]), "+f"(acc[16]), "+f"(acc[17]), \
  "+f"(acc[18]), "+f"(acc[19]), "+f"(acc[20]), "+f"(acc[21]), "+f"(acc[22]), "+f"(acc[23]), \
  "+f"(acc[24]), "+f"(acc[25]), "+f"(acc[26]), "+f"(acc[27]), "+f"(acc[28]), "+f"(acc[29]), \
  "+f"(acc[30]), "+f"(acc[31]), "+f"(acc[32]), "+f"(acc[33]), "+f"(acc[34]), "+f"(acc[35]), \
  "+f"(acc[36]), "+f"(acc[37]), "+f"(acc[38]), "+f"(acc[39]), "+f"(acc[40]), "+f"(acc[41]), \
  "+f"(acc[42]), "+f"(acc[43]), "+f"(acc[44]), "+f"(acc[45]), "+f"(acc[46]), "+f"(acc[47]), \
  "+f"(acc[48]), "+f"(acc[49]), "+f"(acc[50]), "+f"(acc[51]), "+f"(acc[52]), "+f"(acc[53]), \
  "+f"(acc[54]), "+f"(acc[55]), "+f"(acc[56]), "+f"(acc[57]), "+f"(acc[58]), "+f"(acc[59]), \
  "+f"(acc[60]), "+f"(acc[61]), "+f"(acc[62]), "+f"(acc[63]), "+f"(acc[64]), "+f"(acc[65]), \
  "+f"(acc[66]), "+f"(acc[67]), "+f"(acc[68]), "+f"(acc[69]), "+f"(acc[70]), "+f"(acc[71]), \
  "+f"(acc[72]), "+f"(acc[73]), "+f"(acc[74]), "+f"(acc[75]), "+f"(acc[76]), "+f"(acc[77]), \
  "+f"(acc[78]), "+f"(acc[79]), "+f"(acc[80]), "+f"(acc[81]), "+f"(acc[82]), "+f"(acc[83]), \
  "+f"(acc[84]), "+f"(acc[85]), "+f"(acc[86]), "+f"(acc[87]), "+f"(acc[88]), "+f"(acc[89]), \
  "+f"(acc[90]), "+f"(acc[91]), "+f"(acc[92]), "+f"(acc[93]), "+f"(acc[94]), "+f"(acc[95]), \
  "+f"(acc[96]), "+f"(acc[97]), "+f"(acc[98]), "+f"(acc[99]), "+f"(acc[100]), "+f"(acc[101]), \
  "+f"(acc[102]), "+f"(acc[103]), "+f"(acc[104]), "+f"(acc[105]), "+f"(acc[106]), \
  "+f"(acc[107]), "+f"(acc[108]), "+f"(acc[109]), "+f"(acc[110]), "+f"(acc[111]), \
  "+f"(acc[112]), "+f"(acc[113]), "+f"(acc[114]), "+f"(acc[115]), "+f"(acc[116]), \
  "+f"(acc[117]), "+f"(acc[118]), "+f"(acc[119]), "+f"(acc[120]), "+f"(acc[121]), \
  "+f"(acc[122]), "+f"(acc[123]), "+f"(acc[124]), "+f"(acc[125]), "+f"(acc[126]), \
  "+f"(acc[127])

// acc (64 × 32, fp32) += A · B over one k16 step: A 64 × 16 (MN-major when TRANS_A) and B 32 × 16
// (MN-major when TRANS_B), bf16 in shared memory named by descriptors; with zero_acc the product
// replaces acc. Asynchronous: read acc only after commit() and wait<0>().
template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void mma_m64n32k16(float (&acc)[16], uint64_t desc_a, uint64_t desc_b, bool zero_acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.eq.u32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}"
      ", %16, %17, p, 1, 1, %19, %20;\n}\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]), "+f"(acc[4]), "+f"(acc[5]),
        "+f"(acc[6]), "+f"(acc[7]), "+f"(acc[8]), "+f"(acc[9]), "+f"(acc[10]), "+f"(acc[11]),
        "+f"(acc[12]), "+f"(acc[13]), "+f"(acc[14]), "+f"(acc[15])
      : "l"(desc_a), "l"(desc_b), "r"(uint32_t(zero_acc)), "n"(TRANS_A), "n"(TRANS_B));
}

// acc (64 × 256, fp32) += A · B over one k16 step: A 64 × 16 (MN-major when TRANS_A) and B 16 × 256
// (MN-major when TRANS_B), bf16 in shared memory named by descriptors; with zero_acc the product
// replaces acc. Asynchronous: read acc only after commit() and wait<0>().
template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void mma_m64n256k16(float (&acc)[128], uint64_t desc_a, uint64_t desc_b, bool zero_acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.eq.u32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      GLMTUNE_WGMMA_ACC128_REGS
      ", %128, %129, p, 1, 1, %131, %132;\n}\n"
      : GLMTUNE_WGMMA_ACC128_OPERANDS(acc)
      : "l"(desc_a), "l"(desc_b), "r"(uint32_t(zero_acc)), "n"(TRANS_A), "n"(TRANS_B));
}

// acc (64 × 256, fp32) += A · B over one k16 step with A (64 × 16, bf16) in registers: a thread
// holds the pairs (row g, k 2t), (row g + 8, k 2t), (row g, k 2t + 8), (row g + 8, k 2t + 8) of its
// warp's 16 rows, the layout of an fp32 accumulator's columns 16s .. 16s + 15 packed in pairs; B
// (16 × 256, MN-major when TRANS_B) in shared memory. Asynchronous, like the shared-memory form;
// a and acc must stay untouched until wait().
template <int TRANS_B>
__device__ __forceinline__ void mma_m64n256k16_rs(float (&acc)[128], const uint32_t (&a)[4], uint64_t desc_b, bool zero_acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.eq.u32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      GLMTUNE_WGMMA_ACC128_REGS
      ", {%128,%129,%130,%131}, %132, p, 1, 1, %134;\n}\n"
      : GLMTUNE_WGMMA_ACC128_OPERANDS(acc)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(uint32_t(zero_acc)), "n"(TRANS_B));
}
// acc (64 × 128, fp32) = (or +=, without zero_acc) A · B over one k32 step of e4m3 codes: A 64 × 32
// and B 128 × 32, both K-major in shared memory (FP8 operands have no transposed form), named by
// descriptors. Asynchronous, like the bf16 forms.
__device__ __forceinline__ void mma_m64n128k32_e4m3(float (&acc)[64], uint64_t desc_a, uint64_t desc_b, bool zero_acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.eq.u32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
      "}"
      ", %64, %65, p, 1, 1;\n}\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]), "+f"(acc[4]), "+f"(acc[5]),
        "+f"(acc[6]), "+f"(acc[7]), "+f"(acc[8]), "+f"(acc[9]), "+f"(acc[10]), "+f"(acc[11]),
        "+f"(acc[12]), "+f"(acc[13]), "+f"(acc[14]), "+f"(acc[15]), "+f"(acc[16]),
        "+f"(acc[17]), "+f"(acc[18]), "+f"(acc[19]), "+f"(acc[20]), "+f"(acc[21]),
        "+f"(acc[22]), "+f"(acc[23]), "+f"(acc[24]), "+f"(acc[25]), "+f"(acc[26]),
        "+f"(acc[27]), "+f"(acc[28]), "+f"(acc[29]), "+f"(acc[30]), "+f"(acc[31]),
        "+f"(acc[32]), "+f"(acc[33]), "+f"(acc[34]), "+f"(acc[35]), "+f"(acc[36]),
        "+f"(acc[37]), "+f"(acc[38]), "+f"(acc[39]), "+f"(acc[40]), "+f"(acc[41]),
        "+f"(acc[42]), "+f"(acc[43]), "+f"(acc[44]), "+f"(acc[45]), "+f"(acc[46]),
        "+f"(acc[47]), "+f"(acc[48]), "+f"(acc[49]), "+f"(acc[50]), "+f"(acc[51]),
        "+f"(acc[52]), "+f"(acc[53]), "+f"(acc[54]), "+f"(acc[55]), "+f"(acc[56]),
        "+f"(acc[57]), "+f"(acc[58]), "+f"(acc[59]), "+f"(acc[60]), "+f"(acc[61]),
        "+f"(acc[62]), "+f"(acc[63])
      : "l"(desc_a), "l"(desc_b), "r"(uint32_t(zero_acc)));
}
#undef GLMTUNE_WGMMA_ACC128_REGS
#undef GLMTUNE_WGMMA_ACC128_OPERANDS
// clang-format on

// ---- warp specialisation: mbarriers, named barriers, register reallocation ----------------------

// An mbarrier in shared memory completes a phase once `count` arrivals have been made; waiters
// name the phase by its parity (phase k has parity k mod 2).
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count)
               : "memory");
}
// Makes the barriers' initialisation visible before any thread uses them (follow with a barrier of
// the block).
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Arrives on `bar` once every cp.async this thread issued before has landed; the arrival is one
// of the barrier's initial count (no pending count is added).
__device__ __forceinline__ void mbarrier_arrive_on_cp_async(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar))
               : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_AGAIN:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_AGAIN;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// A barrier of THREADS threads (a multiple of 32) under id (1 .. 15; 0 is __syncthreads').
template <int THREADS>
__device__ __forceinline__ void named_barrier(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(THREADS) : "memory");
}

// Register budget of the calling warpgroup: a producer gives registers back, consumers take them.
template <int REGS>
__device__ __forceinline__ void take_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void give_back_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

}  // namespace glmtune::cuda::wgmma
