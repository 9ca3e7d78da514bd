// Internal to the tracker. The async-collectives part of a live period (LiveState::async_works):
// the Work of each c10d op run with async_op=True and the tensors it writes, until work.wait()
// (then they are written on the waiting streams). Bounded: the oldest never waited for is
// forgotten. Has a lock of its own, taken after the state's (Note [Tracker locks]).
#pragma once

#include <ATen/core/Tensor.h>

#include <deque>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace torch_pipeline {
namespace tracking {
namespace detail {

class AsyncWorks {
 public:
  static constexpr size_t kKept = 1024;

  // Returns the tensors of a Work forgotten to make room (to be dropped by the caller, after its
  // locks: dropping the last reference frees memory).
  std::vector<at::Tensor> add(const void* work, std::vector<at::Tensor> written) {
    std::vector<at::Tensor> dropped;
    std::lock_guard<std::mutex> lock(mutex_);
    if (works_.size() >= kKept) {
      dropped = std::move(works_.front().second);
      works_.pop_front();
    }
    works_.emplace_back(work, std::move(written));
    return dropped;
  }
  // The tensors `work` writes, if it is known (it is forgotten then).
  std::optional<std::vector<at::Tensor>> take(const void* work) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = works_.begin(); it != works_.end(); ++it) {
      if (it->first == work) {
        std::vector<at::Tensor> written = std::move(it->second);
        works_.erase(it);
        return written;
      }
    }
    return std::nullopt;
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return works_.size();
  }
  void clear() {
    std::deque<std::pair<const void*, std::vector<at::Tensor>>> dropped;  // (after the lock)
    std::lock_guard<std::mutex> lock(mutex_);
    dropped.swap(works_);
  }

 private:
  std::mutex mutex_;
  std::deque<std::pair<const void*, std::vector<at::Tensor>>> works_;
};

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
