// Plain C++17 (no torch includes). Holds the allocator-safety bookkeeping of one stream: things
// (storages, in the runtime) kept alive until the use of them at a position of the stream is known
// complete, in position order, the latest position known complete, and the throttle that keeps a
// poll from querying the same not-yet-complete event on every launch. Touches only its members;
// the runtime (csrc/runtime/tracking/keep_alive.*) owns one per stream, under its lock.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

namespace torch_pipeline {
namespace core {

template <typename T>
class KeepAliveQueue {
 public:
  static constexpr uint32_t kRequery =
      8;  // polls before a label found not complete is queried again

  // Keeps `item` until position `seq` is complete (threads finish out of order: kept sorted).
  void add(uint64_t seq, T item) {
    const auto at =
        std::upper_bound(items_.begin(), items_.end(), seq,
                         [](uint64_t s, const std::pair<uint64_t, T>& x) { return s < x.first; });
    items_.emplace(at, seq, std::move(item));
  }
  // Positions up to `seq` are complete.
  void completed(uint64_t seq) { complete_ = std::max(complete_, seq); }
  uint64_t complete() const { return complete_; }

  // Moves the items whose positions are complete to `out`; returns how many.
  size_t take_done(std::vector<T>& out) {
    size_t n = 0;
    while (!items_.empty() && items_.front().first <= complete_) {
      out.push_back(std::move(items_.front().second));
      items_.pop_front();
      ++n;
    }
    return n;
  }
  // Moves the items at positions up to `seq` for which pred(position, item) holds to `out`, in
  // position order, whatever the ones before them (items known safe to let go early, e.g. ones
  // whose use a later op of their allocation stream was ordered after); returns how many.
  template <typename P>
  size_t take_if(uint64_t seq, P&& pred, std::vector<T>& out) {
    size_t n = 0;
    auto keep = items_.begin();
    auto it = items_.begin();
    for (; it != items_.end() && it->first <= seq; ++it) {
      if (pred(it->first, static_cast<const T&>(it->second))) {
        out.push_back(std::move(it->second));
        ++n;
      } else {
        if (keep != it) *keep = std::move(*it);
        ++keep;
      }
    }
    if (n != 0) items_.erase(std::move(it, items_.end(), keep), items_.end());
    return n;
  }
  // Moves every item to `out` (f(seq, item&) first, e.g. to hand it to the allocator); returns how
  // many. Calls f(seq, item) for each item kept (oldest first), leaving them kept.
  template <typename F>
  void for_each(F&& f) const {
    for (const auto& [seq, item] : items_) f(seq, item);
  }

  template <typename F>
  size_t take_all(std::vector<T>& out, F&& f) {
    const size_t n = items_.size();
    for (auto& [seq, item] : items_) {
      f(seq, item);
      out.push_back(std::move(item));
    }
    items_.clear();
    return n;
  }

  bool empty() const { return items_.empty(); }
  size_t size() const { return items_.size(); }
  uint64_t front_seq() const { return items_.front().first; }  // (not empty)
  uint64_t back_seq() const { return items_.back().first; }    // (not empty)

  // Whether a poll should query the event labelled `label` now: not when the same label was found
  // not complete by one of the last kRequery polls (a device query is not free).
  bool due(uint64_t label) {
    if (label == not_done_ && ++skipped_ < kRequery) {
      return false;
    }
    skipped_ = 0;
    not_done_ = label;
    return true;
  }

 private:
  std::deque<std::pair<uint64_t, T>> items_;  // positions ascending
  uint64_t complete_ = 0;
  uint64_t not_done_ = 0;  // the label a poll last queried (found not complete, if still here)
  uint32_t skipped_ = 0;   // polls since that did not query it again
};

}  // namespace core
}  // namespace torch_pipeline
