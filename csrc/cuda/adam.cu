// CUDA fused multi-tensor Adam / AdamW: the same op and formula as csrc/cpu/adam.cpp (see adam_kernel.h for
// the rounding order), for optimizer states that stay on the GPU. One launch updates every tensor of the
// list: the host builds a table of per-tensor pointers and dtypes plus, for each block, the first table
// entry its chunk overlaps; one async copy ships it on the current stream.
//
// Math is fp32. Params may be fp32, bf16 or fp16 (state is fp32 either way); grads fp32/bf16/fp16; an
// optional bf16/fp16 copy of the updated param is written in the same pass.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "pyparallel/adam.h"
#include "pyparallel/checks.h"

namespace pyparallel {
namespace {

constexpr const char* kOp = "adam_step";
constexpr int kThreads = 256;
constexpr int64_t kChunk = kThreads * 8;  // elements per block

enum DType : int32_t { kNone = -1, kF32 = 0, kBF16 = 1, kF16 = 2 };

struct Entry {
  int64_t p, g, m, v, vmax, out;  // addresses (vmax, out: 0 when unused)
  int64_t offset, numel;          // element offset in the concatenation, length
  int32_t p_type, g_type, out_type, pad;
};

// The dtype switches are uniform across a block's tensor, so they cost a predictable branch, not divergence.
__device__ __forceinline__ float load_as_float(int64_t base, int32_t type, int64_t i) {
  if (type == kBF16) return static_cast<float>(reinterpret_cast<const c10::BFloat16*>(base)[i]);
  if (type == kF16) return static_cast<float>(reinterpret_cast<const c10::Half*>(base)[i]);
  return reinterpret_cast<const float*>(base)[i];
}

__device__ __forceinline__ void store_from_float(int64_t base, int32_t type, int64_t i, float x) {
  if (type == kBF16) reinterpret_cast<c10::BFloat16*>(base)[i] = c10::BFloat16(x);
  else if (type == kF16) reinterpret_cast<c10::Half*>(base)[i] = c10::Half(x);
  else reinterpret_cast<float*>(base)[i] = x;
}

// The element update of adam_kernel.h, written with explicitly rounded intrinsics so nvcc's fma contraction
// cannot change it: the result equals the CPU kernel's bit for bit.
__device__ __forceinline__ void update(const Entry& e, const adam::Consts& c, int64_t i) {
  float g = load_as_float(e.g, e.g_type, i);
  float p = load_as_float(e.p, e.p_type, i);
  if (c.maximize) g = -g;
  if (c.l2_on) g = __fmaf_rn(c.l2, p, g);
  p = __fmul_rn(p, c.decay);  // rounded on its own, as on the CPU
  float* m_ptr = reinterpret_cast<float*>(e.m);
  float* v_ptr = reinterpret_cast<float*>(e.v);
  const float m_old = m_ptr[i];
  const float m = __fmaf_rn(c.lerp_coeff, __fsub_rn(g, m_old), c.lerp_from_end ? g : m_old);
  const float v = __fmaf_rn(__fmul_rn(c.one_minus_beta2, g), g, __fmul_rn(v_ptr[i], c.beta2));
  float vv = v;
  if (c.amsgrad) {
    float* vmax_ptr = reinterpret_cast<float*>(e.vmax);
    const float vm = vmax_ptr[i];
    vv = vm > v ? vm : v;
    vmax_ptr[i] = vv;
  }
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vv), c.bc2_sqrt), c.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(c.neg_step_size, m), denom));
  store_from_float(e.p, e.p_type, i, p);
  m_ptr[i] = m;
  v_ptr[i] = v;
  if (e.out_type != kNone) store_from_float(e.out, e.out_type, i, p);
}

__global__ void adam_kernel(const Entry* table, const int32_t* first_entry, int32_t n_entries, adam::Consts c) {
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t hi = lo + kChunk;
  for (int32_t k = first_entry[blockIdx.x]; k < n_entries; ++k) {
    const Entry e = table[k];
    if (e.offset >= hi) break;
    const int64_t s = max(lo, e.offset) - e.offset;
    const int64_t stop = min(hi, e.offset + e.numel) - e.offset;
    for (int64_t i = s + threadIdx.x; i < stop; i += blockDim.x) update(e, c, i);
  }
}

