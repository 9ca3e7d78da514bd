// The tracker's shared state (see state.h): the process-wide switches and counters, the state of
// the current live period and its reset, and stats(). Touches only what state.h declares.
#include "state.h"

#include "../warn.h"

#include <algorithm>
#include <string>

#include "capture.h"
#include "storages.h"

namespace torch_pipeline {
namespace tracking {
namespace detail {

std::atomic<bool> g_live{false};
std::atomic<bool> g_observing{false};
std::atomic<bool> g_enabled{true};
std::atomic<int64_t> g_pipelines{0};
std::atomic<int64_t> g_pins{0};
std::atomic<int64_t> g_host_watch{0};
Counters g_counters;

namespace {
std::atomic<StreamId> g_next_host{-1};
LiveState* g_state = new LiveState();  // leaked: ops may run at exit; replaced after fork
}  // namespace

StreamId host_stream() {
  // A thread's host position is complete when its op returns; another thread's is not known to be.
  thread_local const StreamId id = g_next_host.fetch_sub(1);
  return id;
}

LiveState::LiveState()
    : tracker(std::make_unique<core::DependencyTracker>()),
      storages([this](std::vector<StorageEntry>& dead) { forget_dead_locked(*this, dead); }) {}

LiveState& state() { return *g_state; }

void replace_state_after_fork() {
  // Only the forking thread exists; another thread may have held the old state's lock: leaked.
  const uint64_t period = g_state->period;
  g_state = new LiveState();
  g_state->period = period + 1;  // positions a thread kept from before are void
}

void reset_locked(LiveState& st) {
  ++st.period;
  st.storages.clear();  // (before the tracker: entries name its ids)
  st.tracker = std::make_unique<core::DependencyTracker>();
  st.streams.clear();
  st.by_id.clear();
  st.baseline.clear();
  st.kept_alive = 0;
  st.launches_since_poll = 0;
  st.async_works.clear();
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
  count(g_counters.gaps);
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

bool has_data(const at::Tensor& t) {
  return t.defined() && t.has_storage() && t.storage().data() != nullptr;
}

}  // namespace detail

Stats stats() {
  using namespace detail;
  Stats s;
  s.live = live();
  s.ops = g_counters.ops.load();
  s.launches = g_counters.launches.load();
  s.waits = g_counters.waits.load();
  s.events = g_counters.events.load();
  s.host_waits = g_counters.host_waits.load();
  s.record_streams = g_counters.record_streams.load();
  s.pin_waits = g_counters.pin_waits.load();
  s.keep_alives = g_counters.keep_alives.load();
  s.released = g_counters.released.load();
  s.unclaimed = g_counters.unclaimed.load();
  s.gaps = g_counters.gaps.load();
  s.compiled_regions = g_counters.compiled_regions.load();
  s.compiled_unwrapped = g_counters.compiled_unwrapped.load();
  s.captures = g_counters.captures.load();
  s.capture_forks = g_counters.capture_forks.load();
  s.capture_joins = g_counters.capture_joins.load();
  s.capture_kept = g_counters.capture_kept.load();
  s.graph_replays = g_counters.graph_replays.load();
  s.polls_paused = g_counters.polls_paused.load();
  s.captures_underway = captures_underway();
  s.queries_paused = query_gate().paused();
  s.gap_ops = gap_ops();
  LiveState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  s.storages = st.tracker->num_storages();
  s.kept_alive = st.kept_alive;
  for (const auto& [stream, entry] : st.streams) {
    entry->kept.for_each(
        [&](uint64_t, const c10::Storage& storage) { s.kept_alive_bytes += storage.nbytes(); });
  }
  s.streams = st.streams.size();
  return s;
}

}  // namespace tracking
}  // namespace torch_pipeline
