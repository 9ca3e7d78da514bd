// Internal to the tracker. Tensors held without their reference counts (borrowed, as c10's
// MaybeOwned does), for the op path's short-lived lists of tensors that something else owns.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/MaybeOwned.h>

#include <vector>

namespace torch_pipeline {
namespace tracking {
namespace detail {

// A list of tensors borrowed (no reference count taken or dropped: two atomic operations each)
// from tensors that outlive it: cleared (released, not dropped) before they go.
class BorrowedTensors {
 public:
  BorrowedTensors() = default;
  BorrowedTensors(const BorrowedTensors&) = delete;
  BorrowedTensors& operator=(const BorrowedTensors&) = delete;
  ~BorrowedTensors() { clear(); }
  void push_back(const at::Tensor& t) {
    tensors_.push_back(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(t));
  }
  void clear() {
    for (at::Tensor& t : tensors_) {
      c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(t);
    }
    tensors_.clear();
  }
  // NB: a copy of an element owns its tensor (it takes a reference count).
  const std::vector<at::Tensor>& tensors() const { return tensors_; }

 private:
  std::vector<at::Tensor> tensors_;
};

}  // namespace detail
}  // namespace tracking
}  // namespace torch_pipeline