int32_t type_code(const at::Tensor& t, bool state, const char* what, size_t i) {
  const auto st = t.scalar_type();
  PP_CHECK(t.is_cuda() && t.is_contiguous(), kOp, what, "[", i, "] must be a contiguous CUDA tensor");
  if (st == at::kFloat) return kF32;
  PP_CHECK(!state, kOp, what, "[", i, "] must be fp32 (optimizer state), got ", st);
  if (st == at::kBFloat16) return kBF16;
  PP_CHECK(st == at::kHalf, kOp, what, "[", i, "] must be fp32, bf16 or fp16, got ", st);
  return kF16;
}

int64_t address(const at::Tensor& t, const at::Tensor& p, const char* what, size_t i) {
  PP_CHECK(t.numel() == p.numel(), kOp, what, "[", i, "] has ", t.numel(), " elements but params[", i, "] has ",
           p.numel());
  check_same_device(t, p, kOp);
  return reinterpret_cast<int64_t>(t.data_ptr());
}

std::vector<Entry> build_table(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                               at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList lowp_out,
                               bool amsgrad) {
  const size_t n = params.size();
  adam::check_list_lengths(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, lowp_out, amsgrad);
  std::vector<Entry> table;
  table.reserve(n);
  int64_t offset = 0;
  for (size_t i = 0; i < n; ++i) {
    const auto& p = params[i];
    Entry e{};
    e.p_type = type_code(p, false, "params", i);
    check_same_device(p, params[0], kOp);  // one launch serves one device
    e.g_type = type_code(grads[i], false, "grads", i);
    type_code(exp_avgs[i], true, "exp_avgs", i);
    type_code(exp_avg_sqs[i], true, "exp_avg_sqs", i);
    e.p = reinterpret_cast<int64_t>(p.data_ptr());
    e.g = address(grads[i], p, "grads", i);
    e.m = address(exp_avgs[i], p, "exp_avgs", i);
    e.v = address(exp_avg_sqs[i], p, "exp_avg_sqs", i);
    if (amsgrad) {
      type_code(max_exp_avg_sqs[i], true, "max_exp_avg_sqs", i);
      e.vmax = address(max_exp_avg_sqs[i], p, "max_exp_avg_sqs", i);
    }
    e.out_type = kNone;
    if (!lowp_out.empty()) {
      e.out_type = type_code(lowp_out[i], false, "lowp_out", i);
      PP_CHECK(e.out_type != kF32, kOp, "lowp_out[", i, "] must be bf16 or fp16, got fp32");
      e.out = address(lowp_out[i], p, "lowp_out", i);
    }
    e.offset = offset;
    e.numel = p.numel();
    offset += p.numel();
    if (e.numel > 0) table.push_back(e);
  }
  return table;
}

void adam_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                    at::TensorList max_exp_avg_sqs, at::TensorList lowp_out, int64_t step, double lr, double beta1,
                    double beta2, double eps, double weight_decay, bool adamw, bool maximize, bool amsgrad) {
  PP_CHECK(step >= 1, kOp, "step counts from 1 (the bias correction divides by 1 - beta^step), got ", step);
  std::vector<Entry> table = build_table(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, lowp_out, amsgrad);
  if (table.empty()) return;
  const adam::Consts c = adam::make_consts(step, lr, beta1, beta2, eps, weight_decay, adamw, maximize, amsgrad);
  c10::cuda::CUDAGuard guard(params[0].device());
  const int64_t total = table.back().offset + table.back().numel;
  const int64_t n_blocks = (total + kChunk - 1) / kChunk;
  std::vector<int32_t> first(n_blocks);
  size_t k = 0;
  for (int64_t b = 0; b < n_blocks; ++b) {
    while (table[k].offset + table[k].numel <= b * kChunk) ++k;
    first[b] = static_cast<int32_t>(k);
  }
  // Pinned staging makes the table upload async on the current stream; the caching host allocator keeps
  // the block alive until the stream has consumed it.
  const int64_t table_bytes = static_cast<int64_t>(table.size() * sizeof(Entry));
  const int64_t first_bytes = static_cast<int64_t>(first.size() * sizeof(int32_t));
  auto host = at::empty({table_bytes + first_bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), table.data(), table_bytes);
  std::memcpy(static_cast<char*>(host.data_ptr()) + table_bytes, first.data(), first_bytes);
  auto dev = host.to(params[0].device(), /*non_blocking=*/true);
  const auto* d_table = reinterpret_cast<const Entry*>(dev.data_ptr());
  const auto* d_first = reinterpret_cast<const int32_t*>(static_cast<char*>(dev.data_ptr()) + table_bytes);
  adam_kernel<<<n_blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      d_table, d_first, static_cast<int32_t>(table.size()), c);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(pyparallel, CUDA, m) {
  m.impl("adam_step", &adam_step_cuda);
}

}  // namespace pyparallel
