// What the Adam kernels share across translation units: the per-call constants, used by the CPU and CUDA
// kernels alike so that both round torch's Python scalars the same way, and the checks of the tensor lists
// both receive, so that both reject bad input with the same message.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "pyparallel/adam_kernel.h"
#include "pyparallel/checks.h"

namespace pyparallel {
namespace adam {

Consts make_consts(int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                   bool maximize, bool amsgrad);

// One tensor per parameter in every list (max_exp_avg_sqs only with amsgrad; lowp_out empty or full).
inline void check_list_lengths(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                               at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList lowp_out,
                               bool amsgrad) {
  constexpr const char* kOp = "adam_step";
  const size_t n = params.size();
  PP_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n, kOp, "list lengths differ: ", n,
           " params, ", grads.size(), " grads, ", exp_avgs.size(), " exp_avgs, ", exp_avg_sqs.size(), " exp_avg_sqs");
  PP_CHECK(!amsgrad || max_exp_avg_sqs.size() == n, kOp, "amsgrad needs one max_exp_avg_sq per param, got ",
           max_exp_avg_sqs.size(), " for ", n, " params");
  PP_CHECK(lowp_out.empty() || lowp_out.size() == n, kOp, "lowp_out must be empty or hold one tensor per param, got ",
           lowp_out.size(), " for ", n);
}

}  // namespace adam
}  // namespace pyparallel
