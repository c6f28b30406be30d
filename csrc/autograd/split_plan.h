// pybind11 registration of the zero-bubble split's graph analysis (pyparallel/pipeline_parallel/split.py):
// split_plan(y, x, params) and SplitCapture. Called from ops.cpp's PYBIND11_MODULE; it walks the autograd
// graph and makes Python node objects, so only the Python extension compiles it (not the CMake build).
#pragma once

#include <pybind11/pybind11.h>

namespace pyparallel {
namespace autograd {

void bind_split(pybind11::module_& m);

}  // namespace autograd
}  // namespace pyparallel
