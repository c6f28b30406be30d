// The Adam / AdamW element update shared by every SIMD level (Kingma & Ba 2015; decoupled weight decay:
// Loshchilov & Hutter 2019), written as the exact sequence of roundings that torch.optim.Adam performs:
//
//   g  = maximize ? -g : g;        g = g + wd * p            (L2, adamw=False: torch's grad.add(p, alpha=wd))
//   p  = p * (1 - lr * wd)                                   (decoupled, adamw=True)
//   m  = lerp(m, g, 1 - beta1)                               (torch's lerp: fma(w, g - m, m) for w < 0.5)
//   v  = v * beta2 + (1 - beta2) * g * g
//   v̂  = amsgrad ? max(v̂, v) : v
//   p  = p + (-step_size * m) / (sqrt(v̂) / sqrt(1 - beta2^t) + eps),   step_size = lr / (1 - beta1^t)
//                                                            (torch's addcdiv: self + (value * t1) / t2)
//
// Every multiply-add is an explicit fma and no plain multiply feeds an add, so nothing is left for the
// compiler to contract (GCC's default -ffp-contract=fast would fuse p * decay + x into one fma in the
// AVX paths only): the scalar, AVX2 and AVX-512 paths give bit-identical results. The one difference from
// torch is sqrt, which is correctly rounded here and not in torch's CPU kernel (about 1 ulp apart).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace pyparallel {
namespace adam {

// Per-call constants, computed once in double (as torch does in Python) and rounded to float.
struct Consts {
  float neg_step_size;  // -lr / (1 - beta1^t)
  float lerp_coeff;     // torch's lerp: w when |w| < 0.5, else w - 1 (then the base is g, not m)
  bool lerp_from_end;
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;  // sqrt(1 - beta2^t)
  float eps;
  float decay;  // 1 - lr * wd with decoupled decay, else 1 (p * 1 is exact)
  float l2;     // wd for L2 (adamw=False), unused otherwise
  bool l2_on;
  bool maximize;
  bool amsgrad;
};

// One tensor's pointers; `g` and `out` are typed by the kernel's template arguments.
struct Piece {
  float* p;
  const void* g;
  float* m;
  float* v;
  float* vmax;  // amsgrad only
  void* out;    // bf16 / fp16 copy of the updated p, or null
};

struct NoOut {};  // the template argument for "no low-precision copy"

template <typename O>
inline constexpr bool kHasOut = !std::is_same_v<O, NoOut>;

// The scalar update of elements [lo, hi). always_inline so that each SIMD path's tail compiles inside that
// path's target (std::fma becomes one instruction there, a correctly rounded libm call in the baseline).
template <typename G, typename O>
__attribute__((always_inline)) inline void scalar_range(const Consts& c, const Piece& pc, int64_t lo, int64_t hi) {
  const G* gp = static_cast<const G*>(pc.g);
  for (int64_t i = lo; i < hi; ++i) {
    float g = static_cast<float>(gp[i]);
    float p = pc.p[i];
    if (c.maximize) g = -g;
    if (c.l2_on) g = std::fma(c.l2, p, g);
    p = std::fma(p, c.decay, -0.0f);  // p * decay, as an fma so it cannot fuse with the add below
    const float m_old = pc.m[i];
    const float m = std::fma(c.lerp_coeff, g - m_old, c.lerp_from_end ? g : m_old);
    const float v = std::fma(c.one_minus_beta2 * g, g, pc.v[i] * c.beta2);
    float vv = v;
    if (c.amsgrad) {
      const float vm = pc.vmax[i];
      vv = vm > v ? vm : v;  // the same NaN rule as _mm*_max_ps(vm, v): the second operand wins
      pc.vmax[i] = vv;
    }
    const float denom = std::sqrt(vv) / c.bc2_sqrt + c.eps;
    p = p + (c.neg_step_size * m) / denom;
    pc.p[i] = p;
    pc.m[i] = m;
    pc.v[i] = v;
    if constexpr (kHasOut<O>) static_cast<O*>(pc.out)[i] = O(p);  // c10: round to nearest even
  }
}

}  // namespace adam
}  // namespace pyparallel
