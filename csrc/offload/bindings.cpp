// See bindings.h. Waits release the GIL so that backward (or the delayed-update thread) keeps running
// while a copy finishes.
#include "bindings.h"

#include <torch/csrc/utils/pybind.h>  // the casters for at::Device and dtypes, without all of torch/extension.h

#include <string>
#include <vector>

#include "copy_engine.h"
#include "pyparallel/simd.h"

namespace pyparallel {
namespace offload {

void bind_optimizers(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("simd_level", [] { return std::string(simd::name(simd::active())); },
        "The SIMD level the CPU Adam kernel uses now (avx512, avx2 or scalar).");
  m.def("set_simd_level", &simd::set_level, py::arg("level"),
        "Force the CPU Adam SIMD level (avx512, avx2, scalar or auto); returns the previous one. Raises if "
        "the CPU lacks it.");
  m.def("supported_simd_levels", [] {
    std::vector<std::string> out;
    for (auto l : {simd::Level::kAvx512, simd::Level::kAvx2, simd::Level::kScalar})
      if (simd::cpu_supports(l)) out.emplace_back(simd::name(l));
    return out;
  }, "The SIMD levels this CPU can run, widest first.");

  py::register_exception<HostMemoryError>(m, "HostMemoryError", PyExc_MemoryError);
  py::class_<CopyEngine>(m, "OffloadCopyEngine",
                         "Pinned host buffers and async device<->host copies for ZeRO-Offload (see "
                         "pyparallel/zero/offload.py). Copies are waited on by ticket.")
      .def(py::init<at::Device, bool>(), py::arg("device"), py::arg("pin"))
      .def("alloc", &CopyEngine::alloc, py::arg("numel"), py::arg("dtype"), py::arg("what"))
      .def("copy", &CopyEngine::copy, py::arg("dst"), py::arg("src"))
      .def("wait", &CopyEngine::wait, py::arg("ticket"), py::call_guard<py::gil_scoped_release>())
      .def("wait_on_current_stream", &CopyEngine::wait_on_current_stream, py::arg("ticket"),
           py::call_guard<py::gil_scoped_release>())
      .def("done", &CopyEngine::done, py::arg("ticket"))
      .def("synchronize", &CopyEngine::synchronize, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("pinned", &CopyEngine::pinned)
      .def_property_readonly("uses_cuda", &CopyEngine::uses_cuda)
      .def_property_readonly("device", &CopyEngine::device)
      .def_property_readonly("allocated_bytes", &CopyEngine::allocated_bytes)
      .def_property_readonly("last_ticket", &CopyEngine::last_ticket);
}

}  // namespace offload
}  // namespace pyparallel
