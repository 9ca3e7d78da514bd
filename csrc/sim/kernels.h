// The sim device's kernels: a few native ones (factories, views, copies, item) and a boxed
// fallback that runs every other aten op's CPU kernel on the host memory, checking its accesses.
#pragma once

#include <c10/core/Storage.h>

#include <cstddef>

namespace torch_pipeline {
namespace sim {

// Registers the PrivateUse1 kernels and the fallback (heap-allocated torch::Library objects).
void register_kernels();

// Storage.resize_ of a sim storage (PrivateUse1Hooks): a new block on the storage's device and the
// current stream, holding the old bytes that fit; recorded as a read of those and a write.
void resize_storage_bytes(const c10::Storage& storage, size_t nbytes);

}  // namespace sim
}  // namespace torch_pipeline
