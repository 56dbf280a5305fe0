#pragma once
// The clamped SwiGLU's elementwise math (ops/cuda/swiglu.h), shared by its own kernels and the
// kernels that fuse it with a neighbour (the routed experts' backward, ops/cuda/moe.cu), so
// every caller rounds the same expressions the same way.

namespace glmtune::cuda::swiglu_math {

// std::min(g, lim) and std::clamp(u, -lim, lim) spelled out, so a NaN input stays NaN exactly as
// on the CPU (fminf would return the bound instead).
__device__ __forceinline__ float clamp_gate(float g, float lim) { return lim < g ? lim : g; }
__device__ __forceinline__ float clamp_up(float u, float lim) {
  return u < -lim ? -lim : (lim < u ? lim : u);
}

// silu(min(g, lim)) · clamp(u, −lim, lim).
__device__ __forceinline__ float value(float g, float u, float lim) {
  const float a = clamp_gate(g, lim);
  const float b = clamp_up(u, lim);
  return a / (1.0f + expf(-a)) * b;
}

// The gradients of value() for an output gradient d; a clamp passes none outside its bounds.
__device__ __forceinline__ void grads(float g, float u, float d, float lim, float& dg, float& du) {
  const bool gate_free = g < lim;
  const bool up_free = u > -lim && u < lim;
  const float a = gate_free ? g : lim;
  const float b = up_free ? u : clamp_up(u, lim);
  const float s = 1.0f / (1.0f + expf(-a));
  dg = gate_free ? d * b * s * (1.0f + a * (1.0f - s)) : 0.0f;
  du = up_free ? d * (a * s) : 0.0f;
}

}  // namespace glmtune::cuda::swiglu_math
