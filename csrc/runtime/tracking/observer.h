// Internal to the tracker. The observer module: what the tracker does with an op it sees, whichever
// path saw it (Note [Two ways to observe ops]): the outermost op of a thread that touches real
// storage, its accesses (arguments, with the write flags of its schema) and fresh outputs, handed
// to the pins, host-watch, launch and collectives modules; ops on tensors without storage left to
// the ops they call (unclaimed), and gaps. Touches only its thread-local state and its counters.
//
// Note [Two ways to observe ops]: the dispatcher path (observe_dispatch.cpp, the default) is a
// boxed fallback on a thread-local mode key, paid once per observed op: the key is excluded
// while an observed op runs, so the ops it calls never reach the fallback. The RecordFunction
// path (observe_record_function.cpp) is a global callback that every thread pays on every
// RecordFunction event, callees included. TORCH_PIPELINE_OBSERVER=dispatcher|record_function
// chooses (docs/design.md, "What observing costs").
#pragma once

#include "../op_facts.h"

#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <utility>

namespace torch_pipeline {
namespace tracking {
namespace detail {

// What op_start made of an op (op_end takes it back).
enum class Taken : uint8_t {
  kInside,       // inside an observed op or a compiled region: not looked at
  kTransparent,  // a view or metadata query (or no dispatcher op): looked through to its callees
  kUnclaimed,    // tensors without storage: left to the ops it calls (op_end reports a gap)
  kClaimed,      // observed: launched before it runs, finished by op_end; callees not looked at
};

// Before an op runs, with its boxed arguments (valid until op_start returns; what it keeps it
// copies), and after it (its returns; none when it failed). Every op_start is answered by one
// op_end on the same thread, innermost first; ops nest per thread.
Taken op_start(const OpFacts& facts, c10::ArrayRef<c10::IValue> inputs);
void op_end(Taken taken, c10::ArrayRef<c10::IValue> outputs);

// The common case of CPU code, decided before any lookup: nothing on a device (no device
// tensor or device argument), no tensor without storage, no watched host memory, no pins. Such
// an op needs nothing from the tracker, nor do the ops it calls (counted as an observed op).
bool host_only_op(c10::ArrayRef<c10::IValue> inputs);
// Whether CPU ops can matter to the tracker now: watched host memory or pinned tensors.
bool host_memory_observed();
// Whether `t` is, for host_only_op and the unboxed kernels alike, a plain CPU tensor (or
// undefined). A CPU tensor that may stand for others (a wrapper subclass, a torch.func wrapper,
// sparse, nested) is not: the full scan (op_start) decides. Read from the key set: no call.
inline bool host_tensor(const at::Tensor& t) {
  static constexpr c10::DispatchKeySet kMayStandIn = c10::DispatchKeySet(
      {c10::DispatchKey::Python, c10::DispatchKey::FuncTorchBatched,
       c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::Functionalize,
       c10::DispatchKey::Sparse, c10::DispatchKey::SparseCsr, c10::DispatchKey::NestedTensor});
  if (!t.defined()) {
    return true;
  }
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  return impl->device_type() == c10::kCPU && (impl->key_set() & kMayStandIn).empty();
}

// Whether this thread is inside an observed op or a compiled region now.
bool inside_observed_op();
// This thread's nesting of op_start calls, and (compiled regions opened, ops looked at) so far:
// a Dynamo range in which neither moved ran kernels the tracker could not see.
int observer_level();
std::pair<uint64_t, uint64_t> observer_progress();
// Counts and warns once: a compiled region ran whose kernels the tracker did not see.
void report_compiled_gap(const char* name);

// The dispatcher path: registers its fallback (once; false, after a warning, when the key is
// taken), installs the sampled check of threads without the key (the caller keeps the handle),
// and starts observing (a new generation for the Python layer's sweep of its threads).
bool register_dispatch_observer();
at::CallbackHandle add_sampled_check();
// Whether the backend of `type` checks every device op itself (set_backend_checks in tracking.h,
// and the test switch set_unobserved_checks on): then no sampled check is wanted for it.
bool backend_checks(c10::DeviceType type);
void dispatch_observing_started();

// The dispatcher path's check of Dynamo's "Torch-Compiled Region" ranges, installed while
// range_check_due(): a range in which nothing was tracked is reported (report_compiled_gap). A
// callback without sampling puts every op of every thread on RecordFunction's slow path (about
// 2,000 instructions per sim op), so only then.
at::CallbackHandle add_dynamo_range_check();
// Called when range_check_due() may have changed (life.cpp installs the check above if it is due
// now).
void compiled_state_changed();

// The RecordFunction path: installs its callbacks (the caller keeps the handle, to remove it).
at::CallbackHandle add_observer();
// The RecordFunction path's per-thread Dynamo ranges start over (in a forked child).
void reset_dynamo_ranges_after_fork();
// In a forked child (on the forking thread): its per-thread state starts over.
void reset_observer_thread_after_fork();

// A compiled region on this thread (CompiledRegion): until end_region(), ops are not observed.
// False (and nothing changes) when the thread is already inside an observed op or region.
bool begin_region();
void end_region();
// Whether torch_pipeline/_compiled.py wrapped AOTAutograd's compiled calls (set_regions_wrapped in
// tracking.h). Without it, a Dynamo "Torch-Compiled Region" in which nothing was tracked is
// counted and warned about once.
bool regions_wrapped();
// Whether a Dynamo region can run unwrapped: torch._dynamo (whose convert_frame opens those
// ranges) is imported (set_dynamo_loaded in tracking.h) and regions are not wrapped.
bool range_check_due();

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
