// Plain C++17 (no torch includes). Holds the per-stream bookkeeping of the
// automatic-synchronization tracker: the positions handed out on one stream, those still launching,
// and the events recorded after positions, kept by position. Touches nothing but its own members;
// the runtime (csrc/runtime/tracking/streams.*) owns one per stream, under its lock, with Event =
// std::shared_ptr<c10::Event>. Tests use any copyable type.
//
// Several threads can launch on one stream at once (every thread shares the default stream): a
// position is handed out (start) before its op launches and settles (finish) after; an event
// recorded now covers only positions up to settled(), so that is the highest label it may carry.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <utility>
#include <vector>

namespace torch_pipeline {
namespace core {

template <typename Event>
class StreamLog {
 public:
  static constexpr size_t kDefaultEventsKept = 64;

  explicit StreamLog(size_t events_kept = kDefaultEventsKept)
      : events_kept_(std::max<size_t>(1, events_kept)) {}

  // Position `seq` was handed out; its op is launching (until finish(seq)).
  void start(uint64_t seq) {
    launched_ = std::max(launched_, seq);
    in_flight_.push_back(seq);
  }
  // The op at `seq` has launched. Unknown positions are ignored.
  void finish(uint64_t seq) {
    const auto it = std::find(in_flight_.begin(), in_flight_.end(), seq);
    if (it != in_flight_.end()) {
      in_flight_.erase(it);
    }
  }
  // Position `seq` was handed out to an op that has launched already (a factory seen at its end).
  void note_launched(uint64_t seq) { launched_ = std::max(launched_, seq); }

  // The latest position handed out.
  uint64_t launched() const { return launched_; }
  // The latest position such that it and every earlier one have finished launching.
  uint64_t settled() const {
    uint64_t s = launched_;
    for (const uint64_t f : in_flight_) {
      s = std::min(s, f - 1);
    }
    return s;
  }
  size_t in_flight() const { return in_flight_.size(); }

  // The label an event recorded now after position `seq` gets (seq, lowered to settled()), or 0
  // when there is nothing to record: seq 0, or an event kept at that label or later already.
  uint64_t label_for(uint64_t seq) const {
    seq = std::min(seq, settled());
    if (seq == 0 || (!events_.empty() && events_.back().first >= seq)) {
      return 0;
    }
    return seq;
  }

  // Makes room for one more event: when full, the oldest is dropped and returned (the caller may
  // reuse it when nobody else holds it).
  std::optional<Event> make_room() {
    if (events_.size() < events_kept_) {
      return std::nullopt;
    }
    std::optional<Event> out(std::move(events_.front().second));
    events_.pop_front();
    return out;
  }
  // Keeps `event` as recorded after `label`, if newer than the newest kept (labels ascend).
  // Returns whether it was kept.
  bool keep(uint64_t label, Event event) {
    if (label == 0 || (!events_.empty() && events_.back().first >= label)) {
      return false;
    }
    if (auto dropped = make_room()) {
      (void)dropped;
    }
    events_.emplace_back(label, std::move(event));
    return true;
  }

  // The first event kept at or after `seq` (later ones over-wait, which is safe), or nullptr.
  const std::pair<uint64_t, Event>* event_at(uint64_t seq) const {
    const auto it = std::lower_bound(
        events_.begin(), events_.end(), seq,
        [](const std::pair<uint64_t, Event>& entry, uint64_t s) { return entry.first < s; });
    return it == events_.end() ? nullptr : &*it;
  }
  // The newest event kept, or nullptr.
  const std::pair<uint64_t, Event>* newest() const {
    return events_.empty() ? nullptr : &events_.back();
  }
  size_t events() const { return events_.size(); }

 private:
  const size_t events_kept_;
  uint64_t launched_ = 0;
  std::vector<uint64_t> in_flight_;  // positions handed out, still launching (few: one per thread)
  std::deque<std::pair<uint64_t, Event>> events_;  // oldest first, labels ascending
};

}  // namespace core
}  // namespace torch_pipeline
