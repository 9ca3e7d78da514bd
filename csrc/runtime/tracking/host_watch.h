// Internal to the tracker. The host-watch module: CPU memory that a non_blocking copy reads or
// writes on a stream is watched; a CPU op touching it first synchronizes with that copy (the host
// timelines of the core tracker), and going idle waits for copies still pending. Touches
// StorageData::host_watched, g_host_watch, and the core tracker's host positions.
#pragma once

#include "state.h"

#include <memory>
#include <vector>

namespace torch_pipeline {
namespace tracking {
namespace detail {

// Whether any CPU memory is watched (lock-free).
inline bool watching_host() { return g_host_watch.load(std::memory_order_acquire) > 0; }
// Marks `e` (a CPU storage an async copy touches) watched. LiveState::mutex held.
void watch_locked(StorageEntry& e);
// A synchronous CPU op accesses `cpu` (CPU tensors): it waits on the host for the copies that
// touched watched ones. `reads`/`writes`: scratch space. Takes LiveState::mutex; waits after it.
void host_access(const std::vector<Access>& cpu, std::vector<StorageId>& reads,
                 std::vector<StorageId>& writes);
// Going idle: events on the streams that touched watched memory, for the caller to wait for after
// the lock. LiveState::mutex held.
void pending_copies_locked(LiveState& st, std::vector<std::shared_ptr<c10::Event>>& out);

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
