// Internal to the tracker. The stream events module: the events kept by position on the streams of
// a live period (LiveState::streams, whose StreamTable holds the entries and the baseline), and
// external waits (tracking::mark / tracking::waited), which it tells LiveState::tracker and the
// keep-alive module. Callers of *_locked hold LiveState::mutex.
#pragma once

#include "state.h"

#include <memory>

namespace torch_pipeline {
namespace tracking {
namespace detail {

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

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
