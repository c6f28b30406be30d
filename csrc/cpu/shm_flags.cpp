// Counters in shared memory that let the ranks of one host hand buffers to each other
// (pyparallel/shm.py): a rank posts "round k done" with a fence before the store, so every byte it wrote
// to the shared buffers before posting (memcpy may use non-temporal stores, which a plain release store does
// not order) is visible to a peer that reads the counter with acquire semantics.
//
// The wait spins briefly (a peer on another core answers in microseconds), then yields its core (several
// ranks may share one core), then sleeps in short steps (a peer still computing its backward may take
// milliseconds), and gives up at the timeout, returning which rank is behind so the caller can name it.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <chrono>
#include <thread>

#include "pyparallel/checks.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PP_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define PP_CPU_RELAX() asm volatile("yield" ::: "memory")
#else
#define PP_CPU_RELAX() ((void)0)
#endif

namespace pyparallel {
namespace {

void check_flags(const at::Tensor& flags, const char* op) {
  PP_CHECK(flags.device().is_cpu(), op, "flags must be a CPU tensor, got ", flags.device());
  PP_CHECK(flags.scalar_type() == at::kLong, op, "flags must be int64, got ", flags.scalar_type());
  PP_CHECK(flags.dim() == 2 && flags.is_contiguous(), op, "flags must be a contiguous [ranks, slots] tensor, got ",
           flags.sizes());
}

void shm_post_cpu(const at::Tensor& flags, int64_t index, int64_t value) {
  check_flags(flags, "shm_post");
  PP_CHECK(index >= 0 && index < flags.size(0), "shm_post", "index ", index, " out of range for ", flags.size(0),
           " ranks");
  int64_t* slot = flags.data_ptr<int64_t>() + index * flags.stride(0);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);  // orders the payload's (possibly non-temporal) stores first
  __atomic_store_n(slot, value, __ATOMIC_RELEASE);
}

// -1 once every rank's counter is >= value; otherwise, at the timeout, the first rank that is behind.
int64_t shm_wait_cpu(const at::Tensor& flags, int64_t value, double timeout_s) {
  check_flags(flags, "shm_wait");
  const int64_t n = flags.size(0), stride = flags.stride(0);
  const int64_t* base = flags.data_ptr<int64_t>();
  auto behind = [&]() -> int64_t {
    for (int64_t i = 0; i < n; ++i)
      if (__atomic_load_n(base + i * stride, __ATOMIC_ACQUIRE) < value) return i;
    return -1;
  };
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto deadline = start + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
  for (int64_t spin = 0;; ++spin) {
    int64_t late = behind();
    if (late < 0) return -1;
    if (spin < 512) {
      PP_CPU_RELAX();
      continue;
    }
    const auto now = clock::now();
    if (now >= deadline) return late;
    if (now - start < std::chrono::microseconds(300))
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(pyparallel, CPU, m) {
  m.impl("shm_post", &shm_post_cpu);
  m.impl("shm_wait", &shm_wait_cpu);
}

}  // namespace pyparallel
