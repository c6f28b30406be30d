// Every op schema of the pyparallel namespace, in one place (DESIGN.md). Kernels register per backend
// with TORCH_LIBRARY_IMPL in csrc/cpu and csrc/cuda; Python wrappers, fake (meta) kernels and the
// plain-torch references live in pyparallel/_ops.py. pybind11 is only for objects with state.
// Only torch/library.h and pybind11 here, not torch/extension.h: this file is compiled on every install.
#include <torch/library.h>

#ifndef PYPARALLEL_NO_PYTHON
#include <pybind11/pybind11.h>

#include "autograd/split_plan.h"
#include "offload/bindings.h"  // --- optimizers ---
#endif

TORCH_LIBRARY(pyparallel, m) {
  // --- gradient buckets (data parallel, ZeRO): multi-tensor copies into / out of one flat buffer ---
  // Copies tensors[i] (any shape, contiguous or not) into out[offset_i : offset_i + numel_i] in order;
  // out may be longer than the sum (bucket padding is left untouched). Casts when dtypes differ.
  m.def("flatten_into(Tensor[] tensors, Tensor(a!) out) -> ()");
  // The inverse: outs[i].copy_(flat[offset_i : offset_i + numel_i].view_as(outs[i])).
  m.def("unflatten_from(Tensor flat, Tensor(a!)[] outs) -> ()");
  // --- tensor parallel: fused GeLU -> row matmul ---
  // y = gelu(z + bias) @ weight^T with z [..., K], bias [K] or None, weight [N, K]; approximate is "none"
  // (erf) or "tanh" as in torch.nn.functional.gelu. gelu(z + bias) is never materialized in full.
  m.def("gelu_linear(Tensor z, Tensor? bias, Tensor weight, str approximate=\"none\") -> Tensor");
  // (grad_z, grad_bias, grad_weight) from z alone (gelu recomputed); outputs not in output_mask are empty.
  m.def("gelu_linear_backward(Tensor grad_out, Tensor z, Tensor? bias, Tensor weight, str approximate, "
        "bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  // --- end tensor parallel ---
  // --- optimizers ---
  // One fused Adam/AdamW step over lists of tensors (torch.optim.Adam's math; CPU: csrc/cpu/adam.cpp,
  // CUDA: csrc/cuda/adam.cu). max_exp_avg_sqs is used only with amsgrad (else pass []); lowp_out, when not
  // empty, receives a bf16/fp16 copy of each updated param in the same pass. step counts from 1.
  m.def(
      "adam_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] lowp_out, int step, float lr, float beta1, float beta2, "
      "float eps, float weight_decay, bool adamw, bool maximize, bool amsgrad) -> ()");
  // --- end optimizers ---
  // --- same-host collectives (pyparallel/shm.py): round counters in shared memory, csrc/cpu/shm_flags.cpp ---
  // flags is int64 [ranks, slots] (one cache line per rank); post stores value at flags[index, 0] after a
  // full fence; wait returns -1 once every flags[i, 0] >= value, or the first i still behind at the timeout.
  m.def("shm_post(Tensor(a!) flags, int index, int value) -> ()");
  m.def("shm_wait(Tensor flags, int value, float timeout_s) -> int");
}

#ifndef PYPARALLEL_NO_PYTHON
#ifdef PYPARALLEL_WITH_CUDA
static constexpr bool kWithCuda = true;
#else
static constexpr bool kWithCuda = false;
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pyparallel compiled kernels (ops are registered under torch.ops.pyparallel)";
  m.attr("with_cuda") = kWithCuda;
  pyparallel::offload::bind_optimizers(m);  // --- optimizers ---: SIMD level, OffloadCopyEngine
  pyparallel::autograd::bind_split(m);       // the zero-bubble split's graph analysis
}
#endif  // PYPARALLEL_NO_PYTHON
