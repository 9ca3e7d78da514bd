// UntypedStorage.resize_ (StorageResize in tracking.h): the resize of a device storage, which no
// dispatcher op shows, as one op that writes the storage and may give it new memory. Touches only
// its members; acts through the scope launch and end (scope.h) it shares with tp.track.
#include "../context.h"
#include "../warn.h"
#include "scope.h"
#include "state.h"

#include <c10/core/DispatchKeySet.h>
#include <c10/core/TensorImpl.h>

namespace torch_pipeline {
namespace tracking {

namespace {
// A byte tensor over all of `storage`, made without an op (an op would be tracked itself).
at::Tensor bytes_of(const c10::Storage& storage) {
  const c10::DispatchKeySet keys(
      c10::computeDispatchKey(c10::kByte, c10::kStrided, storage.device()));
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(storage), keys,
                                                   caffe2::TypeMeta::Make<uint8_t>());
  impl->set_sizes_contiguous({static_cast<int64_t>(storage.nbytes())});
  return at::Tensor(std::move(impl));
}
}  // namespace

StorageResize::StorageResize(const c10::Storage& storage) {
  using namespace detail;
  if (!live() || !storage || storage.device().is_cpu()) {
    return;
  }
  if (in_pipeline()) {
    enter_device(storage.device());  // (as an op on the device would: it joins the lane)
  }
  view_ = bytes_of(storage);
  before_ = storage.data();
  open_ = true;
  if (has_data(view_)) {
    const std::vector<Access> accesses{Access{&view_, /*write=*/true, /*may_move=*/true}};
    open_scope(accesses, launched_, period_, keep_alive_);
  }
}

void StorageResize::done() {
  using namespace detail;
  if (!open_) {
    return;
  }
  open_ = false;
  const void* now = view_.storage().data();
  const bool allocated = now != nullptr && now != before_;
  if (launched_.empty()) {
    if (allocated) {  // (from no memory: a fresh allocation on the current stream, like a factory)
      const std::vector<at::Tensor> fresh{view_};
      close_scope(launched_, 0, keep_alive_, &fresh, "UntypedStorage.resize_");
    }
    return;
  }
  const std::vector<at::Tensor> moved{view_};
  close_scope(launched_, period_, keep_alive_, nullptr, "UntypedStorage.resize_",
              allocated ? &moved : nullptr);
}

StorageResize::~StorageResize() {
  try {
    done();
  } catch (const std::exception& e) {
    warn_once("tracking: storage resize", std::string("automatic synchronization failed after "
                                                      "UntypedStorage.resize_ (") +
                                              e.what() + "); the storage may race.");
  }
}

}  // namespace tracking
}  // namespace torch_pipeline
