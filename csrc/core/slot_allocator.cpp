#include "slot_allocator.h"

#include <stdexcept>
#include <string>

namespace torch_pipeline {
namespace core {

SlotAllocator::SlotAllocator(int64_t first) : first_(first), next_(first) {}

int64_t SlotAllocator::acquire() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!free_.empty()) {
    // Every released slot is below next_, so the smallest free one beats a fresh slot.
    const auto smallest = free_.begin();
    const int64_t slot = *smallest;
    free_.erase(smallest);
    return slot;
  }
  return next_++;
}

void SlotAllocator::release(int64_t slot) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (slot < first_ || slot >= next_ || free_.count(slot) != 0) {
    throw std::logic_error("torch_pipeline: slot " + std::to_string(slot) +
                           " is released but is not held");
  }
  free_.insert(slot);
}

bool SlotAllocator::is_held(int64_t slot) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return slot >= first_ && slot < next_ && free_.count(slot) == 0;
}

int64_t SlotAllocator::num_held() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return (next_ - first_) - static_cast<int64_t>(free_.size());
}

int64_t SlotAllocator::high_water() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return next_;
}

}  // namespace core
}  // namespace torch_pipeline
