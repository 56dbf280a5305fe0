#pragma once
// Status check for cuBLAS / cuBLASLt calls: a failure names the call, the status and the source
// line, like GLMTUNE_CUDA_CHECK does for the runtime.

#include <cublasLt.h>

namespace glmtune {
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* expr, const char* file,
                                     int line);
}

#define GLMTUNE_CUBLAS_CHECK(expr)                                                      \
  do {                                                                                  \
    cublasStatus_t glmtune_cublas_status_ = (expr);                                     \
    if (glmtune_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                \
      ::glmtune::throw_cublas_error(glmtune_cublas_status_, #expr, __FILE__, __LINE__); \
  } while (0)
