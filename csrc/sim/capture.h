// The sim device's twin of CUDA stream capture in its global mode (docs/design.md §5 "Graph
// capture twin"), so the tracker's capture rules are tested without a GPU:
//
// * begin_capture(s) starts a capture on a non-default sim stream; end_capture(s) ends it on the
//   same stream and returns a Graph. Ops keep running eagerly (the twin records no kernels), but
//   ops on capturing streams are race-checked against what was captured only, in the capture's
//   own checker: captured work does not run at capture time, so it races neither with work from
//   before nor after it; its replays do (Graph::replay, one op touching what the capture touched).
// * An event recorded on a capturing stream belongs to the capture. A stream that waits for one
//   joins the capture; a capturing stream that waits for an event recorded outside its capture
//   raises (cudaErrorStreamCaptureIsolation).
// * While any capture is underway, every event or stream query and every host synchronization in
//   the process raises (cudaErrorStreamCaptureUnsupported) and invalidates the captures, so that
//   end_capture raises too (cudaErrorStreamCaptureInvalidated).
// * end_capture raises when a stream joined the capture and the origin never waited for its last
//   captured op (cudaErrorStreamCaptureUnjoined).
// The capture status reaches the runtime through its capture probe (csrc/runtime/capture.h).
#pragma once

#include "race_checker.h"

#include "../core/capture_state.h"

#include <c10/core/Stream.h>

#include <memory>
#include <string>
#include <vector>

namespace torch_pipeline {
namespace sim {

// The capture timeline `t` captures into (core::kNoCapture if none). Lock-free when none is
// underway.
core::CaptureId capture_of(Timeline t);
// Raises (and invalidates every capture underway) if any capture is underway; `what` names the
// call, e.g. "event query".
void check_not_capturing(const char* what);

// An op on timeline `t`: if t is capturing, checked and recorded in its capture (returns true).
bool record_captured(Timeline t, const std::string& op, const std::vector<Access>& accesses);
// An event recorded on `t`: its capture and its clock there, if t is capturing.
bool captured_snapshot(Timeline t, core::CaptureId& capture, VectorClock& clock);
// Timeline `waiter` waits for an event recorded in `capture` (kNoCapture: outside any) with
// `clock`: returns true if the wait belongs to a capture (joined there, or the capture is over
// and there is nothing to wait for); raises for a capturing waiter and an event of elsewhere.
bool captured_wait(Timeline waiter, core::CaptureId capture, const VectorClock& clock);

// What a capture touched: replayed as one op on the replaying stream.
class Graph {
 public:
  explicit Graph(std::vector<Access> accesses) : accesses_(std::move(accesses)) {}
  void replay(const c10::Stream& stream) const;
  size_t accesses() const { return accesses_.size(); }

 private:
  std::vector<Access> accesses_;
};

core::CaptureId begin_capture(const c10::Stream& stream);
std::shared_ptr<Graph> end_capture(const c10::Stream& stream);
// Registers the capture probe with the runtime (from enable()).
void register_capture_probe();
// In a forked child: no capture survives fork.
void reset_captures_in_child();

}  // namespace sim
}  // namespace torch_pipeline
