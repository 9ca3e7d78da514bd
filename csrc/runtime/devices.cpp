#include "devices.h"

#include <ATen/Context.h>
#include <ATen/DeviceAccelerator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cctype>
#include <limits>
#include <string>

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
    if (acc.has_value() && (!c10::impl::hasDeviceGuardImpl(*acc) || device_count(*acc) == 0)) {
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

void refresh_accelerator() { cached_accelerator.store(-2, std::memory_order_release); }

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
  TORCH_CHECK_VALUE(type != c10::kCPU,
                    "device 'cpu' has no streams; pass an accelerator device such as 'cuda:0'");
  TORCH_CHECK_VALUE(c10::impl::hasDeviceGuardImpl(type), "device ", device,
                    ": this PyTorch has no '", c10::DeviceTypeName(type, /*lower_case=*/true),
                    "' support (no stream implementation is "
                    "registered for it)");
  TORCH_CHECK_VALUE(
      at::isAccelerator(type), "device ", device,
      " is not an accelerator: pipelines have "
      "streams on accelerator devices only (cuda, or a registered backend such as sim)");
  const c10::DeviceIndex count = device_count(type);
  TORCH_CHECK_VALUE(count > 0, "device ", device, " does not exist: no '",
                    c10::DeviceTypeName(type, true), "' device is available in this process");
  c10::Device resolved = device.has_index() ? device : current_device(type);
  TORCH_CHECK_VALUE(resolved.index() >= 0 && resolved.index() < count, "device ", resolved,
                    " does not exist: this process sees ", static_cast<int>(count), " '",
                    c10::DeviceTypeName(type, true), "' device(s) (indices 0..",
                    static_cast<int>(count) - 1, ")");
  return resolved;
}

namespace {

std::string devices_that_exist(c10::DeviceType type) {
  const int count = device_count(type);
  const std::string name = c10::DeviceTypeName(type, /*lower_case=*/true);
  if (count == 0) {
    return "no '" + name + "' device is available in this process";
  }
  return "this process sees " + std::to_string(count) + " '" + name + "' device(s) (indices 0.." +
         std::to_string(count - 1) + ")";
}

}  // namespace

void check_device_index(c10::DeviceType type, long long index) {
  TORCH_CHECK_VALUE(index >= 0 && index < device_count(type), "device index ", index,
                    " does not exist: ", devices_that_exist(type));
}

void check_device_string(const std::string& text) {
  const auto colon = text.find(':');
  const std::string type_name = text.substr(0, colon);
  TORCH_CHECK_VALUE(type_name != "sim" || c10::get_privateuse1_backend() == "sim", "device '", text,
                    "': the sim device is not enabled in this process; call "
                    "torch_pipeline.sim.enable(num_devices) first");
  if (colon == std::string::npos || colon + 1 >= text.size()) {
    return;
  }
  long long index = 0;
  for (size_t i = colon + 1; i < text.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(text[i]))) {
      return;  // not a plain index: torch's parser says what is wrong
    }
    index = std::min<long long>(index * 10 + (text[i] - '0'), 1LL << 40);  // no overflow
  }
  if (index <= std::numeric_limits<c10::DeviceIndex>::max()) {
    return;  // torch parses it exactly; the range is checked where the device is used
  }
  const c10::DeviceType type = c10::Device(type_name).type();
  TORCH_CHECK_VALUE(false, "device '", text, "' does not exist: ", devices_that_exist(type));
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
