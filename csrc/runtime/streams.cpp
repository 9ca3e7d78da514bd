#include "streams.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <array>
#include <mutex>

namespace torch_pipeline {
namespace {

constexpr size_t kNumTypes = static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES);

struct Registry {
  std::mutex mutex;
  std::array<ExclusiveStreamFactory, kNumTypes> factories;
  std::array<PriorityRangeQuery, kNumTypes> ranges;
};

Registry& registry() {
  static Registry* r = new Registry();  // leaked: used until process exit
  return *r;
}

}  // namespace

bool register_exclusive_stream_factory(c10::DeviceType type, ExclusiveStreamFactory factory) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.factories[static_cast<size_t>(type)] = std::move(factory);
  return true;
}

bool has_exclusive_streams(c10::DeviceType type) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return static_cast<bool>(r.factories[static_cast<size_t>(type)]);
}

bool register_priority_range(c10::DeviceType type, PriorityRangeQuery query) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.ranges[static_cast<size_t>(type)] = std::move(query);
  return true;
}

PriorityRange pipeline_priority_range() {
  std::array<PriorityRangeQuery, kNumTypes> ranges;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    ranges = r.ranges;
  }
  for (const auto& query : ranges) {  // (queried without the lock: they may call the backend)
    if (query) {
      if (std::optional<PriorityRange> range = query()) {
        return *range;
      }
    }
  }
  return PriorityRange{};
}

c10::Stream new_stream(c10::Device device, int priority) {
  ExclusiveStreamFactory factory;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    factory = r.factories[static_cast<size_t>(device.type())];
  }
  if (factory) {
    return factory(device, priority);
  }
  return c10::impl::getDeviceGuardImpl(device.type())->getNewStream(device, priority);
}

}  // namespace torch_pipeline
