// The boxed fallback's deferral in asynchronous mode (docs/design.md,
// "Asynchronous mode and the latency model"): an op on sim tensors is queued on its stream instead
// of run. Its outputs' sizes, strides and dtypes come from running the op on meta tensors of the
// same layout; the sim outputs are allocated on the current stream at once, and the queued kernel
// runs the CPU kernel on CPU aliases of the inputs (that do not own the sim memory) and copies its
// results into the outputs (in-place and out= ops write directly). An op whose outputs cannot be
// known without its data (no meta kernel, data-dependent sizes, host results, random numbers, an
// out= argument it resizes, a result that is a view of an input, non-scalar CPU tensor arguments)
// is not deferred: the fallback then waits for the stream and runs it at once, like CUDA's syncing
// ops.
#pragma once

#include "race_checker.h"

#include <ATen/core/stack.h>
#include <c10/core/DispatchKeySet.h>

namespace c10 {
class OperatorHandle;
}  // namespace c10

namespace torch_pipeline {
struct OpFacts;

namespace sim {

// Runs an op on a stack whose tensors are of one backend: `keys` is the backend's key set (CPU
// for the kernel, Meta for the output metadata). The default runs the op's own kernel.
using Runner = void (*)(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                        c10::DispatchKeySet keys);

struct UncheckedPlan;

// Queues the op on stream `t` of the current device and replaces its arguments on `stack` by its
// sim results; false (stack untouched, nothing recorded) when the op cannot be deferred. When the
// op could be deferred by a plan not yet checked against the CPU kernel, `unchecked` receives it:
// the caller runs the op at once and checks the plan with its results (meta_plan.h).
bool try_defer(const c10::OperatorHandle& op, torch::jit::Stack* stack, const OpFacts& facts,
               Runner runner, Timeline t, UncheckedPlan* unchecked);

}  // namespace sim
}  // namespace torch_pipeline
