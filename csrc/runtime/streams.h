// Where a pipeline slot's streams come from.
//
// A backend may register an exclusive stream factory (csrc/cuda does so for CUDA): each call makes
// a stream no one else uses. Without one, streams come from the backend's own `getNewStream`
// (for CUDA that is torch's fixed pool of 32 streams per priority, which aliases the 33rd request
// onto the first); the runtime then watches live slots for shared streams and warns once.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <functional>
#include <optional>
#include <string>

namespace torch_pipeline {

using ExclusiveStreamFactory = std::function<c10::Stream(c10::Device, int priority)>;

// Registers the factory for device type `type` (at static-initialisation time). Returns true so it
// can initialise a static.
bool register_exclusive_stream_factory(c10::DeviceType type, ExclusiveStreamFactory factory);

// Whether streams of `type` are exclusive (a factory is registered).
bool has_exclusive_streams(c10::DeviceType type);

// A new stream on `device` with `priority` (lower is higher priority, as in torch.cuda.Stream):
// from the exclusive factory when there is one, else from the backend's getNewStream.
c10::Stream new_stream(c10::Device device, int priority);

// Stream priorities, as in torch.cuda.Stream: lower numbers are higher priority; 0 is the default
// and the lowest.
struct PriorityRange {
  int greatest = -3;  // numerically smallest: the highest priority
  int least = 0;      // the lowest priority (the default)
  std::string source =
      "a backend without a range of its own (fixed, the levels of torch's CUDA "
      "stream pools)";
};

// A backend's range, or nullopt while it has no device (registered at static-initialisation time
// by csrc/cuda; asked only for a priority other than 0, so a default pipeline never initialises a
// backend). Returns true so it can initialise a static.
using PriorityRangeQuery = std::function<std::optional<PriorityRange>()>;
bool register_priority_range(c10::DeviceType type, PriorityRangeQuery query);

// The range pipelines accept: the first registered backend that has a device (CUDA, then sim),
// else the fixed range -3..0.
PriorityRange pipeline_priority_range();

}  // namespace torch_pipeline
