#pragma once
// Device dispatch of the ops. Every op in ops/*.h is one function for every device: its CPU body
// (ops/cpu/) starts with GLMTUNE_DISPATCH_CUDA, which hands tensors that live on a CUDA device to
// the op's CUDA path (ops/cuda/dispatch.h) with the same arguments. The model code above the ops
// therefore runs unchanged on either device.
//
// On the GPU the op contract is the same with the storage policy of the CUDA backend: activations
// and weights bf16 (the fp32-kept parameters, model::is_fp32_kept, stay f32), reductions and
// parameter gradients f32. A CUDA tensor cannot exist in a build without the backend, so the macro
// is empty there.

#ifdef GLMTUNE_WITH_CUDA
#include "glmtune/ops/cuda/dispatch.h"
#define GLMTUNE_DISPATCH_CUDA(tensor, call) \
  do {                                      \
    if ((tensor).device().is_cuda()) {      \
      return call;                          \
    }                                       \
  } while (0)
#else
#define GLMTUNE_DISPATCH_CUDA(tensor, call) \
  do {                                      \
  } while (0)
#endif
