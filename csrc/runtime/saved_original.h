// A weak handle on a tensor saved for backward (tp.offload): gives the tensor back while its
// memory is still alive and unchanged, so that saved tensors something else keeps alive anyway
// (parameters, their views, inputs the caller holds) are not copied back from the host as
// duplicates. Holds no reference to the memory: only a weak one to the storage and the tensor's
// version counter (the counter autograd checks saved tensors against).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>
#include <c10/util/intrusive_ptr.h>

#include <optional>
#include <vector>

namespace torch_pipeline {

class SavedOriginal {
 public:
  explicit SavedOriginal(const at::Tensor& t);
  // The tensor as saved (same memory, sizes, strides, offset), or nullopt when its storage died,
  // moved to other memory, or was written in place since (its version changed).
  std::optional<at::Tensor> get() const;
  // Whether the tensor (or a view sharing its version counter) was written in place since, which
  // autograd refuses for a saved tensor; also known after its memory died.
  bool modified() const;

 private:
  c10::weak_intrusive_ptr<c10::StorageImpl> storage_;
  c10::VariableVersion version_;  // the tensor's counter (shared with its views), or disabled
  uint32_t saved_version_ = 0;
  const void* data_ = nullptr;
  std::vector<int64_t> sizes_;
  std::vector<int64_t> strides_;
  int64_t offset_ = 0;
  at::TensorOptions options_;
};

}  // namespace torch_pipeline
