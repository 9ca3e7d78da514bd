// Devices and streams of the sim device, the thread-local current device and streams, and the op
// recorder. A stream is a race checker timeline, and stream/event operations move vector clocks
// (race_checker.h); in asynchronous mode they also order the streams' queues (executor.h). Events
// and the DeviceGuardImpl are in guard.cpp.
#include "state.h"
#include "allocator.h"
#include "executor.h"
#include "graph_capture.h"
#include "host.h"

#include "../runtime/tracking.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <optional>

namespace torch_pipeline {
namespace sim {
namespace {

thread_local c10::DeviceIndex tls_device = 0;
thread_local std::array<c10::StreamId, kMaxDevices> tls_streams{};  // 0: the default stream

std::atomic<RaceThrower> g_thrower{nullptr};
std::atomic<RaceThrower> g_device_index_thrower{nullptr};
std::atomic<SiteGatherer> g_site_gatherer{nullptr};
std::atomic<bool> g_record_sites{false};

int clamp_priority(int priority) {
  return std::min(kLowestPriority, std::max(kHighestPriority, priority));
}

std::string device_name(c10::DeviceIndex d) { return "sim:" + std::to_string(static_cast<int>(d)); }

}  // namespace

// ---- state ---------------------------------------------------------------------------------
State& State::get() {
  static State* state = new State();
  return *state;
}

void State::init_devices(int n) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(num_devices_.load() == 0);
  for (int d = 0; d < n; ++d) {
    add_stream_locked(static_cast<c10::DeviceIndex>(d), 0, "default");
  }
  num_devices_.store(n, std::memory_order_release);
}

c10::Stream State::add_stream_locked(c10::DeviceIndex d, int priority, const char* kind) {
  auto& dev = devices_[static_cast<size_t>(d)];
  const auto id = static_cast<c10::StreamId>(dev.streams.size());
  std::string label = device_name(d) + " stream " + std::to_string(id) + " (" + kind;
  if (priority != 0) {
    label += ", priority " + std::to_string(priority);
  }
  label += ")";
  const Timeline t = checker_.add_timeline(label);
  dev.streams.push_back(StreamInfo{t, priority, std::move(label)});
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kSim, d), id);
}

const State::StreamInfo& State::info_locked(const c10::Stream& s) {
  TORCH_CHECK_VALUE(s.device_type() == kSim, "expected a sim stream, got a stream of device ",
                    s.device());
  const c10::DeviceIndex d = s.device_index();
  TORCH_CHECK_VALUE(d >= 0 && d < num_devices(), "stream of device sim:", static_cast<int>(d),
                    ", which does not exist (", num_devices(), " sim devices)");
  const auto& streams = devices_[static_cast<size_t>(d)].streams;
  TORCH_CHECK_VALUE(s.id() >= 0 && static_cast<size_t>(s.id()) < streams.size(),
                    "sim:", static_cast<int>(d), " has no stream with id ", s.id(),
                    " (streams come from torch.Stream(), the pool, or ",
                    "torch.accelerator.current_stream())");
  return streams[static_cast<size_t>(s.id())];
}

Timeline State::timeline(const c10::Stream& s) {
  std::lock_guard<std::mutex> lock(mutex_);
  return info_locked(s).timeline;
}

int State::priority(const c10::Stream& s) {
  std::lock_guard<std::mutex> lock(mutex_);
  return info_locked(s).priority;
}

const std::string& State::label(const c10::Stream& s) {
  std::lock_guard<std::mutex> lock(mutex_);
  return info_locked(s).label;  // deque elements never move
}

c10::Stream State::new_stream(c10::DeviceIndex d, int priority) {
  d = check_device(d);
  std::lock_guard<std::mutex> lock(mutex_);
  return add_stream_locked(d, clamp_priority(priority), "exclusive");
}

c10::Stream State::pool_stream(c10::DeviceIndex d, int priority) {
  d = check_device(d);
  priority = clamp_priority(priority);
  std::lock_guard<std::mutex> lock(mutex_);
  auto& dev = devices_[static_cast<size_t>(d)];
  const auto k = static_cast<size_t>(kLowestPriority - priority);
  auto& pool = dev.pool[k];
  const uint32_t i = dev.next[k]++ % kStreamsPerPool;
  if (i >= pool.size()) {
    pool.push_back(add_stream_locked(d, priority, "pool").id());
  }
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kSim, d), pool[i]);
}

c10::Stream State::pool_stream(c10::DeviceIndex d, bool high_priority) {
  // CUDA: the high-priority pool is the one of the highest priority.
  return pool_stream(d, high_priority ? kHighestPriority : kLowestPriority);
}

std::vector<Timeline> State::device_timelines(c10::DeviceIndex d) {
  d = check_device(d);
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<Timeline> out;
  for (const auto& s : devices_[static_cast<size_t>(d)].streams) {
    out.push_back(s.timeline);
  }
  return out;
}

