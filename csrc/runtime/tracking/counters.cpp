// The tracker's counters (see counters.h): per-thread blocks, their registry, and their sums.
#include "counters.h"

#include <algorithm>
#include <mutex>
#include <vector>

namespace torch_pipeline {
namespace tracking {
namespace detail {

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

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
