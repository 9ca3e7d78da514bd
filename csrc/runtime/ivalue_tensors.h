// The one walk over the tensors inside an IValue, used by the op observer, the sim device's
// kernels and the race checker's host path: a tensor, lists of tensors (Tensor[], Tensor?[]),
// generic lists, tuples and dicts (keys and values), nested to any depth. Undefined tensors and
// None entries are skipped; objects (torchbind, script objects) are not entered.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <optional>
#include <utility>

namespace torch_pipeline {

// Calls f(const at::Tensor&) for each defined tensor in `v`, in order. The reference may be a
// temporary (an element of a list): copy the tensor to keep it beyond the call. Returns early
// (and returns true) as soon as f returns true, when f returns bool.
template <typename F>
bool for_each_tensor(const c10::IValue& v, F&& f) {
  auto visit = [&f](const at::Tensor& t) -> bool {
    if (!t.defined()) {
      return false;
    }
    if constexpr (std::is_same_v<decltype(f(t)), bool>) {
      return f(t);
    } else {
      f(t);
      return false;
    }
  };
  if (v.isTensor()) {
    return visit(v.toTensor());
  }
  if (v.isTensorList() || v.isOptionalTensorList()) {
    // NB: the elements as IValues (no List copy, no Tensor copy: no reference-count traffic).
    for (const c10::IValue& x : v.toListRef()) {
      if (x.isTensor() && visit(x.toTensor())) return true;
    }
    return false;
  }
  if (v.isList()) {
    for (const c10::IValue& x : v.toListRef()) {
      if (for_each_tensor(x, f)) return true;
    }
    return false;
  }
  if (v.isTuple()) {
    for (const c10::IValue& x : v.toTupleRef().elements()) {
      if (for_each_tensor(x, f)) return true;
    }
    return false;
  }
  if (v.isGenericDict()) {
    for (const auto& entry : v.toGenericDict()) {
      if (for_each_tensor(entry.key(), f) || for_each_tensor(entry.value(), f)) return true;
    }
    return false;
  }
  return false;
}

// Whether any tensor in `v` satisfies `pred`.
template <typename P>
bool any_tensor(const c10::IValue& v, P&& pred) {
  return for_each_tensor(v, [&pred](const at::Tensor& t) -> bool { return pred(t); });
}

}  // namespace torch_pipeline
