// Internal to the tracker. The async-collectives room: c10d ops that return a Work (async_op=True)
// write their tensors on a stream of the process group's own; the tracker remembers them by Work
// until work.wait() (tracking::work_waited) records them as written on the waiter's streams.
// Touches LiveState::async_works; records through TrackScope.
#pragma once

#include "state.h"

#include <ATen/record_function.h>

#include <vector>

namespace torch_pipeline {
namespace tracking {
namespace detail {

// A c10d op ended: if it returned a Work, remember the device tensors it writes (`accesses`).
void note_async_collective(const at::RecordFunction& fn, const std::vector<Access>& accesses);

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
