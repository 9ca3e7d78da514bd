// Internal to the tracker (csrc/runtime/tracking/*.cpp only). Holds the state of one live period
// (LiveState: streams, storages, the core DependencyTracker, under one lock) and the process-wide
// switches and counters the op path reads without a lock. Every room of the tracker may touch
// these; each room's header says which parts of LiveState it owns.
//
// The rooms (one responsibility each):
//   state.cpp       this state, its reset, the fork handler, stats()
//   life.cpp        going live / idle (core::LiveSwitch), pipeline counts, the callback
//   observer.*      the RecordFunction callbacks and their per-thread state
//   launch.*        an op's launch on its streams and its end (the path observer and tp.track
//   share) streams.*       the stream log: positions, events, settled; baseline and barrier;
//   external waits storages.*      the storage table: entries, young outputs, sweep keep_alive.*
//   allocator safety: keep alive or record_stream, polling pins.*          tensors pinned by tasks
//   (TaskPins) host_watch.*    CPU memory of non_blocking copies collectives.cpp async collectives
//   (work_waited) track_scope.cpp tp.track (TrackScope) compiled.cpp    compiled regions
//   (CompiledRegion) capture.*       graph capture: captures underway (each a LiveState of its
//   own), the hooks
//                   around a capture's begin and end, captured graphs and their replays
#pragma once

#include "../tracking.h"

#include "../../core/dependency_tracker.h"
#include "../../core/keep_alive_queue.h"
#include "../../core/storage_table.h"
#include "../../core/stream_log.h"

#include <c10/core/Event.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <deque>
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

// ---- process-wide switches and counters (lock-free reads on the op path) ----------------------
extern std::atomic<bool> g_live;       // ops are tracked (set after going live, cleared first
                                       // when going idle)
extern std::atomic<bool> g_observing;  // the RecordFunction path's callback installed is this
                                       // process's (not a forked child's copy of the parent's)
extern std::atomic<bool> g_dispatch_observing;  // the dispatcher path observes keyed threads
extern std::atomic<bool> g_enabled;
extern std::atomic<int64_t> g_pipelines;   // non-default pipelines alive
extern std::atomic<int64_t> g_pins;        // TaskPins with tensors, not released
extern std::atomic<int64_t> g_host_watch;  // watched CPU storages, not swept

struct Counters {
  std::atomic<uint64_t> ops{0}, launches{0}, waits{0}, events{0}, host_waits{0}, record_streams{0},
      pin_waits{0}, keep_alives{0}, released{0}, unclaimed{0}, gaps{0}, compiled_regions{0},
      compiled_unwrapped{0}, captures{0}, capture_forks{0}, capture_joins{0}, capture_kept{0},
      graph_replays{0}, polls_paused{0}, unobserved{0};
};
using Counter = std::atomic<uint64_t> Counters::*;
// Note [Per-thread counters]: each thread counts in a block of its own (no cache line that
// every op of every thread writes); stats() sums the blocks of live threads and what exited
// threads left.
// NB: a plain pointer (no constructor, no guard): one thread-local read per count.
extern __thread Counters* t_counters;
Counters& register_thread_counters();  // the first count of a thread
inline Counters& thread_counters() {
  Counters* c = t_counters;
  return c != nullptr ? *c : register_thread_counters();
}
inline void count(Counter counter, uint64_t n = 1) {
  std::atomic<uint64_t>& c = thread_counters().*counter;
  c.store(c.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);  // (one writer)
}
uint64_t total(Counter counter);
// In a forked child: the blocks of the parent's other threads stay counted; the lock is new.
void reset_counters_after_fork();

// A gap (docs/design.md, "Coverage: no silent gaps"): an op on a device whose accesses the
// tracker cannot account for. Counted, its name kept, and warned about once per operator name.
void report_gap(const std::string& op, const std::string& why);
std::vector<std::string> gap_ops();

// The host timelines (CPU ops on watched memory): one per thread, ids -1, -2, ...
StreamId host_stream();
inline bool is_host(StreamId id) { return id < 0; }

// ---- one live period ------------------------------------------------------------------------
struct StreamEntry {  // (streams.*; `kept` belongs to keep_alive.*)
  StreamEntry(StreamId i, const c10::Stream& s) : id(i), stream(s) {}
  StreamId id;
  c10::Stream stream;
  core::StreamLog<std::shared_ptr<c10::Event>> log;
  core::KeepAliveQueue<c10::Storage> kept;  // storages of other streams used here
};

struct StorageData {          // the runtime's fields of a storage entry
  bool host_watched = false;  // a CPU storage an async copy touched (host_watch.*)
  std::vector<PinPtr> pins;   // tasks pinning it (pins.*)
};
using StorageTable = core::StorageTable<const c10::StorageImpl*,
                                        c10::weak_intrusive_ptr<c10::StorageImpl>, StorageData>;
using StorageEntry = StorageTable::Entry;

struct LiveState {
  LiveState();
  std::mutex mutex;
  uint64_t period = 1;  // the live period: bumped by every reset; positions of another are void
  std::unique_ptr<core::DependencyTracker> tracker;
  // streams.*
  std::unordered_map<c10::Stream, std::unique_ptr<StreamEntry>> streams;
  std::unordered_map<StreamId, StreamEntry*> by_id;
  StreamId next_stream = 1;
  // Go-live baseline: the streams current then; each stream seen for the first time waits once
  // for the baseline event of its device.
  std::vector<std::pair<c10::Stream, c10::Event>> baseline;
  // storages.*
  StorageTable storages;
  // keep_alive.*
  size_t kept_alive = 0;  // storages kept alive, all streams
  size_t launches_since_poll = 0;
  // collectives.cpp: async collectives not waited for yet, their Work and the tensors they write.
  std::deque<std::pair<const void*, std::vector<at::Tensor>>> async_works;
};

// The state of the current live period (replaced in a forked child).
LiveState& state();
// In a forked child: a new state (the old one and its lock are leaked), in a later period.
void replace_state_after_fork();
// Starts a new live period: everything of the old one is dropped.
void reset_locked(LiveState& st);

// An access of an op: a tensor (with storage and data) and whether it is written.
struct Access {
  const at::Tensor* tensor;
  bool write;
  bool may_move = false;  // a write that may give the storage new memory (OpFacts::may_move)
};
bool has_data(const at::Tensor& t);

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
