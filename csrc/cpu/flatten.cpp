// CPU multi-tensor flatten / unflatten: the copies that fill and drain flat gradient buckets.
// One parallel loop over all elements of all tensors (not one loop per tensor), so a bucket of many
// small parameters costs one fork/join instead of hundreds.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "pyparallel/checks.h"

namespace pyparallel {
namespace {

constexpr int64_t kGrain = 1 << 16;  // elements per task; below this memcpy beats a fork

struct Span {
  int64_t offset;  // element offset in the flat buffer
  int64_t numel;
};

std::vector<Span> spans_of(at::TensorList tensors, int64_t flat_numel, const char* op) {
  std::vector<Span> spans;
  spans.reserve(tensors.size());
  int64_t off = 0;
  for (const auto& t : tensors) {
    spans.push_back({off, t.numel()});
    off += t.numel();
  }
  PP_CHECK(off <= flat_numel, op, "tensors hold ", off, " elements but the flat buffer only ", flat_numel);
  return spans;
}

// Copies the byte ranges [lo, hi) of the concatenation, split over threads.
template <typename F>
void parallel_spans(const std::vector<Span>& spans, F&& copy_range) {
  const int64_t total = spans.empty() ? 0 : spans.back().offset + spans.back().numel;
  at::parallel_for(0, total, kGrain, [&](int64_t lo, int64_t hi) {
    // Binary search would save little: buckets hold at most a few hundred tensors.
    for (size_t i = 0; i < spans.size(); ++i) {
      const int64_t s = std::max(lo, spans[i].offset);
      const int64_t e = std::min(hi, spans[i].offset + spans[i].numel);
      if (s < e) copy_range(i, s - spans[i].offset, e - s);
    }
  });
}

bool fast_path(at::TensorList tensors, const at::Tensor& flat) {
  for (const auto& t : tensors) {
    // A conjugate or negative view's bits are not its values: copy_ resolves them.
    if (!t.is_contiguous() || t.scalar_type() != flat.scalar_type() || t.device() != flat.device() || t.is_conj() ||
        t.is_neg())
      return false;
  }
  return flat.is_contiguous() && !flat.is_conj() && !flat.is_neg();
}

void flatten_into_cpu(at::TensorList tensors, const at::Tensor& out) {
  PP_CHECK(out.dim() == 1, "flatten_into", "out must be 1-D, got shape ", out.sizes());
  auto spans = spans_of(tensors, out.numel(), "flatten_into");
  if (!fast_path(tensors, out)) {
    for (size_t i = 0; i < tensors.size(); ++i)
      out.narrow(0, spans[i].offset, spans[i].numel).view(tensors[i].sizes()).copy_(tensors[i]);
    return;
  }
  const int64_t es = out.element_size();
  char* dst = static_cast<char*>(out.data_ptr());
  parallel_spans(spans, [&](size_t i, int64_t start, int64_t n) {
    const char* src = static_cast<const char*>(tensors[i].data_ptr());
    std::memcpy(dst + (spans[i].offset + start) * es, src + start * es, n * es);
  });
}

void unflatten_from_cpu(const at::Tensor& flat, at::TensorList outs) {
  PP_CHECK(flat.dim() == 1, "unflatten_from", "flat must be 1-D, got shape ", flat.sizes());
  auto spans = spans_of(outs, flat.numel(), "unflatten_from");
  if (!fast_path(outs, flat)) {
    for (size_t i = 0; i < outs.size(); ++i)
      outs[i].copy_(flat.narrow(0, spans[i].offset, spans[i].numel).view(outs[i].sizes()));
    return;
  }
  const int64_t es = flat.element_size();
  const char* src = static_cast<const char*>(flat.data_ptr());
  parallel_spans(spans, [&](size_t i, int64_t start, int64_t n) {
    char* dst = static_cast<char*>(outs[i].data_ptr());
    std::memcpy(dst + start * es, src + (spans[i].offset + start) * es, n * es);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(pyparallel, CPU, m) {
  m.impl("flatten_into", &flatten_into_cpu);
  m.impl("unflatten_from", &unflatten_from_cpu);
}

}  // namespace pyparallel
