// Internal to the tracker. The async-collectives module: c10d ops that return a Work
// (async_op=True) write their tensors on a stream of the process group's own; the tracker remembers
// them by Work until work.wait() (tracking::work_waited) records them as written on the waiter's
// streams. Touches LiveState::async_works; records through TrackScope.
#pragma once

#include "state.h"

#include <ATen/core/ivalue.h>

#include <vector>

namespace torch_pipeline {
namespace tracking {
namespace detail {

// A c10d op ended: if it returned a Work, remember the device tensors it writes (`written`, taken
// at its start: the tensors its accesses point at do not outlive the start callbacks).
void note_async_collective(c10::ArrayRef<c10::IValue> outputs, std::vector<at::Tensor>& written);

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
