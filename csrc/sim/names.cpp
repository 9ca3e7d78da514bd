#include "names.h"

#include <utility>

namespace torch_pipeline {
namespace sim {

StorageNames& StorageNames::get() {
  static StorageNames* names = new StorageNames();
  return *names;
}

void StorageNames::set(const void* base, std::string name) {
  std::lock_guard<std::mutex> lock(mutex_);
  names_.emplace(base, std::move(name));
  size_.store(names_.size(), std::memory_order_relaxed);
}

std::string StorageNames::find(const void* base) const {
  if (size() == 0) {
    return {};
  }
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = names_.find(base);
  return it == names_.end() ? std::string() : it->second;
}

void StorageNames::forget(const void* base) {
  if (size() == 0) {
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  names_.erase(base);
  size_.store(names_.size(), std::memory_order_relaxed);
}

}  // namespace sim
}  // namespace torch_pipeline
