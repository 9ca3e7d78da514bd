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

}  // namespace torch_pipeline
