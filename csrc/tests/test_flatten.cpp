// ctest: the CPU flatten / unflatten kernels against torch::cat / narrow on random, odd-sized tensors.
// Runs under sanitizers and valgrind (see CMakeLists.txt); no Python involved.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <iostream>
#include <vector>

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
  if (!ok) {
    std::cerr << "FAILED: " << what << "\n";
    ++failures;
  }
}

}  // namespace

int main() {
  auto flatten = c10::Dispatcher::singleton()
                     .findSchemaOrThrow("pyparallel::flatten_into", "")
                     .typed<void(at::TensorList, const at::Tensor&)>();
  auto unflatten = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pyparallel::unflatten_from", "")
                       .typed<void(const at::Tensor&, at::TensorList)>();
  at::manual_seed(0);
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kLong}) {
    std::vector<at::Tensor> ts;
    for (int64_t n : {1, 7, 1031, 0, 300007, 13}) ts.push_back(at::randn({n}).mul(100).to(dtype));
    ts.push_back(at::randn({3, 5}).to(dtype));
    int64_t total = 0;
    std::vector<at::Tensor> flat_parts;
    for (auto& t : ts) {
      total += t.numel();
      flat_parts.push_back(t.reshape({-1}));
    }
    auto out = at::full({total + 4}, 9, at::TensorOptions().dtype(dtype));
    flatten.call(ts, out);
    expect(at::equal(out.narrow(0, 0, total), at::cat(flat_parts)), "flatten_into matches cat");
    expect(at::equal(out.narrow(0, total, 4), at::full({4}, 9, at::TensorOptions().dtype(dtype))),
           "flatten_into leaves the padding alone");
    std::vector<at::Tensor> back;
    for (auto& t : ts) back.push_back(at::zeros_like(t));
    unflatten.call(out, back);
    for (size_t i = 0; i < ts.size(); ++i) expect(at::equal(back[i], ts[i]), "unflatten_from round trip");
  }
  bool threw = false;
  try {
    auto small = at::zeros({3});
    std::vector<at::Tensor> big{at::zeros({4})};
    flatten.call(big, small);
  } catch (const c10::Error&) {
    threw = true;
  }
  expect(threw, "too-small buffer raises");
  std::cout << (failures == 0 ? "all flatten checks passed" : "flatten checks FAILED") << "\n";
  return failures == 0 ? 0 : 1;
}
