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

#include <atomic>
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

// What the meta computation found: the op's results, each None, an undefined tensor (an optional
// output the op did not compute: convolution_backward's masked-off gradients), a (written)
// argument or a new tensor of this layout. The same for every call whose arguments have the same
// key (below). NB: None and an undefined tensor differ on the stack: a Tensor return unboxes
// None as "Expected Tensor but got None".
struct Result {
  enum Kind { kNone, kUndefined, kArgument, kNew } kind = kNone;
  size_t argument = 0;  // index into the Arguments
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
};
// See Note [A plan is checked against the CPU kernel once].
struct Plan {
  bool deferrable = false;
  std::vector<std::optional<std::vector<Result>>> returns;  // nullopt: a single result in [0]
  std::vector<std::vector<Result>> lists;                   // per return: its results
  enum Check : int { kUnchecked, kAgrees, kDisagrees };
  mutable std::atomic<int> check{kUnchecked};  // plans are per thread; atomic for clarity only
};

// Note [A plan is checked against the CPU kernel once]
// A meta kernel is not always its CPU kernel's twin: native_batch_norm's CPU kernel returns empty
// save_mean/save_invstd where the meta kernel gives them C elements, native_layer_norm's CPU kernel
// returns float statistics for bfloat16 inputs, _embedding_bag's CPU kernel sizes offset2bag by
// mode. A queued kernel whose results do not fit the outputs allocated from the plan fails on its
// stream, or worse, copies into them with a conversion. So the first call of each plan runs at once
// (as a syncing op does), and its results are compared with the plan (check_plan below): only a
// plan the CPU kernel agreed with defers later calls; one it disagreed with never does.
struct UncheckedPlan {
  std::shared_ptr<const Plan> plan;
  std::vector<Argument> arguments;                  // the sim arguments, as try_defer saw them
  std::vector<std::vector<int64_t>> written_sizes;  // per written argument, before the kernel
  std::vector<std::vector<int64_t>> written_strides;
  std::vector<int> written_bits;  // is_conj() * 2 + is_neg()
};

// Compares the results of the op's first call (the sim values on `stack` after the synchronous
// run, `nrets` of them at its end) and its written arguments with the plan; records the verdict.
void check_plan(const UncheckedPlan& unchecked, const torch::jit::Stack& stack, size_t nrets);

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
                                     size_t first, const std::vector<Argument>& sims, Runner runner,
                                     const CallKey* key);

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
