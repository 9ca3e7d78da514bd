// The stream events module (see streams.h): events by position on the streams of a live period,
// and external waits (which can end keep-alives, through keep_alive.h).
#include "streams.h"
#include "graph_capture.h"
#include "keep_alive.h"

#include "../warn.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>

namespace torch_pipeline {
namespace tracking {
namespace detail {

Reach event_at_locked(LiveState& st, const Position& p) {
  StreamEntry& e = st.streams.at(p.stream);
  if (const auto* kept = e.log.event_at(p.seq)) {
    return Reach{kept->second, p.seq};
  }
  if (!is_capture_period(st.period) && captures_now(e.stream)) {
    // The stream captures now (another thread's torch.cuda.graph on it, or a side pipeline
    // forked into a capture): an event recorded there would be part of the graph, and the waiter
    // would join the capture. Its eager work got an event when it began capturing (capture_prepare,
    // join_capture_locked); a position past that one was still launching then (another thread
    // launching on a stream while it begins to capture): the newest event kept is waited for
    // instead, which does not cover it.
    warn_once("wait for a capturing stream",
              "an op waited for work on a stream that another thread was "
              "launching on while that stream began capturing a graph; the wait covers only the "
              "work launched before the capture began, so the op may race with the rest. Do not "
              "launch on a stream from one thread while another thread begins a capture on it.");
    if (const auto* newest = e.log.newest()) {
      return Reach{newest->second, newest->first};
    }
    return Reach{std::make_shared<c10::Event>(e.stream.device_type()), 0};  // (never recorded)
  }
  // Not kept: the thread that launched p is still on that stream (or p is that old). Not kept
  // either, since a position launched there by another thread may still be mid-launch.
  auto ev = std::make_shared<c10::Event>(e.stream.device_type());
  ev->record(e.stream);
  count(&Counters::events);
  return Reach{std::move(ev), std::min(p.seq, e.log.settled())};
}

void record_locked(LiveState& st, StreamId id, uint64_t seq) {
  StreamEntry& e = st.streams.at(id);
  const uint64_t label = e.log.label_for(seq);
  if (label == 0) {
    return;
  }
  if (!is_capture_period(st.period) && captures_now(e.stream)) {
    return;  // (its eager work got its event before it began capturing: see event_at_locked)
  }
  std::shared_ptr<c10::Event> ev;
  if (auto dropped = e.log.make_room(); dropped && dropped->use_count() == 1) {
    ev = std::move(*dropped);  // re-recorded: nobody holds it
  }
  if (!ev) {
    ev = std::make_shared<c10::Event>(e.stream.device_type());
  }
  ev->record(e.stream);
  e.log.keep(label, std::move(ev));
  count(&Counters::events);
}

}  // namespace detail

// ---- external waits
// ------------------------------------------------------------------------------
Mark mark(const c10::Stream& stream) {
  using namespace detail;
  if (!live()) {
    return Mark{};
  }
  const TrackedCapturePtr capture =
      tracked_capture_of(stream);  // capturing: a position in its capture
  LiveState& st = capture ? capture->st : state();
  std::lock_guard<std::mutex> lock(st.mutex);
  const StreamEntry* e = st.streams.find(stream);
  if (e == nullptr) {
    return Mark{};  // nothing tracked there in this period
  }
  return Mark{st.period, e->id, e->log.settled()};
}

void waited(const c10::Stream& waiter, const Mark& m) {
  using namespace detail;
  if (m.seq == 0 || !live()) {
    return;
  }
  if (is_capture_period(m.period)) {
    // A wait for an event recorded in a capture: the waiter captures into it from now on.
    const TrackedCapturePtr capture = capture_of_period(m.period);
    if (!capture) {
      return;
    }
    std::lock_guard<std::mutex> lock(capture->st.mutex);
    StreamEntry& w = capture->st.streams.acquire(waiter);
    capture->ledger.join(w.id);
    if (w.id != m.stream) {
      capture->st.tracker->waited(w.id, Position{m.stream, m.seq});
    }
    return;
  }
  if (tracked_capture_of(waiter)) {
    return;  // a capturing stream: positions outside its capture mean nothing to what it captures
  }
  LiveState& st = state();
  std::vector<c10::Storage> released;  // dropped after the lock (declared before it)
  std::lock_guard<std::mutex> lock(st.mutex);
  if (st.period != m.period) {
    return;
  }
  StreamEntry& w = st.streams.acquire(waiter);
  if (w.id != m.stream) {
    const Position producer{m.stream, m.seq};
    st.tracker->waited(w.id, producer);
    release_ordered_locked(st, w, {producer}, released);
  }
}

}  // namespace tracking
}  // namespace torch_pipeline
