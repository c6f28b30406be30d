// The host side of ZeRO-Offload's data movement (Ren et al. 2021, section 4): a pool of (pinned) host
// buffers and asynchronous device <-> host copies that the caller waits on by ticket.
//
// With CUDA the copies run on a side stream, ordered after the work already queued on the current stream
// (an event), so gradients stream to the host while backward continues. Without CUDA (a CPU-only build,
// or a CPU device) the same API copies on a worker thread: the Python code above it is one code path.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

namespace pyparallel {
namespace offload {

// Raised (as Python's MemoryError subclass pyparallel._C.HostMemoryError) when a host buffer cannot be
// allocated or pinned; the message names the bytes asked for.
struct HostMemoryError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct CudaState;  // side stream and per-ticket events; defined only in CUDA builds

// Hidden like pybind11's own types: a class bound with py::class_ must not be more visible than them.
class __attribute__((visibility("hidden"))) CopyEngine {
 public:
  // `device` is where the compute-side tensors live; `pin` asks for page-locked host buffers (only
  // possible, and only useful, when `device` is a CUDA device).
  CopyEngine(at::Device device, bool pin);
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // A host buffer of `numel` elements, page-locked when pinned() (exact size, not rounded up to a power of
  // two as the caching host allocator does). `what` names it in errors.
  at::Tensor alloc(int64_t numel, at::ScalarType dtype, const std::string& what);
  // Queues dst.copy_(src) (casting if dtypes differ) and returns its ticket. Both tensors are kept alive
  // until the copy is waited on; neither may be modified by the caller before then.
  int64_t copy(const at::Tensor& dst, const at::Tensor& src);
  // Blocks the calling thread until copy `ticket` (and every earlier one) has finished.
  void wait(int64_t ticket);
  // Makes the device's current stream wait for `ticket` without blocking the host (CUDA); on the CPU
  // backend it is wait().
  void wait_on_current_stream(int64_t ticket);
  bool done(int64_t ticket);
  void synchronize();  // waits for every queued copy

  bool pinned() const { return pin_; }
  bool uses_cuda() const { return cuda_ != nullptr; }
  at::Device device() const { return device_; }
  int64_t allocated_bytes() const { return allocated_; }
  int64_t last_ticket() const { return next_ticket_ - 1; }

 private:
  struct Task {
    int64_t ticket;
    at::Tensor dst, src;
  };
  void check_ticket(int64_t ticket) const;
  void worker_loop();
  int64_t copy_on_worker(const at::Tensor& dst, const at::Tensor& src);
  void wait_worker(int64_t ticket);

  at::Device device_;
  bool pin_;
  std::atomic<int64_t> next_ticket_{1};
  int64_t allocated_ = 0;
  std::unique_ptr<CudaState> cuda_;

  // Guards the queues and the CUDA pending map: the DPU thread of zero/offload.py and the main thread may
  // both call in. Never held while a tensor reference is dropped (that may take the GIL).
  std::mutex mu_;
  // CPU backend: one worker thread, FIFO, so tickets complete in order.
  std::condition_variable cv_;
  std::deque<Task> queue_;
  std::deque<Task> finished_;  // done, references not yet dropped (see worker_loop)
  int64_t completed_ = 0;
  std::string error_;  // first failure, reported by the next wait
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace offload
}  // namespace pyparallel
