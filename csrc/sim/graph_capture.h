// The sim device's twin of CUDA stream capture in its global mode (docs/design.md,
// "Graph capture twin"), so the tracker's capture rules are tested without a GPU:
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
// * A device's default stream that waits for an event recorded in a capture raises and
//   invalidates it (CUDA's legacy default stream never joins a capture:
//   cudaErrorStreamCaptureImplicit).
// * An op the capturing thread runs on a stream that is not in its capture while it is underway
//   is not captured: on a GPU it would run once, now, outside the graph. The twin lists them
//   (Graph::eager_ops), next to the ops it captured (Graph::captured_ops).
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

// An op on timeline `t`: if t is capturing, checked and recorded in its capture (returns true);
// else, if the calling thread began a capture that is underway, listed as run eagerly there.
bool record_captured(Timeline t, const std::string& op, const std::vector<Access>& accesses);
// An event recorded on `t`: its capture and its clock there, if t is capturing.
bool captured_snapshot(Timeline t, core::CaptureId& capture, VectorClock& clock);
// Timeline `waiter` (`is_default`: a device's default stream) waits for an event recorded in
// `capture` (kNoCapture: outside any) with `clock`: returns true if the wait belongs to a capture
// (joined there, or the capture is over and there is nothing to wait for); raises for a capturing
// waiter and an event of elsewhere, and for a default stream and an event of a capture underway.
bool captured_wait(Timeline waiter, bool is_default, core::CaptureId capture,
                   const VectorClock& clock);

// What a capture touched: replayed as one op on the replaying stream.
class Graph {
 public:
  Graph(std::vector<Access> accesses, std::vector<std::string> captured_ops,
        std::vector<std::string> eager_ops)
      : accesses_(std::move(accesses)),
        captured_ops_(std::move(captured_ops)),
        eager_ops_(std::move(eager_ops)) {}
  void replay(const c10::Stream& stream) const;
  size_t accesses() const { return accesses_.size(); }
  // The ops captured, in order ("aten::mul on sim:0 stream 3"), and the ops the capturing thread
  // ran outside the capture while it was underway (on a stream not in it).
  const std::vector<std::string>& captured_ops() const { return captured_ops_; }
  const std::vector<std::string>& eager_ops() const { return eager_ops_; }

 private:
  std::vector<Access> accesses_;
  std::vector<std::string> captured_ops_;
  std::vector<std::string> eager_ops_;
};

core::CaptureId begin_capture(const c10::Stream& stream);
std::shared_ptr<Graph> end_capture(const c10::Stream& stream);
// How often the runtime asked the sim probe (tests: the op path asks only during a capture).
uint64_t probe_calls();
// Registers the capture probe with the runtime (from enable()).
void register_capture_probe();
// In a forked child: no capture survives fork.
void reset_captures_in_child();

}  // namespace sim
}  // namespace torch_pipeline