// ---- thread-local current device and streams -----------------------------------------------
c10::DeviceIndex check_device(c10::DeviceIndex d) {
  const int n = State::get().num_devices();
  TORCH_CHECK(n > 0, "the sim device is not enabled: call torch_pipeline.sim.enable() first");
  if (d < 0) {
    return tls_device;
  }
  if (d >= n) {
    const std::string message =
        c10::str("device sim:", static_cast<int>(d), " does not exist: sim was enabled with ", n,
                 " device(s) (sim:0..sim:", n - 1, ")");
    if (RaceThrower thrower = g_device_index_thrower.load()) {
      thrower(message);
    }
    TORCH_CHECK_VALUE(false, message);
  }
  return d;
}

c10::DeviceIndex current_device() { return tls_device; }

void set_current_device(c10::DeviceIndex d) { tls_device = d; }

c10::Stream current_stream(c10::DeviceIndex d) {
  d = check_device(d);
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kSim, d),
                     tls_streams[static_cast<size_t>(d)]);
}

c10::Stream exchange_stream(const c10::Stream& s) {
  State::get().timeline(s);  // validates
  const c10::DeviceIndex d = s.device_index();
  const c10::Stream previous = current_stream(d);
  tls_streams[static_cast<size_t>(d)] = s.id();
  return previous;
}

Timeline current_timeline(c10::DeviceIndex d) { return State::get().timeline(current_stream(d)); }

// ---- recording -----------------------------------------------------------------------------
void set_race_thrower(RaceThrower thrower) { g_thrower.store(thrower); }

void set_device_index_thrower(RaceThrower thrower) { g_device_index_thrower.store(thrower); }

void throw_races(const std::vector<Race>& races) {
  std::string msg = "torch_pipeline.sim (strict mode): " + races.front().to_string();
  if (races.size() > 1) {
    msg += " (and " + std::to_string(races.size() - 1) + " more race(s) of the same op)";
  }
  if (RaceThrower thrower = g_thrower.load()) {
    thrower(msg);
  }
  throw RaceError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, msg);
}

void set_site_gatherer(SiteGatherer gatherer) { g_site_gatherer.store(gatherer); }

void set_record_sites(bool on) { g_record_sites.store(on, std::memory_order_relaxed); }

bool record_sites() { return g_record_sites.load(std::memory_order_relaxed); }

Site gather_site() {
  if (!record_sites()) {
    return nullptr;
  }
  SiteGatherer gatherer = g_site_gatherer.load();
  return gatherer == nullptr ? nullptr : gatherer();
}

void record(Timeline t, const std::string& op, const std::vector<Access>& accesses) {
  if (t != kHost) {
    tracking::device_op_seen(op.c_str());  // (a thread the tracker does not observe is warned of)
  }
  if (record_captured(t, op, accesses)) {
    return;  // captured: checked against its capture only
  }
  State& st = State::get();
  std::vector<Race> found = st.checker().record_op(t, op, accesses, gather_site());
  if (!found.empty() && st.strict()) {
    throw_races(found);
  }
}

void host_sync(Timeline t) {
  check_not_capturing(
      "a host synchronization (stream or device synchronize, a blocking copy to "
      "the host, .item())");
  host_wait(t);  // asynchronous mode: what t has queued runs first
  State::get().checker().join_timeline(kHost, t);
  prune_async_host_accesses();
}

void host_join(const VectorClock& clock) {
  State::get().checker().join(kHost, clock);
  prune_async_host_accesses();
}

std::string describe_storage(c10::DeviceIndex d, const void* base, size_t nbytes) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), " storage %p (%zu bytes)", base, nbytes);
  return device_name(d) + buffer;
}

// ---- public API (sim.h) ------------------------------------------------------------------
bool enabled() { return State::get().num_devices() > 0; }

int num_devices() { return State::get().num_devices(); }

std::vector<Race> races() { return State::get().checker().races(); }

void clear_races() { State::get().checker().clear_races(); }

void set_strict(bool s) { State::get().set_strict(s); }

bool strict() { return State::get().strict(); }

c10::Stream stream_from_pool(int device, bool high_priority) {
  return State::get().pool_stream(static_cast<c10::DeviceIndex>(device), high_priority);
}

int stream_priority(const c10::Stream& stream) { return State::get().priority(stream); }

std::string stream_label(const c10::Stream& stream) { return State::get().label(stream); }

size_t history_size() { return State::get().checker().history_size(); }

void synchronize(int device) {
  State& st = State::get();
  const int n = st.num_devices();
  TORCH_CHECK(n > 0, "the sim device is not enabled: call torch_pipeline.sim.enable() first");
  TORCH_CHECK_VALUE(device >= -1,
                    "synchronize: device must be a sim device index or -1 (every device), got ",
                    device);
  if (device >= 0) {
    check_device(static_cast<c10::DeviceIndex>(device));
  }
  for (int d = 0; d < n; ++d) {
    if (device >= 0 && d != device) {
      continue;
    }
    for (Timeline t : st.device_timelines(static_cast<c10::DeviceIndex>(d))) {
      host_sync(t);
    }
  }
}

}  // namespace sim
}  // namespace torch_pipeline
