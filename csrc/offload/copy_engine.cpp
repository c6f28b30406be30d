// CopyEngine: see copy_engine.h. Two backends behind one API, chosen by the device at construction:
// a CUDA side stream with one event per ticket, or a worker thread for CPU tensors.
#include "copy_engine.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "pyparallel/checks.h"

#ifdef PYPARALLEL_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

namespace pyparallel {
namespace offload {

namespace {

constexpr const char* kOp = "OffloadCopyEngine";

std::string describe_bytes(int64_t bytes) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "%lld bytes (%.2f GiB)", static_cast<long long>(bytes),
                static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

// Same-dtype contiguous copies are one memcpy on the worker (single-threaded on purpose: a background copy
// should not take every core from the compute it overlaps); anything else goes through copy_.
void copy_now(const at::Tensor& dst, const at::Tensor& src) {
  if (dst.scalar_type() == src.scalar_type() && dst.is_contiguous() && src.is_contiguous() &&
      dst.device().is_cpu() && src.device().is_cpu()) {
    std::memcpy(dst.data_ptr(), src.data_ptr(), static_cast<size_t>(dst.nbytes()));
  } else {
    dst.copy_(src);
  }
}

}  // namespace

#ifdef PYPARALLEL_WITH_CUDA
struct CudaState {
  struct Pending {
    std::shared_ptr<at::cuda::CUDAEvent> done;  // shared: a waiter syncs on it outside the lock
    at::Tensor dst, src;                          // alive until the copy is known to be finished
  };
  explicit CudaState(at::Device device) : stream(c10::cuda::getStreamFromPool(false, device.index())) {}
  c10::cuda::CUDAStream stream;
  std::map<int64_t, Pending> pending;  // by ticket; one stream, so they complete in ticket order

  // The event of the last pending copy with a ticket <= `ticket`, or null when all of them were retired.
  std::shared_ptr<at::cuda::CUDAEvent> last_event(int64_t ticket) {
    auto last = pending.upper_bound(ticket);
    return last == pending.begin() ? nullptr : std::prev(last)->second.done;
  }
  // Moves out the entries with tickets <= `ticket` (or only the finished ones) for the caller to drop
  // after releasing the lock.
  std::vector<Pending> retire(int64_t ticket, bool only_finished) {
    std::vector<Pending> out;
    while (!pending.empty() && pending.begin()->first <= ticket &&
           (!only_finished || pending.begin()->second.done->query())) {
      out.push_back(std::move(pending.begin()->second));
      pending.erase(pending.begin());
    }
    return out;
  }
};
#else
struct CudaState {};
#endif

CopyEngine::CopyEngine(at::Device device, bool pin) : device_(device), pin_(false) {
#ifdef PYPARALLEL_WITH_CUDA
  if (device.is_cuda()) {
    if (device_.index() < 0) device_ = at::Device(at::kCUDA, c10::cuda::current_device());
    cuda_ = std::make_unique<CudaState>(device_);
    pin_ = pin;
  }
#else
  PP_CHECK(!device.is_cuda(), kOp, "device ", device, " needs a CUDA build of pyparallel._C (built without CUDA)");
#endif
  (void)pin;  // pinning is meaningless without a GPU: plain host memory then
}

CopyEngine::~CopyEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();  // the worker finishes queued copies first; it never needs the GIL
#ifdef PYPARALLEL_WITH_CUDA
  if (cuda_) cuda_->stream.synchronize();  // no copy may still target a buffer freed with this engine
#endif
}

at::Tensor CopyEngine::alloc(int64_t numel, at::ScalarType dtype, const std::string& what) {
  PP_CHECK(numel >= 0, kOp, "alloc of ", numel, " elements for ", what);
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  at::Tensor t;
#ifdef PYPARALLEL_WITH_CUDA
  if (pin_) {
    // cudaHostAlloc of the exact size: the caching host allocator rounds up to a power of two, which for a
    // multi-GB shard could waste almost half of host memory.
    c10::cuda::CUDAGuard guard(device_);
    void* ptr = nullptr;
    cudaError_t err = cudaHostAlloc(&ptr, static_cast<size_t>(std::max<int64_t>(bytes, 1)), cudaHostAllocDefault);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // clear it so the next CUDA call does not report it
      throw HostMemoryError("pyparallel offload: could not allocate " + describe_bytes(bytes) +
                            " of pinned host memory for " + what + " (" + cudaGetErrorString(err) +
                            "). Free host memory, spread the shard over more data-parallel ranks, or disable "
                            "pinning.");
    }
    t = at::from_blob(ptr, {numel}, [](void* p) { cudaFreeHost(p); }, at::TensorOptions().dtype(dtype));
  }
#endif
  if (!t.defined()) {
    try {
      t = at::empty({numel}, at::TensorOptions().dtype(dtype));
    } catch (const c10::Error& e) {
      throw HostMemoryError("pyparallel offload: could not allocate " + describe_bytes(bytes) +
                            " of host memory for " + what + ": " + e.what_without_backtrace());
    }
  }
  allocated_ += bytes;
  return t;
}

