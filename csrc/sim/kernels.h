// The sim device's kernels: a few native ones (factories, views, copies, item) and a boxed
// fallback that runs every other aten op's CPU kernel on the host memory, checking its accesses.
#pragma once

namespace torch_pipeline {
namespace sim {

// Registers the PrivateUse1 kernels and the fallback (heap-allocated torch::Library objects).
void register_kernels();

}  // namespace sim
}  // namespace torch_pipeline
