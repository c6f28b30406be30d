// Entry points of the Adam kernels shared across translation units: the per-call constants (used by the
// CPU and CUDA kernels alike, so both round torch's Python scalars the same way) and the pybind11 hook
// that ops.cpp calls to expose the SIMD level.
#pragma once

#include <cstdint>

#include "pyparallel/adam_kernel.h"

namespace pybind11 {
class module_;
}

namespace pyparallel {
namespace adam {

Consts make_consts(int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                   bool maximize, bool amsgrad);

// Adds simd_level(), set_simd_level(level) and supported_simd_levels() to the extension module.
void bind_cpu_adam(pybind11::module_& m);

}  // namespace adam
}  // namespace pyparallel
