// Internal to the tracker (csrc/runtime/tracking/*.cpp only). The state of one live period
// (LiveState: a class made of owned parts, table below) and the process-wide switches the op path
// reads without a lock. A part's fields are private to it: a module changes another part's state
// only through that part's methods.
//
// The parts of a LiveState (docs/design.md, "The tracker's parts"):
//   tracker      core::DependencyTracker: last writer and readers per storage, clocks per stream
//   streams      StreamTable (stream_table.h): an entry and core::StreamLog per stream, baseline
//   storages     StorageTable (core::StorageTable): an entry per storage, young outputs
//   kept         KeptStorages (kept_storages.h): storages kept alive per stream of use
//   async_works  AsyncWorks (async_works.h): async collectives until work.wait()
// The modules that use them: state.cpp (this state, its reset, stats), life.cpp (going live and
// idle), observer.* and observe_*.cpp (seeing ops), launch.* (an op's launch and end),
// streams.* (events by position, external waits), storages.* (entries for c10 storages),
// keep_alive.* (allocator safety), pins.* (task pins), host_watch.* (CPU memory of non_blocking
// copies), collectives.cpp, track_scope.cpp, compiled.cpp, graph_capture.* and graph_replay.cpp
// (graph capture: each capture underway is a LiveState of its own).
//
// Note [Tracker locks]: the tracker's locks, in the order they may be taken (never against it):
//   0. going live and idle: the callbacks' registration (life.cpp)
//   1. a capture's LiveState::mutex (TrackedCapture, graph_capture.h)
//   2. the main LiveState::mutex (state()): guards every part of the state but async_works
//   3. leaves, taken last and held without calling out: AsyncWorks' own, the counters' list
//      (counters.h), the gap names (report_gap), a task's pins and the blocking-wait hook
//      (pins.cpp), a captured graph's (graph_replay.cpp), the query gate's (core)
// A part that is thread-local (ThreadRun, the observer's Tls) or atomic (the switches below, the
// per-thread counters) takes none. No lock is held while waiting for a device or another thread.
// Storages let go of on the op path are dropped after the lock (collected in a vector declared
// before it): dropping the last reference frees memory, under the allocator's own lock.
#pragma once

#include "../tracking.h"
#include "async_works.h"
#include "counters.h"
#include "kept_storages.h"
#include "stream_table.h"

#include "../../core/dependency_tracker.h"
#include "../../core/storage_table.h"

#include <c10/core/Event.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torch_pipeline {
namespace tracking {
namespace detail {

using core::Position;
using core::StorageId;
using core::StreamId;
using PinPtr = std::shared_ptr<TaskPins::State>;

// ---- process-wide switches (lock-free reads on the op path; the counters: counters.h) ---------
extern std::atomic<bool> g_live;       // ops are tracked (set after going live, cleared first
                                       // when going idle)
extern std::atomic<bool> g_observing;  // the RecordFunction path's callback installed is this
                                       // process's (not a forked child's copy of the parent's)
extern std::atomic<bool> g_dispatch_observing;  // the dispatcher path observes keyed threads
extern std::atomic<bool> g_enabled;
extern std::atomic<int64_t> g_pipelines;   // non-default pipelines alive
extern std::atomic<int64_t> g_pins;        // TaskPins with tensors, not released
extern std::atomic<int64_t> g_host_watch;  // watched CPU storages, not swept

// A gap (docs/design.md, "Coverage: no silent gaps"): an op on a device whose accesses the
// tracker cannot account for. Counted, its name kept, and warned about once per operator name.
void report_gap(const std::string& op, const std::string& why);
std::vector<std::string> gap_ops();

// The host timelines (CPU ops on watched memory): one per thread, ids -1, -2, ...
StreamId host_stream();
inline bool is_host(StreamId id) { return id < 0; }

// ---- one live period ------------------------------------------------------------------------
// The runtime's fields of a storage entry, each one module's: only that module's access struct
// (a friend defined in its .cpp) changes it; others may read.
class StorageData {
 public:
  bool host_watched() const { return host_watched_; }  // an async copy touched it (host_watch.*)
  bool pinned() const { return !pins_.empty(); }       // a task pins it (pins.*)

 private:
  friend struct HostWatchAccess;  // host_watch.cpp
  friend struct PinsAccess;       // pins.cpp
  bool host_watched_ = false;
  std::vector<PinPtr> pins_;
};
using StorageTable = core::StorageTable<const c10::StorageImpl*,
                                        c10::weak_intrusive_ptr<c10::StorageImpl>, StorageData>;
using StorageEntry = StorageTable::Entry;

class LiveState {
 public:
  LiveState();
  // Starts a new live period: everything of the old one is dropped. Lock held.
  void reset();

  std::mutex mutex;
  uint64_t period = 1;  // the live period: bumped by every reset; positions of another are void
  std::unique_ptr<core::DependencyTracker> tracker;
  StreamTable streams;
  StorageTable storages;
  KeptStorages kept;
  AsyncWorks async_works;
};

// The state of the current live period (replaced in a forked child).
LiveState& state();
// In a forked child: a new state (the old one and its lock are leaked), in a later period.
void replace_state_after_fork();

// An access of an op: a tensor (with storage and data) and whether it is written.
struct Access {
  const at::Tensor* tensor;
  bool write;
  bool may_move = false;  // a write that may give the storage new memory (OpFacts::may_move)
};
// A tensor with storage that holds memory. (Inline: called per tensor on the op path.)
inline bool has_data(const at::Tensor& t) {
  return t.defined() && t.has_storage() && t.storage().data() != nullptr;
}

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
