// See split_plan.h. The same analysis as _analyse in pyparallel/pipeline_parallel/split.py (which stays as
// the fallback without the extension and as this code's reference in tests/test_pipeline_units.py), done
// on the C++ graph: no Python wrapper is made for a node that is not an intermediate, and B's capture
// hooks are C++ pre-hooks instead of Python callables.
#include "split_plan.h"

#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

namespace pyparallel {
namespace autograd {
namespace {

namespace py = pybind11;
using torch::autograd::Node;
using torch::autograd::variable_list;
// intrusive_ptr<Node> in recent torch, shared_ptr<Node> in older releases: whatever an Edge holds.
using NodePtr = decltype(torch::autograd::Edge::function);

// Each hook owns one slot of the store: the engine calls a node once per backward, possibly on a device
// thread, and no two hooks share a slot, so no lock is needed.
struct Store {
  std::vector<variable_list> grads;
  std::vector<char> fired;
};

struct CaptureHook : torch::autograd::FunctionPreHook {
  CaptureHook(std::shared_ptr<Store> store, size_t slot) : store_(std::move(store)), slot_(slot) {}
  variable_list operator()(const variable_list& grads) override {
    store_->grads[slot_] = grads;
    store_->fired[slot_] = 1;
    return grads;
  }
  std::shared_ptr<Store> store_;
  size_t slot_;
};

// The pre-hooks B installed, removed by take() or, if B raised before it, by the destructor.
class Capture {
 public:
  explicit Capture(size_t n) : store_(std::make_shared<Store>()) {
    store_->grads.resize(n);
    store_->fired.assign(n, 0);
  }
  Capture(const Capture&) = delete;
  Capture& operator=(const Capture&) = delete;
  ~Capture() { remove(); }

  // Installs the hook of slot nodes_.size() on ``node``.
  void hook(const NodePtr& node) {
    auto hook = std::make_unique<CaptureHook>(store_, nodes_.size());
    hooks_.push_back(hook.get());
    nodes_.push_back(node);
    node->add_pre_hook(std::move(hook));
  }

  // One entry per hooked node, in hook order: the tuple of gradients that flowed into it (None for an
  // undefined one), or None when the node did not run.
  py::list take() {
    remove();
    py::list out;
    for (size_t i = 0; i < store_->grads.size(); ++i) {
      if (!store_->fired[i]) {
        out.append(py::none());
        continue;
      }
      const auto& g = store_->grads[i];
      py::tuple t(g.size());
      for (size_t j = 0; j < g.size(); ++j)
        t[j] = g[j].defined() ? py::cast(g[j]) : py::none();
      out.append(std::move(t));
    }
    store_->grads.clear();
    store_->fired.clear();
    return out;
  }

