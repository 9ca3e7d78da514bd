// The sim device's memory: a caching allocator over host memory that behaves like CUDA's where it
// matters for races (allocator.cpp), and a caching "pinned" host allocator (pinned.cpp).
//
// Blocks are cached per (device, stream they were allocated on). A freed block goes back to its
// stream's pool at once and is reused by the next allocation of a fitting size on that stream.
// A block that record_stream() marked as used on other streams is held back when freed until
// those uses are complete: at the next allocation on the device the allocator "queries the
// events" recorded at free time, which report completion once those streams ran what they had
// queued then (at once in synchronous mode; executor.h), and the block returns to its pool. That
// completion is the allocator's knowledge, for that block only: the checker releases the block's
// uses ordered before those events (RaceChecker::release), and no stream or host clock moves.
// Reusing a cached block is reported to the race checker as a write of the whole block by the
// allocating stream, so uses of the block's previous tensor that are not ordered before the reuse
// race with it. Memory is never given back to the system while the process runs.
#pragma once

#include "race_checker.h"

#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <optional>
#include <string>
#include <vector>

namespace at {
struct HostAllocator;  // ATen/core/CachingHostAllocator.h (included where it is used)
}  // namespace at

namespace torch_pipeline {
namespace sim {

// The device allocator (allocates on the current sim device and its current stream).
c10::DeviceAllocator* device_allocator();
// Tensor.record_stream / recordDataPtrOnStream: `data_ptr` is used on `stream`.
void record_stream(const c10::DataPtr& data_ptr, const c10::Stream& stream);
// Whether `data_ptr` holds a block of the device allocator (whatever device it is tagged with).
bool is_block(const c10::DataPtr& data_ptr);
// The sim device of a pointer into a live or cached block, if any.
std::optional<c10::DeviceIndex> device_of(const void* ptr);

// Host memory that pin_memory() and non_blocking copies to the host use: PrivateUse1's host
// allocator (at::getHostAllocator), caching freed blocks for reuse like CUDA's (pinned.cpp).
at::HostAllocator* host_allocator();
// Whether `ptr` points into a block of the host allocator (live or cached).
bool is_pinned(const void* ptr);

// While an instance lives on this thread, reuse reports of the allocator are appended to `sink`
// (as whole-block writes) instead of being recorded as ops of their own: the op that allocates
// (the ops fallback) records them with its other accesses, under its own name.
class DeferReuseReports {
 public:
  explicit DeferReuseReports(std::vector<Access>* sink);
  ~DeferReuseReports();
  DeferReuseReports(const DeferReuseReports&) = delete;
  DeferReuseReports& operator=(const DeferReuseReports&) = delete;

 private:
  std::vector<Access>* previous_;
};

// The same allocation with another device in its DataPtr (CPU aliases of sim memory hold it as a
// CPU pointer while a CPU kernel resizes an out= argument).
c10::DataPtr retag(c10::DataPtr&& data_ptr, c10::Device device);

}  // namespace sim
}  // namespace torch_pipeline
