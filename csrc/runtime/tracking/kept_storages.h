// Internal to the tracker. The keep-alive part of a live period (LiveState::kept): storages used
// off their allocation stream, kept alive per stream of use until that use completes
// (core::KeepAliveQueue), how many in all, and the launches since the last poll. Its fields are
// its own (the count stays the sum of the queues); callers hold the state's lock (Note [Tracker
// locks]). What keeping alive means, and when a kept storage goes: keep_alive.h.
#pragma once

#include "../../core/dependency_tracker.h"
#include "../../core/keep_alive_queue.h"

#include <c10/core/Storage.h>

#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torch_pipeline {
namespace tracking {
namespace detail {

class KeptStorages {
  using Queue = core::KeepAliveQueue<c10::Storage>;

 public:
  // The storages kept for the uses on one stream (a view of its queue that keeps the count).
  class OnStream {
   public:
    core::StreamId stream() const { return stream_; }
    bool empty() const { return q_->empty(); }
    uint64_t front_seq() const { return q_->front_seq(); }  // (not empty)
    uint64_t back_seq() const { return q_->back_seq(); }    // (not empty)
    bool due(uint64_t label) { return q_->due(label); }
    void completed(uint64_t seq) { q_->completed(seq); }
    // Moves the storages whose uses are complete to `out`.
    void take_done(std::vector<c10::Storage>& out) { *total_ -= q_->take_done(out); }
    // Moves those of uses at or before `seq` that `pred(seq, storage)` accepts to `out`.
    template <class P>
    void take_if(uint64_t seq, P&& pred, std::vector<c10::Storage>& out) {
      *total_ -= q_->take_if(seq, std::forward<P>(pred), out);
    }

   private:
    friend class KeptStorages;
    OnStream(core::StreamId s, Queue* q, size_t* total) : stream_(s), q_(q), total_(total) {}
    core::StreamId stream_;
    Queue* q_;
    size_t* total_;
  };

  // Kept from the end of the use at position `seq` of `stream` until that use completes.
  void add(core::StreamId stream, uint64_t seq, c10::Storage storage) {
    queues_[stream].add(seq, std::move(storage));
    ++total_;
  }
  size_t size() const { return total_; }
  // The storages in the queues, counted one by one, and the streams with any: size() must equal
  // the first (parts_snapshot() in state.cpp: the tests of this part).
  std::pair<size_t, size_t> count_queued() const {
    size_t storages = 0, streams = 0;
    for (const auto& [stream, q] : queues_) {
      storages += q.size();
      streams += q.empty() ? 0 : 1;
    }
    return {storages, streams};
  }
  // A device launch: whether a poll is due (polled() starts the count again).
  bool launch_makes_poll_due(size_t poll_every) { return ++launches_since_poll_ >= poll_every; }
  void polled() { launches_since_poll_ = 0; }
  // The storages kept for uses on `stream`; none when nothing is kept there.
  std::optional<OnStream> on(core::StreamId stream) {
    const auto it = queues_.find(stream);
    if (it == queues_.end() || it->second.empty()) {
      return std::nullopt;
    }
    return OnStream(stream, &it->second, &total_);
  }
  // f(OnStream&) for each stream with storages kept; f may take them (never add).
  template <class F>
  void for_each(F&& f) {
    for (auto& [stream, q] : queues_) {
      if (!q.empty()) {
        OnStream on(stream, &q, &total_);
        f(on);
      }
    }
  }
  // f(stream, seq, storage) for each storage kept, which stays kept.
  template <class F>
  void for_each_storage(F&& f) const {
    for (const auto& [stream, q] : queues_) {
      q.for_each([&](uint64_t seq, const c10::Storage& s) { f(stream, seq, s); });
    }
  }
  // Moves every storage to `out`, f(stream, storage) first.
  template <class F>
  void take_all(std::vector<c10::Storage>& out, F&& f) {
    for (auto& [stream, q] : queues_) {
      const core::StreamId id = stream;
      q.take_all(out, [&](uint64_t, c10::Storage& s) { f(id, s); });
    }
    total_ = 0;
  }
  void clear() {
    queues_.clear();
    total_ = 0;
    launches_since_poll_ = 0;
  }

 private:
  std::unordered_map<core::StreamId, Queue> queues_;  // (a queue stays once made: nodes are stable)
  size_t total_ = 0;                                  // storages in all queues
  size_t launches_since_poll_ = 0;
};

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
