// Plain C++17 (no torch includes): hands out small integer slots, smallest free first.
//
// A Pipeline's `id` is a slot of the (worker thread, priority) it is bound to. Pipelines whose
// lifetimes do not overlap get the same slot (and so the same streams); live pipelines never share
// one. Thread-safe.
#pragma once

#include <cstdint>
#include <mutex>
#include <set>

namespace torch_pipeline {
namespace core {

class SlotAllocator {
 public:
  // Slots are numbered from `first` upwards (the runtime uses 1: slot 0 is the default pipeline).
  explicit SlotAllocator(int64_t first = 0);

  SlotAllocator(const SlotAllocator&) = delete;
  SlotAllocator& operator=(const SlotAllocator&) = delete;

  // Takes the smallest slot that is not held.
  int64_t acquire();
  // Gives back a held slot. Throws std::logic_error if `slot` is not held.
  void release(int64_t slot);

  bool is_held(int64_t slot) const;
  // Number of slots held now.
  int64_t num_held() const;
  // One past the largest slot ever handed out (`first` if none): the number of distinct slots
  // (and so of stream sets) this allocator has ever needed.
  int64_t high_water() const;

 private:
  mutable std::mutex mutex_;
  const int64_t first_;
  int64_t next_;            // slots in [first_, next_) have been handed out at least once
  std::set<int64_t> free_;  // released slots below next_, smallest first
};

}  // namespace core
}  // namespace torch_pipeline
