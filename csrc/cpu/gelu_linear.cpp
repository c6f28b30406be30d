// Fused bias + GeLU -> matmul on CPU: the second half of a Megatron MLP (Shoeybi et al. 2019), where the
// row-parallel weight reads the column-parallel pre-activation Z directly:
//
//   y[M, N] = gelu(z[M, K] + b[K]) @ w[N, K]^T
//
// Why blocked: eager PyTorch writes z + b and then gelu(z + b) to memory (2 full [M, K] passes) before
// the matmul reads it back, and autograd keeps gelu(z + b) alive until backward. Here the forward computes
// gelu for a block of rows into a small buffer that stays in cache and multiplies it at once (ATen's
// GEMM), so the full activation is never written; the backward recomputes gelu (and gelu') for a block of
// columns at a time from the saved z (for tall inputs, whose column blocks would be too narrow, it recomputes
// gelu whole into a transient buffer instead and runs the GEMMs unsplit). Either way autograd keeps only z:
// half the MLP's [M, K] activations. PYPARALLEL_GELU_LINEAR_BACKWARD=blocked|whole forces one (tests).
//
// The elementwise math runs on float rows with polynomial exp/erf that the compiler vectorizes (one clone
// per ISA level, chosen at load time); double uses the C library for gradcheck-grade accuracy.
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "pyparallel/checks.h"
#include "pyparallel/gelu_linear_args.h"

