// Internal to the tracker. The capture room (docs/design.md §4 "Graph capture"): binds
// core/capture_state.h to c10. A capture underway is a CaptureWorld: a LiveState of its own, in
// which the ops captured into the graph get positions (they do not run now), so the waits the
// tracker inserts between them are captured event record + wait edges, and nothing waits for work
// outside the capture (illegal there; replays are ordered instead). The world's ledger names the
// streams that joined the capture and what the graph keeps alive. Owns the registry of captures,
// the thread's capture, and the test switch; the launch room asks it which state an op launches
// in. Callers of *_locked hold the world's LiveState::mutex.
#pragma once

#include "state.h"

#include "../../core/capture_state.h"
#include "../capture.h"

#include <c10/core/Device.h>

#include <memory>
#include <vector>

namespace torch_pipeline {
namespace tracking {
namespace detail {

using GraphLedger = core::CaptureLedger<c10::Storage, c10::weak_intrusive_ptr<c10::StorageImpl>>;

// Periods of capture worlds have this bit (with the capture id below it); the main state's never.
constexpr uint64_t kCapturePeriod = uint64_t{1} << 63;
inline bool is_capture_period(uint64_t period) {
  return (period & kCapturePeriod) != 0;
}

struct CaptureWorld {
  CaptureWorld(core::CaptureId id, const c10::Stream& origin, bool notified);
  const core::CaptureId id;
  const c10::Stream origin;
  const bool notified;  // begun through capture_begun (else detected at a launch on its stream)
  LiveState st;         // positions inside the capture (st.period: kCapturePeriod | id)
  GraphLedger ledger;   // (under st.mutex)
};
using WorldPtr = std::shared_ptr<CaptureWorld>;

// Whether captures are handled (the test switch; on by default).
bool capture_aware();

// The capture world an op launching on the current streams of `devices` belongs to: nullptr for
// the main state (no capture involved). Registers a capture seen for the first time (one not
// begun through capture_begun), and ends the thread's detected capture once its origin stopped
// capturing. TORCH_CHECK error for a stream of another capture than the thread's.
WorldPtr world_for_launch(const std::vector<c10::Device>& devices);
// The world of `period` (a capture period), if that capture is still underway.
WorldPtr world_of_period(uint64_t period);
// The world `stream` captures into, among the thread's and the registered ones; nullptr if none.
WorldPtr world_of_stream(const c10::Stream& stream);

// A stream the capture's op launches on, seen in the world for the first time: joins the ledger;
// one that is not capturing into this capture yet is forked into it first (it waits for an event
// recorded on the origin: a captured edge).
void join_world_locked(CaptureWorld& w, StreamEntry& se);
// The captured op uses `storage` (entry `e`) on `se`: noted in the ledger, and kept alive for the
// graph's lifetime when it existed before the capture or is used off its allocation stream.
void capture_use_locked(CaptureWorld& w, StorageEntry& e, StreamEntry& se,
                        const c10::Storage& storage, bool write);
// A fresh output of a captured op: written by the graph.
void capture_output_locked(CaptureWorld& w, const c10::Storage& storage);

// In a forked child: no capture survives fork.
void reset_captures_after_fork();
// Captures registered now (keeps tracking from going idle while any is underway).
size_t captures_underway();

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
