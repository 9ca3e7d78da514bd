#include "saved_original.h"

#include <ATen/ops/empty.h>
#include <c10/core/TensorImpl.h>

namespace torch_pipeline {

SavedOriginal::SavedOriginal(const at::Tensor& t)
    : storage_(c10::weak_intrusive_ptr<c10::StorageImpl>(t.storage().getWeakStorageImpl())),
      version_(t.unsafeGetTensorImpl()->version_counter()),
      data_(t.storage().data()),
      sizes_(t.sizes().vec()),
      strides_(t.strides().vec()),
      offset_(t.storage_offset()),
      options_(t.options()) {
  if (version_.enabled()) {
    saved_version_ = version_.current_version();
  }
}

bool SavedOriginal::modified() const {
  return version_.enabled() && version_.current_version() != saved_version_;
}

std::optional<at::Tensor> SavedOriginal::get() const {
  if (!version_.enabled() || modified()) {
    return std::nullopt;  // written since (or an inference tensor: no way to tell)
  }
  c10::intrusive_ptr<c10::StorageImpl> impl = storage_.lock();
  if (!impl || impl->data() != data_) {
    return std::nullopt;
  }
  at::Tensor t = at::empty({0}, options_);
  t.set_(c10::Storage(std::move(impl)), offset_, sizes_, strides_);
  return t;
}

}  // namespace torch_pipeline
