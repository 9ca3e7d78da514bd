// Plain C++17 (no torch includes): a vector whose first N elements live inline, for the tracker's
// per-storage records (readers and uses, at most one per stream: most storages see one or two
// streams, so most records never allocate).
#pragma once

#include <array>
#include <cstddef>
#include <utility>
#include <vector>

namespace torch_pipeline {
namespace core {

// Contiguous: up to N elements in `inline_`, then all of them in `heap_` until clear(). T must be
// default-constructible (an unused inline slot holds T{}) and movable.
template <typename T, size_t N>
class SmallVector {
  static_assert(N > 0, "use std::vector");

 public:
  T* begin() { return spilled_ ? heap_.data() : inline_.data(); }
  T* end() { return begin() + size(); }
  const T* begin() const { return spilled_ ? heap_.data() : inline_.data(); }
  const T* end() const { return begin() + size(); }
  size_t size() const { return spilled_ ? heap_.size() : n_; }
  bool empty() const { return size() == 0; }

  void push_back(T value) {
    if (!spilled_) {
      if (n_ < N) {
        inline_[n_++] = std::move(value);
        return;
      }
      heap_.reserve(2 * N);
      for (T& x : inline_) {
        heap_.push_back(std::move(x));
        x = T{};
      }
      n_ = 0;
      spilled_ = true;
    }
    heap_.push_back(std::move(value));
  }

  // Empty again, inline (what the elements held is released now).
  void clear() {
    for (size_t i = 0; i < n_; ++i) {
      inline_[i] = T{};
    }
    n_ = 0;
    heap_.clear();
    spilled_ = false;
  }

 private:
  std::array<T, N> inline_{};
  size_t n_ = 0;  // inline elements in use (0 once spilled)
  bool spilled_ = false;
  std::vector<T> heap_;
};

}  // namespace core
}  // namespace torch_pipeline