namespace pyparallel {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;  // tanh form: sqrt(2/pi) (x + 0.044715 x^3)
constexpr float kCubic = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;  // standard normal density at 0
constexpr int64_t kBufferBytes = 512 * 1024;          // forward staging buffer: inside a 1-2 MiB L2
// Backward column blocks: narrower than ~256 columns makes the two GEMMs too skinny to run near peak
// (measured: 128 columns cost 15% over one GEMM, 256 columns 8%), which costs more than the buffers
// (a few MiB, L3-resident) falling out of L2.
constexpr int64_t kBackwardBytes = 4 * 1024 * 1024;

// ------------------------------------------------------------------------ float math (vectorizable)

// exp(x) for x <= 0 with Cody-Waite range reduction and Cephes' degree-6 polynomial (about 1 ulp); branch-free and
// without floor or float-to-int conversion (which keep GCC from vectorizing under -ftrapping-math), so
// `omp simd` loops vectorize it.
inline float exp_f(float x) {
  // Callers pass x <= 0 only (-2|u|, -a^2, -x^2/2). Clamp |x| to 87 on the bit pattern (monotone for
  // non-negative floats): an integer min vectorizes at every ISA level, a float compare does not.
  const float mag = std::fabs(x);
  uint32_t m;
  std::memcpy(&m, &mag, sizeof(m));
  m = m < 0x42AE0000u ? m : 0x42AE0000u;  // 87.0f
  float clamped;
  std::memcpy(&clamped, &m, sizeof(clamped));
  x = -clamped;
  // n = round(x / ln 2) by the 1.5 * 2^23 trick: the sum's low mantissa bits hold n.
  const float shifted = x * 1.44269504088896341f + 12582912.0f;
  const float n = shifted - 12582912.0f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &shifted, sizeof(bits));
  bits = (bits - 0x4B400000 + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

inline float tanh_f(float u) {
  const float t = exp_f(-2.0f * std::fabs(u));  // in (0, 1]: no overflow
  return std::copysign((1.0f - t) / (1.0f + t), u);
}

// Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7), the same approximation ATen's vectorized erf uses.
inline float erf_f(float x) {
  const float a = std::fabs(x);
  const float t = 1.0f / (1.0f + 0.3275911f * a);
  const float poly =
      t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
  return std::copysign(1.0f - poly * exp_f(-a * a), x);
}

// a[i] = gelu(z[i] + b[i]) and, with kGrad, g[i] = gelu'(z[i] + b[i]). Same formulas as ATen's GeluKernel /
// gelu_backward for approximate = "none" (erf) and "tanh". Branch-free loop bodies (the form and kGrad are
// compile-time), so each loop vectorizes.
template <bool kTanh, bool kGrad>
inline void gelu_loop(const float* __restrict__ z, const float* __restrict__ b, float* __restrict__ a,
                      float* __restrict__ g, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float x = z[i] + b[i];
    if constexpr (kTanh) {
      const float th = tanh_f(kSqrt2OverPi * (x + kCubic * x * x * x));
      a[i] = 0.5f * x * (1.0f + th);
      if constexpr (kGrad)
        g[i] = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * kSqrt2OverPi * (1.0f + 3.0f * kCubic * x * x);
    } else {
      const float cdf = 0.5f * (1.0f + erf_f(x * kInvSqrt2));
      a[i] = x * cdf;
      if constexpr (kGrad) g[i] = cdf + x * kInvSqrt2Pi * exp_f(-0.5f * x * x);
    }
  }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void gelu_row_f32(const float* z, const float* b, float* a, float* g, int64_t n, bool tanh_form) {
  if (tanh_form) {
    g ? gelu_loop<true, true>(z, b, a, g, n) : gelu_loop<true, false>(z, b, a, g, n);
  } else {
    g ? gelu_loop<false, true>(z, b, a, g, n) : gelu_loop<false, false>(z, b, a, g, n);
  }
}

// The double twin, with libm functions: used by gradcheck, so it must be accurate rather than fast.
void gelu_row_f64(const double* z, const double* b, double* a, double* g, int64_t n, bool tanh_form) {
  const double k0 = std::sqrt(2.0 / M_PI), k1 = 0.044715, inv_sqrt2 = 1.0 / std::sqrt(2.0);
  for (int64_t i = 0; i < n; ++i) {
    const double x = z[i] + b[i];
    if (tanh_form) {
      const double th = std::tanh(k0 * (x + k1 * x * x * x));
      a[i] = 0.5 * x * (1.0 + th);
      if (g) g[i] = 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * k0 * (1.0 + 3.0 * k1 * x * x);
    } else {
      const double cdf = 0.5 * (1.0 + std::erf(x * inv_sqrt2));
      a[i] = x * cdf;
      if (g) g[i] = cdf + x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI);
    }
  }
}

// y[i] = x[i] * g[i] and colsum[i] += y[i] (the bias gradient accumulates in float).
__attribute__((target_clones("avx512f", "avx2", "default")))
void mul_accumulate(const float* __restrict__ x, const float* __restrict__ g, float* __restrict__ y,
                    float* __restrict__ colsum, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    y[i] = x[i] * g[i];
    colsum[i] += y[i];
  }
}

void mul_accumulate(const double* x, const double* g, double* y, double* colsum, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    y[i] = x[i] * g[i];
    colsum[i] += y[i];
  }
}

// ------------------------------------------------------------------------ dtype <-> float rows

template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

__attribute__((target_clones("avx512f", "avx2", "default")))
void bf16_to_f32(const uint16_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &u, sizeof(float));
  }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void f32_to_bf16(const float* src, uint16_t* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, sizeof(float));
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
    dst[i] = static_cast<uint16_t>(src[i] != src[i] ? 0x7FC0u : rounded);
  }
}

// Returns a pointer to n accumulation-type values of src (src itself when no conversion is needed).
template <typename T>
const acc_t<T>* load_row(const T* src, acc_t<T>* scratch, int64_t n) {
  if constexpr (std::is_same_v<T, acc_t<T>>) {
    return src;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    bf16_to_f32(reinterpret_cast<const uint16_t*>(src), scratch, n);
    return scratch;
  } else {
    for (int64_t i = 0; i < n; ++i) scratch[i] = static_cast<float>(src[i]);
    return scratch;
  }
}

