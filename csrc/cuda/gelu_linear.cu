// Fused bias + GeLU -> matmul on CUDA: y[M, N] = gelu(z[M, K] + b[K]) @ w[N, K]^T, the row-parallel half
// of a Megatron MLP (Shoeybi et al. 2019) reading the column-parallel pre-activation z.
//
// Forward is one tiled GEMM that applies bias + GeLU to the A operand while staging it into shared memory,
// so gelu(z + b) never exists in global memory:
//   * bf16 / fp16 on sm_80+: tensor cores through WMMA (16x16x16 tiles, fp32 accumulators). A 128x128
//     block tile, 8 warps of 64x32, K in steps of 32; the next K tile is loaded into registers while the
//     tensor cores work on the current one, and GeLU is applied on the way from registers to shared memory.
//   * fp32 / fp64 (and 16-bit below sm_80): the same structure on CUDA cores, 64x64 tiles, 4x4 per thread,
//     accumulating in fp32 (fp64 for fp64) -- no TF32, so fp32 matches torch's default matmul precision.
// Backward recomputes gelu(z + b) and gelu'(z + b) from the saved z in one elementwise pass and leaves the
// two matmuls (dA = dY W, dW = dY^T gelu(z + b)) to cuBLAS; the recomputed activation is a transient buffer
// freed before backward returns, so what autograd keeps between the passes is z alone.
// Everything runs on the current stream.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <torch/library.h>

#include "pyparallel/checks.h"
#include "pyparallel/gelu_linear_args.h"

namespace pyparallel {
namespace {

// ----------------------------------------------------------------------------------- GeLU math

__device__ __forceinline__ float gelu_val(float x, bool tanh_form) {
  if (tanh_form) return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
  return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f));
}

__device__ __forceinline__ double gelu_val(double x, bool tanh_form) {
  if (tanh_form) return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
  return 0.5 * x * (1.0 + erf(x * 0.7071067811865476));
}

// gelu'(x), the formulas of ATen's gelu_backward.
template <typename A>
__device__ __forceinline__ A gelu_grad(A x, bool tanh_form) {
  if (tanh_form) {
    const A k0 = A(0.7978845608028654), k1 = A(0.044715);
    const A th = tanh(k0 * (x + k1 * x * x * x));
    return A(0.5) * (A(1) + th) + A(0.5) * x * (A(1) - th * th) * k0 * (A(1) + A(3) * k1 * x * x);
  }
  return A(0.5) * (A(1) + erf(x * A(0.7071067811865476))) + x * A(0.3989422804014327) * exp(A(-0.5) * x * x);
}

// ----------------------------------------------------------------- tensor-core forward (16-bit)

__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

constexpr int kBM = 128, kBN = 128, kBK = 32, kLds = kBK + 8;  // +8: fewer bank conflicts, ldm % 8 == 0
constexpr int kWarpsN = 4, kWM = 64, kWN = 32;                  // 2 x 4 warps, each 64 x 32 = 4 x 2 tiles
constexpr int kThreads = 256;
constexpr int kPer = kBM * kBK / kThreads;                      // elements each thread stages per K tile

template <typename T>
__global__ void __launch_bounds__(kThreads) gelu_linear_wmma_kernel(const T* __restrict__ z, const T* __restrict__ bias,
                                                                     const T* __restrict__ w, T* __restrict__ y,
                                                                     int64_t M, int64_t N, int64_t K, bool tanh_form) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using namespace nvcuda;
  __shared__ __align__(128) T As[kBM * kLds];  // gelu(z + b) tile, [m][k]
  __shared__ __align__(128) T Bs[kBN * kLds];  // w tile, [n][k] = column-major K x N
  __shared__ __align__(128) float Cs[kThreads / 32][16 * 16];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kBM, n0 = static_cast<int64_t>(blockIdx.x) * kBN;

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kWM / 16][kWN / 16];
#pragma unroll
  for (int i = 0; i < kWM / 16; ++i)
#pragma unroll
    for (int j = 0; j < kWN / 16; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  float za[kPer];  // raw z + b of the next tile (GeLU applied when staged)
  T wb[kPer];
  auto load = [&](int64_t k0) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int idx = tid + i * kThreads, r = idx / kBK, c = idx % kBK;  // a warp reads 32 consecutive k
      const int64_t k = k0 + c, gm = m0 + r, gn = n0 + r;
      const bool kin = k < K;
      za[i] = (gm < M && kin) ? to_float(z[gm * K + k]) + (bias ? to_float(bias[k]) : 0.0f) : 0.0f;
      wb[i] = (gn < N && kin) ? w[gn * K + k] : from_float<T>(0.0f);
    }
  };
  auto stage = [&](int64_t k0) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int idx = tid + i * kThreads, r = idx / kBK, c = idx % kBK;
      const bool valid = m0 + r < M && k0 + c < K;  // padding must be 0, and gelu(0 + b) is not
      As[r * kLds + c] = from_float<T>(valid ? gelu_val(za[i], tanh_form) : 0.0f);
      Bs[r * kLds + c] = wb[i];
    }
  };

  const int64_t k_tiles = (K + kBK - 1) / kBK;
  load(0);
  stage(0);
  __syncthreads();
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    if (kt + 1 < k_tiles) load((kt + 1) * kBK);  // global loads in flight during the MMAs below
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa[kWM / 16];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb[kWN / 16];
#pragma unroll
      for (int i = 0; i < kWM / 16; ++i) wmma::load_matrix_sync(fa[i], As + (wm * kWM + i * 16) * kLds + kk, kLds);
