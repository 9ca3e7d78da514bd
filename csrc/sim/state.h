// Internals of the sim device shared by its translation units: devices, streams (each one a race
// checker timeline), the thread-local current device and streams, and the op recorder.
#pragma once

#include "race_checker.h"
#include "sim.h"

#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <array>
#include <atomic>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

namespace torch_pipeline {
namespace sim {

constexpr c10::DeviceType kSim = c10::DeviceType::PrivateUse1;
constexpr int kMaxDevices = 16;
constexpr int kStreamsPerPool = 32;  // like CUDA's pool, per priority and device
// Priorities as for torch.cuda.Stream: lower is higher; values outside are clamped. Each priority
// has a pool of its own, as on CUDA.
constexpr int kLowestPriority = 0;
constexpr int kHighestPriority = -3;
constexpr int kPriorities = kLowestPriority - kHighestPriority + 1;

class State {
 public:
  static State& get();  // leaked: usable until process exit

  int num_devices() const { return num_devices_.load(std::memory_order_acquire); }
  bool strict() const { return strict_.load(std::memory_order_relaxed); }
  void set_strict(bool s) { strict_.store(s, std::memory_order_relaxed); }
  RaceChecker& checker() { return checker_; }

  // Makes the devices and their default streams (once, from enable()).
  void init_devices(int n);

  // The timeline of `s`; ValueError for a stream that sim never made.
  Timeline timeline(const c10::Stream& s);
  int priority(const c10::Stream& s);
  const std::string& label(const c10::Stream& s);
  // A stream no one else gets (pipelines' exclusive streams): a new timeline each call.
  c10::Stream new_stream(c10::DeviceIndex d, int priority);
  // The next stream of the pool of `priority` (clamped), round robin over 32 like CUDA's
  // getStreamFromPool: torch.Stream() (getNewStream) and getStreamFromGlobalPool come from here,
  // so the 33rd stream of a priority is the first again and the number of timelines stays bounded.
  c10::Stream pool_stream(c10::DeviceIndex d, int priority);
  c10::Stream pool_stream(c10::DeviceIndex d, bool high_priority);
  std::vector<Timeline> device_timelines(c10::DeviceIndex d);

  // fork(): the forking thread holds the streams' lock around fork() (fork.h).
  void lock_for_fork() { mutex_.lock(); }
  void unlock_after_fork() { mutex_.unlock(); }

 private:
  State() = default;
  struct StreamInfo {
    Timeline timeline;
    int priority;
    std::string label;
  };
  struct DeviceStreams {
    std::deque<StreamInfo> streams;  // index = StreamId; 0 = the default stream
    // [i]: the pool of priority -i (kLowestPriority first), made lazily
    std::array<std::vector<c10::StreamId>, kPriorities> pool;
    std::array<uint32_t, kPriorities> next{};
  };
  const StreamInfo& info_locked(const c10::Stream& s);
  c10::Stream add_stream_locked(c10::DeviceIndex d, int priority, const char* kind);

  std::atomic<int> num_devices_{0};
  std::atomic<bool> strict_{false};
  RaceChecker checker_;
  std::mutex mutex_;
  std::array<DeviceStreams, kMaxDevices> devices_;
};

// Throws ValueError unless 0 <= d < num_devices; -1 means the current device.
c10::DeviceIndex check_device(c10::DeviceIndex d);
c10::DeviceIndex current_device();
void set_current_device(c10::DeviceIndex d);
c10::Stream current_stream(c10::DeviceIndex d);
c10::Stream exchange_stream(const c10::Stream& s);
Timeline current_timeline(c10::DeviceIndex d);

// Sets the current device for a scope (no checks: d must be valid).
class DeviceScope {
 public:
  explicit DeviceScope(c10::DeviceIndex d) : previous_(current_device()) { set_current_device(d); }
  ~DeviceScope() { set_current_device(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  c10::DeviceIndex previous_;
};

// An op on stream timeline `t` with these accesses; in strict mode a race throws (the op is
// recorded first, so the history stays consistent).
void record(Timeline t, const std::string& op, const std::vector<Access>& accesses);
// The host waits for timeline `t` (stream synchronize, blocking copy to the host): in asynchronous
// mode until its queue ran what was queued, then a pending asynchronous error is raised.
void host_sync(Timeline t);
// The host waits for an event's position (event synchronize or a query reporting completion).
void host_join(const VectorClock& clock);
[[noreturn]] void throw_races(const std::vector<Race>& races);
// Where the calling op was called from, while sites are on (Note [Race reports with sites]).
Site gather_site();
// "sim:0 storage 0x... (64 bytes)"
std::string describe_storage(c10::DeviceIndex d, const void* base, size_t nbytes);

// The c10 DeviceGuardImpl of the sim device (a new, leaked object).
const c10::impl::DeviceGuardImplInterface* make_guard_impl();

}  // namespace sim
}  // namespace torch_pipeline
