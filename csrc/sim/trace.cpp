#include "trace.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <utility>

namespace torch_pipeline {
namespace sim {
namespace trace {
namespace {

std::atomic<bool> g_on{false};
std::mutex g_mutex;                                       // a leaf
std::vector<Event>* g_events = new std::vector<Event>();  // leaked: used until exit

void keep(Event e) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_on.load(std::memory_order_relaxed)) {
    g_events->push_back(std::move(e));
  }
}

}  // namespace

bool on() { return g_on.load(std::memory_order_relaxed); }

void start() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_events->clear();
  g_on.store(true);
}

std::vector<Event> stop() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_on.store(false);
  std::vector<Event> out;
  out.swap(*g_events);
  return out;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void kernel(Timeline t, const std::string& name, int64_t begin_ns, int64_t end_ns) {
  Event e;
  e.kind = Event::kKernel;
  e.timeline = t;
  e.name = name;
  e.begin_ns = begin_ns;
  e.end_ns = end_ns;
  keep(std::move(e));
}

void wait(Timeline waiter, Timeline from, int64_t from_ns, int64_t end_ns) {
  Event e;
  e.kind = Event::kWait;
  e.timeline = waiter;
  e.name = "wait";
  e.begin_ns = end_ns;
  e.end_ns = end_ns;
  e.from = from;
  e.from_ns = from_ns;
  keep(std::move(e));
}

}  // namespace trace
}  // namespace sim
}  // namespace torch_pipeline
