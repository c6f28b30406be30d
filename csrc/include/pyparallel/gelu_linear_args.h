// Argument checks of the fused gelu_linear op, shared by its CPU and CUDA kernels (csrc/cpu/gelu_linear.cpp,
// csrc/cuda/gelu_linear.cu) so that both reject bad input with the same message.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "pyparallel/checks.h"

namespace pyparallel {

// "tanh" -> true, "none" -> false; anything else names the op and the value.
inline bool parse_approximate(c10::string_view approximate, const char* op) {
  PP_CHECK(approximate == "none" || approximate == "tanh", op, "approximate must be 'none' or 'tanh', got '",
           std::string(approximate), "'");
  return approximate == "tanh";
}

inline void check_inputs(const at::Tensor& z, const std::optional<at::Tensor>& bias, const at::Tensor& weight,
                         const char* op) {
  PP_CHECK(z.dim() >= 1, op, "z must have at least one dimension");
  PP_CHECK(weight.dim() == 2, op, "weight must be 2-D [out_features, in_features], got shape ", weight.sizes());
  PP_CHECK(z.size(-1) == weight.size(1), op, "z's last dimension (", z.size(-1),
           ") must equal weight.size(1) (", weight.size(1), ")");
  PP_CHECK(z.scalar_type() == weight.scalar_type(), op, "z is ", z.scalar_type(), " but weight is ",
           weight.scalar_type());
  check_same_device(z, weight, op);
  if (bias.has_value() && bias->defined()) {
    PP_CHECK(bias->dim() == 1 && bias->size(0) == z.size(-1), op, "bias must have shape [", z.size(-1),
             "], got ", bias->sizes());
    PP_CHECK(bias->scalar_type() == z.scalar_type(), op, "bias is ", bias->scalar_type(), " but z is ",
             z.scalar_type());
    check_same_device(z, *bias, op);
  }
}

}  // namespace pyparallel