template <typename T>
void store_row(const acc_t<T>* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, acc_t<T>>) {
    if (src != dst) std::memcpy(dst, src, n * sizeof(T));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    f32_to_bf16(src, reinterpret_cast<uint16_t*>(dst), n);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

template <typename A>
void gelu_row(const A* z, const A* b, A* a, A* g, int64_t n, bool tanh_form) {
  if constexpr (std::is_same_v<A, double>) {
    gelu_row_f64(z, b, a, g, n, tanh_form);
  } else {
    gelu_row_f32(z, b, a, g, n, tanh_form);
  }
}

// The bias in the accumulation type (zeros when absent), converted once per call.
template <typename T>
std::vector<acc_t<T>> bias_acc(const std::optional<at::Tensor>& bias, int64_t k) {
  std::vector<acc_t<T>> out(k, acc_t<T>(0));
  if (bias.has_value() && bias->defined()) {
    auto b = bias->contiguous();
    const T* p = b.template data_ptr<T>();
    for (int64_t i = 0; i < k; ++i) out[i] = static_cast<acc_t<T>>(p[i]);
  }
  return out;
}

int64_t block_of(int64_t other_dim, int64_t lo, int64_t hi, int64_t multiple, int64_t bytes = kBufferBytes) {
  int64_t rows = bytes / (4 * std::max<int64_t>(other_dim, 1));
  rows = std::min(std::max(rows, lo), hi);
  return std::max<int64_t>(multiple, rows / multiple * multiple);
}

// ------------------------------------------------------------------------------------- forward

// One parallel region: each thread takes whole row blocks, writes gelu(z + b) for a block into its own
// cache-sized buffer and multiplies it with a single-threaded GEMM (ATen runs nested calls serially).
// Fewer, larger tasks than "parallel elementwise pass, then parallel GEMM" per block: no fork/join per block.
template <typename T>
void forward_impl(const at::Tensor& z, const std::vector<acc_t<T>>& b, const at::Tensor& w, at::Tensor& y,
                  bool tanh_form) {
  using A = acc_t<T>;
  const int64_t m = z.size(0), k = z.size(1);
  // Rows per cache-resident block; at least 64 so that the GEMM is not too flat to run near peak.
  const int64_t mb = std::min(m, block_of(k, 64, 512, 8));
  const int64_t blocks = (m + mb - 1) / mb;
  const T* zp = z.data_ptr<T>();
  const auto wt = w.t();  // [K, N] view
  at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
    // Worker threads do not inherit the caller's "below autograd" dispatch state: set it, so the GEMMs on
    // tensors that require grad are plain kernels here, not autograd calls.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto abuf = at::empty({mb, k}, z.options());  // gelu(z + b) of one row block, this thread's only
    T* ap = abuf.data_ptr<T>();
    std::vector<A> scratch(std::is_same_v<T, A> ? 0 : 2 * k);
    for (int64_t blk = lo; blk < hi; ++blk) {
      const int64_t r0 = blk * mb, rows = std::min(mb, m - r0);
      for (int64_t r = 0; r < rows; ++r) {
        const A* zr = load_row<T>(zp + (r0 + r) * k, scratch.data(), k);
        A* out = std::is_same_v<T, A> ? reinterpret_cast<A*>(ap + r * k) : scratch.data() + k;
        gelu_row<A>(zr, b.data(), out, nullptr, k, tanh_form);
        store_row<T>(out, ap + r * k, k);
      }
      auto y_blk = y.narrow(0, r0, rows);
      at::mm_out(y_blk, abuf.narrow(0, 0, rows), wt);  // [rows, K] @ [K, N] -> [rows, N]
    }
  });
}

