// Device facts the runtime needs, read through c10 so that any backend that registers a
// DeviceGuardImpl (CUDA, the sim device) works.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>

#include <optional>
#include <string>
#include <vector>

namespace torch_pipeline {

// The process's accelerator device type (CUDA, PrivateUse1, ...) if one is available, else
// nullopt. Cached; refresh_accelerator() re-reads it (after a backend is registered at run time).
std::optional<c10::DeviceType> accelerator();
void refresh_accelerator();

// Number of devices of `type`, 0 if none or if the backend is not registered. Never throws.
c10::DeviceIndex device_count(c10::DeviceType type);

// The calling thread's current device of `type` (which must have a guard).
c10::Device current_device(c10::DeviceType type);

// Whether the backend of `device` has set up the device in this process (CUDA: a primary
// context exists). Work can have been queued on a device only if this holds.
bool device_initialized(const c10::Device& device);

// Throws ValueError unless `device` is a device that streams can be acquired on: an accelerator
// type with a registered guard and an index in [0, device_count). Returns the device with its
// index filled in (current device when the index is unset).
c10::Device check_stream_device(const c10::Device& device);

// ValueError unless `index`, an explicit device index of `type` as the user gave it (before c10
// narrows it to 8 bits, which wraps 257 to 1), is in [0, device_count(type)); the message names
// the devices that exist.
void check_device_index(c10::DeviceType type, long long index);

// Checks a device string ("sim:1", "cuda", "cpu") for what torch's parser gets silently wrong or
// reports without a hint: an index too large for a device index (it wraps: "sim:1023" would be
// the current device), and "sim" before torch_pipeline.sim.enable(). ValueError for those; other
// strings are left to torch.
void check_device_string(const std::string& text);

// The accelerator devices already initialized in this process (see device_initialized).
std::vector<c10::Device> initialized_accelerator_devices();

}  // namespace torch_pipeline
