// Test helpers shared by the core's GoogleTest files: kLong, the timeout only a broken test
// reaches, and Gate, a one-shot gate to sequence threads without busy waiting.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

namespace torch_pipeline {
namespace testing {

// Generous: only reached when something is broken (sanitizer builds are slow).
constexpr std::chrono::milliseconds kLong{30000};

// A one-shot gate: wait() blocks until open().
class Gate {
 public:
  void open() {
    std::lock_guard<std::mutex> lock(mutex_);
    open_ = true;
    cv_.notify_all();
  }
  bool wait(std::chrono::milliseconds timeout = kLong) {
    std::unique_lock<std::mutex> lock(mutex_);
    return cv_.wait_for(lock, timeout, [&] { return open_; });
  }
  bool is_open() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return open_;
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool open_ = false;
};

}  // namespace testing
}  // namespace torch_pipeline