at::Tensor gelu_linear_cpu(const at::Tensor& z, const std::optional<at::Tensor>& bias, const at::Tensor& weight,
                           c10::string_view approximate) {
  const char* op = "gelu_linear";
  check_inputs(z, bias, weight, op);
  const bool tanh_form = parse_approximate(approximate, op);
  const int64_t k = z.size(-1), n = weight.size(0);
  auto z2 = z.reshape({leading_rows(z), k}).contiguous();
  auto w = weight.contiguous();
  auto out_shape = z.sizes().vec();
  out_shape.back() = n;
  auto y = at::empty({z2.size(0), n}, z.options());
  if (z2.size(0) > 0) {
    if (k == 0) {
      y.zero_();
    } else {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, z.scalar_type(), "gelu_linear_cpu", [&] {
        forward_impl<scalar_t>(z2, bias_acc<scalar_t>(bias, k), w, y, tanh_form);
      });
    }
  }
  return y.view(out_shape);
}

// ------------------------------------------------------------------------------------ backward

struct Grads {
  at::Tensor dz, db, dw;
};

// Column-blocked, one parallel region: a thread owns whole blocks of columns [k0, k0 + kc). For its block
// it recomputes a = gelu(z + b) and g = gelu'(z + b) for all rows into cache-sized buffers, then
//   dW[:, blk] = dY^T @ a,   dA = dY @ W[:, blk],   dZ[:, blk] = dA * g,   db[blk] = colsum(dZ[:, blk])
// with single-threaded GEMMs. Threads write disjoint columns: no reduction, no accumulation across blocks.
template <typename T>
void backward_impl(const at::Tensor& gy, const at::Tensor& z, const std::vector<acc_t<T>>& b, const at::Tensor& w,
                   bool tanh_form, std::array<bool, 3> mask, Grads& out) {
  using A = acc_t<T>;
  const int64_t m = z.size(0), k = z.size(1), n = w.size(0);
  int64_t kb = std::min(k, block_of(m, 128, 512, 16, kBackwardBytes));
  const int64_t threads = at::get_num_threads();
  if ((k + kb - 1) / kb < threads)  // at least one block per thread
    kb = std::max<int64_t>(16, ((k + threads - 1) / threads + 15) / 16 * 16);
  kb = std::min(k, kb);
  const int64_t blocks = (k + kb - 1) / kb;
  const bool need_dz = mask[0] || mask[1];
  const T* zp = z.data_ptr<T>();
  T* dzp = need_dz ? out.dz.template data_ptr<T>() : nullptr;
  const auto gyt = gy.t();  // [N, M] view
  std::vector<A> db(k, A(0));
  at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // see forward_impl
    auto opts = z.options();
    auto abuf = at::empty({m * kb}, opts);   // gelu(z + b)[:, blk]
    auto dabuf = at::empty({m * kb}, opts);  // (dY @ W)[:, blk]
    auto dwbuf = at::empty({n * kb}, opts);  // dW[:, blk]
    auto gbuf = at::empty({need_dz ? m * kb : 0}, opts.dtype(c10::CppTypeToScalarType<A>::value));  // gelu'
    A* gp = gbuf.template data_ptr<A>();
    std::vector<A> scratch(std::is_same_v<T, A> ? 0 : 2 * kb);
    for (int64_t blk = lo; blk < hi; ++blk) {
      const int64_t k0 = blk * kb, kc = std::min(kb, k - k0);
      auto a_blk = abuf.narrow(0, 0, m * kc).view({m, kc});
      T* ap = a_blk.template data_ptr<T>();
      for (int64_t r = 0; r < m; ++r) {
        const A* zr = load_row<T>(zp + r * k + k0, scratch.data(), kc);
        A* ar = std::is_same_v<T, A> ? reinterpret_cast<A*>(ap + r * kc) : scratch.data() + kb;
        gelu_row<A>(zr, b.data() + k0, ar, need_dz ? gp + r * kc : nullptr, kc, tanh_form);
        store_row<T>(ar, ap + r * kc, kc);
      }
      if (mask[2]) {
        auto dw_blk = dwbuf.narrow(0, 0, n * kc).view({n, kc});
        at::mm_out(dw_blk, gyt, a_blk);  // [N, M] @ [M, kc] -> [N, kc]
        out.dw.narrow(1, k0, kc).copy_(dw_blk);
      }
      if (!need_dz) continue;
      auto da_blk = dabuf.narrow(0, 0, m * kc).view({m, kc});
      at::mm_out(da_blk, gy, w.narrow(1, k0, kc));  // [M, N] @ [N, kc] -> [M, kc]
      const T* dap = da_blk.template data_ptr<T>();
      A* colsum = db.data() + k0;  // this thread's columns only
      for (int64_t r = 0; r < m; ++r) {
        const A* dar = load_row<T>(dap + r * kc, scratch.data(), kc);
        A* dzr = std::is_same_v<T, A> ? reinterpret_cast<A*>(dzp + r * k + k0) : scratch.data() + kb;
        mul_accumulate(dar, gp + r * kc, dzr, colsum, kc);
        store_row<T>(dzr, dzp + r * k + k0, kc);
      }
    }
  });
  if (mask[1]) {
    auto db_t = at::from_blob(db.data(), {k}, at::TensorOptions().dtype(c10::CppTypeToScalarType<A>::value));
    out.db.copy_(db_t);
  }
}