#pragma unroll
      for (int j = 0; j < kWN / 16; ++j) wmma::load_matrix_sync(fb[j], Bs + (wn * kWN + j * 16) * kLds + kk, kLds);
#pragma unroll
      for (int i = 0; i < kWM / 16; ++i)
#pragma unroll
        for (int j = 0; j < kWN / 16; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();
    if (kt + 1 < k_tiles) {
      stage((kt + 1) * kBK);
      __syncthreads();
    }
  }
  // Epilogue: each warp stages one 16x16 accumulator at a time and writes it with bounds checks.
#pragma unroll
  for (int i = 0; i < kWM / 16; ++i) {
#pragma unroll
    for (int j = 0; j < kWN / 16; ++j) {
      wmma::store_matrix_sync(Cs[warp], acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      for (int e = lane; e < 256; e += 32) {
        const int64_t gm = m0 + wm * kWM + i * 16 + e / 16, gn = n0 + wn * kWN + j * 16 + e % 16;
        if (gm < M && gn < N) y[gm * N + gn] = from_float<T>(Cs[warp][e]);
      }
      __syncwarp();
    }
  }
#elif defined(__CUDA_ARCH__)
  // Only code for an architecture below sm_80 (PTX JIT-compiled for a newer device) reaches this: the host
  // chose this kernel by the device's capability, so fail the launch rather than leave y unwritten.
  __trap();
#endif
}

// ------------------------------------------------------------------- CUDA-core forward (any dtype)

constexpr int kSB = 64, kSK = 16;

template <typename T, typename A>
__global__ void __launch_bounds__(256) gelu_linear_simt_kernel(const T* __restrict__ z, const T* __restrict__ bias,
                                                                const T* __restrict__ w, T* __restrict__ y,
                                                                int64_t M, int64_t N, int64_t K, bool tanh_form) {
  __shared__ A As[kSK][kSB + 4];  // [k][m]: a thread's 4 rows are adjacent
  __shared__ A Bs[kSK][kSB + 4];  // [k][n]
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kSB, n0 = static_cast<int64_t>(blockIdx.x) * kSB;
  A acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = A(0);
  for (int64_t k0 = 0; k0 < K; k0 += kSK) {
#pragma unroll
    for (int i = 0; i < kSB * kSK / 256; ++i) {
      const int idx = tid + i * 256, r = idx / kSK, c = idx % kSK;
      const int64_t k = k0 + c, gm = m0 + r, gn = n0 + r;
      A a = A(0);
      if (gm < M && k < K) {
        const A x = static_cast<A>(z[gm * K + k]) + (bias ? static_cast<A>(bias[k]) : A(0));
        a = gelu_val(x, tanh_form);
      }
      As[c][r] = a;
      Bs[c][r] = (gn < N && k < K) ? static_cast<A>(w[gn * K + k]) : A(0);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kSK; ++kk) {
      A a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = As[kk][ty * 4 + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx * 4 + j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fma(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t gm = m0 + ty * 4 + i, gn = n0 + tx * 4 + j;
      if (gm < M && gn < N) y[gm * N + gn] = static_cast<T>(acc[i][j]);
    }
  }
}

// ----------------------------------------------------------------------- backward elementwise pass

// dz = da * gelu'(z + b) (written over da) and, when act != nullptr, act = gelu(z + b).
template <typename T, typename A>
__global__ void gelu_backward_kernel(const T* __restrict__ z, const T* __restrict__ bias, T* __restrict__ da_dz,
                                     T* __restrict__ act, int64_t total, int64_t K, bool tanh_form) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const A x = static_cast<A>(z[i]) + (bias ? static_cast<A>(bias[i % K]) : A(0));
    if (da_dz) da_dz[i] = static_cast<T>(static_cast<A>(da_dz[i]) * gelu_grad<A>(x, tanh_form));
    if (act) act[i] = static_cast<T>(gelu_val(x, tanh_form));
  }
}

// --------------------------------------------------------------------------------- host side

