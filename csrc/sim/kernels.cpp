// Kernels of the sim device: the native ones for factories, views, resize_ and set_ (here), the
// copy kernels (copy.cpp) and the boxed fallback that runs every other op's CPU kernel on CPU
// aliases of sim memory (fallback.cpp), and those of extra_kernels.h (fused RNN cells, autocast,
// the CPU kernel where a composite would run), all registered by register_kernels().
#include "kernels.h"

#include "aliases.h"
#include "allocator.h"
#include "copy.h"
#include "executor.h"
#include "extra_kernels.h"
#include "fallback.h"
#include "host.h"
#include "state.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/is_set_to_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/SymIntArrayRef.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace torch_pipeline {
namespace sim {
namespace {

// ---- native kernels ---------------------------------------------------------------------------
c10::DeviceIndex device_index_of(std::optional<c10::Device> device) {
  if (!device.has_value() || device->type() != kSim) {
    return check_device(-1);
  }
  return check_device(device->index());
}

void check_factory_options(std::optional<c10::Layout> layout, std::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "the sim device supports strided tensors only, got layout ",
              c10::layout_or_default(layout));
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "pin_memory applies to CPU tensors only");
}

at::Tensor empty_memory_format(c10::SymIntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory,
                               std::optional<c10::MemoryFormat> memory_format) {
  check_factory_options(layout, pin_memory);
  DeviceScope scope(device_index_of(device));
  return at::detail::empty_generic(C10_AS_INTARRAYREF_SLOW(size), device_allocator(), kSimKeys,
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device, std::optional<bool> pin_memory) {
  check_factory_options(layout, pin_memory);
  DeviceScope scope(device_index_of(device));
  return at::detail::empty_strided_generic(C10_AS_INTARRAYREF_SLOW(size),
                                           C10_AS_INTARRAYREF_SLOW(stride), device_allocator(),
                                           kSimKeys, c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                      std::optional<c10::SymInt> storage_offset) {
  std::optional<int64_t> offset;
  if (storage_offset.has_value()) {
    offset = storage_offset->expect_int();
  }
  return at::native::as_strided_tensorimpl(self, C10_AS_INTARRAYREF_SLOW(size),
                                           C10_AS_INTARRAYREF_SLOW(stride), offset);
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size,
                         c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size),
                                    C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor unfold(const at::Tensor& self, int64_t dimension, int64_t size, int64_t step) {
  return at::native::unfold(self, dimension, size, step);
}

// Reallocating a storage on the current stream: a read of the old bytes it copies (recorded
// before, so strict mode raises before anything changes) and a write of the new block, with the
// reuse of a cached block folded in (recorded after). `grow` does the reallocation.
template <class Grow>
void record_reallocation(c10::StorageImpl* storage, size_t keep, const char* op, Grow grow) {
  const c10::DeviceIndex d = check_device(storage->device().index());
  DeviceScope scope(d);
  SimKernelScope kernel;
  const Timeline t = current_timeline(d);
  const void* old = storage->data();
  const std::string memory = describe_storage(d, old, storage->nbytes());
  if (old != nullptr && keep > 0) {
    const auto begin = reinterpret_cast<uintptr_t>(old);
    record(t, op, {Access{begin, begin + keep, /*write=*/false, memory}});
  }
  if (old != nullptr && keep > 0) {
    host_wait(t, /*report=*/false);  // asynchronous mode: the old bytes are final (a syncing op)
  }
  std::vector<Access> post;
  {
    DeferReuseReports defer(&post);
    grow();
  }
  const void* fresh = storage->data();
  if (fresh != old && fresh != nullptr && storage->nbytes() > 0) {
    const auto begin = reinterpret_cast<uintptr_t>(fresh);
    post.push_back(Access{begin, begin + storage->nbytes(), /*write=*/true,
                          describe_storage(d, fresh, storage->nbytes())});
  }
  if (!post.empty()) {
    record(t, op, post);
  }
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  const auto sizes = C10_AS_INTARRAYREF_SLOW(size);
  c10::StorageImpl* storage = self.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
  if (storage == nullptr) {
    DeviceScope scope(check_device(self.device().index()));
    return at::native::resize_(self, sizes, memory_format);
  }
  // The CPU resize reallocates (and copies the old bytes) only when the storage is too small.
  const size_t needed = at::detail::computeStorageNbytesContiguous(sizes, self.dtype().itemsize(),
                                                                   self.storage_offset());
  const size_t keep = needed > storage->nbytes() ? storage->nbytes() : 0;
  record_reallocation(storage, keep, "aten::resize_",
                      [&] { at::native::resize_(self, sizes, memory_format); });
  return self;
}

at::Tensor& set_source_storage_offset(at::Tensor& self, c10::Storage source,
                                      c10::SymInt storage_offset, c10::SymIntArrayRef size,
                                      c10::SymIntArrayRef stride) {
  DeviceScope scope(check_device(self.device().index()));
  return at::native::set_storage_cpu_(self, std::move(source), storage_offset.expect_int(),
                                      C10_AS_INTARRAYREF_SLOW(size),
                                      C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  return at::native::set_(self, std::move(source));
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}

at::Tensor& set_empty(at::Tensor& self) {
  DeviceScope scope(check_device(self.device().index()));
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, device_allocator(), /*resizable=*/true);
  return self.set_(storage, 0, {0}, {});
}

bool is_set_to(const at::Tensor& self, const at::Tensor& tensor) {
  return at::native::is_set_to(self, tensor);
}

}  // namespace

void resize_storage_bytes(const c10::Storage& storage, size_t nbytes) {
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
  const size_t keep = std::min(nbytes, impl->nbytes());
  record_reallocation(impl, keep, "aten::resize_ (storage)", [&] {
    c10::DataPtr fresh = device_allocator()->allocate(nbytes);
    if (keep > 0) {
      std::memcpy(fresh.get(), impl->data(), keep);
    }
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(nbytes);
  });
}

void register_kernels() {
  auto* aten = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                  __FILE__, __LINE__);
  aten->impl("empty.memory_format", TORCH_FN(empty_memory_format));
  aten->impl("empty_strided", TORCH_FN(empty_strided));
  aten->impl("as_strided", TORCH_FN(as_strided));
  aten->impl("view", TORCH_FN(view));
  aten->impl("_reshape_alias", TORCH_FN(reshape_alias));
  aten->impl("unfold", TORCH_FN(unfold));
  aten->impl("resize_", TORCH_FN(resize_));
  aten->impl("set_.source_Storage_storage_offset", TORCH_FN(set_source_storage_offset));
  aten->impl("set_.source_Storage", TORCH_FN(set_source_storage));
  aten->impl("set_.source_Tensor", TORCH_FN(set_source_tensor));
  aten->impl("set_", TORCH_FN(set_empty));
  aten->impl("is_set_to", TORCH_FN(is_set_to));
  aten->impl("_copy_from", TORCH_FN(copy_from));
  aten->impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  aten->impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));
  aten->impl("record_stream", TORCH_FN(record_stream_kernel));
  aten->impl("convolution_overrideable",
             torch::CppFunction::makeFromBoxedFunction<&convolution_kernel>());
  aten->impl("convolution_backward_overrideable",
             torch::CppFunction::makeFromBoxedFunction<&convolution_backward_kernel>());
  register_rnn_kernels(*aten);
  register_cpu_kernels_over_composites(*aten);
  register_autocast();

  // copy_ resolves conjugate and negative bits itself and sends sim copies to _copy_from, whose
  // kernel above copies the bits' values too (its CPU aliases carry the bits): without these
  // fallthroughs the math-bit fallbacks would materialize the source with clone(), which copies
  // with _copy_from again, forever.
  for (auto key : {c10::DispatchKey::Conjugate, c10::DispatchKey::Negative}) {
    auto* bits = new torch::Library(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
    bits->impl("_copy_from", torch::CppFunction::makeFallthrough());
    bits->impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
  }

  auto* fallback = new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::PrivateUse1,
                                      __FILE__, __LINE__);
  fallback->fallback(torch::CppFunction::makeFromBoxedFunction<&sim_fallback>());
}

void raw_kernel(const std::string& name, const std::vector<at::Tensor>& reads,
                const std::vector<at::Tensor>& writes) {
  std::vector<c10::DeviceIndex> devices;
  for (const auto* list : {&reads, &writes}) {
    for (const at::Tensor& t : *list) {
      TORCH_CHECK_VALUE(is_sim(t), "sim.raw_kernel takes sim tensors, got one on ", t.device());
      if (std::find(devices.begin(), devices.end(), t.device().index()) == devices.end()) {
        devices.push_back(t.device().index());
      }
    }
  }
  for (const c10::DeviceIndex d : devices) {
    std::vector<Access> accesses;
    for (const at::Tensor& t : reads) {
      if (t.device().index() == d) add_accesses(t, false, accesses);
    }
    for (const at::Tensor& t : writes) {
      if (t.device().index() == d) add_accesses(t, true, accesses);
    }
    record(current_timeline(check_device(d)), name, accesses);
  }
}

}  // namespace sim
}  // namespace torch_pipeline
