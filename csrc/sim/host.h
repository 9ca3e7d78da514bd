// Host accesses of pinned memory that asynchronous copies use.
//
// A non_blocking copy between a sim tensor and a pinned CPU tensor reads or writes the host
// memory on the stream: until the host synchronizes with that stream, a CPU op that writes the
// memory (or reads it, for a copy to the host) races with the copy. While such copies are pending,
// a RecordFunction callback watches the CPU tensor arguments of every op and records the ones
// that touch pending memory as accesses of the host timeline. Strict mode does not apply to
// these (a RecordFunction callback cannot fail its op): they are only recorded. Only the outermost
// op that accesses data is checked (not the ops it calls); an op with a sim tensor or a sim
// device argument is the device's (its host side, if any, is the copy kernel's to check).
#pragma once

#include "race_checker.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace torch_pipeline {
namespace sim {

// The bytes of host tensor `t` as accesses, appended to `out` (false when it has none).
bool host_accesses(const at::Tensor& t, bool write, std::vector<Access>& out);
// After recording a non_blocking copy on `t` that touches `accesses` (host memory): watch CPU ops.
void watch_async_host_accesses(Timeline t, const std::vector<Access>& accesses);
// The host synchronized with some stream: forget what is complete now.
void prune_async_host_accesses();
// Host memory [begin, end) went back to the system: stop watching it.
void forget_async_host_accesses(uintptr_t begin, uintptr_t end);

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