template <typename Raw, typename T>
void launch_wmma(const at::Tensor& z, const at::Tensor& b, const at::Tensor& w, at::Tensor& y, bool tanh_form) {
  const int64_t M = z.size(0), K = z.size(1), N = w.size(0);
  const dim3 grid((N + kBN - 1) / kBN, (M + kBM - 1) / kBM);
  const Raw* bp = b.defined() ? reinterpret_cast<const Raw*>(b.data_ptr<T>()) : nullptr;
  gelu_linear_wmma_kernel<Raw><<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const Raw*>(z.data_ptr<T>()), bp, reinterpret_cast<const Raw*>(w.data_ptr<T>()),
      reinterpret_cast<Raw*>(y.data_ptr<T>()), M, N, K, tanh_form);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor gelu_linear_cuda(const at::Tensor& z, const std::optional<at::Tensor>& bias, const at::Tensor& weight,
                            c10::string_view approximate) {
  const char* op = "gelu_linear";
  check_inputs(z, bias, weight, op);
  const bool tanh_form = parse_approximate(approximate, op);
  c10::cuda::CUDAGuard guard(z.device());
  const int64_t K = z.size(-1), N = weight.size(0);
  auto z2 = z.reshape({leading_rows(z), K}).contiguous();
  auto w = weight.contiguous();
  at::Tensor b = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  const int64_t M = z2.size(0);
  auto out_shape = z.sizes().vec();
  out_shape.back() = N;
  auto y = at::empty({M, N}, z.options());
  if (M == 0 || N == 0) return y.view(out_shape);
  if (K == 0) return y.zero_().view(out_shape);
  const bool tensor_cores = at::cuda::getCurrentDeviceProperties()->major >= 8;
  const bool use_wmma = tensor_cores && (z.scalar_type() == at::kBFloat16 || z.scalar_type() == at::kHalf);
  const int64_t tile = use_wmma ? kBM : kSB;  // rows per block of the kernel that runs (grid.y <= 65535)
  PP_CHECK((M + tile - 1) / tile <= 65535, op, M, " rows exceed the kernel's grid (at most ", 65535LL * tile, ")");
  if (tensor_cores && z.scalar_type() == at::kBFloat16) {
    launch_wmma<__nv_bfloat16, at::BFloat16>(z2, b, w, y, tanh_form);
  } else if (tensor_cores && z.scalar_type() == at::kHalf) {
    launch_wmma<__half, at::Half>(z2, b, w, y, tanh_form);
  } else {
    const dim3 grid((N + kSB - 1) / kSB, (M + kSB - 1) / kSB);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, z.scalar_type(), "gelu_linear_cuda", [&] {
      using A = at::opmath_type<scalar_t>;  // float for 16-bit and fp32, double for fp64
      gelu_linear_simt_kernel<scalar_t, A><<<grid, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
          z2.data_ptr<scalar_t>(), b.defined() ? b.data_ptr<scalar_t>() : nullptr, w.data_ptr<scalar_t>(),
          y.data_ptr<scalar_t>(), M, N, K, tanh_form);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return y.view(out_shape);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gelu_linear_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& z, const std::optional<at::Tensor>& bias,
    const at::Tensor& weight, c10::string_view approximate, std::array<bool, 3> output_mask) {
  const char* op = "gelu_linear_backward";
  check_inputs(z, bias, weight, op);
  const bool tanh_form = parse_approximate(approximate, op);
  c10::cuda::CUDAGuard guard(z.device());
  const int64_t K = z.size(-1), N = weight.size(0);
  PP_CHECK(grad_out.size(-1) == N && leading_rows(grad_out) == leading_rows(z), op, "grad_out has shape ",
           grad_out.sizes(), ", expected z's leading dimensions and ", N);
  const bool has_bias = bias.has_value() && bias->defined();
  const bool want_dz = output_mask[0], want_db = output_mask[1] && has_bias, want_dw = output_mask[2];
  auto z2 = z.reshape({leading_rows(z), K}).contiguous();
  auto gy = grad_out.reshape({leading_rows(z), N}).to(z.scalar_type()).contiguous();
  auto w = weight.contiguous();
  at::Tensor b = has_bias ? bias->contiguous() : at::Tensor();
  const int64_t M = z2.size(0), total = M * K;
  auto empty = at::empty({0}, z.options());
  at::Tensor dz = (want_dz || want_db) ? at::mm(gy, w) : at::Tensor();  // dA = dY [M, N] @ W [N, K]
  at::Tensor act = want_dw ? at::empty({M, K}, z.options()) : at::Tensor();
  if (total > 0 && (dz.defined() || act.defined())) {
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, 65535LL * 8);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, z.scalar_type(), "gelu_linear_backward_cuda", [&] {
      using A = at::opmath_type<scalar_t>;
      gelu_backward_kernel<scalar_t, A><<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
          z2.data_ptr<scalar_t>(), has_bias ? b.data_ptr<scalar_t>() : nullptr,
          dz.defined() ? dz.data_ptr<scalar_t>() : nullptr, act.defined() ? act.data_ptr<scalar_t>() : nullptr,
          total, K, tanh_form);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  at::Tensor dw = want_dw ? at::mm(gy.t(), act) : empty;  // dY^T [N, M] @ gelu(z + b) [M, K]
  at::Tensor db = want_db ? dz.sum(0, /*keepdim=*/false, at::toOpMathType(z.scalar_type())).to(z.scalar_type()) : empty;
  return {want_dz ? dz.view(z.sizes()) : empty, db, dw};
}

}  // namespace

TORCH_LIBRARY_IMPL(pyparallel, CUDA, m) {
  m.impl("gelu_linear", &gelu_linear_cuda);
  m.impl("gelu_linear_backward", &gelu_linear_backward_cuda);
}

}  // namespace pyparallel
