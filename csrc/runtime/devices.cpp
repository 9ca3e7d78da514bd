#include "devices.h"

#include <ATen/Context.h>
#include <ATen/DeviceAccelerator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <atomic>

namespace torch_pipeline {
namespace {

// -2: not read yet; -1: no accelerator; otherwise the DeviceType value.
std::atomic<int> cached_accelerator{-2};

}  // namespace

std::optional<c10::DeviceType> accelerator() {
  int cached = cached_accelerator.load(std::memory_order_acquire);
  if (cached == -2) {
    std::optional<c10::DeviceType> acc;
    try {
      acc = at::getAccelerator(false);
    } catch (const std::exception&) {
      acc = std::nullopt;  // several accelerators registered: treat as none we can pick
    }
    if (acc.has_value() &&
        (!c10::impl::hasDeviceGuardImpl(*acc) || device_count(*acc) == 0)) {
      acc = std::nullopt;
    }
    cached = acc.has_value() ? static_cast<int>(*acc) : -1;
    cached_accelerator.store(cached, std::memory_order_release);
  }
  if (cached < 0) {
    return std::nullopt;
  }
  return static_cast<c10::DeviceType>(cached);
}

void refresh_accelerator() {
  cached_accelerator.store(-2, std::memory_order_release);
}

c10::DeviceIndex device_count(c10::DeviceType type) {
  if (type == c10::kCPU || !c10::impl::hasDeviceGuardImpl(type)) {
    return 0;
  }
  try {
    return c10::impl::getDeviceGuardImpl(type)->deviceCount();
  } catch (const std::exception&) {
    return 0;
  }
}

c10::Device current_device(c10::DeviceType type) {
  return c10::impl::getDeviceGuardImpl(type)->getDevice();
}

bool device_initialized(const c10::Device& device) {
  if (device.is_cpu()) {
    return false;
  }
  try {
    if (!at::isAccelerator(device.type())) {
      return true;  // no way to ask: assume work may be pending
    }
    return at::globalContext()
        .getAcceleratorHooksInterface(device.type())
        .hasPrimaryContext(device.index());
  } catch (const std::exception&) {
    return true;
  }
}

c10::Device check_stream_device(const c10::Device& device) {
  const auto type = device.type();
  TORCH_CHECK_VALUE(
      type != c10::kCPU,
      "device 'cpu' has no streams; pass an accelerator device such as 'cuda:0'");
  TORCH_CHECK_VALUE(
      c10::impl::hasDeviceGuardImpl(type), "device ", device, ": this PyTorch has no '",
      c10::DeviceTypeName(type, /*lower_case=*/true), "' support (no stream implementation is "
      "registered for it)");
  TORCH_CHECK_VALUE(
      at::isAccelerator(type), "device ", device, " is not an accelerator: pipelines have "
      "streams on accelerator devices only (cuda, or a registered backend such as sim)");
  const c10::DeviceIndex count = device_count(type);
  TORCH_CHECK_VALUE(
      count > 0, "device ", device, " does not exist: no '", c10::DeviceTypeName(type, true),
      "' device is available in this process");
  c10::Device resolved = device.has_index() ? device : current_device(type);
  TORCH_CHECK_VALUE(
      resolved.index() >= 0 && resolved.index() < count, "device ", resolved,
      " does not exist: this process sees ", static_cast<int>(count), " '",
      c10::DeviceTypeName(type, true), "' device(s) (indices 0..",
      static_cast<int>(count) - 1, ")");
  return resolved;
}

std::vector<c10::Device> initialized_accelerator_devices() {
  std::vector<c10::Device> out;
  const auto acc = accelerator();
  if (!acc.has_value()) {
    return out;
  }
  const c10::DeviceIndex count = device_count(*acc);
  for (c10::DeviceIndex i = 0; i < count; ++i) {
    c10::Device d(*acc, i);
    if (device_initialized(d)) {
      out.push_back(d);
    }
  }
  return out;
}

}  // namespace torch_pipeline