// Unblocked, for problems whose column blocks would not stay in cache anyway: dA = dY @ W as one GEMM
// straight into the dZ buffer, then one elementwise pass that recomputes a = gelu(z + b) and gelu' from z,
// turns dA into dZ in place (with the bias gradient's column sums) and writes a into a transient [M, K]
// buffer (freed on return: autograd still saved only z) for the second whole GEMM, dW = dY^T @ a. Both
// GEMMs run unsplit and multi-threaded; tanh/erf is evaluated once per element.
template <typename T>
void backward_whole(const at::Tensor& gy, const at::Tensor& z, const std::vector<acc_t<T>>& b, const at::Tensor& w,
                    bool tanh_form, std::array<bool, 3> mask, Grads& out) {
  using A = acc_t<T>;
  const int64_t m = z.size(0), k = z.size(1);
  const bool need_dz = mask[0] || mask[1];
  const T* zp = z.data_ptr<T>();
  at::Tensor a = mask[2] ? at::empty({m, k}, z.options()) : at::Tensor();
  T* ap = mask[2] ? a.data_ptr<T>() : nullptr;
  T* dzp = need_dz ? out.dz.template data_ptr<T>() : nullptr;
  if (need_dz) at::mm_out(out.dz, gy, w);  // dA = [M, N] @ [N, K], into the dZ buffer
  // Tasks of `grain` rows; each keeps its own column sums, added in task order afterwards, so the bias
  // gradient does not depend on how tasks land on threads.
  const int64_t grain = std::max<int64_t>(1, 32768 / k);
  const int64_t tasks = (m + grain - 1) / grain;
  std::vector<A> partial(mask[1] ? tasks * k : 0, A(0));
  at::parallel_for(0, tasks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<A> scratch(4 * k);
    A* act = scratch.data();  // gelu(z + b)
    A* grad = act + k;        // gelu'(z + b)
    A* dzr = grad + k;        // this row's dZ
    A* conv = dzr + k;        // a converted input row (bf16 / fp16)
    std::vector<A> discard(mask[1] ? 0 : k);
    for (int64_t task = lo; task < hi; ++task) {
      A* colsum = mask[1] ? partial.data() + task * k : discard.data();
      for (int64_t r = task * grain; r < std::min(m, (task + 1) * grain); ++r) {
        gelu_row<A>(load_row<T>(zp + r * k, conv, k), b.data(), act, need_dz ? grad : nullptr, k, tanh_form);
        if (mask[2]) store_row<T>(act, ap + r * k, k);
        if (need_dz) {
          mul_accumulate(load_row<T>(dzp + r * k, conv, k), grad, dzr, colsum, k);
          store_row<T>(dzr, dzp + r * k, k);
        }
      }
    }
  });
  if (mask[2]) at::mm_out(out.dw, gy.t(), a);  // [N, M] @ [M, K]
  if (mask[1]) {
    std::vector<A> db(k, A(0));
    for (int64_t t = 0; t < tasks; ++t)  // serial: tasks x k additions, small next to the GEMMs
      for (int64_t i = 0; i < k; ++i) db[i] += partial[t * k + i];
    auto db_t = at::from_blob(db.data(), {k}, at::TensorOptions().dtype(c10::CppTypeToScalarType<A>::value));
    out.db.copy_(db_t);
  }
}

