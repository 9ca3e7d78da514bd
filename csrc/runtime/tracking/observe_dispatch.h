// Internal to the observer module: what the dispatcher path's two files share
// (observe_dispatch.cpp, the keys and the boxed fallback; observe_dispatch_unboxed.cpp, its unboxed
// kernels). Note [The observer's dispatch keys] is in observe_dispatch.cpp.
#pragma once

#include "observer.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace torch_pipeline {
namespace tracking {
namespace detail {

constexpr c10::DispatchKey kObserverKey = c10::DispatchKey::TESTING_ONLY_GenericMode;
constexpr c10::DispatchKey kInnerKey = c10::DispatchKey::CustomRNGKeyId;
constexpr c10::DispatchKeySet kBothKeys =
    c10::DispatchKeySet(kObserverKey) | c10::DispatchKeySet(kInnerKey);

// Runs an op below the observer's key as op_start took it: an observed op (or one inside one) with
// both keys excluded, so its callees never reach the observer; an unclaimed one (tensors without
// storage) with the inner key included, so the real ops inside __torch_dispatch__ are seen there;
// any other as it is.
template <class Run>
decltype(auto) run_taken(Taken taken, Run&& run) {
  if (taken == Taken::kClaimed || taken == Taken::kInside) {
    c10::impl::ExcludeDispatchKeyGuard callees(kBothKeys);
    return run();
  }
  if (taken == Taken::kUnclaimed) {
    c10::impl::IncludeDispatchKeyGuard inside_python(kInnerKey);
    return run();
  }
  return run();
}

// The boxed fallback at the observer's key (the unboxed kernels hand it every call they do not
// run themselves).
void observe_boxed(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                   torch::jit::Stack* stack);

// Note [Unboxed observer kernels]: registers them on `lib` (an IMPL library of namespace aten at
// the observer's key).
void register_unboxed_kernels(torch::Library& lib);

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
