// enable(): registers the sim backend with c10, ATen and the dispatcher, once per process.
#include "allocator.h"
#include "executor.h"
#include "fork.h"
#include "graph_capture.h"
#include "kernels.h"
#include "names.h"
#include "sim.h"
#include "state.h"

#include "../runtime/streams.h"
#include "../runtime/tracking.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <pthread.h>

#include <mutex>

namespace torch_pipeline {
namespace sim {
namespace {

// enable()'s lock: the first of the sim device's locks that fork's handlers take (fork.h).
std::mutex g_enable_mutex;

void before_fork() {
  g_enable_mutex.lock();
  lock_allocators_for_fork();
  lock_host_for_fork();
  State::get().lock_for_fork();
  lock_events_for_fork();
  State::get().checker().lock_for_fork();
  lock_executors_for_fork();
  lock_latency_for_fork();
  StorageNames::get().lock_for_fork();
}

void after_fork() {  // in the parent and in the child
  StorageNames::get().unlock_after_fork();
  unlock_latency_after_fork();
  unlock_executors_after_fork();
  State::get().checker().unlock_after_fork();
  unlock_events_after_fork();
  State::get().unlock_after_fork();
  unlock_host_after_fork();
  unlock_allocators_after_fork();
  g_enable_mutex.unlock();
}

void after_fork_in_child() {
  reset_captures_in_child();
  reset_executors_in_child();  // under the registry's lock, still held
  after_fork();
}

struct SimHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }

  bool isAvailable() const override { return State::get().num_devices() > 0; }

  // Random ops run their CPU kernels, which draw from the CPU generator.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }

  at::Generator getNewGenerator(c10::DeviceIndex) const override {
    return at::detail::createCPUGenerator();
  }

  at::Device getDeviceFromPtr(void* data) const override {
    const auto d = device_of(data);
    return c10::Device(kSim, d.has_value() ? *d : current_device());
  }

  bool isPinnedPtr(const void* data) const override { return is_pinned(data); }

  at::Allocator* getPinnedMemoryAllocator() const override { return host_allocator(); }

  bool hasPrimaryContext(c10::DeviceIndex device_index) const override {
    return device_index >= 0 && device_index < State::get().num_devices();
  }

  void init() const override {}

  c10::DeviceIndex deviceCount() const override {
    return static_cast<c10::DeviceIndex>(State::get().num_devices());
  }

  void setCurrentDevice(c10::DeviceIndex device) const override {
    set_current_device(check_device(device));
  }

  c10::DeviceIndex getCurrentDevice() const override { return current_device(); }

  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    const c10::DeviceIndex old = current_device();
    set_current_device(check_device(device));
    return old;
  }

  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }

  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage_bytes(storage, newsize);
  }
};

}  // namespace

void register_fork_handlers() {
  static bool registered = false;  // under g_enable_mutex
  if (!registered) {
    registered = true;
    pthread_atfork(&before_fork, &after_fork, &after_fork_in_child);
  }
}

void enable(int n, bool strict) {
  std::lock_guard<std::mutex> lock(g_enable_mutex);
  State& st = State::get();
  const int have = st.num_devices();
  if (have > 0) {
    TORCH_CHECK_VALUE(n == have, "torch_pipeline.sim is already enabled with num_devices=", have,
                      "; enable(num_devices=", n,
                      ") cannot change it (the device count is fixed for the "
                      "process)");
    st.set_strict(strict);
    return;
  }
  TORCH_CHECK_VALUE(n >= 1 && n <= kMaxDevices, "num_devices must be in [1, ", kMaxDevices,
                    "], got ", n);
  TORCH_CHECK(!c10::impl::hasDeviceGuardImpl(kSim),
              "cannot enable torch_pipeline.sim: another backend "
              "already registered a device guard for PrivateUse1 in this process");
  TORCH_CHECK(!at::isPrivateUse1HooksRegistered(),
              "cannot enable torch_pipeline.sim: another backend "
              "already registered PrivateUse1 hooks in this process");

  st.set_strict(strict);
  register_fork_handlers();  // before the devices exist: no thread uses them yet
  register_capture_probe();
  st.init_devices(n);
  c10::impl::registerDeviceGuard(kSim, make_guard_impl());
  c10::SetAllocator(kSim, device_allocator());
  // torch.accelerator.empty_host_cache() (and PyTorch's other host-allocator calls) reach it
  // through this slot; left empty, they dereference a null pointer.
  at::setHostAllocator(kSim, host_allocator());
  at::RegisterPrivateUse1HooksInterface(new SimHooks());
  register_kernels();
  // Every device op reaches sim::record, which checks its thread (tracking::device_op_seen).
  tracking::set_backend_checks(kSim);
  // torch.Stream() (getNewStream) draws from the pools of 32 like CUDA's; a pipeline slot's stream
  // is a fresh one (bounded by the slots, which reuse their streams): live pipelines never share.
  register_exclusive_stream_factory(kSim, [](c10::Device device, int priority) {
    return State::get().new_stream(device.index(), priority);
  });
  register_priority_range(kSim, [] {
    return std::optional<PriorityRange>(
        PriorityRange{kHighestPriority, kLowestPriority, "the sim device"});
  });
}

}  // namespace sim
}  // namespace torch_pipeline
