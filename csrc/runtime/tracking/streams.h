// Internal to the tracker. The stream log room: binds core::StreamLog to c10 streams and events
// (positions handed out, settled, events kept by position), the go-live baseline, the go-idle
// barrier, and external waits (tracking::mark / tracking::waited). Touches LiveState::streams,
// by_id, next_stream, baseline, and LiveState::tracker for external waits. Callers of *_locked
// hold LiveState::mutex.
#pragma once

#include "state.h"

#include <memory>

namespace torch_pipeline {
namespace tracking {
namespace detail {

// The entry of `stream`, created on its first use in the period (it then waits for the baseline).
StreamEntry& acquire_stream_locked(LiveState& st, const c10::Stream& stream);
// The entry of stream `id`; nullptr if unknown.
StreamEntry* find_stream_locked(LiveState& st, StreamId id);
// An event recorded after position `p`, and how far it reaches on p's stream: the first kept at
// or after p (recorded when every position up to its label had finished launching: it reaches
// p's whole prefix; a later one over-waits, which is safe), else one recorded now. One recorded
// now covers every op enqueued there so far, p's included, but not a lower position another
// thread is still launching: it reaches only the settled prefix (and p itself, which the core
// tracker credits through p's clock).
struct Reach {
  std::shared_ptr<c10::Event> event;
  uint64_t reach;
};
Reach event_at_locked(LiveState& st, const Position& p);
// Records (and keeps) an event after position `seq` of stream `id`, lowered below positions
// other threads are still launching; nothing if one is kept there already.
void record_locked(LiveState& st, StreamId id, uint64_t seq);
// Going live: events on the current and default streams of every device, which each stream
// waits for at its first use in the period.
void record_baseline_locked(LiveState& st);
// Going idle: every tracked stream, and each device's default and this thread's current stream,
// waits for all tracked work of its device.
void barrier_locked(LiveState& st);

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
