// Internal to the tracker. A scope: accesses declared for work the observer does not see op by op
// (tp.track's raw kernels, a compiled region), launched on the current streams of their devices
// when the scope opens and ended when it closes, like one op. Used by TrackScope and
// CompiledRegion (tracking.h).
#pragma once

#include "launch.h"

#include <vector>

namespace torch_pipeline {
namespace tracking {
namespace detail {

// Waits for the pins of the accesses, reports the CPU ones to the host watch, and launches the
// device ones (`launched` stays empty when there are none). The keep-alives the launch chose are
// the scope's (ops inside the scope must not take them): moved to `keep_alive`.
void open_scope(const std::vector<Access>& accesses, std::vector<Launched>& launched,
                uint64_t& period, std::vector<PendingKeepAlive>& keep_alive);

// Ends a scope opened with a device launch: `fresh` (may be null) are storages it made, `moved`
// (may be null) storages it gave new memory (finish() in launch.h); `what` names it in the
// warning if ending fails.
void close_scope(std::vector<Launched>& launched, uint64_t period,
                 std::vector<PendingKeepAlive>& keep_alive, const std::vector<at::Tensor>* fresh,
                 const char* what, const std::vector<at::Tensor>* moved = nullptr);

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
