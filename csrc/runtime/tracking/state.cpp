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
std::atomic<bool> g_dispatch_observing{false};
std::atomic<bool> g_enabled{true};
std::atomic<int64_t> g_pipelines{0};
std::atomic<int64_t> g_pins{0};
std::atomic<int64_t> g_host_watch{0};
namespace {
std::mutex* g_counters_mutex = new std::mutex();  // (leaked: threads count until exit)
std::vector<Counters*>* g_thread_counters = new std::vector<Counters*>();
Counters* g_exited_counters = new Counters();  // what exited threads counted
__thread bool t_counters_gone = false;         // this thread's block was folded in (its exit)

constexpr Counter kAllCounters[] = {&Counters::ops,
                                    &Counters::launches,
                                    &Counters::waits,
                                    &Counters::events,
                                    &Counters::host_waits,
                                    &Counters::record_streams,
                                    &Counters::pin_waits,
                                    &Counters::keep_alives,
                                    &Counters::released,
                                    &Counters::unclaimed,
                                    &Counters::gaps,
                                    &Counters::compiled_regions,
                                    &Counters::compiled_unwrapped,
                                    &Counters::captures,
                                    &Counters::capture_forks,
                                    &Counters::capture_joins,
                                    &Counters::capture_kept,
                                    &Counters::graph_replays,
                                    &Counters::polls_paused,
                                    &Counters::unobserved};

struct ThreadCounters {
  Counters* block = new Counters();
  ThreadCounters() {
    std::lock_guard<std::mutex> lock(*g_counters_mutex);
    g_thread_counters->push_back(block);
  }
  ~ThreadCounters() {
    t_counters = nullptr;
    t_counters_gone = true;
    std::lock_guard<std::mutex> lock(*g_counters_mutex);
    for (const Counter c : kAllCounters) {
      (g_exited_counters->*c).fetch_add((block->*c).load(std::memory_order_relaxed));
    }
    auto& v = *g_thread_counters;
    v.erase(std::remove(v.begin(), v.end(), block), v.end());
    delete block;
  }
};
}  // namespace

__thread Counters* t_counters = nullptr;
Counters& register_thread_counters() {
  if (t_counters_gone) {
    return *g_exited_counters;  // (a count from another thread-local's destructor, at exit)
  }
  thread_local ThreadCounters mine;  // (its destructor folds the counts in at thread exit)
  t_counters = mine.block;
  return *mine.block;
}

uint64_t total(Counter counter) {
  std::lock_guard<std::mutex> lock(*g_counters_mutex);
  uint64_t sum = (g_exited_counters->*counter).load();
  for (const Counters* c : *g_thread_counters) {
    sum += (c->*counter).load(std::memory_order_relaxed);
  }
  return sum;
}

void reset_counters_after_fork() {
  g_counters_mutex = new std::mutex();  // (the parent's may have been held by another thread)
}

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

void reset_locked(LiveState& st) {
  ++st.period;
  st.storages.clear();  // (before the tracker: entries name its ids)
  st.tracker = make_tracker();
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

bool has_data(const at::Tensor& t) {
  return t.defined() && t.has_storage() && t.storage().data() != nullptr;
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
