// pybind11 registration of the stateful optimizer pieces: the CPU Adam SIMD level and ZeRO-Offload's
// copy engine. Called from ops.cpp's PYBIND11_MODULE; compiled only into the Python extension (the CMake
// developer build of csrc/cpu has no Python).
#pragma once

#include <pybind11/pybind11.h>

namespace pyparallel {
namespace offload {

// Adds simd_level(), set_simd_level(level), supported_simd_levels(), OffloadCopyEngine and HostMemoryError.
void bind_optimizers(pybind11::module_& m);

}  // namespace offload
}  // namespace pyparallel
