// Internal to the tracker. Its counters (what stats() reports): one block per thread, summed on
// demand. Lock-free on the op path; the list of blocks has a lock of its own (Note [Tracker
// locks]).
#pragma once

#include <atomic>
#include <cstdint>

namespace torch_pipeline {
namespace tracking {
namespace detail {

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

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
