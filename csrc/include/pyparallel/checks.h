// Argument checks shared by every kernel: each failure names the op and the offending value, so a
// user reading the Python traceback knows which tensor to fix.
#pragma once

// Only the Tensor class and TORCH_CHECK: ATen/ATen.h (every op) triples a translation unit's compile time.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#define PP_CHECK(cond, op, ...) TORCH_CHECK(cond, "pyparallel::", op, ": ", __VA_ARGS__)

namespace pyparallel {

inline void check_contiguous(const at::Tensor& t, const char* op, const char* name) {
  PP_CHECK(t.is_contiguous(), op, name, " must be contiguous (got strides ", t.strides(), ")");
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op) {
  PP_CHECK(a.device() == b.device(), op, "tensors on different devices: ", a.device(), " and ", b.device());
}

// Rows of ``t`` seen as a [rows, t.size(-1)] matrix: the product of its leading dimensions. Unlike
// reshape({-1, k}), this is defined when the last dimension is 0.
inline int64_t leading_rows(const at::Tensor& t) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  return rows;
}

// Sum of numels, checked against the flat buffer's size.
inline int64_t total_numel(at::TensorList tensors) {
  int64_t n = 0;
  for (const auto& t : tensors) n += t.numel();
  return n;
}

}  // namespace pyparallel
