// CUDA multi-tensor flatten / unflatten. One launch copies every tensor of a bucket: the host builds a
// table of (pointer, numel, flat offset) and of the tensor each block starts in, ships it with one
// async copy on the current stream, and each block walks its share of the concatenation.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "pyparallel/checks.h"

namespace pyparallel {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = kThreads * 16;  // elements per block

struct alignas(16) Word16 {  // complex128's 16 bytes, copied as one
  uint64_t lo, hi;
};

struct Entry {
  int64_t ptr;     // address of the tensor's first element
  int64_t offset;  // element offset in the flat buffer
  int64_t numel;
};

// Each block copies elements [blockIdx.x * kChunk, +kChunk) of the concatenation; first_entry[b] is the
// first table entry that overlaps that range.
template <typename T, bool kToFlat>
__global__ void multi_copy_kernel(const Entry* table, const int32_t* first_entry, int32_t n_entries, T* flat) {
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t hi = lo + kChunk;
  for (int32_t e = first_entry[blockIdx.x]; e < n_entries; ++e) {
    const Entry ent = table[e];
    if (ent.offset >= hi) break;
    const int64_t s = max(lo, ent.offset);
    const int64_t stop = min(hi, ent.offset + ent.numel);
    T* other = reinterpret_cast<T*>(ent.ptr);
    for (int64_t i = s + threadIdx.x; i < stop; i += blockDim.x) {
      if (kToFlat) {
        flat[i] = other[i - ent.offset];
      } else {
        other[i - ent.offset] = flat[i];
      }
    }
  }
}

template <bool kToFlat>
void multi_copy(at::TensorList tensors, const at::Tensor& flat, const char* op) {
  PP_CHECK(flat.dim() == 1 && flat.is_contiguous(), op, "flat buffer must be 1-D and contiguous, got ", flat.sizes());
  bool fast = true;
  int64_t total = 0;
  for (const auto& t : tensors) {
    // A conjugate or negative view's bits are not its values: copy_ resolves them.
    fast = fast && t.is_contiguous() && t.scalar_type() == flat.scalar_type() && t.device() == flat.device() &&
           !t.is_conj() && !t.is_neg();
    total += t.numel();
  }
  PP_CHECK(total <= flat.numel(), op, "tensors hold ", total, " elements but the flat buffer only ", flat.numel());
  fast = fast && !flat.is_conj() && !flat.is_neg();
  if (!fast || tensors.empty() || total == 0) {  // casts and strided views: let copy_ handle them
    int64_t off = 0;
    for (const auto& t : tensors) {
      auto view = flat.narrow(0, off, t.numel()).view(t.sizes());
      if (kToFlat) view.copy_(t); else t.copy_(view);
      off += t.numel();
    }
    return;
  }
  c10::cuda::CUDAGuard guard(flat.device());
  const int64_t n_blocks = (total + kChunk - 1) / kChunk;
  std::vector<Entry> table;
  table.reserve(tensors.size());
  int64_t off = 0;
  for (const auto& t : tensors) {
    if (t.numel() > 0) table.push_back({reinterpret_cast<int64_t>(t.data_ptr()), off, t.numel()});
    off += t.numel();
  }
  std::vector<int32_t> first(n_blocks);
  size_t e = 0;
  for (int64_t b = 0; b < n_blocks; ++b) {
    while (table[e].offset + table[e].numel <= b * kChunk) ++e;
    first[b] = static_cast<int32_t>(e);
  }
  // Pinned staging so the host-to-device copy is truly async on the current stream; the caching host
  // allocator keeps the block alive until the stream has consumed it.
  const int64_t table_bytes = static_cast<int64_t>(table.size() * sizeof(Entry));
  const int64_t first_bytes = static_cast<int64_t>(first.size() * sizeof(int32_t));
  auto host = at::empty({table_bytes + first_bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), table.data(), table_bytes);
  std::memcpy(static_cast<char*>(host.data_ptr()) + table_bytes, first.data(), first_bytes);
  auto dev = host.to(flat.device(), /*non_blocking=*/true);
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto* d_table = reinterpret_cast<const Entry*>(dev.data_ptr());
  const auto* d_first = reinterpret_cast<const int32_t*>(static_cast<char*>(dev.data_ptr()) + table_bytes);
  // A copy moves bits, so the kernel is chosen by element size, not dtype: every dtype the CPU kernel takes
  // (complex, float8, unsigned, bool) works here too.
  const auto launch = [&](auto word) {
    using W = decltype(word);
    multi_copy_kernel<W, kToFlat><<<n_blocks, kThreads, 0, stream>>>(
        d_table, d_first, static_cast<int32_t>(table.size()), static_cast<W*>(flat.data_ptr()));
  };
  switch (flat.element_size()) {
    case 1: launch(uint8_t{}); break;
    case 2: launch(uint16_t{}); break;
    case 4: launch(uint32_t{}); break;
    case 8: launch(uint64_t{}); break;
    case 16: launch(Word16{}); break;
    default: PP_CHECK(false, op, "unsupported element size ", flat.element_size(), " (", flat.scalar_type(), ")");
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void flatten_into_cuda(at::TensorList tensors, const at::Tensor& out) {
  multi_copy<true>(tensors, out, "flatten_into");
}

void unflatten_from_cuda(const at::Tensor& flat, at::TensorList outs) {
  multi_copy<false>(outs, flat, "unflatten_from");
}

}  // namespace

TORCH_LIBRARY_IMPL(pyparallel, CUDA, m) {
  m.impl("flatten_into", &flatten_into_cuda);
  m.impl("unflatten_from", &unflatten_from_cuda);
}

}  // namespace pyparallel
