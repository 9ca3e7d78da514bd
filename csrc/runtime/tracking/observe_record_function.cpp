// The RecordFunction path of the observer module (Note [Two ways to observe ops] in observer.h):
// one global callback with inputs and outputs, paid on every RecordFunction event of every thread.
// Also sees Dynamo's "Torch-Compiled Region" ranges, so a compiled region whose kernels nothing
// tracked is reported; the dispatcher path installs that check alone (add_dynamo_range_check)
// when AOTAutograd's calls are not wrapped. Touches only its thread-local ranges; the rest is
// observer.cpp's.
#include "../warn.h"
#include "observer.h"
#include "state.h"

#include <cstring>
#include <optional>
#include <vector>

namespace torch_pipeline {
namespace tracking {
namespace detail {

namespace {

// The name of Dynamo's range around a call of compiled code ("Torch-Compiled Region: 0/0").
constexpr char kDynamoRange[] = "Torch-Compiled Region";

// Dynamo's ranges open on this thread, innermost last: their level and observer_progress() when
// they started.
struct DynamoRange {
  int level;
  std::pair<uint64_t, uint64_t> progress;
};
thread_local std::vector<DynamoRange> t_dynamo;

// What on_start made of each event, innermost last (on_end answers it): what op_start took it
// for, or nothing (a callee of an observed op, rejected before any lookup).
thread_local std::vector<std::optional<Taken>> t_taken;

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (!g_observing.load(std::memory_order_relaxed)) {
    return nullptr;  // a forked child's copy of the parent's callback, or being removed
  }
  if (inside_observed_op() && std::strcmp(fn.name(), "inductor::resize_storage_bytes_") != 0) {
    // (the common callee event: rejected before any lookup; a storage resize may be observed
    // inside a compiled region, op_start decides)
    t_taken.emplace_back();
    return nullptr;
  }
  const OpFacts& facts = op_facts(fn);
  const Taken taken = op_start(facts, fn.inputs());
  t_taken.push_back(taken);
  if (taken == Taken::kTransparent && !fn.operator_name().has_value() &&
      std::strncmp(fn.name(), kDynamoRange, sizeof(kDynamoRange) - 1) == 0) {
    t_dynamo.push_back(DynamoRange{observer_level(), observer_progress()});
  }
  return nullptr;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (t_taken.empty()) {
    return;  // the callback was installed while this op ran (or a fork reset this thread)
  }
  const std::optional<Taken> taken = t_taken.back();
  t_taken.pop_back();
  if (!taken.has_value()) {
    return;
  }
  if (!t_dynamo.empty() && t_dynamo.back().level == observer_level()) {
    const DynamoRange d = t_dynamo.back();
    t_dynamo.pop_back();
    if (d.progress == observer_progress() && !regions_wrapped()) {
      // Nothing in it was tracked: its kernels ran where the tracker could not see them.
      report_compiled_gap(fn.name());
    }
  }
  op_end(*taken, fn.outputs());
}

// The dispatcher path's check of Dynamo's ranges (add_dynamo_range_check): per event, innermost
// last, observer_progress() at the start of a range, or nothing for other events.
thread_local std::vector<std::optional<std::pair<uint64_t, uint64_t>>> t_events;

std::unique_ptr<at::ObserverContext> on_range_start(const at::RecordFunction& fn) {
  if (!fn.operator_name().has_value() &&
      std::strncmp(fn.name(), kDynamoRange, sizeof(kDynamoRange) - 1) == 0) {
    t_events.emplace_back(observer_progress());
  } else {
    t_events.emplace_back();
  }
  return nullptr;
}

void on_range_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (t_events.empty()) {
    return;  // the callback was installed while this op ran
  }
  const auto started = t_events.back();
  t_events.pop_back();
  if (started.has_value() && *started == observer_progress() && !regions_wrapped() &&
      g_dispatch_observing.load(std::memory_order_relaxed)) {
    report_compiled_gap(fn.name());
  }
}

}  // namespace

void report_compiled_gap(const char* name) {
  count(&Counters::compiled_unwrapped);
  warn_once("compiled region not tracked",
            std::string("automatic synchronization could not see the kernels of a compiled region "
                        "(") +
                name +
                "): neither its AOTAutograd call nor any operator in it was "
                "tracked, so it may race with other pipelines. torch_pipeline wraps AOTAutograd's "
                "compiled calls (the default inductor backend and aot_* backends); for another "
                "backend, declare the region's tensors with `with tp.track(read=..., write=...)` "
                "around the call. Warned once.");
}

at::CallbackHandle add_dynamo_range_check() {
  return at::addGlobalCallback(at::RecordFunctionCallback(&on_range_start, &on_range_end)
                                   .scopes({at::RecordScope::FUNCTION}));
}

at::CallbackHandle add_observer() {
  return at::addGlobalCallback(at::RecordFunctionCallback(&on_start, &on_end)
                                   .needsInputs(true)
                                   .needsOutputs(true)
                                   .scopes({at::RecordScope::FUNCTION}));
}

void reset_dynamo_ranges_after_fork() {
  t_dynamo.clear();
  t_taken.clear();
  t_events.clear();
}

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
