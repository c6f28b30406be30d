// CPU multi-tensor Adam / AdamW: the host optimizer of ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload:
// Democratizing Billion-Scale Model Training", section 5.1: a SIMD, multi-threaded CPU Adam).
//
// One parallel loop over all elements of all tensors: each thread gets one contiguous share of the
// concatenation and runs the SIMD path of simd::active() over the tensor pieces in it. Each element is
// touched once (read p, g, m, v; write p, m, v and, optionally, a bf16/fp16 copy of p), so the step runs
// at memory bandwidth. The formula and rounding order are in adam_kernel.h.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "pyparallel/adam.h"
#include "pyparallel/adam_kernel.h"
#include "pyparallel/adam_x86.h"
#include "pyparallel/checks.h"
#include "pyparallel/simd.h"

namespace pyparallel {
namespace adam {
namespace {

constexpr const char* kOp = "adam_step";
constexpr int64_t kGrain = 1 << 15;  // elements per thread at least: below this a fork costs more than it saves

using RangeFn = void (*)(const Consts&, const Piece&, int64_t, int64_t);

template <typename G, typename O>
void scalar_path(const Consts& c, const Piece& pc, int64_t lo, int64_t hi) {
  scalar_range<G, O>(c, pc, lo, hi);
}

template <typename G, typename O>
RangeFn pick_for(simd::Level level) {
#if defined(__x86_64__)
  if (level == simd::Level::kAvx512) return &range_avx512<G, O>;
  if (level == simd::Level::kAvx2) return &range_avx2<G, O>;
#endif
  (void)level;
  return &scalar_path<G, O>;
}

template <typename G>
RangeFn pick_out(simd::Level level, c10::optional<at::ScalarType> out) {
  if (!out) return pick_for<G, NoOut>(level);
  if (*out == at::kBFloat16) return pick_for<G, c10::BFloat16>(level);
  return pick_for<G, c10::Half>(level);
}

RangeFn pick(simd::Level level, at::ScalarType grad, c10::optional<at::ScalarType> out) {
  if (grad == at::kBFloat16) return pick_out<c10::BFloat16>(level, out);
  if (grad == at::kHalf) return pick_out<c10::Half>(level, out);
  return pick_out<float>(level, out);
}

void check_state(const at::Tensor& t, const at::Tensor& p, const char* what, size_t i) {
  PP_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), kOp, what, "[", i,
           "] must be a contiguous fp32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
  PP_CHECK(t.numel() == p.numel(), kOp, what, "[", i, "] has ", t.numel(), " elements but params[", i, "] has ",
           p.numel());
}

void check_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                at::TensorList max_exp_avg_sqs, at::TensorList lowp_out, bool amsgrad) {
  const size_t n = params.size();
  check_list_lengths(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, lowp_out, amsgrad);
  for (size_t i = 0; i < n; ++i) {
    const auto& p = params[i];
    check_state(p, p, "params", i);
    const auto& g = grads[i];
    const auto gt = g.scalar_type();
    PP_CHECK(g.device().is_cpu() && g.is_contiguous() && (gt == at::kFloat || gt == at::kBFloat16 || gt == at::kHalf),
             kOp, "grads[", i, "] must be a contiguous fp32/bf16/fp16 CPU tensor, got ", gt, " on ", g.device());
    PP_CHECK(g.numel() == p.numel(), kOp, "grads[", i, "] has ", g.numel(), " elements but params[", i, "] has ",
             p.numel());
    check_state(exp_avgs[i], p, "exp_avgs", i);
    check_state(exp_avg_sqs[i], p, "exp_avg_sqs", i);
    if (amsgrad) check_state(max_exp_avg_sqs[i], p, "max_exp_avg_sqs", i);
    if (!lowp_out.empty()) {
      const auto& o = lowp_out[i];
      PP_CHECK(o.device().is_cpu() && o.is_contiguous() && (o.scalar_type() == at::kBFloat16 || o.scalar_type() == at::kHalf),
               kOp, "lowp_out[", i, "] must be a contiguous bf16/fp16 CPU tensor, got ", o.scalar_type());
      PP_CHECK(o.numel() == p.numel(), kOp, "lowp_out[", i, "] has ", o.numel(), " elements but params[", i,
               "] has ", p.numel());
    }
  }
}

}  // namespace

// The double -> float roundings of torch.optim.Adam's Python scalars (see _single_tensor_adam).
Consts make_consts(int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                   bool maximize, bool amsgrad) {
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  Consts c{};
  c.neg_step_size = static_cast<float>(-(lr / bc1));
  const float w1 = static_cast<float>(1.0 - beta1);
  c.lerp_from_end = std::abs(w1) >= 0.5f;
  c.lerp_coeff = c.lerp_from_end ? w1 - 1.0f : w1;
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.bc2_sqrt = static_cast<float>(std::pow(bc2, 0.5));
  c.eps = static_cast<float>(eps);
  c.decay = (adamw && weight_decay != 0.0) ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  c.l2 = static_cast<float>(weight_decay);
  c.l2_on = !adamw && weight_decay != 0.0;
  c.maximize = maximize;
  c.amsgrad = amsgrad;
  return c;
}

void adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                   at::TensorList max_exp_avg_sqs, at::TensorList lowp_out, int64_t step, double lr, double beta1,
                   double beta2, double eps, double weight_decay, bool adamw, bool maximize, bool amsgrad) {
  PP_CHECK(step >= 1, kOp, "step counts from 1 (the bias correction divides by 1 - beta^step), got ", step);
  check_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, lowp_out, amsgrad);
  const Consts c = make_consts(step, lr, beta1, beta2, eps, weight_decay, adamw, maximize, amsgrad);
  const simd::Level level = simd::active();

  const size_t n = params.size();
  std::vector<Piece> pieces(n);
  std::vector<RangeFn> fns(n);
  std::vector<int64_t> starts(n + 1, 0);  // element offset of each tensor in the concatenation
  for (size_t i = 0; i < n; ++i) {
    c10::optional<at::ScalarType> out_type;
    if (!lowp_out.empty()) out_type = lowp_out[i].scalar_type();
    pieces[i] = {params[i].data_ptr<float>(), grads[i].data_ptr(), exp_avgs[i].data_ptr<float>(),
                 exp_avg_sqs[i].data_ptr<float>(), amsgrad ? max_exp_avg_sqs[i].data_ptr<float>() : nullptr,
                 lowp_out.empty() ? nullptr : lowp_out[i].data_ptr()};
    fns[i] = pick(level, grads[i].scalar_type(), out_type);
    starts[i + 1] = starts[i] + params[i].numel();
  }
  at::parallel_for(0, starts[n], kGrain, [&](int64_t lo, int64_t hi) {
    // The first tensor that ends after lo, then walk forward: a thread's share spans few tensors.
    size_t i = std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin() - 1;
    for (; i < n && starts[i] < hi; ++i) {
      const int64_t s = std::max(lo, starts[i]) - starts[i];
      const int64_t e = std::min(hi, starts[i + 1]) - starts[i];
      if (s < e) fns[i](c, pieces[i], s, e);
    }
  });
}

}  // namespace adam

TORCH_LIBRARY_IMPL(pyparallel, CPU, m) {
  m.impl("adam_step", &adam::adam_step_cpu);
}

}  // namespace pyparallel
