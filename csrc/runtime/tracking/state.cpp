// The tracker's shared state (see state.h): the process-wide switches and counters, the state of
// the current live period and its reset, and stats(). Touches only what state.h declares.
#include "state.h"

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

LiveState& state() {
  return *g_state;
}

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
  LiveState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  s.storages = st.tracker->num_storages();
  s.kept_alive = st.kept_alive;
  s.streams = st.streams.size();
  return s;
}

}  // namespace tracking
}  // namespace torch_pipeline