// The column-blocked backward keeps its buffers in cache and wins while they fit and the GEMMs stay small;
// beyond that the whole-matrix GEMMs win (benchmarks/tensor_parallel.py measures both sides).
bool use_whole_backward(int64_t m, int64_t k) {
  if (const char* force = std::getenv("PYPARALLEL_GELU_LINEAR_BACKWARD")) {
    if (std::strcmp(force, "whole") == 0) return true;
    if (std::strcmp(force, "blocked") == 0) return false;
  }
  // Blocked runs best with full-width (512-column) blocks; taller problems force narrower blocks (128-256
  // columns at M = 4096-8192), whose skinny GEMMs measured 3-30% slower than the whole-matrix path.
  return block_of(m, 128, 512, 16, kBackwardBytes) < std::min<int64_t>(k, 512);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gelu_linear_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& z, const std::optional<at::Tensor>& bias,
    const at::Tensor& weight, c10::string_view approximate, std::array<bool, 3> output_mask) {
  const char* op = "gelu_linear_backward";
  check_inputs(z, bias, weight, op);
  const bool tanh_form = parse_approximate(approximate, op);
  const int64_t k = z.size(-1), n = weight.size(0);
  PP_CHECK(grad_out.size(-1) == n && leading_rows(grad_out) == leading_rows(z), op, "grad_out has shape ",
           grad_out.sizes(), ", expected z's leading dimensions and ", n);
  const bool has_bias = bias.has_value() && bias->defined();
  std::array<bool, 3> mask = {output_mask[0], output_mask[1] && has_bias, output_mask[2]};
  auto z2 = z.reshape({leading_rows(z), k}).contiguous();
  auto gy = grad_out.reshape({leading_rows(z), n}).to(z.scalar_type()).contiguous();
  auto w = weight.contiguous();
  Grads g;
  // Outputs a caller did not ask for are returned empty (shape [0]) rather than undefined.
  g.dz = mask[0] ? at::empty(z.sizes(), z.options()) : at::empty({0}, z.options());
  g.db = mask[1] ? at::empty({k}, z.options()) : at::empty({0}, z.options());
  g.dw = mask[2] ? at::empty({n, k}, z.options()) : at::empty({0}, z.options());
  // The kernel writes dZ into a contiguous [M, K] buffer even when only db is wanted.
  at::Tensor dz_full = mask[0] ? g.dz.view({z2.size(0), k}) : at::empty({mask[1] ? z2.size(0) : 0, k}, z.options());
  Grads work{dz_full, g.db, g.dw};
  if (z2.size(0) == 0 || k == 0) {
    if (mask[0]) g.dz.zero_();
    if (mask[1]) g.db.zero_();
    if (mask[2]) g.dw.zero_();
    return {g.dz, g.db, g.dw};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, z.scalar_type(), "gelu_linear_backward_cpu", [&] {
    if (use_whole_backward(z2.size(0), k)) {
      backward_whole<scalar_t>(gy, z2, bias_acc<scalar_t>(bias, k), w, tanh_form, mask, work);
    } else {
      backward_impl<scalar_t>(gy, z2, bias_acc<scalar_t>(bias, k), w, tanh_form, mask, work);
    }
  });
  return {g.dz, g.db, g.dw};
}

}  // namespace

TORCH_LIBRARY_IMPL(pyparallel, CPU, m) {
  m.impl("gelu_linear", &gelu_linear_cpu);
  m.impl("gelu_linear_backward", &gelu_linear_backward_cpu);
}

}  // namespace pyparallel
