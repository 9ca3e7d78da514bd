// The tracker's shared state (see state.h): the process-wide switches and counters, the state of
// the current live period and its reset, and stats(). Touches only what state.h declares.
#include "state.h"

#include "../warn.h"

#include <algorithm>
#include <string>
#include <tuple>

#include "graph_capture.h"
#include "storages.h"

namespace torch_pipeline {
namespace tracking {
namespace detail {

std::atomic<bool> g_live{false};
std::atomic<bool> g_observing{false};
std::atomic<bool> g_dispatch_observing{false};
std::atomic<bool> g_enabled{true};
std::atomic<int64_t> g_pipelines{0};
std::atomic<int64_t> g_pins{0};
std::atomic<int64_t> g_host_watch{0};

namespace {
std::atomic<StreamId> g_next_host{-1};
LiveState* g_state = new LiveState();  // leaked: ops may run at exit; replaced after fork
}  // namespace

StreamId host_stream() {
  // A thread's host position is complete when its op returns; another thread's is not known to be.
  thread_local const StreamId id = g_next_host.fetch_sub(1);
  return id;
}

namespace {
// Every call is made under LiveState::mutex: the core tracker needs no lock of its own.
std::unique_ptr<core::DependencyTracker> make_tracker() {
  return std::make_unique<core::DependencyTracker>(core::DependencyTracker::kDefaultHistoryLimit,
                                                   core::DependencyTracker::Locking::kByCaller);
}
}  // namespace

LiveState::LiveState()
    : tracker(make_tracker()),
      storages([this](std::vector<StorageEntry>& dead) { forget_dead_locked(*this, dead); }) {}

LiveState& state() { return *g_state; }

void replace_state_after_fork() {
  // Only the forking thread exists; another thread may have held the old state's lock: leaked.
  const uint64_t period = g_state->period;
  g_state = new LiveState();
  g_state->period = period + 1;  // positions a thread kept from before are void
}

void LiveState::reset() {
  ++period;
  storages.clear();  // (before the tracker: entries name its ids)
  tracker = make_tracker();
  streams.clear();
  kept.clear();
  async_works.clear();
  g_host_watch.store(0, std::memory_order_relaxed);
}

namespace {
std::mutex& gap_mutex() {
  static auto* m = new std::mutex();
  return *m;
}
std::vector<std::string>& gap_names() {  // one per operator name: bounded by the operators
  static auto* names = new std::vector<std::string>();
  return *names;
}
}  // namespace

void report_gap(const std::string& op, const std::string& why) {
  count(&Counters::gaps);
  {
    std::lock_guard<std::mutex> lock(gap_mutex());
    auto& names = gap_names();
    if (std::find(names.begin(), names.end(), op) != names.end()) {
      return;
    }
    names.push_back(op);
  }
  warn_once("gap: " + op,
            "automatic synchronization cannot see the memory that " + op + " touches (" + why +
                "): its accesses are not ordered against other streams. Declare them with `with "
                "torch_pipeline.track(read=[...], write=[...]):` around the call, or run it on "
                "the default pipeline. (Warned once per operator; "
                "torch_pipeline.tracking_stats()['gap_ops'] lists them.)");
}

std::vector<std::string> gap_ops() {
  std::lock_guard<std::mutex> lock(gap_mutex());
  return gap_names();
}

}  // namespace detail

Stats stats() {
  using namespace detail;
  Stats s;
  s.live = live();
  s.ops = total(&Counters::ops);
  s.launches = total(&Counters::launches);
  s.waits = total(&Counters::waits);
  s.events = total(&Counters::events);
  s.host_waits = total(&Counters::host_waits);
  s.record_streams = total(&Counters::record_streams);
  s.pin_waits = total(&Counters::pin_waits);
  s.keep_alives = total(&Counters::keep_alives);
  s.released = total(&Counters::released);
  s.unclaimed = total(&Counters::unclaimed);
  s.gaps = total(&Counters::gaps);
  s.compiled_regions = total(&Counters::compiled_regions);
  s.compiled_unwrapped = total(&Counters::compiled_unwrapped);
  s.captures = total(&Counters::captures);
  s.capture_forks = total(&Counters::capture_forks);
  s.capture_joins = total(&Counters::capture_joins);
  s.capture_kept = total(&Counters::capture_kept);
  s.graph_replays = total(&Counters::graph_replays);
  s.polls_paused = total(&Counters::polls_paused);
  s.unobserved = total(&Counters::unobserved);
  s.observer = observer() == Observer::kDispatcher ? "dispatcher" : "record_function";
  s.captures_underway = captures_underway();
  s.queries_paused = query_gate().paused();
  s.gap_ops = gap_ops();
  LiveState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  s.storages = st.tracker->num_storages();
  s.kept_alive = st.kept.size();
  st.kept.for_each_storage([&](StreamId, uint64_t, const c10::Storage& storage) {
    s.kept_alive_bytes += storage.nbytes();
  });
  s.streams = st.streams.size();
  return s;
}

PartsSnapshot parts_snapshot() {
  using namespace detail;
  PartsSnapshot s;
  LiveState& st = state();
  s.async_works = st.async_works.size();  // (its own lock, a leaf: before the state's)
  std::lock_guard<std::mutex> lock(st.mutex);
  s.period = st.period;
  s.tracker_storages = st.tracker->num_storages();
  s.tracker_records = st.tracker->num_records();
  s.tracker_history = st.tracker->num_history_entries();
  s.stream_entries = st.streams.size();
  st.streams.for_each([&](const StreamEntry& e) {
    s.streams_in_flight += e.log.in_flight();
    s.stream_events += e.log.events();
  });
  s.storage_entries = st.storages.size();
  s.young = st.storages.young();
  s.sweeps = st.storages.sweeps();
  s.kept = st.kept.size();
  std::tie(s.kept_queued, s.kept_streams) = st.kept.count_queued();
  return s;
}

}  // namespace tracking
}  // namespace torch_pipeline
