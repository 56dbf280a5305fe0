#pragma once
// Device dispatch of the ops. The ops of ops/*.h come in two kinds:
//
//   - leaf ops (linear, the norms, the conv, the gates, the attention and delta-rule cores, ...)
//     have a CPU body (ops/cpu/) and a CUDA body (ops/cuda/dispatch.h). The CPU body starts with
//     GLMTUNE_DISPATCH_CUDA, which hands tensors that live on a CUDA device to the CUDA body with
//     the same arguments; a leaf op without a CUDA body starts with GLMTUNE_CPU_ONLY instead, so
//     a GPU tensor gets a message rather than a CPU kernel reading device memory.
//   - composite ops (the KDA mixer, the MLA/DSA block, the MLP; ops/composite/) are written once
//     on top of the leaf ops and run unchanged on either device. Where a device has a fused form
//     of part of a composite (the absorbed-latent MLA attention on the GPU), a leaf op chooses it.
//
// On the GPU the op contract is the same with the storage policy of the CUDA backend: activations
// and weights bf16 (the fp32-kept parameters, model::is_fp32_kept, stay f32), reductions and
// parameter gradients f32. A CUDA tensor cannot exist in a build without the backend, so the
// macros are empty there.

#include "glmtune/base/error.h"
#include "glmtune/tensor/tensor.h"

#ifdef GLMTUNE_WITH_CUDA
#include "glmtune/ops/cuda/dispatch.h"
#define GLMTUNE_DISPATCH_CUDA(tensor, call) \
  do {                                      \
    if ((tensor).device().is_cuda()) {      \
      return call;                          \
    }                                       \
  } while (0)
// Times the enclosing composite in `glmtune bench step`'s per-op breakdown when `tensor` is on a
// CUDA device (ops/cuda/dispatch.h, enable_op_timing).
#define GLMTUNE_TIME_OP(name, tensor) \
  ::glmtune::ops::cuda_path::OpTimer glmtune_op_timer_((name), (tensor).device().is_cuda())
#else
#define GLMTUNE_DISPATCH_CUDA(tensor, call) \
  do {                                      \
  } while (0)
#define GLMTUNE_TIME_OP(name, tensor) \
  do {                                \
  } while (0)
#endif

// A leaf op that only has a CPU body refuses tensors on another device.
#define GLMTUNE_CPU_ONLY(op, tensor)                                                       \
  do {                                                                                     \
    if ((tensor).defined() && !(tensor).device().is_cpu())                                 \
      throw ::glmtune::Error(                                                              \
          fmt::format("{} has no GPU implementation, got {}", (op), (tensor).str()), (op), \
          "run this step on the CPU (device = \"cpu\")");                                  \
  } while (0)

namespace glmtune::ops {

// Document offsets in the form the ops of `like`'s device read: unchanged on the CPU (int32 or
// int64), int32 on the device on a GPU, so that a composite converts them once rather than every
// leaf op once per call.
Tensor cu_seqlens_for(const Tensor& cu_seqlens, const Tensor& like);

// The dtype in which a composite sums several input gradients before rounding them once: the
// tensor's own dtype on the CPU, f32 on a GPU (where activations are bf16).
DType gradient_sum_dtype(const Tensor& like);

}  // namespace glmtune::ops
