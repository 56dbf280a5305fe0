// CUDA parity for mHC (ops/cuda/mhc.h) against the CPU ops (ops/mhc.h): mhc_pre (post, comb,
// collapsed and the saved statistics), its backward through the Sinkhorn iterations (d streams,
// with and without a residual gradient, and the fn, base and scale gradients), mhc_post and its
// backward, in bf16 storage and in the f32 mode, with bit-identical reruns. Fresh random inputs
// every run (seed printed; GLMTUNE_TEST_SEED reproduces one); the CPU reference runs in f32 on the
// same (bf16-rounded) values; outputs are poisoned with NaN where the API lets the caller own them.
// Skipped where no GPU is visible.

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "glmtune/ops/mhc.h"
#include "glmtune/tensor/tensor.h"
#include "support/cuda_test_support.h"
#ifdef GLMTUNE_WITH_CUDA
#include "glmtune/ops/cuda/mhc.h"
#endif

using namespace glmtune;
using namespace glmtune::test;

namespace {

#ifdef GLMTUNE_WITH_CUDA
struct Case {
  Shape lead;  // token dims
  int64_t d;
  DType dtype;
  double act_bar;    // activations stored in `dtype`
  double param_bar;  // f32 outputs and parameter gradients
  const char* what;
};

void run_case(const Case& c, uint64_t& stream) {
  const int64_t h = 4, m = (2 + h) * h, hd = h * c.d;
  Shape xs = c.lead;
  xs.push_back(h);
  xs.push_back(c.d);
  Shape ys = c.lead;
  ys.push_back(c.d);
  ops::MhcOptions opt;
  // Streams with a per-token scale spread, so rstd matters.
  const Tensor x = random_cpu(xs, c.dtype, stream++, 0.1, 1.5);
  const Tensor fn = random_cpu({m, hd}, DType::f32, stream++, 1.5 / std::sqrt(double(hd)));
  const Tensor base = random_cpu({m}, DType::f32, stream++, 0.5);
  const Tensor scale = random_cpu({3}, DType::f32, stream++, 1.0, 0.3);
  const Tensor xg = x.to(kGpu), fng = fn.to(kGpu), bg = base.to(kGpu), sg = scale.to(kGpu);
  const std::string tag = std::string(", ") + c.what;

  ops::MhcPreSaved cs;
  const ops::MhcPreResult cr = ops::mhc_pre(f32(x), fn, base, scale, opt, &cs);
  ops::MhcPreSaved gs;
  const ops::MhcPreResult gr = cuda::mhc_pre(xg, fng, bg, sg, opt, &gs);
  EXPECT_CLOSE(gr.post, cr.post, c.param_bar, "pre post" + tag);
  EXPECT_CLOSE(gr.comb, cr.comb, c.param_bar, "pre comb (Sinkhorn)" + tag);
  EXPECT_CLOSE(gr.collapsed, cr.collapsed, c.act_bar, "pre collapsed" + tag);
  EXPECT_CLOSE(gs.rstd, cs.rstd, c.param_bar, "pre rstd" + tag);
  EXPECT_CLOSE(gs.mix, cs.mix, c.param_bar, "pre mix" + tag);
  EXPECT_CLOSE(gs.pre, cs.pre, c.param_bar, "pre weights" + tag);
  EXPECT_CLOSE(gs.comb_init, cs.comb_init, c.param_bar, "pre comb_init" + tag);

  Shape ps = c.lead, cms = c.lead;
  ps.push_back(h);
  cms.push_back(h);
  cms.push_back(h);
  const Tensor d_post = random_cpu(ps, DType::f32, stream++);
  const Tensor d_comb = random_cpu(cms, DType::f32, stream++);
  const Tensor d_coll = random_cpu(ys, c.dtype, stream++);
  ops::MhcGrads cgr;
  const Tensor cdx =
      ops::mhc_pre_backward(f32(x), fn, base, scale, opt, &cs, d_post, d_comb, f32(d_coll), cgr);
  ops::MhcGrads ggr;
  ggr.fn = random_cpu({m, hd}, DType::f32, stream++).to(kGpu);
  const Tensor fn0 = ggr.fn.to(Device::cpu());
  const Tensor gdx = cuda::mhc_pre_backward(xg, fng, bg, sg, opt, &gs, d_post.to(kGpu),
                                            d_comb.to(kGpu), d_coll.to(kGpu), ggr);
  EXPECT_CLOSE(gdx, cdx, c.act_bar, "pre backward d streams" + tag);
  EXPECT_CLOSE(minus(ggr.fn, fn0), cgr.fn, c.param_bar, "pre backward d fn (accumulated)" + tag);
  EXPECT_CLOSE(ggr.base, cgr.base, c.param_bar, "pre backward d base" + tag);
  EXPECT_CLOSE(ggr.scale, cgr.scale, c.param_bar, "pre backward d scale" + tag);

  // A residual gradient of the streams, added before the one rounding to the streams' dtype.
  const Tensor residual = random_cpu(xs, c.dtype, stream++);
  ops::MhcGrads cgr_r, ggr_r;
  const Tensor cdx_r = ops::mhc_pre_backward(f32(x), fn, base, scale, opt, &cs, d_post, d_comb,
                                             f32(d_coll), cgr_r, f32(residual));
  const Tensor gdx_r =
      cuda::mhc_pre_backward(xg, fng, bg, sg, opt, &gs, d_post.to(kGpu), d_comb.to(kGpu),
                             d_coll.to(kGpu), ggr_r, residual.to(kGpu));
  EXPECT_CLOSE(gdx_r, cdx_r, c.act_bar, "pre backward d streams + residual" + tag);
  EXPECT_CLOSE(ggr_r.fn, cgr.fn, c.param_bar, "pre backward d fn, unchanged by a residual" + tag);

  // Rerun without saved tensors: recomputed, bit-identical.
  ops::MhcGrads ggr2;
  ggr2.fn = fn0.to(kGpu);
  const Tensor gdx2 = cuda::mhc_pre_backward(xg, fng, bg, sg, opt, nullptr, d_post.to(kGpu),
                                             d_comb.to(kGpu), d_coll.to(kGpu), ggr2);
  EXPECT_TRUE(bit_identical(gdx, gdx2)) << ctx("pre backward rerun d streams" + tag);
  EXPECT_TRUE(bit_identical(ggr.fn, ggr2.fn)) << ctx("pre backward rerun d fn" + tag);
  EXPECT_TRUE(bit_identical(ggr.scale, ggr2.scale)) << ctx("pre backward rerun d scale" + tag);

  // Only the collapse path (undefined d post / d comb).
  ops::MhcGrads cgr3, ggr3;
  const Tensor cdx3 = ops::mhc_pre_backward(f32(x), fn, base, scale, opt, &cs, Tensor(), Tensor(),
                                            f32(d_coll), cgr3);
  const Tensor gdx3 =
      cuda::mhc_pre_backward(xg, fng, bg, sg, opt, &gs, Tensor(), Tensor(), d_coll.to(kGpu), ggr3);
  EXPECT_CLOSE(gdx3, cdx3, c.act_bar, "pre backward, collapse path only" + tag);
  EXPECT_CLOSE(ggr3.base, cgr3.base, c.param_bar, "pre backward d base, collapse only" + tag);

  // post and its backward on the GPU's own mixing weights.
  const Tensor y = random_cpu(ys, c.dtype, stream++);
  const Tensor post = gr.post.to(Device::cpu()), comb = gr.comb.to(Device::cpu());
  const Tensor cpost = ops::mhc_post(f32(x), f32(y), post, comb);
  const Tensor gpost = cuda::mhc_post(xg, y.to(kGpu), gr.post, gr.comb);
  EXPECT_CLOSE(gpost, cpost, c.act_bar, "post" + tag);
  const Tensor dout = random_cpu(xs, c.dtype, stream++);
  const ops::MhcPostGrads cpg = ops::mhc_post_backward(f32(x), f32(y), post, comb, f32(dout));
  const ops::MhcPostGrads gpg =
      cuda::mhc_post_backward(xg, y.to(kGpu), gr.post, gr.comb, dout.to(kGpu));
  EXPECT_CLOSE(gpg.d_streams, cpg.d_streams, c.act_bar, "post backward d streams" + tag);
  EXPECT_CLOSE(gpg.d_y, cpg.d_y, c.act_bar, "post backward d y" + tag);
  EXPECT_CLOSE(gpg.d_post, cpg.d_post, c.param_bar, "post backward d post" + tag);
  EXPECT_CLOSE(gpg.d_comb, cpg.d_comb, c.param_bar, "post backward d comb" + tag);
  const ops::MhcPostGrads gpg2 =
      cuda::mhc_post_backward(xg, y.to(kGpu), gr.post, gr.comb, dout.to(kGpu));
  EXPECT_TRUE(bit_identical(gpg.d_comb, gpg2.d_comb)) << ctx("post backward rerun" + tag);
}
#endif

}  // namespace