void CopyEngine::check_ticket(int64_t ticket) const {
  PP_CHECK(ticket >= 0 && ticket < next_ticket_, kOp, "unknown ticket ", ticket, " (issued so far: ",
           next_ticket_ - 1, ")");
}

int64_t CopyEngine::copy(const at::Tensor& dst, const at::Tensor& src) {
  PP_CHECK(dst.numel() == src.numel(), kOp, "copy of ", src.numel(), " elements into a tensor of ", dst.numel());
  if (!cuda_) return copy_on_worker(dst, src);
#ifdef PYPARALLEL_WITH_CUDA
  at::NoGradGuard no_grad;
  c10::cuda::CUDAGuard guard(device_);
  std::vector<CudaState::Pending> retired;  // dropped after the lock (declared first: destroyed last)
  std::lock_guard<std::mutex> lock(mu_);
  // Forget copies known to be done (a caller may only ever wait on the stream, never on the host).
  retired = cuda_->retire(next_ticket_, /*only_finished=*/true);
  // The copy must see what the current stream has produced so far (the reduced gradient shard, say).
  at::cuda::CUDAEvent ready;
  ready.record(c10::cuda::getCurrentCUDAStream(device_.index()));
  ready.block(cuda_->stream);
  {
    c10::cuda::CUDAStreamGuard stream_guard(cuda_->stream);
    dst.copy_(src, /*non_blocking=*/true);
  }
  // The caching allocator must not hand these device blocks to the compute stream before the side stream
  // is done with them, even if the caller drops its last reference.
  for (const auto* t : {&dst, &src})
    if (t->is_cuda()) c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), cuda_->stream);
  auto done = std::make_shared<at::cuda::CUDAEvent>();
  done->record(cuda_->stream);
  const int64_t ticket = next_ticket_++;
  cuda_->pending.emplace(ticket, CudaState::Pending{std::move(done), dst, src});
  return ticket;
#else
  return 0;
#endif
}

void CopyEngine::wait(int64_t ticket) {
  check_ticket(ticket);
  if (!cuda_) return wait_worker(ticket);
#ifdef PYPARALLEL_WITH_CUDA
  std::shared_ptr<at::cuda::CUDAEvent> event;
  {
    std::lock_guard<std::mutex> lock(mu_);
    event = cuda_->last_event(ticket);
  }
  if (!event) return;  // already retired
  event->synchronize();
  std::vector<CudaState::Pending> retired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    retired = cuda_->retire(ticket, /*only_finished=*/false);
  }
#endif
}

void CopyEngine::wait_on_current_stream(int64_t ticket) {
  check_ticket(ticket);
  if (!cuda_) return wait_worker(ticket);
#ifdef PYPARALLEL_WITH_CUDA
  std::shared_ptr<at::cuda::CUDAEvent> event;
  {
    std::lock_guard<std::mutex> lock(mu_);
    event = cuda_->last_event(ticket);
  }
  if (event) event->block(c10::cuda::getCurrentCUDAStream(device_.index()));
#endif
}

bool CopyEngine::done(int64_t ticket) {
  check_ticket(ticket);
  std::lock_guard<std::mutex> lock(mu_);
  if (!cuda_) return completed_ >= ticket;
#ifdef PYPARALLEL_WITH_CUDA
  auto event = cuda_->last_event(ticket);
  return !event || event->query();
#else
  return true;
#endif
}

void CopyEngine::synchronize() {
  if (next_ticket_ > 1) wait(next_ticket_ - 1);
}

// ---------------------------------------------------------------- CPU backend: one worker thread

int64_t CopyEngine::copy_on_worker(const at::Tensor& dst, const at::Tensor& src) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
  const int64_t ticket = next_ticket_++;
  queue_.push_back({ticket, dst, src});
  cv_.notify_all();
  return ticket;
}

void CopyEngine::worker_loop() {
  at::NoGradGuard no_grad;
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left to copy
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    std::string err;
    try {
      copy_now(task.dst, task.src);
    } catch (const std::exception& e) {
      err = e.what();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      completed_ = task.ticket;
      if (!err.empty() && error_.empty()) error_ = "copy " + std::to_string(task.ticket) + " failed: " + err;
      // The references are dropped by a waiter, not here: releasing the last reference to a tensor that
      // Python still sees may need the GIL, which the worker must never wait for.
      finished_.push_back(std::move(task));
    }
    cv_.notify_all();
  }
}

void CopyEngine::wait_worker(int64_t ticket) {
  std::deque<Task> finished;
  std::string err;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return completed_ >= ticket; });
    finished.swap(finished_);
    err.swap(error_);
  }
  finished.clear();  // outside the lock: see worker_loop
  PP_CHECK(err.empty(), kOp, err);
}

}  // namespace offload
}  // namespace pyparallel
