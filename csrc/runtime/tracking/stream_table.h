// Internal to the tracker. The streams part of a live period (LiveState::streams): an entry per
// c10 stream used in the period (its id for the core tracker, and its core::StreamLog of
// positions and kept events), and the go-live baseline each stream waits for at its first use.
// Its fields are its own; callers hold the state's lock (Note [Tracker locks]).
#pragma once

#include "counters.h"

#include "../../core/dependency_tracker.h"
#include "../../core/stream_log.h"

#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torch_pipeline {
namespace tracking {
namespace detail {

struct StreamEntry {
  StreamEntry(core::StreamId i, const c10::Stream& s) : id(i), stream(s) {}
  const core::StreamId id;
  const c10::Stream stream;
  core::StreamLog<std::shared_ptr<c10::Event>> log;
};

class StreamTable {
 public:
  // The entry of `stream`, made at its first use in the period, when the stream waits for the
  // baseline event of every other stream of its device.
  // NB: the entry used last is answered without a lookup (an op's launch and end, and most ops
  // of a thread, are on one stream); entries stay where they are until clear().
  StreamEntry& acquire(const c10::Stream& stream) {
    if (last_ != nullptr && last_->stream == stream) {
      return *last_;
    }
    return acquire_slow(stream);
  }
  StreamEntry* find(core::StreamId id) {
    return last_ != nullptr && last_->id == id ? last_ : find_slow(id);
  }
  StreamEntry* find(const c10::Stream& stream);
  StreamEntry& at(core::StreamId id);  // (one that is known)
  size_t size() const { return by_stream_.size(); }
  // f(const StreamEntry&) for each entry (parts_snapshot() in state.cpp: the tests of this part).
  template <class F>
  void for_each(F&& f) const {
    for (const auto& [stream, entry] : by_stream_) {
      f(*entry);
    }
  }
  // Going live: events on the current and default streams of every device (not on a stream that
  // captures a graph now: the event would be part of the graph).
  void record_baseline();
  // Going idle: every stream of the period, and each device's default and this thread's current
  // stream, waits for all work of the period's streams on its device.
  void barrier();
  void clear();

 private:
  StreamEntry& acquire_slow(const c10::Stream& stream);
  StreamEntry* find_slow(core::StreamId id);

  std::unordered_map<c10::Stream, std::unique_ptr<StreamEntry>> by_stream_;
  std::unordered_map<core::StreamId, StreamEntry*> by_id_;
  core::StreamId next_id_ = 1;
  std::vector<std::pair<c10::Stream, c10::Event>> baseline_;
  StreamEntry* last_ = nullptr;  // the entry acquired or found last (nullptr: none)
};

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
