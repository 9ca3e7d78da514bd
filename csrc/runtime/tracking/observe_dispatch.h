// Internal to the observer room: what the dispatcher path's two files share (observe_dispatch.cpp,
// the keys and the boxed fallback; observe_dispatch_unboxed.cpp, its unboxed kernels). Note [The
// observer's dispatch keys] is in observe_dispatch.cpp.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKeySet.h>
#include <torch/library.h>

namespace torch_pipeline {
namespace tracking {
namespace detail {

constexpr c10::DispatchKey kObserverKey = c10::DispatchKey::TESTING_ONLY_GenericMode;
constexpr c10::DispatchKey kInnerKey = c10::DispatchKey::CustomRNGKeyId;
constexpr c10::DispatchKeySet kBothKeys =
    c10::DispatchKeySet(kObserverKey) | c10::DispatchKeySet(kInnerKey);

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
