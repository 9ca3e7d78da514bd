// Host accesses of pinned memory that asynchronous copies use.
//
// A non_blocking copy between a sim tensor and a pinned CPU tensor reads or writes the host
// memory on the stream: until the host synchronizes with that stream, a CPU op that writes the
// memory (or reads it, for a copy to the host) races with the copy. While such copies are pending,
// a RecordFunction callback watches the CPU tensor arguments of every op and records the ones
// that touch pending memory as accesses of the host timeline. Strict mode does not apply to
// these (a RecordFunction callback cannot fail its op): they are only recorded.
#pragma once

#include "race_checker.h"

#include <ATen/core/Tensor.h>

namespace torch_pipeline {
namespace sim {

// The bytes of host tensor `t` as an access (false when it has none).
bool host_access(const at::Tensor& t, bool write, Access* out);
// After recording a non_blocking copy on `t` that touches `access` (host memory): watch CPU ops.
void watch_async_host_access(Timeline t, const Access& access);
// The host synchronized with some stream: forget what is complete now.
void prune_async_host_accesses();

// While alive on a thread, CPU ops there are the sim device's own (kernels on host memory).
class SimKernelScope {
 public:
  SimKernelScope();
  ~SimKernelScope();
  SimKernelScope(const SimKernelScope&) = delete;
  SimKernelScope& operator=(const SimKernelScope&) = delete;

 private:
  bool previous_;
};

}  // namespace sim
}  // namespace torch_pipeline