 private:
  void remove() {
    for (size_t i = 0; i < nodes_.size(); ++i) {
      auto& hooks = nodes_[i]->pre_hooks();
      auto it = std::find_if(hooks.begin(), hooks.end(), [&](const auto& h) { return h.get() == hooks_[i]; });
      if (it != hooks.end()) hooks.erase(it);
    }
    nodes_.clear();  // releases the nodes: the graph is the caller's to free
    hooks_.clear();
  }
  std::shared_ptr<Store> store_;
  std::vector<NodePtr> nodes_;
  std::vector<CaptureHook*> hooks_;
};

// A set of parameter indices as a bitset: a chunk has tens to hundreds of parameters.
struct Bits {
  std::vector<uint64_t> w;
  explicit Bits(size_t n = 0) : w((n + 63) / 64, 0) {}
  void set(size_t i) { w[i / 64] |= uint64_t(1) << (i % 64); }
  void operator|=(const Bits& o) {
    for (size_t k = 0; k < w.size(); ++k) w[k] |= o.w[k];
  }
  bool any() const {
    return std::any_of(w.begin(), w.end(), [](uint64_t v) { return v != 0; });
  }
  template <class F>
  void each(F f) const {
    for (size_t k = 0; k < w.size(); ++k)
      for (uint64_t v = w[k]; v; v &= v - 1) f(k * 64 + __builtin_ctzll(v));
  }
};

NodePtr node_of(const at::Tensor& t) { return torch::autograd::impl::gradient_edge(t).function; }

py::object to_python(const NodePtr& n) {
  PyObject* obj = torch::autograd::functionToPyObject(n);
  if (obj == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(obj);
}

py::tuple split_plan(const at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& params) {
  NodePtr root = node_of(y), x_node = node_of(x);
  TORCH_CHECK(root, "split_plan: the output has no autograd graph");
  std::unordered_map<Node*, size_t> param_index;
  for (size_t i = 0; i < params.size(); ++i)
    if (auto n = node_of(params[i])) param_index.emplace(n.get(), i);
  const size_t P = params.size();

  // Post-order over the graph (children first), iteratively: a deep graph must not overflow the stack.
  std::unordered_map<Node*, size_t> id;
  std::vector<NodePtr> nodes;
  std::vector<std::vector<size_t>> kids;
  std::vector<size_t> post;
  std::vector<std::pair<NodePtr, bool>> stack{{root, false}};
  while (!stack.empty()) {
    auto [n, finished] = std::move(stack.back());
    stack.pop_back();
    if (finished) {
      size_t me = id.at(n.get());
      for (const auto& e : n->next_edges())
        if (e.function) kids[me].push_back(id.at(e.function.get()));
      post.push_back(me);
      continue;
    }
    if (id.count(n.get())) continue;
    id.emplace(n.get(), nodes.size());
    nodes.push_back(n);
    kids.emplace_back();
    stack.emplace_back(n, true);
    for (const auto& e : n->next_edges())
      if (e.function && !id.count(e.function.get())) stack.emplace_back(e.function, false);
  }

  // Nodes with a path to the input, and the parameters under every node without one.
  const size_t N = nodes.size();
  std::vector<char> to_x(N, 0);
  std::vector<Bits> reach(N);
  for (size_t n : post) {
    bool on = nodes[n].get() == x_node.get();
    for (size_t k : kids[n]) on = on || to_x[k];
    if (on) {
      to_x[n] = 1;
      continue;
    }
    Bits under(P);
    auto it = param_index.find(nodes[n].get());
    if (it != param_index.end()) under.set(it->second);
    for (size_t k : kids[n]) under |= reach[k];
    reach[n] = std::move(under);
  }

  // Intermediates (parents first) and the union-find over them and their parameters (ids N + index).
  std::vector<size_t> parent(N + P);
  for (size_t i = 0; i < parent.size(); ++i) parent[i] = i;
  auto find = [&](size_t a) {
    while (parent[a] != a) a = parent[a] = parent[parent[a]];
    return a;
  };
  std::vector<std::pair<size_t, Bits>> owners;
  for (auto it = post.rbegin(); it != post.rend(); ++it) {
    size_t n = *it;
    if (!to_x[n] || nodes[n].get() == x_node.get()) continue;
    Bits mine(P);
    for (size_t k : kids[n])
      if (!to_x[k]) mine |= reach[k];
    if (!mine.any()) continue;
    mine.each([&](size_t q) { parent[find(N + q)] = find(n); });
    owners.emplace_back(n, std::move(mine));
  }

  // Groups in the order their first intermediate comes; hooks installed in the same order.
  std::unordered_map<size_t, size_t> group_of;
  std::vector<std::vector<size_t>> inter;
  std::vector<Bits> group_params;
  for (auto& [n, mine] : owners) {
    auto [it, fresh] = group_of.emplace(find(n), inter.size());
    if (fresh) {
      inter.emplace_back();
      group_params.emplace_back(P);
    }
    inter[it->second].push_back(n);
    group_params[it->second] |= mine;
  }

  size_t hooked = 0;
  for (const auto& members : inter) hooked += members.size();
  auto capture = std::make_unique<Capture>(hooked);
  py::list groups;
  for (size_t g = 0; g < inter.size(); ++g) {
    py::list members, indices;
    for (size_t n : inter[g]) {
      members.append(to_python(nodes[n]));
      capture->hook(nodes[n]);
    }
    group_params[g].each([&](size_t q) { indices.append(q); });
    groups.append(py::make_tuple(members, indices));
  }
  return py::make_tuple(groups, py::cast(std::move(capture)));
}

}  // namespace

void bind_split(pybind11::module_& m) {
  py::class_<Capture>(m, "SplitCapture",
                      "The gradients B's pre-hooks captured at the intermediates (split_plan); take() "
                      "removes the hooks and returns them.")
      .def("take", &Capture::take);
  m.def("split_plan", &split_plan, py::arg("y"), py::arg("x"), py::arg("params"),
        "The zero-bubble split's graph analysis (pipeline_parallel/split.py, _analyse): a list of groups "
        "(intermediate nodes, indices into params), parents first, and a SplitCapture whose pre-hooks on "
        "every intermediate record the gradient flowing into it during B.");
}

}  // namespace autograd
}  // namespace pyparallel