TEST(CudaOpsMhc, PreAndPostForwardBackwardMatchCpu) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  uint64_t stream = 1;
  const Case cases[] = {
      {{2, 37}, 256, DType::bf16, 1e-2, 1e-3, "bf16, [2, 37] tokens, D 256"},
      {{131}, 512, DType::bf16, 1e-2, 1e-3, "bf16, 131 tokens (partial token tiles), D 512"},
      {{70}, 128, DType::f32, 1e-4, 1e-4, "f32 mode, 70 tokens, D 128"},
      // Three column tiles of 64 over H·D = 192: tiles cross the streams, and no run of several.
      {{45}, 48, DType::bf16, 1e-2, 1e-3, "bf16, 45 tokens, D 48"},
  };
  for (const Case& c : cases) run_case(c, stream);
#endif
}

TEST(CudaOpsMhc, BadArgumentsAreRejected) {
  REQUIRE_GPU();
#ifdef GLMTUNE_WITH_CUDA
  ops::MhcOptions opt;
  const Tensor fn = Tensor::zeros({24, 4 * 64}, DType::f32, kGpu);
  const Tensor base = Tensor::zeros({24}, DType::f32, kGpu);
  const Tensor scale = Tensor::zeros({3}, DType::f32, kGpu);
  EXPECT_THROW(cuda::mhc_pre(Tensor::zeros({5, 3, 64}, DType::bf16, kGpu), fn, base, scale, opt),
               InternalError);
  EXPECT_THROW(cuda::mhc_pre(Tensor::zeros({5, 4, 32}, DType::bf16, kGpu), fn, base, scale, opt),
               InternalError);
#endif
}
