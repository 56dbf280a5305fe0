#pragma once
// For the harnesses that build with the CUDA toolkit alone (bench/*_wgmma.cu): stop at the first
// failed runtime call, naming it and the line.

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define STANDALONE_CUDA_CHECK(x)                                                        \
  do {                                                                                  \
    cudaError_t e = (x);                                                                \
    if (e != cudaSuccess) {                                                             \
      printf("CUDA %s at %s:%d (%s)\n", cudaGetErrorString(e), __FILE__, __LINE__, #x); \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)
