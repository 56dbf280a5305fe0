#include "glmtune/train/step_metrics.h"

#include "glmtune/train/flops.h"

namespace glmtune::train {

StepMetrics step_metrics(const StepResult& r, double mtp_scale,
                         const std::vector<model::text::PackInput>& packs, int64_t text_tokens,
                         int64_t slots, std::chrono::steady_clock::time_point start,
                         const model::TextConfig& tc, bool mtp, const ParallelLayout& layout,
                         ThroughputMeter& meter) {
  StepMetrics m;
  m.step = r.step;
  m.total_steps = r.total_steps;
  m.epoch = r.epoch;
  m.loss = r.lm_loss;
  double mtp_mean = 0;
  for (size_t k = 0; k < r.mtp_loss_sums.size(); ++k)
    mtp_mean += r.mtp_loss_sums[k] / r.mtp_denominators[k];
  m.mtp_loss =
      r.mtp_loss_sums.empty() ? 0.0 : mtp_scale * mtp_mean / double(r.mtp_loss_sums.size());
  m.balancing_loss = r.balancing_loss;
  m.grad_norm = r.grad_norm;
  m.lr = r.lr;
  m.maxvio = r.maxvio;
  m.skipped = r.skipped;
  m.nonfinite = r.nonfinite;
  const MemoryPeaks peaks = take_memory_peaks(layout.device);
  m.max_memory = peaks.max_memory;
  m.reserved_memory = peaks.reserved_memory;
  // Throughput per rank (tgs is per GPU-second): this rank's share of the step's tokens.
  meter.record(m, text_tokens / layout.dp, slots / layout.dp,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  // Model FLOPs per rank and second: the step's packs (their documents, padding left out) over
  // every rank of the job.
  double step_flops = 0;
  for (const model::text::PackInput& in : packs) {
    const Tensor cu = in.cu_seqlens.to(DType::i64).contiguous();
    std::vector<int64_t> lengths;
    for (int64_t d = 0; d + 1 < cu.numel(); ++d)
      lengths.push_back(cu.data<int64_t>()[d + 1] - cu.data<int64_t>()[d]);
    if (in.padding_tokens > 0 && !lengths.empty()) lengths.pop_back();
    int64_t tokens = 0;
    for (int64_t n : lengths) tokens += n;
    step_flops += count_flops(tc, lengths, mtp).step(tokens);
  }
  m.model_tflops = m.step_time > 0 ? step_flops / double(layout.ranks()) / m.step_time / 1e12 : 0.0;
  if (layout.on_gpu) m.mfu = m.model_tflops / kH200Bf16PeakTflops;
  if (layout.on_gpu && layout.distributed) m.comm_time = layout.par->take_gpu_busy_seconds();
  return m;
}

}  // namespace glmtune::train
