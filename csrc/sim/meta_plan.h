// The output metadata of an op on sim tensors without its data, for the fallback's deferral
// (deferral.h): a Plan says what each result is (None, a written argument, or a new tensor of a
// given layout), found by running the op on meta tensors of the same layouts. Plans are cached
// per thread by a key of everything the metadata may depend on (the op, its tensor arguments'
// dtypes and layouts and which of them share storage, the values of its non-Scalar arguments and
// the types of its Scalars), as a meta computation costs tens of microseconds (most of
// PyTorch's meta kernels are Python).
#pragma once

#include "deferral.h"
#include "state.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/stack.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch_pipeline {
namespace sim {

struct Argument {  // a sim tensor argument, in the order of the op's arguments
  at::Tensor sim;
  bool write;
};

// What the meta computation found: the op's results, each None, a (written) argument or a new
// tensor of this layout. The same for every call whose arguments have the same key (below).
struct Result {
  enum Kind { kNone, kArgument, kNew } kind = kNone;
  size_t argument = 0;  // index into the Arguments
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
};
struct Plan {
  bool deferrable = false;
  std::vector<std::optional<std::vector<Result>>> returns;  // nullopt: a single result in [0]
  std::vector<std::vector<Result>> lists;                   // per return: its results
};

// The key of a call (KeyBuilder in meta_plan.cpp); false when an argument cannot be keyed.
class CallKey {
 public:
  explicit CallKey(const std::string& op) : key_(op) {}
  bool add(const c10::IValue& v, const c10::TypePtr& type);
  const std::string& str() const { return key_; }

 private:
  bool tensor(const at::Tensor& t);
  std::string key_;
  std::vector<const c10::StorageImpl*> storages_;
};

// The plan of the op whose arguments are stack[first..]: cached by `key` (when given).
std::shared_ptr<const Plan> plan_for(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                                     size_t first, const std::vector<Argument>& sims,
                                     Runner runner, const CallKey* key);

// An argument of an op with its tensors (also inside tensor lists and optional tensor lists)
// replaced by `f(tensor)` and a sim device argument by `device`: the meta twin of a call
// (meta_plan.cpp) and its queued CPU twin (deferral.cpp).
template <class F>
c10::IValue replace_tensors(const c10::IValue& v, F&& f, c10::Device device) {
  if (v.isTensor()) {
    return f(v.toTensor());
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> list;
    for (const at::Tensor& x : v.toTensorList().vec()) list.push_back(f(x));
    return list;
  }
  if (v.isOptionalTensorList()) {
    c10::List<std::optional<at::Tensor>> list;
    for (const std::optional<at::Tensor>& x : v.toOptionalTensorList().vec()) {
      list.push_back(x.has_value() ? std::optional<at::Tensor>(f(*x)) : x);
    }
    return list;
  }
  if (v.isDevice() && v.toDevice().type() == kSim) {
    return device;
  }
  return v;
}

}  // namespace sim
}  // namespace torch_pipeline
