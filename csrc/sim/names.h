// Names of sim storages for race reports (Note [Race reports with sites]): the Python layer names
// the storages of module parameters and buffers while sites are on; a name goes when its block is
// freed, so a reused block never carries the name of a dead tensor.
#pragma once

#include <atomic>
#include <cstddef>
#include <mutex>
#include <string>
#include <unordered_map>

namespace torch_pipeline {
namespace sim {

class StorageNames {
 public:
  static StorageNames& get();  // leaked: usable until process exit

  // Names the storage at `base`, unless it has a name already (the first, outermost, wins).
  void set(const void* base, std::string name);
  // The name of the storage at `base`, or "".
  std::string find(const void* base) const;
  // The block at `base` was freed (an atomic load when nothing is named).
  void forget(const void* base);
  size_t size() const { return size_.load(std::memory_order_relaxed); }

  // fork(): the forking thread holds the lock around fork() (fork.h); a leaf lock, taken last.
  void lock_for_fork() { mutex_.lock(); }
  void unlock_after_fork() { mutex_.unlock(); }

 private:
  StorageNames() = default;
  mutable std::mutex mutex_;
  std::unordered_map<const void*, std::string> names_;
  std::atomic<size_t> size_{0};
};

}  // namespace sim
}  // namespace torch_pipeline
