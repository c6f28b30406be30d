// What the Adam kernels share across translation units: the per-call constants, used by the CPU and CUDA
// kernels alike so that both round torch's Python scalars the same way.
#pragma once

#include <cstdint>

#include "pyparallel/adam_kernel.h"

namespace pyparallel {
namespace adam {

Consts make_consts(int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                   bool maximize, bool amsgrad);

}  // namespace adam
}  // namespace pyparallel
