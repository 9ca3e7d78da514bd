#include "task.h"

#include "context.h"
#include "devices.h"
#include "runtime.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <thread>

namespace torch_pipeline {

TaskSync::TaskSync(int worker_id)
    : generation_(Runtime::current_generation()), worker_id_(worker_id) {}

void TaskSync::record_submitter_position() {
  for (const c10::Device& d : initialized_accelerator_devices()) {
    const c10::Stream s = c10::impl::getDeviceGuardImpl(d.type())->getStream(d);
    start_.emplace_back(d, c10::Event(d.type()));
    start_.back().second.record(s);
  }
}

void TaskSync::wait_for_submitter(PipelineImpl& p) {
  // start_ is written before the task is queued and read only here, after it is dequeued.
  for (const auto& [device, event] : start_) {
    event.block(pipeline_stream(p, device));
  }
}

void TaskSync::record_end(PipelineImpl& p) {
  DeviceStreams lane = lane_streams(p);
  // Every device that may hold work of the task: those initialised when it was submitted (the
  // devices of start_; initialisation is never undone) and those it initialised itself.
  for (const c10::Device& d : initialized_accelerator_devices()) {
    const bool present = std::any_of(
        lane.begin(), lane.end(), [&](const auto& ds) { return ds.first == d; });
    if (!present) {
      lane.emplace_back(d, pipeline_stream(p, d));
    }
  }
  std::vector<std::pair<c10::Device, c10::Event>> end;
  end.reserve(lane.size());
  for (const auto& [device, stream] : lane) {
    end.emplace_back(device, c10::Event(device.type()));
    end.back().second.record(stream);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  end_ = std::move(end);
}

void TaskSync::mark_done() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

bool TaskSync::done() const {
  return done_.load(std::memory_order_acquire);
}

bool TaskSync::wait_for(std::chrono::milliseconds timeout) const {
  const auto spin_until = std::chrono::steady_clock::now() + kSpin;
  while (std::chrono::steady_clock::now() < spin_until) {
    if (done()) {
      return true;
    }
    std::this_thread::yield();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  return cv_.wait_for(lock, timeout, [&] { return done(); });
}

void TaskSync::block_current_streams() const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [device, event] : end_) {
    event.block(c10::impl::getDeviceGuardImpl(device.type())->getStream(device));
  }
}

}  // namespace torch_pipeline
