// The sim device's timeline recorder (sim.trace in Python): while on, every kernel the device runs
// (with its stream, its op name and its begin and end) and every stream wait for an event (from
// the event's record to the wait's end, drawn as a flow arrow) is kept, for a Chrome / Perfetto
// trace. Times are steady-clock nanoseconds: in asynchronous mode when the stream's thread ran the
// kernel (its modelled time included), in synchronous mode when the calling thread did.
#pragma once

#include "race_checker.h"

#include <cstdint>
#include <string>
#include <vector>

namespace torch_pipeline {
namespace sim {
namespace trace {

struct Event {
  enum Kind { kKernel = 0, kWait = 1 } kind = kKernel;
  Timeline timeline = 0;  // where it ran (a wait: the waiting stream)
  std::string name;       // the op (a wait: "wait")
  int64_t begin_ns = 0;
  int64_t end_ns = 0;
  Timeline from = 0;    // a wait: the stream of the event it waited for ...
  int64_t from_ns = 0;  // ... and when that stream reached the event
};

bool on();
void start();               // clears what was kept
std::vector<Event> stop();  // stops and hands over what was kept
int64_t now_ns();
void kernel(Timeline t, const std::string& name, int64_t begin_ns, int64_t end_ns);
void wait(Timeline waiter, Timeline from, int64_t from_ns, int64_t end_ns);

}  // namespace trace
}  // namespace sim
}  // namespace torch_pipeline
